"""Backward kernels of shared-prefix attention: the prefix part's gradients
(``pallas_kernels.prefix_attention_bwd``) and the flash backward with given statistics
(``pallas_kernels.flash_attention.flash_attention_bwd``), against the dense pure-JAX reference
and an independent float64 NumPy computation; interpret mode on the CPU, compiled on the GPU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import lower_for_cuda, rel_err
from pallas_kernels.flash_attention import flash_attention, flash_attention_bwd
from jax_prefix_attn.planner import row_splits as choose_row_splits
from pallas_kernels.prefix_attention_bwd import (prefix_grads,
                                                 prefix_grads_reference)

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _case(seed, *, b=3, tq=2, hq=4, hkv=2, d=16, g=1, p=21, dtype=jnp.float32, s2p=None,
          plen=None):
    """Random queries, cotangents and prefixes; statistics of a real merged attention (the
    prefix part plus a random "suffix" part), so ``lse`` is consistent with the scores."""
    rng = np.random.default_rng(seed)

    def rnd(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)
    q, do = rnd(b, tq, hq, d), rnd(b, tq, hq, d)
    pk, pv = rnd(g, p, hkv, d), rnd(g, p, hkv, d)
    s2p = jnp.asarray(rng.integers(0, g, size=b) if s2p is None else s2p, jnp.int32)
    plen = jnp.asarray(rng.integers(1, p + 1, size=g) if plen is None else plen, jnp.int32)
    pl_b = plen[s2p]
    # per-row limits as shared-prefix attention builds them, with random suffix lengths (0 too)
    sl = jnp.asarray(rng.integers(0, 4, size=b), jnp.int32)
    i = jnp.arange(tq)[None, :]
    lim = jnp.clip(pl_b[:, None] + sl[:, None] - tq + i + 1, 0, pl_b[:, None]).astype(jnp.int32)
    scale = 1.0 / np.sqrt(d)
    k_b = np.repeat(np.asarray(pk, np.float64)[np.asarray(s2p)], hq // hkv, axis=2)
    sc = np.einsum("bqhd,bkhd->bqhk", np.asarray(q, np.float64), k_b) * scale
    vis = np.arange(p)[None, None, None, :] < np.asarray(lim)[:, :, None, None]
    sc = np.where(vis, sc, -np.inf)
    extra = rng.standard_normal((b, tq, hq)) * 0.5 + 1.0          # a suffix part's log-mass
    with np.errstate(divide="ignore"):
        lse = np.logaddexp(np.log(np.exp(sc).sum(-1)), extra)
    lse[0, 0, 0] = -np.inf                                          # a row with no key at all
    delta = rng.standard_normal((b, tq, hq))
    return (q, do, jnp.asarray(lse, jnp.float32), jnp.asarray(delta, jnp.float32), pk, pv, s2p,
            lim, plen, scale)


def _numpy_grads(q, do, lse, delta, pk, pv, s2p, lim, scale):
    """Float64 NumPy, loops over sequences: the oracle of the dense reference."""
    q, do, lse, delta = (np.asarray(x, np.float64) for x in (q, do, lse, delta))
    pk, pv = np.asarray(pk, np.float64), np.asarray(pv, np.float64)
    b, tq, hq, d = q.shape
    g, p, hkv, _ = pk.shape
    grp = hq // hkv
    dq = np.zeros_like(q)
    dk, dv = np.zeros_like(pk), np.zeros_like(pv)
    for bi in range(b):
        gi = int(s2p[bi])
        for h in range(hq):
            kh = h // grp
            k, v = pk[gi, :, kh], pv[gi, :, kh]
            for t in range(tq):
                n = int(lim[bi, t])
                if n == 0 or not np.isfinite(lse[bi, t, h]):
                    continue
                s = k[:n] @ q[bi, t, h] * scale
                pr = np.exp(s - lse[bi, t, h])
                dp = v[:n] @ do[bi, t, h]
                ds = pr * (dp - delta[bi, t, h])
                dq[bi, t, h] += scale * ds @ k[:n]
                dk[gi, :n, kh] += scale * np.outer(ds, q[bi, t, h])
                dv[gi, :n, kh] += np.outer(pr, do[bi, t, h])
    return dq, dk, dv


def test_dense_reference_matches_float64_numpy():
    q, do, lse, delta, pk, pv, s2p, lim, plen, scale = _case(0, b=4, tq=3, hq=4, hkv=2, g=3)
    got = prefix_grads_reference(q, do, lse, delta, pk, pv, s2p, lim, plen, scale=scale)
    want = _numpy_grads(q, do, lse, delta, pk, pv, np.asarray(s2p), np.asarray(lim), scale)
    for a, w in zip(got, want):
        assert rel_err(a, w) < 1e-5, rel_err(a, w)


CASES = [  # (b, tq, hq, hkv, d, g, p, dtype, row_splits = key_splits)
    (3, 1, 4, 4, 16, 1, 21, jnp.float32, None),       # decoding, one prefix, MHA
    (3, 4, 8, 2, 16, 1, 40, jnp.float32, 1),          # Tq = 4, GQA 4
    (5, 2, 8, 1, 32, 3, 37, jnp.float32, 3),          # 3 ragged groups, GQA 8, rows split
    (4, 4, 4, 2, 64, 2, 70, jnp.bfloat16, None),      # bf16, head_dim 64
    (2, 3, 4, 1, 16, 4, 17, jnp.float32, 2),          # more groups than sequences: empty groups
    (8, 4, 4, 2, 16, 1, 48, jnp.float32, None),       # full row blocks: the mask-free key tiles
]


@pytest.mark.parametrize("b,tq,hq,hkv,d,g,p,dtype,rs", CASES)
def test_prefix_grads_match_reference_interpret(b, tq, hq, hkv, d, g, p, dtype, rs):
    q, do, lse, delta, pk, pv, s2p, lim, plen, scale = _case(
        b + 10 * g + tq, b=b, tq=tq, hq=hq, hkv=hkv, d=d, g=g, p=p, dtype=dtype,
        plen=[p] * g if b == 8 else None)
    got = prefix_grads(q, do, lse, delta, pk, pv, s2p, lim, plen, scale=scale, interpret=True,
                       row_splits=rs or 1, key_splits=rs or 1, block_q=16, block_k=16, dkv_block_q=16,
                       dkv_block_k=16)
    want = prefix_grads_reference(q, do, lse, delta, pk, pv, s2p, lim, plen, scale=scale)
    for name, a, w in zip(("dq", "dk", "dv"), got, want):
        assert a.shape == w.shape and a.dtype == w.dtype, name
        assert np.isfinite(np.asarray(a, np.float32)).all(), name
        assert rel_err(a, w) < TOL[dtype], (name, rel_err(a, w))
    # a row with no visible key gets no gradient; keys no row sees get none either
    np.testing.assert_array_equal(np.asarray(got[0], np.float32)[0, 0, 0], 0.0)


def test_prefix_grads_ignore_keys_past_the_limits():
    """Prefix keys/values at or past every row's limit (padding, a stale cache) may hold NaN."""
    q, do, lse, delta, pk, pv, s2p, lim, plen, scale = _case(3, b=3, tq=2, g=2, p=40,
                                                           plen=[23, 9])
    kw = dict(scale=scale, interpret=True, block_q=16, block_k=16, dkv_block_q=16,
              dkv_block_k=16)
    clean = prefix_grads(q, do, lse, delta, pk, pv, s2p, lim, plen, **kw)
    past = jnp.arange(40)[None, :, None, None] >= plen[:, None, None, None]
    pk_nan, pv_nan = jnp.where(past, jnp.nan, pk), jnp.where(past, jnp.nan, pv)
    dirty = prefix_grads(q, do, lse, delta, pk_nan, pv_nan, s2p, lim, plen, **kw)
    for a, w in zip(dirty, clean):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(w))
    np.testing.assert_array_equal(np.asarray(clean[1])[np.asarray(past[..., 0, 0])], 0.0)


