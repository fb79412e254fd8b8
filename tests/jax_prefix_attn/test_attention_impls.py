"""``jax_prefix_attn.attention`` through each of its kernels: the Mosaic GPU flash kernels
(``impl="flash_mgpu"``) in the CPU interpreter against float64 NumPy (forward, and the
gradients of a loss of ``out`` and ``lse``), lowered for CUDA, and on a GPU against the
reference and the Triton kernels (``impl="flash"``)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_prefix_attn as jpa
from helpers import lower_for_cuda, rel_err


def _np_attention(q, k, v, lengths, causal):
    """float64 ``(out, lse)``: bottom-right causal aligned to each sequence's length."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, tq, hq, d = q.shape
    g = hq // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    cols = np.arange(k.shape[1])
    ok = cols[None, None, None, :] < lengths[:, None, None, None]
    if causal:
        rows = lengths[:, None] - tq + np.arange(tq)[None, :]               # [B, Tq]
        ok = ok & (cols[None, None, None, :] <= rows[:, None, :, None])
    s = np.where(ok, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", p / np.where(l > 0, l, 1.0), v)
    lse = np.where(l[..., 0] > 0, np.log(np.where(l[..., 0] > 0, l[..., 0], 1.0)) + m[..., 0], -np.inf)
    return out, lse.transpose(0, 2, 1)


def test_flash_mgpu_in_cpu_interpreter():
    """Causal, GQA 2, an empty, a ragged and a full sequence: forward against float64 NumPy, and
    the gradients of a weighted loss of ``out`` and ``lse`` against the reference's (one jitted
    program each: the kernels' forward and backward run once)."""
    b, tq, tk, hq, hkv, d = 3, 20, 37, 4, 2, 64
    ks = jax.random.split(jax.random.PRNGKey(3), 5)
    q, k, v = (jax.random.normal(kk, sh, jnp.float32).astype(jnp.bfloat16) for kk, sh in
               zip(ks, [(b, tq, hq, d), (b, tk, hkv, d), (b, tk, hkv, d)]))
    lengths = np.array([0, 23, tk])
    w_out = jax.random.normal(ks[3], (b, tq, hq, d), jnp.float32)
    w_lse = jax.random.normal(ks[4], (b, tq, hq), jnp.float32)

    def loss(impl, q, k, v):
        o, l = jpa.attention(q, k, v, causal=True, kv_lengths=jnp.asarray(lengths), impl=impl,
                             interpret=True)
        fin = jnp.where(jnp.isfinite(l), l, 0)
        return jnp.sum(o.astype(jnp.float32) * w_out) + jnp.sum(fin * w_lse), (o, l)

    grad = lambda impl: jax.jit(jax.grad(lambda *a: loss(impl, *a), argnums=(0, 1, 2),  # noqa: E731
                                         has_aux=True))
    got, (out, lse) = grad("flash_mgpu")(q, k, v)
    want, _ = grad("reference")(*(x.astype(jnp.float32) for x in (q, k, v)))
    want_out, want_lse = _np_attention(q, k, v, lengths, True)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    assert rel_err(out, want_out) < 2e-2
    fin = np.isfinite(want_lse)
    assert np.abs(np.asarray(lse)[fin] - want_lse[fin]).max() < 2e-2
    for name, g, w in zip("qkv", got, want):
        assert g.dtype == jnp.bfloat16, name
        assert rel_err(g, w) < 3e-2, name


def test_flash_mgpu_lowers_for_cuda_and_names_what_it_cannot_run():
    s = jax.ShapeDtypeStruct
    text = lower_for_cuda(
        lambda q, k, v: jax.grad(lambda q: jpa.attention(q, k, v, causal=True, impl="flash_mgpu")[0]
                                 .astype(jnp.float32).sum())(q),
        s((2, 256, 8, 128), jnp.bfloat16), s((2, 256, 2, 128), jnp.bfloat16),
        s((2, 256, 2, 128), jnp.bfloat16))
    assert text.count("mosaic_gpu") >= 2        # forward and backward kernels
    x = jnp.zeros((1, 4, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"impl='flash_mgpu'.*bfloat16 or float16.*use impl='reference'"):
        jpa.attention(x, x, x, impl="flash_mgpu", interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("causal,d,dtype", [(True, 128, jnp.bfloat16), (False, 64, jnp.float16),
                                            (True, 256, jnp.bfloat16)])
def test_gpu_flash_mgpu_matches_reference_and_triton(causal, d, dtype):
    """Realistic sizes, GQA 4, ragged lengths: ``flash_mgpu`` forward and gradients against the
    reference, in one program with the Triton kernels' (``flash``)."""
    b, t, hq, hkv = 2, 2048, 16, 4
    ks = jax.random.split(jax.random.PRNGKey(d), 5)
    q, k, v = (jax.random.normal(kk, (b, t, h, d), jnp.float32).astype(dtype)
               for kk, h in zip(ks, (hq, hkv, hkv)))
    lengths = jnp.array([t, 1500], jnp.int32)
    w = jax.random.normal(ks[3], (b, t, hq, d), jnp.float32)

    @jax.jit
    def run(q, k, v):
        def grads(impl):
            def loss(q, k, v):
                o, l = jpa.attention(q, k, v, causal=causal, kv_lengths=lengths, impl=impl)
                return jnp.sum(o.astype(jnp.float32) * w) + jnp.sum(jnp.where(jnp.isfinite(l), l, 0))
            g = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
            return jpa.attention(q, k, v, causal=causal, kv_lengths=lengths, impl=impl), g
        return grads("flash_mgpu"), grads("flash"), grads("reference")

    (mg, mg_g), (tr, tr_g), (ref, ref_g) = run(q, k, v)
    for got in (mg, tr):
        assert rel_err(got[0], ref[0]) < 2e-2
        lse, want_lse = np.asarray(got[1]), np.asarray(ref[1])
        # causal, bottom-right aligned: the first rows of the shorter sequence see no key
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
        fin = np.isfinite(want_lse)
        assert np.abs(lse[fin] - want_lse[fin]).max() < 2e-2
    for g, rg in zip(mg_g, ref_g):
        assert rel_err(g, rg) < 2e-2
