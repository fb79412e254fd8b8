"""Decoupled one-launch decode kernel (experimental, not dispatched: measured slower than the
default shared path, see the module docstring).

CPU: validation, and the kernel traced and lowered for CUDA (Mosaic GPU layout inference and the
shared-memory budget; no PTX is compiled).  GPU (marker ``gpu``): the whole decode (kernel, then
one XLA merge of its prefix and suffix states) against float64 NumPy, with random suffix lengths
(0 and the capacity included) and NaN in the suffix cache past them.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import decoupled_decode_mgpu as dd
from pallas_kernels import prefix_attention as pa
from test_prefix_attention_mgpu import _lower_for_cuda

S = jax.ShapeDtypeStruct


def _decode(q, pk, pv, sk, sv, sl):
    """q [B, Hq, D] -> out [B, Hq, D]: the kernel, then one merge of its partial states."""
    b, hq, d = q.shape
    hkv = pk.shape[1]
    g = hq // hkv
    qm, _ = pa._rows_128(q[:, None], hkv, g)
    o_pre, l_pre, o_suf, l_suf = dd.decoupled_decode_mgpu(
        qm, pk, pv, jnp.full((1,), pk.shape[0], jnp.int32), sk, sv, sl, scale=d ** -0.5, group=g)
    os_, ls_ = dd.suffix_rows(o_suf, l_suf, batch=b, group=g)
    out, _ = pa._merge_row_parts([(o_pre, l_pre, g), (os_, ls_, g)], b=b, tq=1, hq=hq, r=g,
                                 dtype=q.dtype, inv=None)
    return out[:, 0]


def test_supported_and_validation():
    ok = dict(batch=256, heads_q=32, heads_kv=8, prefix_len=4096, suffix_cap=128, head_dim=128,
              dtype=jnp.bfloat16)
    assert dd.decoupled_supported(**ok) is None
    assert "power of two" in dd.decoupled_supported(**{**ok, "heads_q": 24})
    assert "suffix capacity" in dd.decoupled_supported(**{**ok, "suffix_cap": 100})
    assert "head_dim" in dd.decoupled_supported(**{**ok, "head_dim": 96})
    q = jnp.zeros((8, 1024, 128), jnp.bfloat16)
    kv = jnp.zeros((4096, 8, 128), jnp.bfloat16)
    skv = jnp.zeros((256, 128, 8, 128), jnp.bfloat16)
    sl = jnp.zeros((256,), jnp.int32)
    for bad in (232, 100, 204):   # suffix warpgroup 16 / 280 registers; not a multiple of 8
        with pytest.raises(ValueError, match="compute_registers"):
            dd.decoupled_decode_mgpu(q, kv, kv, 4096, skv, skv, sl, scale=1.0, group=4,
                                     compute_registers=bad)
    with pytest.raises(ValueError, match="num_splits"):
        dd.decoupled_decode_mgpu(q, kv, kv, 4096, skv, skv, sl, scale=1.0, group=4, num_splits=3)
    with pytest.raises(ValueError, match="suffix k/v"):
        dd.decoupled_decode_mgpu(q, kv, kv, 4096, skv[:, :64], skv, sl, scale=1.0, group=4)


def test_lowers_for_cuda_on_cpu():
    b, hq, hkv, d, p, s = 256, 32, 8, 128, 4096, 128
    txt = _lower_for_cuda(_decode, S((b, hq, d), jnp.bfloat16), S((p, hkv, d), jnp.bfloat16),
                          S((p, hkv, d), jnp.bfloat16), S((b, s, hkv, d), jnp.bfloat16),
                          S((b, s, hkv, d), jnp.bfloat16), S((b,), jnp.int32))
    assert "mosaic_gpu" in txt


def _oracle(q, pk, pv, sk, sv, sl):
    q, pk, pv, sk, sv = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, pk, pv, sk, sv))
    b, hq, d = q.shape
    g = hq // pk.shape[1]
    out = np.zeros((b, hq, d))
    for i in range(b):
        k = np.concatenate([pk, sk[i, :sl[i]]])
        v = np.concatenate([pv, sv[i, :sl[i]]])
        for h in range(hq):
            sc = k[:, h // g] @ q[i, h] / np.sqrt(d)
            e = np.exp(sc - sc.max())
            out[i, h] = e @ v[:, h // g] / e.sum()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("b,hq,hkv,d,p,s", [(40, 8, 2, 64, 256, 128), (70, 32, 8, 128, 1024, 256),
                                           (33, 8, 1, 128, 512, 192)])
def test_gpu_matches_float64_with_nan_past_lengths(b, hq, hkv, d, p, s):
    rng = np.random.default_rng(b)
    f = lambda *sh: jnp.asarray(rng.standard_normal(sh, np.float32), jnp.bfloat16)  # noqa: E731
    q, pk, pv, sk, sv = f(b, hq, d), f(p, hkv, d), f(p, hkv, d), f(b, s, hkv, d), f(b, s, hkv, d)
    sl = rng.integers(0, s + 1, b)
    sl[0], sl[-1] = s, 0
    past = jnp.asarray(np.arange(s)[None, :, None, None] >= sl[:, None, None, None])
    out = jax.jit(_decode)(q, pk, pv, jnp.where(past, jnp.nan, sk).astype(sk.dtype),
                           jnp.where(past, jnp.nan, sv).astype(sv.dtype), jnp.asarray(sl, jnp.int32))
    out = np.asarray(out.astype(jnp.float32), np.float64)
    ref = _oracle(q, pk, pv, sk, sv, sl)
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 2e-2
