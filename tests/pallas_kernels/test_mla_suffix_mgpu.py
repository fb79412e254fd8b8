"""Mosaic GPU suffix kernel of absorbed MLA decoding (``pallas_kernels.mla_suffix_mgpu``).

CPU: (1) argument checks; (2) the kernel in Mosaic GPU's CPU interpreter (simulated warpgroups,
barriers, TMA copies, wgmma; keys pre-transposed in memory and ``P`` staged through shared
memory, the operand forms that interpreter has) against a float64 NumPy reference written from
the equations ``s = scale (q_nope . c + q_rope . k_rope)``, ``o = softmax(s) c`` over each
sequence's keys ``j < clip(n - Tq + t + 1, 0, n)``: ragged lengths (0, 1, full, a capacity that
is not a whole tile), ``Tq`` 1 and 3, NaN past the lengths (must not reach a row) and in a
visible key (must), key splits with traced lengths.  The interpreter runs one CTA per (row block,
split, sequence) at about a second each, so the cases are small: ``R = 128`` (the kernel takes
multiples of 128 up to 512), heads 3 and 16.  (3) Lowering for CUDA at DeepSeek shapes.
GPU (marker ``gpu``): the compiled kernel against the library's pure-JAX suffix part
(:func:`jax_prefix_attn.mla_reference.latent_part`) at DeepSeek-V2-Lite and V3 shapes.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import lower_for_cuda
from jax_prefix_attn.mla_reference import latent_part
from jax_prefix_attn.reference import row_limits
from pallas_kernels._common import merge_partials
from pallas_kernels.mla_suffix_mgpu import mla_suffix_attention, mla_suffix_partials, supported

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16


def _operands(b, m, r, dr, s, lengths, *, seed, dtype, nan_at=()):
    """Random ``(q_nope [B, M, R], q_rope [B, M, Dr], c [B, S, R], k_rope [B, S, Dr])``: NaN in
    ``c`` and ``k_rope`` at and past each length, and at the ``(sequence, key)`` of ``nan_at``."""
    rng = np.random.default_rng(seed)
    qn, qr, c, kr = (rng.standard_normal(shape).astype(np.float32)
                     for shape in ((b, m, r), (b, m, dr), (b, s, r), (b, s, dr)))
    for i, n in enumerate(lengths):
        c[i, n:] = np.nan
        kr[i, n:] = np.nan
    for i, j in nan_at:
        c[i, j] = np.nan
    return tuple(jnp.asarray(x, dtype) for x in (qn, qr, c, kr))


def _reference(qn, qr, c, kr, lengths, seq_q, scale):
    """float64 ``(o [B, M, R], lse [B, M])``: row ``t * H + h`` of sequence ``b`` over the keys
    ``j < clip(n_b - Tq + t + 1, 0, n_b)``, ``o = 0`` and ``lse = -inf`` where there are none."""
    qn, qr, c, kr = (np.asarray(x, np.float64) for x in (qn, qr, c, kr))
    b, m, r = qn.shape
    heads = m // seq_q
    o, lse = np.zeros((b, m, r)), np.full((b, m), -np.inf)
    for i, n in enumerate(lengths):
        for row in range(m):
            lim = min(max(n - seq_q + row // heads + 1, 0), n)
            if lim:
                z = scale * (c[i, :lim] @ qn[i, row] + kr[i, :lim] @ qr[i, row])
                w = np.exp(z - z.max())
                o[i, row] = w @ c[i, :lim] / w.sum()
                lse[i, row] = z.max() + np.log(w.sum())
    return o, lse


def _assert_close(o, lse, ref, rows, tol):
    """``o``, ``lse`` equal the reference on the sequences ``rows`` (relative Frobenius error
    of ``o``, absolute error of ``lse``; ``-inf`` where the reference has it)."""
    o, lse = np.asarray(o, np.float64)[rows], np.asarray(lse, np.float64)[rows]
    ro, rl = ref[0][rows], ref[1][rows]
    assert np.linalg.norm(o - ro) / np.linalg.norm(ro) < tol
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(rl))
    np.testing.assert_allclose(lse, rl, atol=tol, rtol=0)


def test_supported_and_argument_checks():
    ok = functools.partial(supported, rope_dim=64, suffix_cap=1024, dtype=BF16)
    assert ok(rank=512) is None and ok(rank=128) is None
    assert "shared memory" in ok(rank=512, num_stages=3)
    assert "kv_lora_rank" in ok(rank=576)
    assert "rope_dim" in supported(rank=512, rope_dim=32, suffix_cap=64, dtype=BF16)
    assert "dtype" in ok(rank=512, dtype=jnp.float32)
    assert "suffix capacity" in supported(rank=512, rope_dim=64, suffix_cap=0, dtype=BF16)
    qn, qr, c, kr = _operands(2, 6, 128, 64, 128, (128, 128), seed=0, dtype=BF16)
    lens = jnp.array([3, 128], jnp.int32)
    call = functools.partial(mla_suffix_partials, sm_scale=0.1)
    with pytest.raises(TypeError, match="q_nope must be bfloat16"):
        call(qn.astype(jnp.float32), qr, c, kr, lens)
    with pytest.raises(TypeError, match="k_rope must have q_nope's dtype"):
        call(qn, qr, c, kr.astype(jnp.float16), lens)
    with pytest.raises(ValueError, match=r"c must have shape \(B, S, R\) with q_nope's B=2"):
        call(qn, qr, c[:1], kr, lens)
    with pytest.raises(ValueError, match=r"k_rope must have shape \(B, S, Dr\) = \(2, 128, 64\)"):
        call(qn, qr, c, kr[:, :64], lens)
    with pytest.raises(ValueError, match="q_rope must have q_nope's"):
        call(qn, qr[:, :3], c, kr, lens)
    with pytest.raises(ValueError, match="seq_q must be a positive int dividing the 6 rows"):
        call(qn, qr, c, kr, lens, seq_q=4)
    with pytest.raises(ValueError, match=r"lengths must have shape \(2,\)"):
        call(qn, qr, c, kr, lens[:1])
    with pytest.raises(TypeError, match="lengths must be integers"):
        call(qn, qr, c, kr, lens.astype(jnp.float32))
    with pytest.raises(ValueError, match="num_splits=3 must leave every split"):
        call(qn, qr, c, kr, lens, num_splits=3)               # 2 tiles
    with pytest.raises(ValueError, match="sm_scale must be a positive"):
        call(qn, qr, c, kr, lens, sm_scale=-1.0)
    with pytest.raises(TypeError, match="out_dtype"):
        call(qn, qr, c, kr, lens, out_dtype=jnp.int32)


def test_causal_rows_ragged_lengths_and_nan_in_cpu_interpreter():
    """``Tq = 3`` queries of 3 heads per sequence (row ``t * 3 + h``), one CTA each: length 1
    (rows ``t < 2`` see no key), the full capacity 150 (three tiles, the last padded), 67 with
    NaN past it, and 20 with a NaN in a key every row sees."""
    lengths, seq_q, scale = (1, 150, 67, 20), 3, (128 + 64) ** -0.5
    ops = _operands(4, 9, 128, 64, 150, lengths, seed=1, dtype=BF16, nan_at=[(3, 5)])
    o, lse = mla_suffix_attention(*ops, jnp.asarray(lengths), sm_scale=scale, seq_q=seq_q,
                                  interpret=True)
    assert o.shape == (4, 9, 128) and o.dtype == jnp.float32 and lse.shape == (4, 9)
    ref = _reference(*ops, lengths, seq_q, scale)
    _assert_close(o, lse, ref, slice(0, 3), 2e-2)
    assert np.all(np.asarray(o[0, :6]) == 0) and np.all(np.isneginf(np.asarray(lse[0, :6])))
    assert np.isnan(np.asarray(lse[3])).all() and np.isnan(np.asarray(o[3])).any(axis=-1).all()


def test_splits_traced_lengths_empty_and_fp16_in_cpu_interpreter():
    """Decoding (``Tq = 1``) with 16 heads, ``Dr = 128``, two key splits of one tile each,
    float16 in and out, no ping-pong: the lengths traced (one compilation); length 0 (both
    splits empty: ``lse = -inf``, ``o = 0``), and 100 with NaN past it (split 1 holds the
    length)."""
    scale = 0.06
    ops = _operands(2, 16, 128, 128, 128, (0, 100), seed=2, dtype=jnp.float16)
    run = jax.jit(lambda n: mla_suffix_partials(*ops, n, sm_scale=scale, num_splits=2,
                                                schedule_barrier=False, out_dtype=jnp.float16,
                                                interpret=True))
    o, lse = run(jnp.array([0, 100], jnp.int32))
    assert o.shape == (2, 2, 16, 128) and o.dtype == jnp.float16 and lse.shape == (2, 2, 16)
    assert bool(jnp.all(jnp.isneginf(lse[:, 0]))) and bool(jnp.all(o[:, 0] == 0))
    assert np.isfinite(np.asarray(o[:, 1], np.float32)).all()
    om, lm = merge_partials(o.astype(jnp.float32), lse)
    _assert_close(om, lm, _reference(*ops, (0, 100), 1, scale), slice(1, 2), 5e-3)


@pytest.mark.parametrize("b,h,seq_q,s,splits,sched,out_dtype", [
    (64, 128, 1, 1024, 1, True, jnp.float32),     # DeepSeek-V3 heads: two row blocks
    (32, 16, 3, 1000, 4, False, BF16)])           # V2-Lite heads, Tq = 3, S padded to 1024
def test_kernel_lowers_for_cuda_at_deepseek_shapes(b, h, seq_q, s, splits, sched, out_dtype):
    m, r, dr = seq_q * h, 512, 64
    txt = lower_for_cuda(
        lambda a, b_, c, d, n: mla_suffix_partials(a, b_, c, d, n, sm_scale=(192 ** -0.5),
                                                   seq_q=seq_q, num_splits=splits,
                                                   schedule_barrier=sched, out_dtype=out_dtype),
        S((b, m, r), BF16), S((b, m, dr), BF16), S((b, s, r), BF16), S((b, s, dr), BF16),
        S((b,), jnp.int32))
    assert "mosaic_gpu" in txt


# --------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("b,h,seq_q,s,splits", [
    (256, 16, 1, 1024, 1),       # DeepSeek-V2-Lite heads, decoding
    (64, 128, 1, 512, 2),        # DeepSeek-V3 heads: two row blocks per sequence
    (5, 16, 3, 1000, 4)])        # Tq = 3 (48 rows), S padded to 1024
def test_gpu_kernel_matches_library_suffix_part(b, h, seq_q, s, splits):
    r, dr = 512, 64
    rng = np.random.default_rng(b + s)
    lengths = rng.integers(0, s + 1, b)
    lengths[:2] = (0, s)
    qn, qr, c, kr = _operands(b, seq_q * h, r, dr, s, lengths, seed=b, dtype=BF16)
    scale = 192 ** -0.5
    lens = jnp.asarray(lengths, jnp.int32)
    o, lse = jax.jit(lambda *a: mla_suffix_attention(*a, sm_scale=scale, seq_q=seq_q,
                                                     num_splits=splits))(qn, qr, c, kr, lens)
    _, lim = row_limits(seq_q, jnp.zeros((b,), jnp.int32), lens)
    ro, rl = latent_part(qn.reshape(b, seq_q, h, r), qr.reshape(b, seq_q, h, dr), c, kr,
                         jnp.arange(b, dtype=jnp.int32), lim, scale)
    ref = (np.asarray(ro, np.float64).reshape(b, seq_q * h, r),
           np.asarray(rl, np.float64).reshape(b, seq_q * h))
    _assert_close(o, lse, ref, slice(None), 2e-2)
