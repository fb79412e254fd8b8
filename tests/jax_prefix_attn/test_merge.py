"""merge_attention_states: split-attend-merge property and gradients."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_prefix_attn import merge_attention_states, merge_two, reference
from helpers import rel_err


def _randn(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)


def _qkv(seed, b=2, tq=3, tk=24, hq=4, hkv=2, d=16):
    return _randn(3 * seed, (b, tq, hq, d)), _randn(3 * seed + 1, (b, tk, hkv, d)), _randn(3 * seed + 2, (b, tk, hkv, d))


@pytest.mark.parametrize("seed", range(12))
def test_split_attend_merge_equals_whole(seed):
    rng = np.random.default_rng(seed)
    tk = 24
    q, k, v = _qkv(seed, tk=tk)
    n_cuts = int(rng.integers(1, 5))
    cuts = sorted(rng.integers(0, tk + 1, size=n_cuts).tolist())  # may repeat: empty parts
    bounds = [0] + cuts + [tk]
    lengths = jnp.array([tk, int(rng.integers(0, tk + 1))], jnp.int32)
    causal = bool(seed % 2)
    whole_o, whole_l = reference.attention(q, k, v, causal=causal, kv_lengths=lengths)
    outs, lses = [], []
    # Key j of the whole is visible iff j < L and (not causal or j <= i + L - Tq). Each part
    # [a, e) is a key subset; express the same mask via a per-part attention on explicit masks.
    for a, e in zip(bounds[:-1], bounds[1:]):
        if e == a:
            outs.append(jnp.full(q.shape, jnp.nan))  # garbage in an empty part must be ignored
            lses.append(jnp.full(q.shape[:3], -jnp.inf))
            continue
        o, l = _part_attention(q, k, v, jnp.int32(a), jnp.int32(e), lengths, causal=causal)
        outs.append(o)
        lses.append(l)
    mo, ml = merge_attention_states(outs, lses)
    assert np.isfinite(np.asarray(mo)).all()
    assert rel_err(mo, whole_o) < 1e-5
    fin = np.isfinite(np.asarray(whole_l))
    np.testing.assert_array_equal(np.isfinite(np.asarray(ml)), fin)
    np.testing.assert_allclose(np.asarray(ml)[fin], np.asarray(whole_l)[fin], rtol=1e-5, atol=1e-5)
    # Stacked form gives the same.
    so, sl = merge_attention_states(jnp.stack(outs), jnp.stack(lses))
    np.testing.assert_array_equal(np.asarray(so), np.asarray(mo))


@functools.partial(jax.jit, static_argnames=("causal",))
def _part_attention(q, k, v, a, e, lengths, causal):
    """Attention of ``q`` to the keys ``[a, e)`` of ``k``, ``v`` (``a < e`` traced: one compiled
    program for every part of every case): the part's keys are moved to the front of a buffer
    of the whole's length and those past the part are masked by the part's length, so the part
    is ``k[:, a:e]`` attended with the lengths ``clip(L - a, 0, e - a)``."""
    idx = jnp.clip(a + jnp.arange(k.shape[1]), 0, k.shape[1] - 1)
    kp, vp = k[:, idx], v[:, idx]
    part_len = jnp.clip(lengths - a, 0, e - a)
    if causal:
        # Queries are the last Tq of length L: visible key index in part <= i + L - Tq - a.
        # Equivalent to causal over a sequence of length (L - a) truncated to the part.
        return _causal_part(q, kp, vp, part_len, lengths - a)
    return reference.attention(q, kp, vp, kv_lengths=part_len)


def _causal_part(q, kp, vp, part_len, align_len):
    """Attention of q (last Tq of a sequence) to a key part, with explicit causal masking."""
    tq, tp = q.shape[1], kp.shape[1]
    i = jnp.arange(tq)[None, :, None]
    j = jnp.arange(tp)[None, None, :]
    mask = (j < part_len[:, None, None]) & (j <= i + align_len[:, None, None] - tq)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(kp, q.shape[2] // kp.shape[2], axis=2),
                   precision="highest") / np.sqrt(q.shape[-1])
    s = jnp.where(mask[:, None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.where(jnp.isfinite(lse)[..., None], jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0)[..., None]), 0)
    o = jnp.einsum("bhqk,bkhd->bqhd", p, jnp.repeat(vp, q.shape[2] // vp.shape[2], axis=2), precision="highest")
    return o, jnp.transpose(lse, (0, 2, 1))


def test_all_parts_empty_gives_zero_and_minus_inf():
    o = _randn(100, (3, 2, 5, 4, 8))
    l = jnp.full((3, 2, 5, 4), -jnp.inf)
    mo, ml = merge_attention_states(o, l)
    np.testing.assert_array_equal(np.asarray(mo), 0.0)
    assert (np.asarray(ml) == -np.inf).all()


def test_single_part_is_identity():
    o = _randn(101, (1, 2, 5, 4, 8))
    l = _randn(102, (1, 2, 5, 4))
    mo, ml = merge_attention_states(o, l)
    np.testing.assert_allclose(mo, o[0], rtol=1e-6)
    np.testing.assert_allclose(ml, l[0], rtol=1e-6)


def _merge_numpy(o, l):
    o = np.asarray(o, np.float64)
    l = np.asarray(l, np.float64)
    lse = np.logaddexp.reduce(l, axis=0)
    return (np.exp(l - lse)[..., None] * o).sum(0), lse


def test_merge_matches_numpy_and_large_lse_is_stable():
    o = _randn(103, (4, 2, 3, 2, 8))
    l = _randn(104, (4, 2, 3, 2)) * 30 + 500.0  # exp would overflow
    mo, ml = merge_attention_states(o, l)
    ro, rl = _merge_numpy(o, l)
    assert rel_err(mo, ro) < 1e-6
    np.testing.assert_allclose(ml, rl, rtol=1e-6)


def test_merge_gradients_match_finite_differences():
    o = _randn(105, (3, 1, 2, 2, 4), jnp.float32)
    l = _randn(106, (3, 1, 2, 2), jnp.float32)
    l = l.at[1, 0, 0, 0].set(-jnp.inf)  # one empty part
    wo = _randn(107, (1, 2, 2, 4))
    wl = _randn(108, (1, 2, 2))

    def loss(o, l):
        mo, ml = merge_attention_states(o, l)
        return jnp.sum(mo * wo) + jnp.sum(ml * wl)

    go, gl = jax.grad(loss, argnums=(0, 1))(o, l)
    assert np.isfinite(np.asarray(go)).all() and np.isfinite(np.asarray(gl)).all()
    # Analytic: d/d o_n = w_n * wo ; d/d l_n = w_n * (<o_n - out, wo> + wl), w_n = exp(l_n - lse).
    on, ln, won, wln = (np.asarray(x, np.float64) for x in (o, l, wo, wl))
    lse = np.logaddexp.reduce(ln, axis=0)
    w = np.exp(ln - lse)
    out = (w[..., None] * on).sum(0)
    np.testing.assert_allclose(go, w[..., None] * won, rtol=1e-5, atol=1e-6)
    expect_gl = w * (((on - out) * won).sum(-1) + wln)
    np.testing.assert_allclose(gl, expect_gl, rtol=1e-4, atol=1e-6)
    # Central finite differences on a finite entry as an independent check.
    eps = 1e-2
    d = np.zeros(l.shape, np.float32)
    d[2, 0, 1, 1] = eps
    fd = (loss(o, l + d) - loss(o, l - d)) / (2 * eps)
    np.testing.assert_allclose(gl[2, 0, 1, 1], fd, rtol=2e-2, atol=1e-3)


def test_merge_gradient_all_empty_is_zero_not_nan():
    o = _randn(109, (2, 1, 1, 1, 4))
    l = jnp.full((2, 1, 1, 1), -jnp.inf)
    go, gl = jax.grad(lambda o, l: jnp.sum(merge_attention_states(o, l)[0]), argnums=(0, 1))(o, l)
    np.testing.assert_array_equal(np.asarray(go), 0.0)
    np.testing.assert_array_equal(np.asarray(gl), 0.0)


def test_merge_is_jittable_and_merge_two_agrees():
    q, k, v = _qkv(11)
    o1, l1 = reference.attention(q, k[:, :10], v[:, :10])
    o2, l2 = reference.attention(q, k[:, 10:], v[:, 10:])
    mo, ml = jax.jit(merge_two)(o1, l1, o2, l2)
    wo, wl = reference.attention(q, k, v)
    assert rel_err(mo, wo) < 1e-5
    np.testing.assert_allclose(ml, wl, rtol=1e-5)


def test_merge_bf16_outputs_keep_dtype():
    o = _randn(112, (2, 1, 3, 2, 8), jnp.bfloat16)
    l = _randn(113, (2, 1, 3, 2))
    mo, ml = merge_attention_states(o, l)
    assert mo.dtype == jnp.bfloat16 and ml.dtype == jnp.float32
