"""Mosaic GPU prefix kernel of absorbed MLA decoding (``pallas_kernels.mla_prefix_mgpu``).

CPU: (1) argument checks and the shared-memory budget; (2) the kernel in Mosaic GPU's CPU
interpreter (simulated warpgroups, barriers, TMA copies, wgmma; keys pre-transposed in memory and
``P`` staged through shared memory, the operand forms that interpreter has) against a float64
NumPy reference written from the equations ``s = scale (q_nope . c + q_rope . k_rope)``,
``o = softmax(s) c``, both ways of giving the two compute warpgroups ``P`` (each computes it,
or ``share_p``): ragged lengths, padded rows, NaN past the length, empty splits, splits
merged against the unsplit kernel; (3) lowering for CUDA at DeepSeek-V3 shapes.
GPU (marker ``gpu``): the compiled kernel against the library's pure-JAX prefix part
(:func:`jax_prefix_attn.mla_reference.latent_part`) at DeepSeek-V2-Lite and V3 shapes.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import lower_for_cuda
from jax_prefix_attn.mla_reference import latent_part
from pallas_kernels._common import merge_partials
from pallas_kernels.mla_prefix_mgpu import (SMEM_LIMIT, mla_prefix_attention, mla_prefix_partials,
                                            smem_bytes, supported)

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16


def _operands(m, r, dr, p, n, *, seed, nan_tail=False, dtype=BF16):
    """Random ``(q_nope [M, R], q_rope [M, Dr], c [P, R], k_rope [P, Dr])`` in ``dtype``; with
    ``nan_tail`` the prefix holds NaN at and past ``n``."""
    rng = np.random.default_rng(seed)
    qn, qr, c, kr = (rng.standard_normal(shape).astype(np.float32)
                     for shape in ((m, r), (m, dr), (p, r), (p, dr)))
    if nan_tail:
        c[n:] = np.nan
        kr[n:] = np.nan
    return tuple(jnp.asarray(x, dtype) for x in (qn, qr, c, kr))


def _reference(qn, qr, c, kr, n, scale):
    """float64 ``(o [M, R], lse [M])`` over the keys ``[0, n)`` from the equations."""
    qn, qr, c, kr = (np.asarray(x, np.float64) for x in (qn, qr, c, kr))
    s = (qn @ c[:n].T + qr @ kr[:n].T) * scale
    mx = s.max(axis=1, keepdims=True)
    w = np.exp(s - mx)
    return w @ c[:n] / w.sum(axis=1, keepdims=True), mx[:, 0] + np.log(w.sum(axis=1))


def _assert_close(o, lse, ref):
    ro, rl = ref
    o = np.asarray(o, np.float64)
    rel = np.linalg.norm(o - ro) / np.linalg.norm(ro)
    assert rel < 2e-2, rel
    np.testing.assert_allclose(np.asarray(lse, np.float64), rl, atol=2e-2, rtol=0)


def test_supported_and_shared_memory_budget():
    ok = functools.partial(supported, rope_dim=64, prefix_len=8192, dtype=BF16)
    assert ok(rank=512) is None and ok(rank=128) is None
    assert smem_bytes(512, 64, BF16) <= SMEM_LIMIT
    assert "shared memory" in ok(rank=512, block_kv=128)    # 2 x 144 KiB tiles
    assert "shared memory" in ok(rank=512, num_stages=3)
    assert ok(rank=256, num_stages=3) is None
    assert ok(rank=512, share_p=True) is None and smem_bytes(512, 64, BF16, share_p=True) <= SMEM_LIMIT
    assert "share_p needs rope_dim == block_kv" in ok(rank=256, rope_dim=128, share_p=True)
    assert "kv_lora_rank" in ok(rank=576)
    assert "rope_dim" in supported(rank=512, rope_dim=32, prefix_len=64, dtype=BF16)
    assert "dtype" in ok(rank=512, dtype=jnp.float32)
    assert "prefix length" in supported(rank=512, rope_dim=64, prefix_len=0, dtype=BF16)
    qn, qr, c, kr = _operands(64, 128, 64, 256, 256, seed=0)
    call = functools.partial(mla_prefix_partials, sm_scale=0.1)
    with pytest.raises(TypeError, match="q_nope must be bfloat16"):
        call(qn.astype(jnp.float32), qr, c, kr, 256)
    with pytest.raises(TypeError, match="c must have q_nope's dtype"):
        call(qn, qr, c.astype(jnp.float16), kr, 256)
    with pytest.raises(ValueError, match="c must have q_nope's kv_lora_rank R=128"):
        call(qn, qr, c[:, :64], kr, 256)
    with pytest.raises(ValueError, match=r"k_rope must have shape \(P, Dr\) = \(256, 64\)"):
        call(qn, qr, c, kr[:128], 256)
    with pytest.raises(ValueError, match="q_rope must have q_nope's 64 rows"):
        call(qn, qr[:32], c, kr, 256)
    with pytest.raises(ValueError, match="shared memory"):
        call(*_operands(64, 512, 64, 256, 256, seed=0), 256, block_kv=128)
    with pytest.raises(ValueError, match="num_splits=3 must leave every split"):
        call(qn, qr, c, kr, 256, num_splits=3)                # 4 tiles: 2 + 2 + none
    with pytest.raises(ValueError, match="length must be a scalar"):
        call(qn, qr, c, kr, jnp.array([1, 2]))
    with pytest.raises(TypeError, match="length must be an integer, got float32"):
        call(qn, qr, c, kr, jnp.float32(3.0))
    with pytest.raises(ValueError, match="sm_scale must be a positive"):
        call(qn, qr, c, kr, 256, sm_scale=0.0)
    with pytest.raises(TypeError, match="out_dtype"):
        call(qn, qr, c, kr, 256, out_dtype=jnp.int32)


@pytest.mark.parametrize("m,r,p,n,splits,sched,share,dtype,out_dtype", [
    (100, 128, 384, 201, 2, True, False, BF16, jnp.float32),  # padded rows, ragged length, NaN
    (100, 128, 384, 201, 2, True, True, BF16, jnp.float32),   # the same with P shared
    (64, 256, 250, 250, 1, False, True, BF16, BF16),          # whole prefix padded to 4 tiles
    (64, 128, 128, 128, 1, True, False, jnp.float16, jnp.float16)])
def test_kernel_in_cpu_interpreter_matches_reference(m, r, p, n, splits, sched, share, dtype,
                                                     out_dtype):
    qn, qr, c, kr = _operands(m, r, 64, p, n, seed=m + p + n, nan_tail=n < p, dtype=dtype)
    scale = (r + 64) ** -0.5
    o, lse = mla_prefix_partials(qn, qr, c, kr, n, sm_scale=scale, num_splits=splits,
                                 schedule_barrier=sched, share_p=share, out_dtype=out_dtype,
                                 interpret=True)
    assert o.shape == (splits, m, r) and o.dtype == out_dtype and lse.shape == (splits, m)
    assert np.isfinite(np.asarray(o, np.float32)).all() and np.isfinite(np.asarray(lse)).all()
    o, lse = merge_partials(o.astype(jnp.float32), lse)
    _assert_close(o, lse, _reference(qn, qr, c, kr, n, scale))


@pytest.mark.parametrize("share", [False, True])
def test_splits_merged_equal_unsplit_with_traced_length(share):
    """Three splits of two tiles each (the length traced, one compilation): at length 100 two
    splits see no key (``lse = -inf``, ``o = 0``) and the merge equals the unsplit kernel; at
    length 0 every row is empty; a length past ``P`` is ``P``."""
    m, r, p = 64, 128, 384
    qn, qr, c, kr = _operands(m, r, 64, p, p, seed=3)
    scale = 0.07
    split3 = jax.jit(lambda n: mla_prefix_partials(qn, qr, c, kr, n, sm_scale=scale,
                                                   num_splits=3, share_p=share, interpret=True))
    o3, lse3 = split3(jnp.int32(100))
    assert bool(jnp.all(jnp.isneginf(lse3[1:]))) and bool(jnp.all(o3[1:] == 0))
    o1, lse1 = mla_prefix_attention(qn, qr, c, kr, 100, sm_scale=scale, share_p=share,
                                    interpret=True)
    om, lsem = merge_partials(o3, lse3)
    np.testing.assert_allclose(np.asarray(om), np.asarray(o1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lsem), np.asarray(lse1), rtol=1e-6, atol=1e-6)
    _assert_close(o1, lse1, _reference(qn, qr, c, kr, 100, scale))
    o0, lse0 = split3(jnp.int32(0))
    assert bool(jnp.all(jnp.isneginf(lse0))) and bool(jnp.all(o0 == 0))
    _assert_close(*merge_partials(*split3(jnp.int32(p + 500))), _reference(qn, qr, c, kr, p, scale))


@pytest.mark.parametrize("splits,sched,share,out_dtype", [
    (1, True, False, jnp.float32), (4, False, False, BF16), (1, False, True, jnp.float32),
    (4, False, True, BF16)])
def test_kernel_lowers_for_cuda_at_deepseek_shapes(splits, sched, share, out_dtype):
    """DeepSeek-V3 decoding: B=64 sequences x 128 heads, R=512, Dr=64, an 8K prefix."""
    m, r, dr, p = 64 * 128, 512, 64, 8192
    txt = lower_for_cuda(
        lambda a, b, c, d, n: mla_prefix_partials(a, b, c, d, n, sm_scale=(192 ** -0.5),
                                                  num_splits=splits, schedule_barrier=sched,
                                                  share_p=share, out_dtype=out_dtype),
        S((m, r), BF16), S((m, dr), BF16), S((p, r), BF16), S((p, dr), BF16), S((), jnp.int32))
    assert "mosaic_gpu" in txt


# --------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("b,h,p,n,splits", [
    (64, 16, 4096, 4000, 4),      # DeepSeek-V2-Lite heads, ragged length
    (8, 128, 8192, 8192, 1),      # DeepSeek-V3 heads
    (3, 16, 1000, 700, 2)])       # 48 rows: a padded row block; P padded to 1024
@pytest.mark.parametrize("share", [False, True])
def test_gpu_kernel_matches_library_prefix_part(b, h, p, n, splits, share):
    r, dr = 512, 64
    qn, qr, c, kr = _operands(b * h, r, dr, p, n, seed=b + p, nan_tail=n < p)
    scale = 192 ** -0.5
    o, lse = jax.jit(lambda *a: mla_prefix_attention(*a, n, sm_scale=scale, num_splits=splits,
                                                     share_p=share))(qn, qr, c, kr)
    ro, rl = latent_part(qn.reshape(b, 1, h, r), qr.reshape(b, 1, h, dr), c[None], kr[None],
                         jnp.zeros((b,), jnp.int32), jnp.full((b, 1), n, jnp.int32), scale)
    _assert_close(o, lse, (np.asarray(ro, np.float64).reshape(b * h, r),
                           np.asarray(rl, np.float64).reshape(b * h)))
