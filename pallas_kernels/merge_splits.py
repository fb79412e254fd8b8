"""Merge of split-KV partial states in one launch (Pallas, Triton lowering).

Flash-decoding cuts each sequence's keys into ``n`` splits, and every split leaves a float32
partial state ``(o [R, D], lse [R])`` per query row.  Merging them in XLA takes several launches:
with up to :data:`pallas_kernels._common.UNROLL_MERGE` parts, a fusion for the running maximum
and one for the weighted sum and the cast; beyond it, two reductions and two elementwise passes.
At small batch a decode call is latency bound (a few microseconds per dependent launch inside a
CUDA graph), so this kernel does the whole merge -- maximum, weights, weighted sum, normalisation,
the cast to the output dtype and the merged LSE -- in one launch.  Program ``(r, c)`` owns row
``r`` and columns ``[c * block_d, +block_d)``: it reads the row's ``n`` LSEs and its
``[n, block_d]`` slab of partial outputs as one masked load each, so even a single row
(``B = 1``) spreads over ``D / block_d`` SMs and no program waits on a chain of loads.

The arithmetic is :func:`pallas_kernels._common.merge_stacked` on the loaded tile, so the NaN
and empty-row rules are those of :func:`pallas_kernels._common.merge_tile_states`: a
part is empty only where its ``lse`` is exactly ``-inf``; a row whose parts are all empty gets
``out = 0``, ``lse = -inf``; a NaN ``lse`` makes the row NaN, and a NaN in the ``o`` of a part
that is not empty makes that element NaN.  ``interpret=True`` runs the kernel in Pallas
interpret mode (CPU).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import merge_stacked, next_pow2

__all__ = ["MAX_PARTS", "merge_splits", "supported"]

# Parts one program reads (as one [parts, block_d] tile).  Split-KV decoding uses at most 64.
MAX_PARTS = 128
# Columns of D per program: halved from D down to MIN_BLOCK_D while the grid has fewer than
# MIN_PROGRAMS programs, so that even one row (B = 1) spreads over several SMs.
MIN_BLOCK_D = 32
MIN_PROGRAMS = 512


def supported(*, parts: int, head_dim: int) -> str | None:
    """``None`` when :func:`merge_splits` takes ``parts`` partial states of width ``head_dim``,
    else the reason."""
    if not 1 <= parts <= MAX_PARTS:
        return f"parts must be in [1, {MAX_PARTS}], got {parts}"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim must be a power of two >= 16, got {head_dim}"
    return None


def _kernel(o_ref, lse_ref, out_ref, lse_out_ref, *, parts, parts_pad, block_d):
    r, c = pl.program_id(0), pl.program_id(1)
    live = jnp.arange(parts_pad) < parts
    lse = plgpu.load(lse_ref.at[pl.ds(0, parts_pad), r], mask=live, other=-jnp.inf)       # [n]
    o = plgpu.load(o_ref.at[pl.ds(0, parts_pad), r, pl.ds(c * block_d, block_d)], mask=live[:, None],
                   other=0.0)                                                               # [n, bd]
    out, lse_r = merge_stacked(o.astype(jnp.float32), lse)                               # [bd], []
    plgpu.store(out_ref.at[r, pl.ds(c * block_d, block_d)], out.astype(out_ref.dtype))

    @pl.when(c == 0)
    def _():
        lse_out_ref[r] = lse_r


def merge_splits(o_nrd: jax.Array, lse_nr: jax.Array, *, out_dtype, interpret: bool = False,
                 block_d: int | None = None, num_warps: int = 1) -> tuple[jax.Array, jax.Array]:
    """Merge ``n`` partial states per row.

    Args:
      o_nrd: ``[n, R, D]`` normalised partial outputs (any float dtype; float32 from the split
        kernels).
      lse_nr: ``[n, R]`` float32 natural-log LSE of each part, ``-inf`` where the part saw no key.
      out_dtype: dtype of the merged output.
      block_d: columns of ``D`` per program (grid ``(R, D / block_d)``; default: see
        ``MIN_PROGRAMS``).

    Returns ``(out [R, D] out_dtype, lse [R] float32)``.
    """
    n, rows, d = o_nrd.shape
    if lse_nr.shape != (n, rows):
        raise ValueError(f"lse_nr must have shape {(n, rows)} to match o_nrd {o_nrd.shape}, got {lse_nr.shape}")
    reason = supported(parts=n, head_dim=d)
    if reason:
        raise ValueError(reason)
    bd = d if block_d is None else min(block_d, d)
    while block_d is None and bd > MIN_BLOCK_D and rows * (d // bd) < MIN_PROGRAMS:
        bd //= 2
    n_pad = max(2, next_pow2(n))
    # The part axis is read as one [n_pad] block (a power of two, as Triton's tensors need);
    # parts >= n lie past the array and are masked (out of bounds and by ``live``).
    lse_in = lse_nr.astype(jnp.float32)
    padded = lambda x: pl.BlockSpec((n_pad,) + x.shape[1:],  # noqa: E731
                                    lambda i, j, nd=x.ndim: (0,) * nd)
    whole = lambda x: pl.BlockSpec(x.shape, lambda i, j, nd=x.ndim: (0,) * nd)  # noqa: E731
    out_shape = [jax.ShapeDtypeStruct((rows, d), out_dtype), jax.ShapeDtypeStruct((rows,), jnp.float32)]
    return pl.pallas_call(
        functools.partial(_kernel, parts=n, parts_pad=n_pad, block_d=bd), grid=(rows, d // bd),
        in_specs=[padded(o_nrd), padded(lse_in)], out_specs=[whole(out_shape[0]), whole(out_shape[1])],
        out_shape=out_shape, interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1), name="merge_splits",
    )(o_nrd, lse_in)