def test_prefix_grads_lower_for_cuda():
    """The Triton lowering of both kernels (what the GPU compiles) on the CPU: catches
    primitives Pallas cannot lower for Triton (e.g. ``jnp.all``) without a GPU."""
    for tq, g, rs in ((1, 1, None), (4, 3, 2)):
        q, do, lse, delta, pk, pv, s2p, lim, plen, scale = _case(tq, b=8, tq=tq, hq=8, hkv=2,
                                                               d=64, g=g, p=200,
                                                               dtype=jnp.bfloat16)
        text = lower_for_cuda(
            lambda *a: prefix_grads(*a, scale=scale, row_splits=rs or 1, key_splits=rs or 1),
            q, do, lse, delta, pk, pv, s2p, lim, plen)
        assert "prefix_bwd_dq" in text and "prefix_bwd_dkv" in text


def test_choose_row_splits():
    assert choose_row_splits(300, 50, 132) == 1
    assert choose_row_splits(8, 100, 132) == 16
    assert choose_row_splits(8, 3, 132) == 3
    assert choose_row_splits(100, 50, 132) == 3


def test_prefix_grads_validation():
    q, do, lse, delta, pk, pv, s2p, lim, plen, scale = _case(1)
    with pytest.raises(ValueError, match="row_splits"):
        prefix_grads(q, do, lse, delta, pk, pv, s2p, lim, plen, scale=scale, interpret=True,
                     row_splits=0)
    with pytest.raises(ValueError, match="key_splits"):
        prefix_grads(q, do, lse, delta, pk, pv, s2p, lim, plen, scale=scale, interpret=True,
                     key_splits=0)
    with pytest.raises(ValueError, match="head_dim"):
        prefix_grads(q[..., :12], do[..., :12], lse, delta, pk[..., :12], pv[..., :12], s2p, lim,
                     plen, scale=scale, interpret=True)


