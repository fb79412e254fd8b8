"""Merge of split-KV partial states in one launch (Pallas, Triton lowering).

Flash-decoding cuts each sequence's keys into ``n`` splits, and every split leaves a float32
partial state ``(o [R, D], lse [R])`` per query row.  Merging them in XLA takes several launches:
with up to :data:`pallas_kernels._common.UNROLL_MERGE` parts, a fusion for the running maximum
and one for the weighted sum and the cast; beyond it, two reductions and two elementwise passes.
At small batch a decode call is latency bound (a few microseconds per dependent launch inside a
CUDA graph), so this kernel does the whole merge -- maximum, weights, weighted sum, normalisation,
the cast to the output dtype and the merged LSE -- in one launch: program ``i`` owns rows
``[i * block_r, (i + 1) * block_r)`` and reads their ``n`` partial tiles, unrolled over the
static ``n`` (the loads are independent, so they are all in flight at once).

The NaN and empty-row rules are those of :func:`pallas_kernels._common.merge_tile_states`: a
part is empty only where its ``lse`` is exactly ``-inf``; a row whose parts are all empty gets
``out = 0``, ``lse = -inf``; a NaN ``lse`` makes the row NaN, and a NaN in the ``o`` of a part
that is not empty makes that element NaN.  ``interpret=True`` runs the kernel in Pallas interpret mode (CPU).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import cdiv, merge_tile_states

__all__ = ["MAX_PARTS", "merge_splits", "supported"]

# Parts one program unrolls.  Split-KV decoding uses at most 64 splits (the planner's cap).
MAX_PARTS = 128
# Rows per program: the 16-row minimum of a Triton tile, more when there are rows to spare, so
# that a program's n loads of [block_r, D] float32 stay within the registers of 4 warps.
MIN_BLOCK_R = 16
MAX_TILE_ELEMS = 1 << 13


def supported(*, parts: int, head_dim: int) -> str | None:
    """``None`` when :func:`merge_splits` takes ``parts`` partial states of width ``head_dim``,
    else the reason."""
    if not 1 <= parts <= MAX_PARTS:
        return f"parts must be in [1, {MAX_PARTS}], got {parts}"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim must be a power of two >= 16, got {head_dim}"
    return None


def block_rows(rows: int, head_dim: int) -> int:
    """Rows per program: ``MIN_BLOCK_R``, doubled while a ``[block_r, D]`` tile stays under
    ``MAX_TILE_ELEMS`` elements and the grid keeps at least 64 programs."""
    br = MIN_BLOCK_R
    while 2 * br * head_dim <= MAX_TILE_ELEMS and cdiv(rows, 2 * br) >= 64:
        br *= 2
    return br


def _kernel(o_ref, lse_ref, out_ref, lse_out_ref, *, parts, rows, block_r):
    start = pl.program_id(0) * block_r
    ok = start + jnp.arange(block_r) < rows
    r = pl.ds(start, block_r)
    o_parts = [plgpu.load(o_ref.at[jnp.int32(i), r, :], mask=ok[:, None], other=0.0) for i in range(parts)]
    l_parts = [plgpu.load(lse_ref.at[jnp.int32(i), r], mask=ok, other=-jnp.inf) for i in range(parts)]
    out, lse = merge_tile_states(o_parts, l_parts)
    plgpu.store(out_ref.at[r, :], out.astype(out_ref.dtype), mask=ok[:, None])
    plgpu.store(lse_out_ref.at[r], lse, mask=ok)


def merge_splits(o_nrd: jax.Array, lse_nr: jax.Array, *, out_dtype, interpret: bool = False,
                 num_warps: int = 4) -> tuple[jax.Array, jax.Array]:
    """Merge ``n`` partial states per row.

    Args:
      o_nrd: ``[n, R, D]`` normalised partial outputs (any float dtype; float32 from the split
        kernels).
      lse_nr: ``[n, R]`` float32 natural-log LSE of each part, ``-inf`` where the part saw no key.
      out_dtype: dtype of the merged output.

    Returns ``(out [R, D] out_dtype, lse [R] float32)``.
    """
    n, rows, d = o_nrd.shape
    if lse_nr.shape != (n, rows):
        raise ValueError(f"lse_nr must have shape {(n, rows)} to match o_nrd {o_nrd.shape}, got {lse_nr.shape}")
    reason = supported(parts=n, head_dim=d)
    if reason:
        raise ValueError(reason)
    br = block_rows(rows, d)
    grid = cdiv(rows, br)
    o_in, lse_in = o_nrd, lse_nr.astype(jnp.float32)
    if interpret:  # the CPU interpreter clamps a slice that runs past an array instead of masking it
        pad = grid * br - rows
        o_in = jnp.pad(o_in, ((0, 0), (0, pad), (0, 0)))
        lse_in = jnp.pad(lse_in, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    whole = lambda x: pl.BlockSpec(x.shape, lambda i, nd=x.ndim: (0,) * nd)  # noqa: E731
    out_rows = grid * br if interpret else rows
    out_shape = [jax.ShapeDtypeStruct((out_rows, d), out_dtype), jax.ShapeDtypeStruct((out_rows,), jnp.float32)]
    out, lse = pl.pallas_call(
        functools.partial(_kernel, parts=n, rows=rows, block_r=br), grid=(grid,),
        in_specs=[whole(o_in), whole(lse_in)], out_specs=[whole(out_shape[0]), whole(out_shape[1])],
        out_shape=out_shape, interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1), name="merge_splits",
    )(o_in, lse_in)
    if interpret:
        out, lse = out[:rows], lse[:rows]
    return out, lse
