"""Mosaic GPU flash attention forward (``pallas_kernels.flash_attention_mgpu``).

CPU: (1) argument checks; (2) the kernel traced and lowered for CUDA at realistic shapes (API,
layout inference, transfer plans and shared-memory budget; no PTX is compiled); (3) the kernel
in Mosaic GPU's CPU interpreter (simulated warpgroups, barriers, TMA, wgmma; K pre-transposed
and P staged through shared memory, the operand forms it has) at small odd shapes against a
float64 NumPy reference written from the softmax equations: ragged ``kv_lengths`` with NaN
keys and values past them, ``Tq != Tk``, rows that see no key, GQA groups 1/2/4/8, head_dim
64/128 and a zero-padded 80, causal and full, bfloat16 and float16.
GPU (marker ``gpu``): the compiled kernel at realistic sizes against cuDNN
(``jax.nn.dot_product_attention(implementation="cudnn")``, where its mask is the same) and the
library's pure-JAX reference.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import lower_for_cuda
from jax_prefix_attn import reference
from pallas_kernels.flash_attention_mgpu import (SMEM_LIMIT, default_block_kv,
                                                 flash_attention_mgpu, smem_bytes, supported)

S = jax.ShapeDtypeStruct


def np_attention(q, k, v, lengths, causal, scale):
    """float64 attention from the equations: ``s_ij = scale q_i . k_j`` over the keys ``j < L``
    (and ``j <= i + L - Tq`` when causal), ``lse_i = log sum_j exp s_ij``, ``o_i = sum_j
    exp(s_ij - lse_i) v_j``; a row without keys: ``lse = -inf``, ``o = 0``."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, tq, hq, d = q.shape
    g = hq // k.shape[2]
    out = np.zeros((b, tq, hq, v.shape[3]))
    lse = np.full((b, tq, hq), -np.inf)
    for bi in range(b):
        n = int(lengths[bi])
        for h in range(hq):
            kk, vv = k[bi, :n, h // g], v[bi, :n, h // g]
            for i in range(tq):
                hi = min(n, i + n - tq + 1) if causal else n
                if hi <= 0:
                    continue
                s = scale * (kk[:hi] @ q[bi, i, h])
                m = s.max()
                w = np.exp(s - m)
                lse[bi, i, h] = m + np.log(w.sum())
                out[bi, i, h] = (w / w.sum()) @ vv[:hi]
    return out, lse


def _case(seed, b, tq, tk, hq, hkv, d, dtype, lengths):
    """Random operands; keys and values at and past each length are NaN."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, tq, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, tk, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, tk, hkv, d)).astype(np.float32)
    lens = np.full((b,), tk) if lengths is None else np.asarray(lengths)
    for bi in range(b):
        k[bi, lens[bi]:] = np.nan
        v[bi, lens[bi]:] = np.nan
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    return q, k, v, lens


def _check(out, lse, q, k, v, lens, causal, scale, tol):
    ro, rl = np_attention(np.asarray(q, np.float32), np.asarray(k, np.float32),
                          np.asarray(v, np.float32), lens, causal, scale)
    out = np.asarray(out, np.float64)
    lse = np.asarray(lse, np.float64)
    assert out.shape == ro.shape and lse.shape == rl.shape
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    empty = np.isneginf(rl)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    assert np.all(out[empty] == 0)
    rel = np.linalg.norm(out - ro) / max(np.linalg.norm(ro), 1e-30)
    assert rel < tol, rel
    np.testing.assert_allclose(lse[~empty], rl[~empty], atol=1e-3, rtol=0)


# ---------------------------------------------------------------------------- arguments

def test_supported_and_argument_checks():
    bf = jnp.bfloat16
    assert supported((2, 64, 8, 128), (2, 64, 2, 128), bf) is None
    assert supported((2, 64, 8, 80), (2, 64, 2, 80), jnp.float16) is None
    assert "dtype" in supported((2, 64, 8, 128), (2, 64, 2, 128), jnp.float32)
    assert "head_dim" in supported((2, 64, 8, 320), (2, 64, 2, 320), bf)
    assert "multiple" in supported((2, 64, 6, 128), (2, 64, 4, 128), bf)
    z = lambda *s, dt=bf: jnp.zeros(s, dt)  # noqa: E731
    with pytest.raises(TypeError, match="bfloat16 and float16.*float32"):
        flash_attention_mgpu(z(1, 64, 2, 64, dt=jnp.float32), z(1, 64, 2, 64), z(1, 64, 2, 64))
    with pytest.raises(TypeError, match="q must be an array"):
        flash_attention_mgpu([1.0], z(1, 64, 2, 64), z(1, 64, 2, 64))
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        flash_attention_mgpu(z(1, 64, 2, 64), z(1, 64, 2, 64), z(1, 32, 2, 64))
    with pytest.raises(ValueError, match="head_dim"):
        flash_attention_mgpu(z(1, 64, 2, 320), z(1, 64, 2, 320), z(1, 64, 2, 320))
    with pytest.raises(ValueError, match="kv_lengths must be an integer array of shape \\[1\\]"):
        flash_attention_mgpu(z(1, 64, 2, 64), z(1, 64, 2, 64), z(1, 64, 2, 64),
                             kv_lengths=jnp.zeros((2,), jnp.int32))
    for kw, msg in (({"block_q": 32}, "block_q must be a positive multiple of 64, got 32"),
                    ({"block_kv": 320}, "block_kv must be a multiple of 64 in \\[64, 256\\], got 320"),
                    ({"num_stages": 1}, "num_stages must be in \\[2, 8\\], got 1")):
        with pytest.raises(ValueError, match=msg):
            flash_attention_mgpu(z(1, 64, 2, 64), z(1, 64, 2, 64), z(1, 64, 2, 64), **kw)
    with pytest.raises(ValueError, match="shared memory"):
        flash_attention_mgpu(z(1, 64, 2, 256), z(1, 64, 2, 256), z(1, 64, 2, 256), block_kv=128)
    assert default_block_kv(256) == 64 and default_block_kv(128) == 128
    for d in (64, 128, 256):
        assert smem_bytes(d, bf, block_q=64, block_kv=default_block_kv(d), num_stages=2) <= SMEM_LIMIT
    # at head_dim 128 a third stage of 128-key tiles, or two of 192 keys, exceed it (by about
    # 100 bytes in Mosaic GPU's own count, alignment and barriers included)
    assert smem_bytes(128, bf, block_q=64, block_kv=128, num_stages=3) > SMEM_LIMIT
    assert smem_bytes(128, bf, block_q=64, block_kv=192, num_stages=2) > SMEM_LIMIT
    assert smem_bytes(64, bf, block_q=64, block_kv=256, num_stages=3) <= SMEM_LIMIT


# ---------------------------------------------------------------------------- CUDA lowering

@pytest.mark.parametrize("b,t,hq,hkv,d,causal,dtype,stages", [
    (2, 4096, 32, 8, 128, True, jnp.bfloat16, 2),
    (1, 8192, 16, 16, 64, False, jnp.float16, 3),
    (4, 2048, 32, 4, 256, True, jnp.bfloat16, 2),
    (2, 1000, 28, 4, 96, True, jnp.float16, 2)])   # padded head_dim, rows not a block multiple
def test_kernel_lowers_for_cuda(b, t, hq, hkv, d, causal, dtype, stages):
    txt = lower_for_cuda(
        lambda q, k, v, n: flash_attention_mgpu(q, k, v, causal=causal, kv_lengths=n,
                                                num_stages=stages),
        S((b, t, hq, d), dtype), S((b, t, hkv, d), dtype), S((b, t, hkv, d), dtype),
        S((b,), jnp.int32))
    assert "mosaic_gpu" in txt


# ---------------------------------------------------------------------------- CPU interpreter

@pytest.mark.parametrize("b,tq,tk,hq,hkv,d,causal,dtype,lengths,extra", [
    # G=1, Tq < Tk, a length shorter than Tq (rows with no key), NaN past the lengths
    (2, 50, 150, 2, 2, 64, True, jnp.bfloat16, [150, 37], {}),
    # G=2, float16, head_dim 128, ragged
    (1, 30, 100, 4, 2, 128, True, jnp.float16, [77], {}),
    # G=4, full attention, a length inside the second tile
    (1, 16, 90, 8, 2, 64, False, jnp.bfloat16, [61], {}),
    # G=8, head_dim 80 (zero-padded to 128), Tq < Tk, no lengths
    (1, 16, 200, 8, 1, 80, True, jnp.bfloat16, None, {}),
    # two row blocks of 128 rows: warpgroup 0 skips tiles warpgroup 1 needs; Tq = Tk
    (1, 130, 130, 1, 1, 64, True, jnp.float16, None, {}),
    # full, a zero length (every row empty) next to a full one, Tq > Tk, 3 stages, no ping-pong
    (2, 40, 33, 2, 1, 64, False, jnp.float16, [0, 33],
     {"num_stages": 3, "schedule_barrier": False}),
    # groups that do not divide the 64 rows into whole 8-row slices: rows folded by the wrapper
    (1, 30, 70, 6, 2, 64, True, jnp.bfloat16, [55], {}),
    (1, 9, 40, 16, 1, 128, False, jnp.float16, None, {}),
])
def test_kernel_in_cpu_interpreter_matches_reference(b, tq, tk, hq, hkv, d, causal, dtype,
                                                     lengths, extra):
    q, k, v, lens = _case(b * 1000 + tq + tk + d, b, tq, tk, hq, hkv, d, dtype, lengths)
    kv_lengths = None if lengths is None else jnp.asarray(lengths, jnp.int32)
    scale = 0.7 / np.sqrt(d)
    out, lse = flash_attention_mgpu(q, k, v, causal=causal, kv_lengths=kv_lengths, sm_scale=scale,
                                    block_kv=64, interpret=True, **extra)
    assert out.dtype == dtype and lse.dtype == jnp.float32
    _check(out, lse, q, k, v, lens, causal, scale, 2e-2 if dtype == jnp.bfloat16 else 4e-3)


# ---------------------------------------------------------------------------- GPU

@functools.partial(jax.jit, static_argnames="causal")
def _gpu_reference(q, k, v, lens, causal):
    return reference.attention(*(x.astype(jnp.float32) for x in (q, k, v)), causal=causal,
                               kv_lengths=lens)


@functools.partial(jax.jit, static_argnames=("shape_q", "shape_kv", "dtype"))
def _gpu_case(seed, lens, shape_q, shape_kv, dtype):
    """Random operands drawn on the device; keys and values at and past each length NaN."""
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    past = jnp.arange(shape_kv[1])[None, :, None, None] >= lens[:, None, None, None]
    q = jax.random.normal(kq, shape_q, jnp.float32).astype(dtype)
    k, v = (jnp.where(past, jnp.nan, jax.random.normal(x, shape_kv, jnp.float32)).astype(dtype)
            for x in (kk, kv))
    return q, k, v


@pytest.mark.gpu
@pytest.mark.parametrize("b,t,hq,hkv,d,causal,dtype,ragged", [
    (4, 4096, 32, 8, 128, True, jnp.bfloat16, False),
    (4, 4096, 32, 8, 128, False, jnp.float16, True),
    (2, 8192, 16, 16, 64, True, jnp.float16, True),
    (8, 2048, 16, 2, 256, True, jnp.bfloat16, True),
    (16, 1024, 8, 1, 128, False, jnp.bfloat16, False),
    (4, 4096, 8, 2, 64, False, jnp.bfloat16, False)])
def test_gpu_matches_cudnn_and_reference(b, t, hq, hkv, d, causal, dtype, ragged):
    lengths = np.full((b,), t)
    if ragged:   # one full sequence, the others cut anywhere
        lengths[1:] = np.random.default_rng(b * t + d).integers(1, t + 1, size=b - 1)
    lens = jnp.asarray(lengths, jnp.int32)
    q, k, v = _gpu_case(b + t + d, lens, (b, t, hq, d), (b, t, hkv, d), dtype)
    out, lse = jax.jit(lambda q, k, v, n: flash_attention_mgpu(
        q, k, v, causal=causal, kv_lengths=n))(q, k, v, lens if ragged else None)
    assert out.dtype == dtype and lse.dtype == jnp.float32
    ro, rl = _gpu_reference(q, k, v, lens, causal)
    out32 = out.astype(jnp.float32)
    tol = 2e-2 if dtype == jnp.bfloat16 else 4e-3
    rel = float(jnp.linalg.norm(out32 - ro) / jnp.linalg.norm(ro))
    assert rel < tol, rel
    finite = jnp.isfinite(rl)
    assert bool(jnp.all(jnp.isneginf(lse) == ~finite))
    assert float(jnp.max(jnp.where(finite, jnp.abs(lse - rl), 0.0))) < 2e-2
    if not ragged:   # cuDNN's causal mask is top-left: the same only without lengths (Tq = Tk)
        cud = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"))(q, k, v)
        rel_c = float(jnp.linalg.norm(out32 - cud.astype(jnp.float32)) / jnp.linalg.norm(ro))
        assert rel_c < tol, rel_c
