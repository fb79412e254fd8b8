"""Reference attention vs an independent float64 NumPy implementation."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_prefix_attn import reference
from helpers import rel_err


def numpy_attention(q, k, v, causal, lengths, scale):
    """Independent float64 loop implementation of the project's conventions."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    out = np.zeros((b, tq, hq, d))
    lse = np.full((b, tq, hq), -np.inf)
    for bi, i, h in itertools.product(range(b), range(tq), range(hq)):
        L = tk if lengths is None else int(lengths[bi])
        kh = h // (hq // hkv)
        keys = [j for j in range(tk) if j < L and (not causal or j <= i + L - tq)]
        if not keys:
            continue
        s = np.array([q[bi, i, h] @ k[bi, j, kh] for j in keys]) * scale
        mx = s.max()
        e = np.exp(s - mx)
        lse[bi, i, h] = mx + np.log(e.sum())
        out[bi, i, h] = (e / e.sum()) @ v[bi, keys, kh]
    return out, lse


def _inputs(seed, b, tq, tk, hq, hkv, d, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, tq, hq, d), np.float32), dtype)
    k = jnp.asarray(rng.standard_normal((b, tk, hkv, d), np.float32), dtype)
    v = jnp.asarray(rng.standard_normal((b, tk, hkv, d), np.float32), dtype)
    return q, k, v


_ref_jit = jax.jit(reference.attention, static_argnames=("causal", "sm_scale"))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 1), (8, 2)])
@pytest.mark.parametrize("tq,tk", [(5, 5), (3, 11), (1, 9), (7, 4)])
@pytest.mark.parametrize("with_lengths", [False, True])
def test_reference_matches_numpy_float64(causal, hq, hkv, tq, tk, with_lengths):
    b, d = 3, 16
    q, k, v = _inputs(hq * 100 + tq * 10 + tk, b, tq, tk, hq, hkv, d)
    lengths = None
    if with_lengths:
        lengths = jnp.array([tk, 0, max(1, tk // 2)], jnp.int32)
    scale = 0.37
    out, lse = _ref_jit(q, k, v, causal=causal, kv_lengths=lengths, sm_scale=scale)
    ref_out, ref_lse = numpy_attention(q, k, v, causal, None if lengths is None else np.asarray(lengths), scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (b, tq, hq) and lse.dtype == jnp.float32
    assert np.isfinite(np.asarray(out)).all()
    assert rel_err(out, ref_out) < 1e-6
    fin = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
    assert (np.asarray(lse)[~fin] == -np.inf).all()
    np.testing.assert_allclose(np.asarray(lse)[fin], ref_lse[fin], rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out)[~fin], 0.0)


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = _inputs(1, 2, 3, 6, 2, 2, 32)
    out, lse = reference.attention(q, k, v)
    ref_out, ref_lse = numpy_attention(q, k, v, False, None, 1 / np.sqrt(32))
    assert rel_err(out, ref_out) < 1e-6
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)


def test_bf16_inputs_accumulate_in_float32():
    q, k, v = _inputs(2, 2, 4, 64, 4, 2, 64, jnp.bfloat16)
    out, lse = reference.attention(q, k, v, causal=True)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    ref_out, _ = numpy_attention(q, k, v, True, None, 1 / 8)
    assert rel_err(out, ref_out) < 2e-2


def test_fully_masked_rows_have_finite_gradients():
    q, k, v = _inputs(3, 2, 4, 6, 2, 1, 8)
    lengths = jnp.array([0, 3], jnp.int32)  # batch 0 sees nothing; causal hides early queries of batch 1

    def loss(q, k, v):
        out, lse = reference.attention(q, k, v, causal=True, kv_lengths=lengths)
        return jnp.sum(out ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for g in grads:
        assert np.isfinite(np.asarray(g)).all()
    assert float(jnp.abs(grads[0][0]).max()) == 0.0


def test_reference_under_jit_with_dynamic_lengths():
    q, k, v = _inputs(4, 2, 1, 10, 4, 2, 16)
    f = jax.jit(lambda q, k, v, n: reference.attention(q, k, v, causal=True, kv_lengths=n))
    for lens in ([10, 3], [5, 7]):
        out, lse = f(q, k, v, jnp.array(lens, jnp.int32))
        ref_out, ref_lse = numpy_attention(q, k, v, True, lens, 0.25)
        assert rel_err(out, ref_out) < 1e-6


def test_nan_past_the_lengths_reaches_neither_outputs_nor_gradients():
    """Keys and values past ``kv_lengths`` may hold anything (a KV cache's unused slots): with
    NaN there, outputs and gradients equal those of a clean cache (and are zero there)."""
    q, k, v = _inputs(7, 2, 3, 9, 4, 2, 16)
    lengths = jnp.array([5, 0], jnp.int32)
    pad = (jnp.arange(9)[None, :] >= lengths[:, None])[:, :, None, None]
    kn, vn = jnp.where(pad, jnp.nan, k), jnp.where(pad, jnp.nan, v)

    def loss(q, k, v):
        out, lse = reference.attention(q, k, v, causal=True, kv_lengths=lengths)
        return jnp.sum(out ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)
    run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))   # one program for both
    (_, (o1, l1)), g1 = run(q, k, v)
    (_, (o2, l2)), g2 = run(q, kn, vn)
    np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
    np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))
    for a, b in zip(g1, g2):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(jnp.abs(jnp.where(pad, g2[1], 0.0)).max()) == 0.0
