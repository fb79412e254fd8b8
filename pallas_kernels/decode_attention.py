"""Ragged split-KV attention over KV pools (flash-decoding), Pallas with the Triton lowering.

One kernel serves the row-layout passes of shared-prefix attention (the batched prefix pass,
the per-sequence suffix pass with ``Tq > 1``, the flat path's row-layout decode):

* rows: queries arranged as ``q_hmd [Hkv, M, D]``; a row is one (sequence, query position,
  query head of the GQA group).  The grid is ``(Hkv, M // block_m, num_splits)``; a program
  owns ``block_m`` rows of one kv head (``block_m >= 16`` for the dot, padded rows have limit 0);
* KV *sources*: each source is a pool ``k/v [N, S, Hkv, D]`` plus, per row, the pool entry
  ``row_index[M]`` it reads and a key limit ``row_limit[M]`` (row ``r`` sees keys
  ``j < row_limit[r]`` of entry ``row_index[r]``; causal masks and ragged lengths are both such
  limits).  The pool is passed whole and indexed inside the kernel, so a shared prefix is read
  for every sequence *without copying it* ("flat over shared storage", PagedAttention-style);
  rows of one block may use several entries (the kernel loops over the entries present);
* split-KV: every source's key axis is cut into ``num_splits`` chunks; program ``s`` handles
  chunk ``s`` of each source (flash-decoding, for small ``B * Hkv``); chunks past a row block's
  longest limit are skipped (zero trips);
* outputs: either float32 partials ``(o [splits, Hkv, M, D], lse [splits, Hkv, M])`` for a
  follow-up merge, or, with one split, the final ``(out [Hkv, M, D], lse [Hkv, M])`` after
  merging ``incoming`` partial states in the epilogue (the fused merge of the shared path).

LSE is natural log, float32; rows without a visible key get ``lse = -inf`` and ``out = 0``.
``interpret=True`` runs the kernel in Pallas interpret mode (CPU).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (LOG2E, attend_pool, finish_state, merge_tile_states,
                                    split_chunk)

__all__ = ["Source", "ragged_attention", "supported"]


def supported(*, head_dim: int, dtype) -> str | None:
    """``None`` when the Triton-lowered kernels of this package (this one, the suffix decode,
    the overlap kernel, the backward kernels) take ``head_dim`` and ``dtype``, else the reason."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim must be a power of two >= 16, got {head_dim}"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
                                jnp.dtype(jnp.float16)):
        return f"dtype must be float32, bfloat16 or float16, got {jnp.dtype(dtype)}"
    return None


@dataclasses.dataclass(frozen=True)
class Source:
    """A KV source: pools ``k/v [N, S, Hkv, D]``, per-row pool entry and key limit ``[M]``."""
    k: jax.Array
    v: jax.Array
    row_index: jax.Array
    row_limit: jax.Array


def _kernel(*refs, n_src, chunks, block_k, seq_lens, scale_log2, n_in, in_stride,
            finalize, precision, two_phase):
    q_ref = refs[0]
    src_refs = [refs[1 + 4 * i: 5 + 4 * i] for i in range(n_src)]
    pos = 1 + 4 * n_src
    if n_in:
        o_in_ref, lse_in_ref = refs[pos], refs[pos + 1]
        pos += 2
    o_ref, lse_ref = refs[pos], refs[pos + 1]

    h = pl.program_id(0)
    rb = pl.program_id(1)
    sp = pl.program_id(2)
    q = q_ref[...]  # [BM, D]
    bm, d = q.shape
    carry = (jnp.zeros((bm, d), jnp.float32), jnp.full((bm,), -jnp.inf, jnp.float32),
             jnp.zeros((bm,), jnp.float32))
    for si in range(n_src):
        idx_ref, lim_ref, k_ref, v_ref = src_refs[si]
        carry = attend_pool(q, idx_ref[...], lim_ref[...], k_ref, v_ref, h, sp * chunks[si],
                            carry, chunk=chunks[si], block_k=block_k, seq_len=seq_lens[si],
                            scale_log2=scale_log2, precision=precision, two_phase=two_phase)
    o_own, lse_own = finish_state(*carry)
    if not finalize:
        o_ref[...] = o_own
        lse_ref[...] = lse_own
        return
    if n_in:
        rows = pl.ds(rb * in_stride, bm)
        o_own, lse_own = merge_tile_states([o_own] + [o_in_ref[i, rows, :] for i in range(n_in)],
                                           [lse_own] + [lse_in_ref[i, rows] for i in range(n_in)])
    o_ref[...] = o_own.astype(o_ref.dtype)
    lse_ref[...] = lse_own


