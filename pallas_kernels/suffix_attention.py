"""Suffix decode with the fused merge, in the queries' own layout (Pallas, Triton lowering).

Launch 2 of the shared path when decoding (``Tq == 1``) with one program per (kv head,
sequence): the program attends its sequence's suffix keys, merges the prefix partial states
computed by launch 1 in its epilogue, and writes the final output and LSE.

Unlike the general row-layout kernel (:func:`pallas_kernels.decode_attention.ragged_attention`),
which takes queries as ``[Hkv, M, D]`` rows padded to 16 per sequence and writes outputs in
that layout, this kernel reads ``q`` and writes ``out``/``lse`` where they live,
``[B * Hq, D]`` (row ``b * Hq + h * G + j`` is query head ``h * G + j`` of sequence ``b``,
``G = Hq / Hkv``): the 16-row tile of a program starts at its group's first head, rows ``>= G``
of the tile are masked on load and store.  Measured on an H200 (``bench/kernel_profile.py``,
B=1024, Hq=32, Hkv=8), the padded layout cost two extra XLA passes (a pad of ``q`` to 16 rows
per sequence, 22 us, and a transpose of the output, 7 us) and 4x the query and output traffic
inside the kernel.

Masked rows past the last sequence are never touched on the GPU; in interpret mode (where a
slice that runs past an array is clamped, not masked) ``q`` and the outputs carry ``R - G``
padding rows at the end.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.decode_attention import attend_pool, finish_state, merge_tile_states, next_pow2

__all__ = ["suffix_decode_merge", "suffix_rows"]

_LOG2E = math.log2(math.e)


def suffix_rows(hq: int, hkv: int) -> int:
    """Rows of one program's tile: the ``G = Hq / Hkv`` query heads of a kv head, padded to a
    power of two of at least 16 (the dot's minimum)."""
    return max(16, next_pow2(hq // hkv))


def _kernel(q_ref, len_ref, pos_ref, k_ref, v_ref, o_in_ref, lse_in_ref, o_ref, lse_ref, *,
            hq, grp, rows, n_in, in_stride, block_k, seq_len, scale_log2, precision, out_dtype,
            has_pos):
    h = pl.program_id(0)
    b = pl.program_id(1)
    r = lax.broadcasted_iota(jnp.int32, (rows,), 0)
    ok = r < grp
    q_rows = pl.ds(b * hq + h * grp, rows)
    q = plgpu.load(q_ref.at[q_rows, :], mask=ok[:, None], other=0.0)
    n = jnp.max(len_ref[...])  # keys of this sequence's suffix
    d = q.shape[-1]
    carry = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    acc, m_i, l_i = attend_pool(q, jnp.broadcast_to(b, (rows,)), jnp.broadcast_to(n, (rows,)),
                                k_ref, v_ref, h, 0, carry, chunk=seq_len, block_k=block_k,
                                seq_len=seq_len, scale_log2=scale_log2, precision=precision)
    o_own, lse_own = finish_state(acc, m_i, l_i)
    if n_in:
        pos = jnp.max(pos_ref[...]) if has_pos else b
        p_rows = pl.ds(pos * in_stride, rows)
        o_own, lse_own = merge_tile_states(
            [o_own] + [o_in_ref[i, p_rows, :] for i in range(n_in)],
            [lse_own] + [lse_in_ref[i, p_rows] for i in range(n_in)])
    plgpu.store(o_ref.at[q_rows, :], o_own.astype(out_dtype), mask=ok[:, None])
    plgpu.store(lse_ref.at[q_rows], lse_own, mask=ok)


def suffix_decode_merge(q_bhd, suffix_k, suffix_v, lengths_b, incoming=None, *, in_stride=0,
                        position_b=None, scale, block_k=32, num_warps=2, num_stages=3,
                        interpret=False):
    """Decode attention of each sequence over its suffix, merged with incoming partial states.

    Args:
      q_bhd: ``[B, Hq, D]`` one query per sequence (16-bit or float32).
      suffix_k, suffix_v: ``[B, S, Hkv, D]``; sequence ``b`` sees keys ``[0, lengths_b[b])``.
      lengths_b: ``[B]`` int32 (dynamic).
      incoming: optional ``(o [n_in, Hkv, M_in, D], lse [n_in, Hkv, M_in])`` partial states
        (``o`` normalised, any float dtype; ``lse`` float32, natural log, ``-inf`` for none),
        of row ``position_b[b] * in_stride + j`` for query head ``h * G + j``; a program reads
        ``suffix_rows(Hq, Hkv)`` rows from there, so ``M_in >= (B - 1) * in_stride + R``.
      position_b: ``[B]`` int32 row block of each sequence in ``incoming`` (default ``b``).
      scale: score scale.  ``block_k``: key tile (power of two >= 16).

    Returns ``(out [B, Hq, D] in q's dtype, lse [B, Hq] float32)``; a row with no visible key
    (empty suffix and no incoming state) gets ``out = 0``, ``lse = -inf``.
    """
    b, hq, d = q_bhd.shape
    _, s_len, hkv, _ = suffix_k.shape
    grp = hq // hkv
    rows = suffix_rows(hq, hkv)
    n_in = 0
    if incoming is not None:
        o_in, lse_in = incoming
        n_in = int(o_in.shape[0])
        need = (b - 1) * in_stride + rows
        assert o_in.shape[2] >= need, (o_in.shape, need)
    pad = rows - grp if interpret else 0  # see the module docstring
    q2 = q_bhd.reshape(b * hq, d)
    if pad:
        q2 = jnp.pad(q2, ((0, pad), (0, 0)))
    has_pos = position_b is not None
    if not has_pos:  # placeholder, never read (the kernel uses its program id)
        position_b = lengths_b
    precision = lax.Precision.HIGHEST if q_bhd.dtype == jnp.float32 else lax.Precision.DEFAULT
    kernel = functools.partial(
        _kernel, hq=hq, grp=grp, rows=rows, n_in=n_in, in_stride=in_stride, block_k=block_k,
        seq_len=s_len, scale_log2=float(scale) * _LOG2E, precision=precision,
        out_dtype=q_bhd.dtype, has_pos=has_pos)
    whole = lambda x: pl.BlockSpec(x.shape, lambda h, i, n=x.ndim: (0,) * n)  # noqa: E731
    one = pl.BlockSpec((1,), lambda h, i: (i,))
    args = [q2, lengths_b.astype(jnp.int32).reshape(b), position_b.astype(jnp.int32), suffix_k,
            suffix_v]
    in_specs = [whole(q2), one, one, whole(suffix_k), whole(suffix_v)]
    if n_in:
        m_in = o_in.shape[2]
        in_specs += [pl.BlockSpec((n_in, None, m_in, d), lambda h, i: (0, h, 0, 0)),
                     pl.BlockSpec((n_in, None, m_in), lambda h, i: (0, h, 0))]
        args += [o_in, lse_in]
    else:  # placeholders (unused by the kernel)
        dummy = jnp.zeros((1, 1, 1), jnp.float32)
        in_specs += [whole(dummy), pl.BlockSpec((1, 1), lambda h, i: (0, 0))]
        args += [dummy, jnp.zeros((1, 1), jnp.float32)]
    out_shape = [jax.ShapeDtypeStruct((b * hq + pad, d), q_bhd.dtype),
                 jax.ShapeDtypeStruct((b * hq + pad,), jnp.float32)]
    out, lse = pl.pallas_call(
        kernel, grid=(hkv, b), in_specs=in_specs,
        out_specs=[whole(out_shape[0]), whole(out_shape[1])], out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="suffix_decode_merge",
    )(*args)
    if pad:
        out, lse = out[:b * hq], lse[:b * hq]
    return out.reshape(b, hq, d), lse.reshape(b, hq)
