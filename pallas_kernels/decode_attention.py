"""Ragged split-KV attention over KV pools (flash-decoding), Pallas with the Triton lowering.

One kernel serves every decode-side pass of shared-prefix attention:

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
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["Source", "ragged_attention", "merge_partials", "flat_forward", "next_pow2",
           "rows_from_q", "q_rows_layout", "rows_to_out", "row_meta", "seq_rows", "pad_rows",
           "merge_partial_list", "flat_decode_tiling", "flat_decode_layout"]

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_chunk(n: int, splits: int, block_k: int) -> int:
    """Keys per program when ``n`` keys are cut into ``splits`` chunks of whole ``block_k`` tiles."""
    return cdiv(cdiv(n, splits), block_k) * block_k


@dataclasses.dataclass(frozen=True)
class Source:
    """A KV source: pools ``k/v [N, S, Hkv, D]``, per-row pool entry and key limit ``[M]``."""
    k: jax.Array
    v: jax.Array
    row_index: jax.Array
    row_limit: jax.Array


def online_update(q, k, v, carry, *, scale_log2, precision, col_ok=None):
    """One key tile of the online softmax: rows ``q [BM, D]`` against ``k/v [BK, D]``.

    ``carry = (acc [BM, D], m [BM] (log2 units), l [BM])`` float32; ``col_ok`` (broadcastable
    to ``[BM, BK]``, optional) masks scores (rows with no visible key yet keep ``m = -inf`` and
    contribute nothing).  The caller must not load masked-out ``v`` rows it cannot trust: a
    zero probability times NaN is NaN.  Returns the updated carry."""
    acc, m_i, l_i = carry
    sc = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32) * scale_log2
    if col_ok is not None:
        sc = jnp.where(col_ok, sc, -jnp.inf)
    m_new = jnp.maximum(m_i, jnp.max(sc, axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if col_ok is not None else m_new
    alpha = jnp.exp2(m_i - m_use)
    p = jnp.exp2(sc - m_use[:, None])
    l_i = l_i * alpha + jnp.sum(p, axis=1)
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                         precision=precision, preferred_element_type=jnp.float32)
    return acc * alpha[:, None] + pv, m_new, l_i


def attend_pool(q, idx, lim, k_ref, v_ref, h, k_start, carry, *, chunk, block_k, seq_len,
                scale_log2, precision, two_phase=False):
    """Online-softmax accumulation of rows ``q [BM, D]`` over keys ``[k_start, k_start + chunk)``
    of pool entries ``idx [BM]`` (row ``r`` sees keys ``< lim[r]``) for kv head ``h``.

    ``carry = (acc [BM, D], m [BM] (log2 units), l [BM])`` float32; returns the updated carry.
    Loops over the pool entries present in the block, and for each over its key tiles up to
    the longest limit of its rows (empty ranges run zero iterations).

    ``two_phase``: first the tiles below every row's limit without masks, then the ragged tail
    with masks.  Measured on an H200 it helps the unsplit large-M prefix kernel (B=1024,
    Hq=32) by ~4% but slows split-prefix and decode launches by up to 50%, so it is off by
    default (one masked loop).
    """
    cols = lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
    g_lo = jnp.min(idx)
    g_hi = jnp.max(idx) + 1
    # Tiles below every row's limit need no mask (only when the block reads a single entry).
    single = g_lo + 1 == g_hi
    all_see = jnp.where(single, jnp.min(lim), 0)
    need_mask = seq_len % block_k != 0

    def kv_body(t, c, *, g, rl, masked):
        k0 = k_start + t * block_k
        ks = pl.ds(pl.multiple_of(k0, block_k), block_k)
        if need_mask or masked:
            # (also in full tiles: a static tile larger than the axis must be masked.)  Keys past
            # every row's limit are not loaded: whatever a cache holds there (NaN included) must
            # not reach the output through ``p @ v`` (0 * NaN).
            key_i = k0 + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
            in_b = key_i < (jnp.minimum(jnp.max(rl), seq_len) if masked else seq_len)
            k = plgpu.load(k_ref.at[g, ks, h, :], mask=in_b, other=0.0)
            v = plgpu.load(v_ref.at[g, ks, h, :], mask=in_b, other=0.0)
        else:
            k = k_ref[g, ks, h, :]
            v = v_ref[g, ks, h, :]
        return online_update(q, k, v, c, scale_log2=scale_log2, precision=precision,
                             col_ok=((k0 + cols) < rl[:, None]) if masked else None)

    def group_body(g, carry):
        rl = jnp.where(idx == g, lim, 0)  # [BM] limits of this entry's rows
        k_end = jnp.minimum(k_start + chunk, jnp.max(rl))
        n_blk = jnp.maximum(k_end - k_start + block_k - 1, 0) // block_k
        if not two_phase:
            return lax.fori_loop(0, n_blk, functools.partial(kv_body, g=g, rl=rl, masked=True),
                                 carry)
        full_end = jnp.minimum(k_start + chunk, all_see)
        n_full = jnp.minimum(jnp.maximum(full_end - k_start, 0) // block_k, n_blk)
        carry = lax.fori_loop(0, n_full, functools.partial(kv_body, g=g, rl=rl, masked=False),
                              carry)
        return lax.fori_loop(n_full, n_blk, functools.partial(kv_body, g=g, rl=rl, masked=True),
                             carry)

    return lax.fori_loop(g_lo, g_hi, group_body, carry)


def finish_state(acc, m_i, l_i):
    """``(o [BM, D], lse [BM])`` (natural log) from an online-softmax state."""
    has = l_i > 0
    l_safe = jnp.where(has, l_i, 1.0)
    return acc / l_safe[:, None], jnp.where(has, (m_i + jnp.log2(l_safe)) * _LN2, -jnp.inf)


def merge_tile_states(o_parts, lse_parts):
    """Merge partial states, elementwise over the parts: ``o [..., D]`` (normalised, any float
    dtype) and ``lse [...]`` (natural log, ``-inf`` for none) -> float32 ``(o, lse)``; rows where
    every part is empty get ``o = 0``, ``lse = -inf``.  Used inside the kernels on one row
    tile (``[BM, D]``) and, through :func:`merge_partial_list`, by XLA."""
    m_all = lse_parts[0]
    for x in lse_parts[1:]:
        m_all = jnp.maximum(m_all, x)
    m_all = jnp.where(m_all == -jnp.inf, 0.0, m_all)
    tot = jnp.zeros(lse_parts[0].shape, jnp.float32)
    out = jnp.zeros(o_parts[0].shape, jnp.float32)
    for o_x, l_x in zip(o_parts, lse_parts):
        w = jnp.exp(l_x - m_all)
        tot = tot + w
        out = out + w[..., None] * jnp.where((w > 0)[..., None], o_x.astype(jnp.float32), 0.0)
    nonempty = tot > 0
    tot_safe = jnp.where(nonempty, tot, 1.0)
    return out / tot_safe[..., None], jnp.where(nonempty, m_all + jnp.log(tot_safe), -jnp.inf)


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
        seq_lens=seq_lens, scale_log2=float(scale) * _LOG2E, n_in=n_in, in_stride=in_stride,
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


UNROLL_MERGE = 32  # merge up to this many partial states as one elementwise fusion


def merge_partial_list(o_parts, lse_parts):
    """Merge partial states given as lists ``o_parts [n] x [..., D]`` (normalised, any float
    dtype) and ``lse_parts [n] x [...]`` (natural log, ``-inf`` for none) -> float32 ``(o, lse)``.

    Written elementwise over the ``n`` parts (a static count), so XLA emits one fusion that also
    absorbs the slicing/reshaping that produced the parts; a reduction over a stacked axis is
    two (the max and exp, then the weighted sum) plus the stacking copy.  Rows where every part
    is empty get ``o = 0``, ``lse = -inf``.  More than :data:`UNROLL_MERGE` parts: stacked and
    reduced (:func:`merge_partials`)."""
    if len(o_parts) > UNROLL_MERGE:
        return _merge_stacked(jnp.stack([o.astype(jnp.float32) for o in o_parts]),
                              jnp.stack(lse_parts))
    return merge_tile_states(o_parts, lse_parts)


def merge_partials(o_nhmd: jax.Array, lse_nhm: jax.Array):
    """Merge float32 partial states over axis 0 (XLA; small follow-up reduction: one fusion up
    to :data:`UNROLL_MERGE` parts, see :func:`merge_partial_list`)."""
    n = o_nhmd.shape[0]
    if n <= UNROLL_MERGE:
        return merge_partial_list([o_nhmd[i] for i in range(n)], [lse_nhm[i] for i in range(n)])
    return _merge_stacked(o_nhmd, lse_nhm)


def _merge_stacked(o_nhmd, lse_nhm):
    m = jnp.max(lse_nhm, axis=0)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse_nhm - m)
    tot = jnp.sum(w, axis=0)
    ok = tot > 0
    tot_safe = jnp.where(ok, tot, 1.0)
    o = jnp.sum(w[..., None] * jnp.where((w > 0)[..., None], o_nhmd, 0.0), axis=0) / tot_safe[..., None]
    return o, jnp.where(ok, m + jnp.log(tot_safe), -jnp.inf)


# ----------------------------------------------------------------------------- row layout

# The forwards put one sequence's query rows in one row tile; more rows than this exceed an SM's
# shared memory in the Triton lowering (callers split Tq: jax_prefix_attn.shared_prefix.query_chunks).
MAX_ROWS_PER_TILE = 128


def q_rows_layout(tq: int, hq: int, hkv: int, min_rows: int = 16) -> tuple[int, int]:
    """``(R, R_pad)``: rows per sequence ``R = Tq * Hq / Hkv`` and its padded size."""
    r = tq * (hq // hkv)
    return r, max(min_rows, next_pow2(r))


def check_rows_per_tile(tq: int, hq: int, hkv: int) -> None:
    """Reject more query rows per sequence than one row tile holds (see MAX_ROWS_PER_TILE)."""
    r = tq * (hq // hkv)
    if r > MAX_ROWS_PER_TILE:
        raise ValueError(f"Tq * Hq / Hkv = {r} query rows per sequence exceed one row tile "
                         f"({MAX_ROWS_PER_TILE}); split the queries along Tq "
                         f"(jax_prefix_attn.shared_prefix.query_chunks)")


def rows_from_q(q_bthd: jax.Array, hkv: int, r_pad: int, order_b: jax.Array | None = None):
    """``q [B, Tq, Hq, D] -> [Hkv, B * r_pad, D]``; row ``(b, t, g)`` in sequence order ``order_b``."""
    b, tq, hq, d = q_bthd.shape
    grp = hq // hkv
    q = q_bthd if order_b is None else q_bthd[order_b]
    q = q.reshape(b, tq, hkv, grp, d).transpose(2, 0, 1, 3, 4).reshape(hkv, b, tq * grp, d)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, r_pad - tq * grp), (0, 0)))
    return q.reshape(hkv, b * r_pad, d)


def seq_rows(values_b, r_pad: int, order_b: jax.Array | None = None):
    """Per-row array ``[B * r_pad]`` holding, on every row of sequence ``b`` (in the order
    ``order_b``), the per-sequence value ``values_b[b]``: the row metadata of a pool index, or of
    a key limit when ``Tq == 1``.  A NumPy ``values_b`` without ``order_b`` gives a NumPy array
    (a constant of the compiled step: no device work, where XLA would launch a small fusion per
    metadata array); otherwise one broadcast."""
    if isinstance(values_b, np.ndarray) and order_b is None:
        return np.repeat(values_b.astype(np.int32), r_pad)
    v = jnp.asarray(values_b)
    v = v if order_b is None else v[order_b]
    return jnp.broadcast_to(v[:, None], (v.shape[0], r_pad)).reshape(v.shape[0] * r_pad)


def pad_rows(x, n: int, **kw):
    """``jnp.pad(x, (0, n), **kw)`` for a 1-D row array, in NumPy when ``x`` is a NumPy array."""
    return np.pad(x, (0, n), **kw) if isinstance(x, np.ndarray) else jnp.pad(x, (0, n), **kw)


def row_meta(values_bt: jax.Array, grp: int, r_pad: int, order_b: jax.Array | None = None,
             pad_value=None):
    """Per-row array ``[B * r_pad]`` from per-(sequence, position) values ``[B, Tq]``.

    Padding rows get ``pad_value`` (scalar or ``[B]`` in the output order); by default each
    sequence's largest value, so a padding row's key limit never shortens the unmasked tiles
    (padding rows are computed from zero queries and discarded).
    """
    if values_bt.shape[1] == 1 and pad_value is None:  # one position: every row the same value
        return seq_rows(values_bt[:, 0], r_pad, order_b)
    v = values_bt if order_b is None else values_bt[order_b]
    b, tq = v.shape
    if pad_value is None:
        pad_value = jnp.max(v, axis=1)
    v = jnp.repeat(v, grp, axis=1)  # row t * grp + g
    pad = jnp.broadcast_to(jnp.asarray(pad_value, v.dtype), (b, r_pad - tq * grp)) if jnp.ndim(
        pad_value) == 0 else jnp.broadcast_to(pad_value[:, None], (b, r_pad - tq * grp))
    return jnp.concatenate([v, pad], axis=1).reshape(b * r_pad)


def rows_to_out(x_hm, b: int, tq: int, hq: int, r_pad: int, inv_order_b=None, d: int | None = None):
    """Inverse of :func:`rows_from_q` for outputs ``[Hkv, B*r_pad(, D)]`` -> ``[B, Tq, Hq(, D)]``."""
    hkv = x_hm.shape[0]
    grp = hq // hkv
    tail = x_hm.shape[2:]
    x = x_hm.reshape((hkv, b, r_pad) + tail)[:, :, :tq * grp]
    x = x.reshape((hkv, b, tq, grp) + tail)
    x = jnp.moveaxis(x, 0, 2).reshape((b, tq, hq) + tail)
    return x if inv_order_b is None else x[inv_order_b]


# ----------------------------------------------------------------------------- flat path

def large_m_layout(batch: int, rows_per_seq: int, heads_kv: int, target: int = 264) -> bool:
    """True when the batched prefix kernel runs unsplit 128-row blocks (enough rows to fill the
    GPU, e.g. B=1024 with Hq=32/Hkv=8): the configuration in which the two-phase key loop is
    used (see :func:`attend_pool`)."""
    m = batch * next_pow2(rows_per_seq)
    return m >= 1024 and heads_kv * cdiv(m + 16, 128) >= target


def _pick_splits(programs: int, seq_len: int, block_k: int, target: int = 264) -> int:
    """Key splits so that ``programs * splits`` reaches ``target`` without chunks below a tile."""
    if programs >= target:
        return 1
    return max(1, min(cdiv(target, programs), cdiv(seq_len, 2 * block_k)))


# Decoding (``Tq == 1``) on the flat path: "own" reads q and writes out/lse in their own layout
# (pallas_kernels.suffix_attention.suffix_decode_merge with the prefix as a pool span and key
# splits); "rows" the row-layout kernel below (q padded to 16 rows per sequence and kv head, the
# output transposed back: two more XLA passes); "auto" (default) picks by
# :func:`flat_decode_layout`.  Measured on an H200, one run
# (bench/results/logs/session11_probe_layout11_h200.json), "own" took 0.73-0.93x the time of
# "rows" at 11 of 12 points (B=16-1024, P=1K-16K, Hq=8/Hkv=1 and 32/8) with the tiling below,
# and 0.98x at the twelfth (Hq=8 B=64 P=4K S=256).  The grid (runs 12-13) and a second probe
# (logs/session11_probe_h32b16_h200.json) then found "own" slower where few programs (128-key
# tiles) each stream a long prefix chunk: Hq=32 B=16 and Hq=8 B=64 at P=16K, S>=256: 1.19-1.32x;
# the cause was not identified (both layouts run the same tiles, splits and loop structure).
FLAT_DECODE_LAYOUT = "auto"
FLAT_DECODE_LAYOUTS = ("auto", "own", "rows")
FLAT_OWN_MAX_CHUNK = 1024  # "auto": longest prefix chunk per program for "own" at <= 400 programs


# Tiling of the "own" kernel by its program count (kv heads x sequences x key splits), from the
# same probe: few programs stream best with 128-key tiles and 4 warps; at about 2-8 programs per
# SM 64-key tiles; beyond that small CTAs (32 keys, 2 warps, 3 stages), more of them per SM
# (B=1024 Hq=32 P=4K: 0.87x "rows" against 0.96x with 128-key tiles).  None: this rule.
FLAT_DECODE_TILING = None
FLAT_DECODE_TILES = ((400, dict(block_k=128, num_warps=4, num_stages=2)),
                     (1024, dict(block_k=64, num_warps=4, num_stages=2)),
                     (None, dict(block_k=32, num_warps=2, num_stages=3)))


def flat_decode_layout(programs: int, prefix_chunk: int) -> str:
    """Layout of the flat decode kernel (``FLAT_DECODE_LAYOUT == "auto"``) for ``programs``
    programs (kv heads x sequences x key splits) each reading ``prefix_chunk`` prefix keys."""
    if FLAT_DECODE_LAYOUT != "auto":
        return FLAT_DECODE_LAYOUT
    if programs <= FLAT_DECODE_TILES[0][0] and prefix_chunk > FLAT_OWN_MAX_CHUNK:
        return "rows"
    return "own"


def flat_decode_tiling(programs: int) -> dict:
    """Tiling of the own-layout flat decode kernel for ``programs`` programs (static)."""
    if FLAT_DECODE_TILING is not None:
        return dict(FLAT_DECODE_TILING)
    for bound, cfg in FLAT_DECODE_TILES:
        if bound is None or programs <= bound:
            return dict(cfg)
    raise AssertionError("FLAT_DECODE_TILES must end with a catch-all entry")


def flat_forward(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, lim_p, lim_s, *,
                 scale, interpret=False, block_k=128, num_warps=4, num_stages=2, num_splits=None,
                 layout=None, prefix_len_g=None):
    """Flat decode over shared storage: every sequence reads its prefix (through
    ``seq_to_prefix``, no copy) and its suffix in one launch (plus an XLA merge of the key
    splits when ``B * Hkv`` is too small to fill the GPU).

    ``q [B, Tq, Hq, D]``, ``prefix_k/v [G, P, Hkv, D]``, ``suffix_k/v [B, S, Hkv, D]``,
    ``seq_to_prefix [B]``, ``lim_p/lim_s [B, Tq]`` per-row key limits.  Returns
    ``(out [B, Tq, Hq, D], lse [B, Tq, Hq])``.  ``prefix_len_g`` (optional, ``[G]`` int32): the
    prefix lengths; when decoding with one prefix (``Tq == G == 1``), where ``lim_p`` is that
    length on every row, the own-layout kernel takes it as it is (no per-sequence array).

    ``layout`` (static, ``Tq == 1`` only): ``"own"``, ``"rows"`` or ``"auto"``/None
    (:func:`flat_decode_layout`, see :data:`FLAT_DECODE_LAYOUT`); it depends on shapes only, so
    changing lengths do not recompile.  ``block_k``/``num_warps``/``num_stages`` tile the
    row-layout kernel; its ``block_k`` also sets the default key splits of both layouts.
    """
    b, tq, hq, d = q.shape
    g, p, hkv, _ = prefix_k.shape
    grp = hq // hkv
    check_rows_per_tile(tq, hq, hkv)
    _, r_pad = q_rows_layout(tq, hq, hkv)
    s = suffix_k.shape[1]
    if num_splits is None:
        num_splits = _pick_splits(b * hkv, p + s, block_k)
    if layout not in FLAT_DECODE_LAYOUTS + (None,):
        raise ValueError(f"layout must be one of {FLAT_DECODE_LAYOUTS}, got {layout!r}")
    if layout in (None, "auto"):
        layout = flat_decode_layout(b * hkv * num_splits, cdiv(p, num_splits))
    if tq == 1 and layout == "own":
        from pallas_kernels.suffix_attention import suffix_decode_merge  # noqa: PLC0415
        # the prefix pool as one span per sequence: entry g's keys start at g * P
        # (one prefix: start 0 and, when given, its length, each one [1] array for every
        # sequence: no [B] array to build)
        start = np.zeros((1,), np.int32) if g == 1 else seq_to_prefix.astype(jnp.int32) * p
        span_len = prefix_len_g if g == 1 and prefix_len_g is not None else lim_p[:, 0]
        span = (prefix_k.reshape(g * p, hkv, d), prefix_v.reshape(g * p, hkv, d), start,
                span_len)
        o, lse = suffix_decode_merge(q[:, 0].astype(prefix_k.dtype), suffix_k, suffix_v,
                                     lim_s[:, 0], span=span, span_max=p, num_splits=num_splits,
                                     scale=scale, interpret=interpret,
                                     **flat_decode_tiling(b * hkv * num_splits))
        if num_splits > 1:
            o, lse = merge_partials(o, lse)
        return o.astype(q.dtype)[:, None], lse[:, None]
    q_rows = rows_from_q(q.astype(prefix_k.dtype), hkv, r_pad)
    # (pool indices are constants where static: one prefix, and each suffix its own entry)
    s2p = np.zeros((b,), np.int32) if g == 1 else seq_to_prefix
    src_p = Source(prefix_k, prefix_v, seq_rows(s2p, r_pad), row_meta(lim_p, grp, r_pad))
    src_s = Source(suffix_k, suffix_v, seq_rows(np.arange(b, dtype=np.int32), r_pad),
                   row_meta(lim_s, grp, r_pad))
    kw = dict(scale=scale, block_m=r_pad, block_k=block_k, num_splits=num_splits,
              num_warps=num_warps, num_stages=num_stages, interpret=interpret,
              two_phase=large_m_layout(b, tq * grp, hkv))
    if num_splits == 1:
        o, lse = ragged_attention(q_rows, [src_p, src_s], finalize=True, out_dtype=q.dtype, **kw)
    else:
        o, lse = ragged_attention(q_rows, [src_p, src_s], finalize=False, **kw)
        o, lse = merge_partials(o, lse)
        o = o.astype(q.dtype)
    return rows_to_out(o, b, tq, hq, r_pad), rows_to_out(lse, b, tq, hq, r_pad)