@pytest.mark.parametrize("causal", [True, False])
def test_flash_attention_bwd_equals_autodiff_of_flash(causal):
    """With its own statistics (and a cotangent on lse) it is flash_attention's gradient."""
    rng = np.random.default_rng(4)
    b, t, hq, hkv, d, s = 2, 5, 4, 2, 16, 13

    def rnd(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32))
    q, k, v, do, dl = rnd(b, t, hq, d), rnd(b, s, hkv, d), rnd(b, s, hkv, d), rnd(b, t, hq, d), \
        rnd(b, t, hq)
    lens = jnp.asarray([13, 2], jnp.int32)  # (causal, length 2 < Tq: rows without keys)

    def loss(q, k, v):
        o, lse = flash_attention(q, k, v, causal=causal, kv_lengths=lens, interpret=True)
        return jnp.sum(o * do) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * dl)
    want = jax.grad(loss, (0, 1, 2))(q, k, v)
    o, lse = flash_attention(q, k, v, causal=causal, kv_lengths=lens, interpret=True)
    delta = jnp.sum(o * do, -1) - jnp.where(jnp.isfinite(lse), dl, 0.0)
    got = flash_attention_bwd(q, k, v, do, lse, delta, causal=causal, kv_lengths=lens,
                              interpret=True)
    for a, w in zip(got, want):
        assert rel_err(a, w) < 1e-5, rel_err(a, w)
    with pytest.raises(ValueError, match="delta"):
        flash_attention_bwd(q, k, v, do, lse, delta[:, :2], interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("tq,g,dtype,d", [(1, 1, jnp.bfloat16, 128), (16, 1, jnp.bfloat16, 64),
                                          (4, 3, jnp.bfloat16, 128), (4, 2, jnp.float32, 64)])
def test_prefix_grads_gpu(tq, g, dtype, d):
    q, do, lse, delta, pk, pv, s2p, lim, plen, scale = _case(
        tq + g, b=24, tq=tq, hq=16, hkv=4, d=d, g=g, p=333, dtype=dtype)
    got = jax.jit(lambda *a: prefix_grads(*a, scale=scale))(q, do, lse, delta, pk, pv, s2p, lim,
                                                            plen)
    want = prefix_grads_reference(q, do, lse, delta, pk, pv, s2p, lim, plen, scale=scale)
    for a, w in zip(got, want):
        assert np.isfinite(np.asarray(a, np.float32)).all()
        assert rel_err(a, w) < TOL[dtype], rel_err(a, w)


def test_flash_attention_bwd_ignores_keys_past_the_lengths():
    """The suffix part of shared-prefix attention past 128 rows: a stale cache (NaN) past each
    length must not reach any gradient."""
    rng = np.random.default_rng(6)
    b, t, hq, hkv, d, s = 2, 3, 4, 2, 16, 40

    def rnd(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32))
    q, k, v, do = rnd(b, t, hq, d), rnd(b, s, hkv, d), rnd(b, s, hkv, d), rnd(b, t, hq, d)
    lens = jnp.asarray([21, 7], jnp.int32)
    lse = rnd(b, t, hq) + 4.0
    delta = rnd(b, t, hq)
    kw = dict(causal=True, kv_lengths=lens, interpret=True)
    clean = flash_attention_bwd(q, k, v, do, lse, delta, **kw)
    past = jnp.arange(s)[None, :, None, None] >= lens[:, None, None, None]
    dirty = flash_attention_bwd(q, jnp.where(past, jnp.nan, k), jnp.where(past, jnp.nan, v), do,
                                lse, delta, **kw)
    for a, w in zip(dirty, clean):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(w))
