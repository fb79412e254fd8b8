"""Pallas flash attention (forward + backward, through out and lse) vs the reference.

CPU tests run the kernels in Pallas interpret mode on small shapes with small blocks (so
every case has several query and key blocks and ragged tails).  Tests marked ``gpu`` run
the compiled kernels at realistic sizes.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_prefix_attn import attention, merge_two, reference
from pallas_kernels.flash_attention import FlashConfig, KernelTiles, flash_attention, supported
from helpers import rel_err

# Interpret-mode kernels are small programs with big loop nests: XLA:CPU's optimiser costs
# far more than running them, so CPU tests compile with it turned down (5x faster).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

SMALL = FlashConfig(fwd=KernelTiles(16, 16), dq=KernelTiles(16, 16), dkv=KernelTiles(16, 32))


def _inputs(seed, b, tq, tk, hq, hkv, d, dtype):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(ks[0], (b, tq, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, tk, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, tk, hkv, d), jnp.float32).astype(dtype)
    w_out = jax.random.normal(ks[3], (b, tq, hq, d), jnp.float32)
    w_lse = jax.random.normal(ks[4], (b, tq, hq), jnp.float32)
    return q, k, v, w_out, w_lse


def _loss(out, lse, w_out, w_lse):
    """Uses both outputs; rows without keys (lse = -inf) contribute through out only."""
    lse_f = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(jnp.sin(lse_f) * w_lse)


def _compiled(f, *args):
    """``jax.jit(f)`` compiled for ``args`` (fast XLA options on CPU)."""
    opts = FAST_COMPILE if jax.default_backend() == "cpu" else None
    return jax.jit(f).lower(*args).compile(compiler_options=opts)


def _check(fn, q, k, v, w_out, w_lse, *, causal, kv_lengths, tol, sm_scale=None):
    """Forward outputs and gradients of ``_loss`` of ``fn`` vs the reference."""
    def run(f):
        def loss(q, k, v):
            out, lse = f(q, k, v)
            return _loss(out, lse, w_out, w_lse), (out, lse)
        vg = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
        (_, (out, lse)), grads = _compiled(vg, q, k, v)(q, k, v)
        return out, lse, grads

    ref = lambda q, k, v: reference.attention(q, k, v, causal=causal, kv_lengths=kv_lengths,  # noqa: E731
                                              sm_scale=sm_scale)
    out, lse, grads = run(fn)
    r_out, r_lse, r_grads = run(ref)
    assert out.shape == r_out.shape and out.dtype == r_out.dtype
    assert lse.shape == r_lse.shape and lse.dtype == jnp.float32
    assert not np.isnan(np.asarray(out, np.float32)).any()
    assert not np.isnan(np.asarray(lse)).any()
    r_lse = np.asarray(r_lse)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(r_lse))
    fin = np.isfinite(r_lse)
    assert rel_err(out, r_out) < tol
    assert rel_err(np.where(fin, lse, 0.0), np.where(fin, r_lse, 0.0)) < tol
    for name, g, rg in zip("qkv", grads, r_grads):
        assert g.shape == rg.shape and g.dtype == rg.dtype, name
        assert not np.isnan(np.asarray(g, np.float32)).any(), f"NaN in d{name}"
        err = rel_err(g, rg)
        assert err < tol, f"d{name} rel err {err}"
    return out, lse


CASES = [
    # (b, tq, tk, hq, hkv, d, causal, lengths)
    pytest.param(2, 37, 53, 4, 1, 64, True, [0, 41], id="causal-gqa4-d64-ragged-with-zero"),
    pytest.param(2, 32, 48, 2, 2, 64, False, None, id="noncausal-mha-d64-full"),
    pytest.param(2, 20, 45, 8, 2, 128, True, [45, 3], id="causal-gqa4-d128-tq<tk-ragged"),
    pytest.param(1, 40, 24, 8, 1, 64, True, None, id="causal-gqa8-tq>tk-empty-rows"),
    pytest.param(2, 1, 50, 4, 2, 64, True, [50, 17], id="decode-tq1-ragged"),
]


@pytest.mark.parametrize("b,tq,tk,hq,hkv,d,causal,lengths", CASES)
def test_fp32_forward_and_grads(b, tq, tk, hq, hkv, d, causal, lengths):
    q, k, v, w_out, w_lse = _inputs(tq * 7 + tk, b, tq, tk, hq, hkv, d, jnp.float32)
    kv_lengths = None if lengths is None else jnp.asarray(lengths, jnp.int32)
    fn = lambda q, k, v: flash_attention(q, k, v, causal=causal, kv_lengths=kv_lengths,  # noqa: E731
                                         interpret=True, config=SMALL)
    out, lse = _check(fn, q, k, v, w_out, w_lse, causal=causal, kv_lengths=kv_lengths, tol=1e-5)
    if lengths is not None and 0 in lengths:  # a sequence with no keys: out = 0, lse = -inf
        i = lengths.index(0)
        assert np.all(np.asarray(out[i]) == 0) and np.all(np.isneginf(np.asarray(lse[i])))


def test_bf16_causal_gqa_d128_public_entry():
    q, k, v, w_out, w_lse = _inputs(3, 2, 48, 48, 4, 2, 128, jnp.bfloat16)
    lengths = jnp.asarray([48, 29], jnp.int32)
    fn = lambda q, k, v: attention(q, k, v, causal=True, kv_lengths=lengths,  # noqa: E731
                                   impl="flash", interpret=True)
    _check(fn, q, k, v, w_out, w_lse, causal=True, kv_lengths=lengths, tol=2e-2)


def test_lse_gradient_through_merge_of_two_halves():
    """Attention over two key halves merged through lse == attention over all keys.

    The loss depends on the halves' lse only through the merge, so a wrong lse cotangent
    path would give wrong gradients.
    """
    b, tq, tk, hq, hkv, d = 2, 19, 40, 8, 1, 64
    q, k, v, w_out, w_lse = _inputs(11, b, tq, tk, hq, hkv, d, jnp.float32)
    lengths = jnp.asarray([40, 13], jnp.int32)
    half = tk // 2

    def merged(q, k, v):
        len_a = jnp.minimum(lengths, half)
        len_b = jnp.maximum(lengths - half, 0)
        oa, la = flash_attention(q, k[:, :half], v[:, :half], kv_lengths=len_a, interpret=True,
                                 config=SMALL)
        ob, lb = flash_attention(q, k[:, half:], v[:, half:], kv_lengths=len_b, interpret=True,
                                 config=SMALL)
        return merge_two(oa, la, ob, lb)

    _check(merged, q, k, v, w_out, w_lse, causal=False, kv_lengths=lengths, tol=1e-5)


def test_head_dim_padding_and_scale():
    """head_dim 40 is zero-padded to 64 inside; a custom sm_scale is honoured."""
    q, k, v, w_out, w_lse = _inputs(5, 1, 24, 33, 2, 1, 40, jnp.float32)
    fn = lambda q, k, v: flash_attention(q, k, v, causal=True, sm_scale=0.3, interpret=True,  # noqa: E731
                                         config=SMALL)
    _check(fn, q, k, v, w_out, w_lse, causal=True, kv_lengths=None, tol=1e-5, sm_scale=0.3)


def test_lengths_change_without_recompiling():
    """kv_lengths are data: one compiled executable serves new values, exactly."""
    q, k, v, _, _ = _inputs(7, 2, 16, 40, 2, 2, 64, jnp.float32)

    def f(q, k, v, lengths):
        return flash_attention(q, k, v, causal=True, kv_lengths=lengths, interpret=True,
                               config=SMALL)

    compiled = _compiled(f, q, k, v, jnp.asarray([40, 16], jnp.int32))
    for lengths in ([40, 16], [23, 0], [17, 39]):
        lengths = jnp.asarray(lengths, jnp.int32)
        out, lse = compiled(q, k, v, lengths)
        r_out, r_lse = reference.attention(q, k, v, causal=True, kv_lengths=lengths)
        assert rel_err(out, r_out) < 1e-5
        fin = np.isfinite(np.asarray(r_lse))
        np.testing.assert_array_equal(fin, np.isfinite(np.asarray(lse)))
        assert rel_err(np.where(fin, lse, 0), np.where(fin, r_lse, 0)) < 1e-5


def test_unsupported_inputs_raise_clear_errors():
    q = jnp.ones((1, 8, 2, 320), jnp.float32)
    with pytest.raises(ValueError, match=r"head_dim \(64, 128, 256\).*320"):
        flash_attention(q, q, q, interpret=True)
    q64 = jnp.ones((1, 8, 2, 64), jnp.float64) if jax.config.jax_enable_x64 else None
    qi = jnp.ones((1, 8, 2, 64), jnp.int32)
    with pytest.raises(TypeError, match="float16, bfloat16, float32.*int32"):
        flash_attention(qi, qi, qi, interpret=True)
    if q64 is not None:
        with pytest.raises(TypeError, match="float64"):
            flash_attention(q64, q64, q64, interpret=True)
    qf = jnp.ones((1, 8, 3, 64), jnp.float32)
    kf = jnp.ones((1, 8, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="multiple of heads_kv"):
        flash_attention(qf, kf, kf, interpret=True)
    with pytest.raises(ValueError, match="block_q must be a power of two"):
        flash_attention(kf, kf, kf, block_q=24, interpret=True)
    with pytest.raises(ValueError, match="impl"):
        attention(kf, kf, kf, impl="triton")
    with pytest.raises(ValueError, match="kv_lengths"):
        attention(kf, kf, kf, kv_lengths=jnp.asarray([9]), impl="flash", interpret=True)
    with pytest.raises(ValueError, match=r"impl='flash'.*head_dim.*320.*use impl='reference'"):
        attention(q, q, q, impl="flash", interpret=True)
    with pytest.raises(TypeError, match="interpret must be a bool"):
        attention(kf, kf, kf, interpret="yes")


def test_supported_predicate_and_auto_choice():
    """``supported`` names what the kernel cannot run; ``impl="auto"`` takes the kernel on a GPU
    where the shapes are supported, else the reference; ``interpret`` only says how a kernel
    runs."""
    assert supported((2, 5, 4, 64), (2, 9, 2, 64), jnp.bfloat16) is None
    assert supported((2, 5, 4, 40), (2, 9, 2, 40), jnp.float32) is None  # padded to 64
    assert "head_dim" in supported((2, 5, 4, 320), (2, 9, 2, 320), jnp.float32)
    assert "dtype" in supported((2, 5, 4, 64), (2, 9, 2, 64), jnp.int32)
    assert "seq_k=0" in supported((2, 5, 4, 64), (2, 0, 2, 64), jnp.float32)
    assert "multiple" in supported((2, 5, 3, 64), (2, 9, 2, 64), jnp.float32)
    q, k, v, _, _ = _inputs(2, 2, 5, 9, 4, 2, 64, jnp.float32)
    kernel = attention(q, k, v, causal=True, impl="flash", interpret=True)
    oracle = attention(q, k, v, causal=True, impl="reference")
    assert rel_err(kernel[0], oracle[0]) < 1e-5
    want = kernel if jax.default_backend() == "gpu" else oracle
    for interpret in (False, True):
        for a, b in zip(attention(q, k, v, causal=True, interpret=interpret), want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    q3, k3, v3, _, _ = _inputs(3, 1, 3, 4, 2, 1, 320, jnp.float32)
    out, _ = attention(q3, k3, v3)  # unsupported head_dim: the reference runs, on any device
    np.testing.assert_array_equal(np.asarray(out), np.asarray(reference.attention(q3, k3, v3)[0]))


# --------------------------------------------------------------------------- GPU (compiled)


def _gpu_case(b, tq, tk, hq, hkv, d, dtype, causal, lengths, tol, seed=0, config=None):
    q, k, v, w_out, w_lse = _inputs(seed, b, tq, tk, hq, hkv, d, dtype)
    kv_lengths = None if lengths is None else jnp.asarray(lengths, jnp.int32)
    fn = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=causal, kv_lengths=kv_lengths,
                                                 config=config))
    _check(fn, q, k, v, w_out, w_lse, causal=causal, kv_lengths=kv_lengths, tol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("causal,lengths", [(True, None), (True, [4096, 2999]),
                                            (False, [1234, 4096])])
def test_gpu_realistic_bf16(causal, lengths):
    _gpu_case(2, 4096, 4096, 32, 8, 128, jnp.bfloat16, causal, lengths, 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("d,dtype", [(64, jnp.bfloat16), (128, jnp.float16), (256, jnp.bfloat16),
                                     (80, jnp.bfloat16)])
def test_gpu_head_dims_half(d, dtype):
    _gpu_case(2, 517, 1000, 8, 2, d, dtype, True, [1000, 0], 2e-2, seed=d)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_fp32_exact(d):
    _gpu_case(2, 200, 333, 4, 1, d, jnp.float32, True, [333, 150], 1e-5, seed=d)


@pytest.mark.gpu
@pytest.mark.parametrize("tq", [1, 3, 16])
def test_gpu_decode_small_tq(tq):
    _gpu_case(3, tq, 2000, 32, 8, 128, jnp.bfloat16, True, [2000, 1, 777], 2e-2, seed=tq)


@pytest.mark.gpu
def test_gpu_hydragen_shape_large_m_noncausal():
    """Prefix attention as used by Hydragen: [1, B*Tq*G, Hkv, D] vs a prefix [1, P, Hkv, D]."""
    _gpu_case(1, 8192 + 5, 1500, 8, 8, 128, jnp.bfloat16, False, None, 2e-2, seed=9)


@pytest.mark.parametrize("causal", [True, False])
def test_nan_past_the_lengths_does_not_reach_the_outputs(causal):
    """Keys and values past ``kv_lengths`` may hold anything (NaN too): the forward's masked
    tiles zero those values before ``P V`` (0 * NaN would reach the row), so outputs, LSE and
    gradients equal the clean cache's."""
    q, k, v, w_out, w_lse = _inputs(11, 2, 5, 40, 2, 1, 32, jnp.float32)
    lengths = jnp.array([21, 3], jnp.int32)
    pad = (jnp.arange(40)[None, :] >= lengths[:, None])[:, :, None, None]
    kn, vn = jnp.where(pad, jnp.nan, k), jnp.where(pad, jnp.nan, v)

    def run(k, v):
        def loss(q, k, v):
            out, lse = flash_attention(q, k, v, causal=causal, kv_lengths=lengths, interpret=True,
                                       config=SMALL)
            return _loss(out, lse, w_out, w_lse), (out, lse)
        vg = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
        (_, (out, lse)), grads = _compiled(vg, q, k, v)(q, k, v)
        return out, lse, grads
    o1, l1, g1 = run(k, v)
    o2, l2, g2 = run(kn, vn)
    assert np.isfinite(np.asarray(o2)).all()
    np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
    np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))
    for a, b in zip(g1, g2):
        b = np.asarray(jnp.where(pad, 0.0, b)) if b.shape == k.shape else np.asarray(b)
        a = np.asarray(jnp.where(pad, 0.0, a)) if a.shape == k.shape else np.asarray(a)
        np.testing.assert_allclose(a, b, rtol=0, atol=0)
