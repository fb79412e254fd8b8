"""Backward of the suffix part at short query counts (``pallas_kernels.suffix_attention_bwd``):
against the dense reference (itself checked against float64 NumPy in
``test_prefix_attention_bwd.py``), NaN past the lengths, key splits, the lowering for CUDA;
compiled on the GPU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import lower_for_cuda, rel_err
from pallas_kernels.suffix_attention_bwd import (MAX_ROWS, suffix_grads, suffix_grads_reference,
                                                 suffix_grads_supported)

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _case(seed, b, tq, hq, hkv, d, s, dtype=jnp.float32):
    rng = np.random.default_rng(seed)

    def rnd(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)
    q, do, sk, sv = rnd(b, tq, hq, d), rnd(b, tq, hq, d), rnd(b, s, hkv, d), rnd(b, s, hkv, d)
    sl = jnp.asarray(rng.integers(0, s + 1, size=b), jnp.int32).at[0].set(0).at[-1].set(s)
    i = jnp.arange(tq)[None, :]
    lim = jnp.clip(sl[:, None] - tq + i + 1, 0, sl[:, None]).astype(jnp.int32)
    lse = jnp.asarray(rng.standard_normal((b, tq, hq)), jnp.float32) + 3.0
    lse = lse.at[-1, 0, 0].set(-jnp.inf)
    delta = jnp.asarray(rng.standard_normal((b, tq, hq)), jnp.float32)
    return q, do, lse, delta, sk, sv, lim, sl


@pytest.mark.parametrize("b,tq,hq,hkv,d,s,dtype,ks", [
    (3, 1, 8, 2, 16, 37, jnp.float32, None),     # decoding, GQA 4
    (2, 4, 4, 1, 32, 50, jnp.float32, 3),        # Tq 4, GQA 4 (one kv head), keys split
    (4, 2, 8, 8, 16, 20, jnp.float32, 1),        # MHA
    (3, 3, 8, 2, 64, 70, jnp.bfloat16, 2),       # bf16, Tq 3 (rows padded to 16)
    (2, 16, 16, 2, 16, 40, jnp.float32, None),   # 128 rows: the largest tile
])
def test_suffix_grads_match_reference_interpret(b, tq, hq, hkv, d, s, dtype, ks):
    q, do, lse, delta, sk, sv, lim, _ = _case(b + tq, b, tq, hq, hkv, d, s, dtype)
    got = suffix_grads(q, do, lse, delta, sk, sv, lim, scale=0.3, interpret=True, key_splits=ks or 1,
                       block_k=16)
    want = suffix_grads_reference(q, do, lse, delta, sk, sv, lim, scale=0.3)
    for name, a, w in zip(("dq", "dk", "dv"), got, want):
        assert a.shape == w.shape and a.dtype == w.dtype, name
        assert rel_err(a, w) < TOL[dtype], (name, rel_err(a, w))
    np.testing.assert_array_equal(np.asarray(got[0], np.float32)[-1, 0, 0], 0.0)  # lse = -inf
    np.testing.assert_array_equal(np.asarray(got[1], np.float32)[0], 0.0)  # length 0: no key


def test_suffix_grads_ignore_keys_past_the_lengths():
    q, do, lse, delta, sk, sv, lim, sl = _case(5, 4, 2, 8, 2, 16, 45)
    kw = dict(scale=0.3, interpret=True, block_k=16)
    clean = suffix_grads(q, do, lse, delta, sk, sv, lim, **kw)
    past = jnp.arange(45)[None, :, None, None] >= sl[:, None, None, None]
    dirty = suffix_grads(q, do, lse, delta, jnp.where(past, jnp.nan, sk),
                         jnp.where(past, jnp.nan, sv), lim, **kw)
    for a, w in zip(dirty, clean):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(w))


def test_suffix_grads_scope_and_validation():
    assert suffix_grads_supported(1, 32, 8, 128) and suffix_grads_supported(16, 8, 1, 64)
    assert not suffix_grads_supported(MAX_ROWS + 1, 1, 1, 64)
    assert not suffix_grads_supported(1, 8, 1, 24)
    q, do, lse, delta, sk, sv, lim, _ = _case(1, 2, 1, 4, 2, 16, 20)
    with pytest.raises(ValueError, match="key_splits"):
        suffix_grads(q, do, lse, delta, sk, sv, lim, scale=0.3, interpret=True, key_splits=0)
    q2 = jnp.zeros((2, 40, 8, 16), jnp.float32)  # 40 x 4 = 160 rows
    with pytest.raises(ValueError, match="rows"):
        suffix_grads(q2, q2, lse, delta, sk, sv, lim, scale=0.3, interpret=True)


def test_suffix_grads_lower_for_cuda():
    """The Triton lowering (transposed products included) on the CPU."""
    q, do, lse, delta, sk, sv, lim, _ = _case(2, 4, 2, 8, 2, 64, 100, jnp.bfloat16)
    for ks in (1, 3):
        text = lower_for_cuda(lambda *a: suffix_grads(*a, lim, scale=0.125, key_splits=ks or 1),
                              q, do, lse, delta, sk, sv)
        assert "suffix_bwd" in text


@pytest.mark.gpu
@pytest.mark.parametrize("b,tq,hq,hkv,d,s,dtype", [(64, 1, 32, 8, 128, 256, jnp.bfloat16),
                                                   (8, 16, 8, 1, 128, 300, jnp.bfloat16),
                                                   (5, 3, 16, 4, 64, 77, jnp.float32)])
def test_suffix_grads_gpu(b, tq, hq, hkv, d, s, dtype):
    q, do, lse, delta, sk, sv, lim, _ = _case(7, b, tq, hq, hkv, d, s, dtype)
    got = jax.jit(lambda *a: suffix_grads(*a, lim, scale=0.125))(q, do, lse, delta, sk, sv)
    want = suffix_grads_reference(q, do, lse, delta, sk, sv, lim, scale=0.125)
    for a, w in zip(got, want):
        assert np.isfinite(np.asarray(a, np.float32)).all()
        assert rel_err(a, w) < TOL[dtype], rel_err(a, w)