def ragged_attention(q_hmd: jax.Array, sources: list[Source], *, scale: float, block_m: int,
                     block_k: int = 64, num_splits: int = 1, incoming: tuple[jax.Array, jax.Array] | None = None,
                     in_stride: int = 0, finalize: bool = True, out_dtype=None,
                     num_warps: int = 4, num_stages: int = 2, interpret: bool = False,
                     two_phase: bool = False):
    """Run the ragged split-KV kernel (``two_phase``: see :func:`attend_pool`).

    Args:
      q_hmd: ``[Hkv, M, D]`` query rows, ``M % block_m == 0``.
      sources: KV sources (see :class:`Source`), all attended by the same rows (one softmax).
      num_splits: key chunks per source (grid axis 2); program ``s`` takes chunk ``s`` of each.
      scale: score scale.
      block_m, block_k: row and key tile sizes (powers of two, ``>= 16``).
      incoming: optional float32 partial states ``(o [n_in, Hkv, M_in, D], lse [n_in, Hkv, M_in])``
        merged in the epilogue (``finalize`` with one split only); row block ``rb`` reads rows
        ``[rb * in_stride, rb * in_stride + block_m)`` of them (``M_in`` must cover that).
      finalize: write final ``(out [Hkv, M, D] out_dtype, lse [Hkv, M])`` (requires one split in
        total); otherwise float32 partials ``(o [splits, Hkv, M, D], lse [splits, Hkv, M])``.
    """
    hkv, m, d = q_hmd.shape
    if m % block_m:
        raise ValueError(f"rows M={m} must be a multiple of block_m={block_m}")
    n_rb = m // block_m
    total = int(num_splits)
    if finalize and total != 1:
        raise ValueError(f"finalize needs num_splits == 1, got {total}")
    seq_lens = tuple(int(s.k.shape[1]) for s in sources)
    chunks = tuple(split_chunk(sl, total, block_k) for sl in seq_lens)
    precision = (lax.Precision.HIGHEST if q_hmd.dtype == jnp.float32 else lax.Precision.DEFAULT)
    n_in = 0 if incoming is None else int(incoming[0].shape[0])
    kernel = functools.partial(
        _kernel, n_src=len(sources), chunks=chunks, block_k=block_k,
        seq_lens=seq_lens, scale_log2=float(scale) * LOG2E, n_in=n_in, in_stride=in_stride,
        finalize=finalize, precision=precision, two_phase=two_phase)

    in_specs = [pl.BlockSpec((None, block_m, d), lambda h, r, s: (h, r, 0))]
    args = [q_hmd]
    for src in sources:
        n, sl = src.k.shape[:2]
        in_specs += [pl.BlockSpec((block_m,), lambda h, r, s: (r,)),
                     pl.BlockSpec((block_m,), lambda h, r, s: (r,)),
                     pl.BlockSpec((n, sl, hkv, d), lambda h, r, s: (0, 0, 0, 0)),
                     pl.BlockSpec((n, sl, hkv, d), lambda h, r, s: (0, 0, 0, 0))]
        args += [src.row_index.astype(jnp.int32), src.row_limit.astype(jnp.int32), src.k, src.v]
    if n_in:
        o_in, lse_in = incoming
        m_in = o_in.shape[2]
        in_specs += [pl.BlockSpec((n_in, None, m_in, d), lambda h, r, s: (0, h, 0, 0)),
                     pl.BlockSpec((n_in, None, m_in), lambda h, r, s: (0, h, 0))]
        args += [o_in, lse_in]
    if finalize:
        out_shape = [jax.ShapeDtypeStruct((hkv, m, d), out_dtype or q_hmd.dtype),
                     jax.ShapeDtypeStruct((hkv, m), jnp.float32)]
        out_specs = [pl.BlockSpec((None, block_m, d), lambda h, r, s: (h, r, 0)),
                     pl.BlockSpec((None, block_m), lambda h, r, s: (h, r))]
    else:
        out_shape = [jax.ShapeDtypeStruct((total, hkv, m, d), jnp.float32),
                     jax.ShapeDtypeStruct((total, hkv, m), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, block_m, d), lambda h, r, s: (s, h, r, 0)),
                     pl.BlockSpec((None, None, block_m), lambda h, r, s: (s, h, r))]
    return pl.pallas_call(
        kernel, grid=(hkv, n_rb, total), in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="ragged_split_kv_attention",
    )(*args)
