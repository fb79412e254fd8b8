"""Numerics and row layouts shared by the Pallas kernels and the code that calls them.

* The online softmax of the Triton-lowered kernels (:func:`online_update`, :func:`attend_pool`,
  :func:`finish_state`) and the exact merge of partial states (:func:`merge_tile_states` inside
  a kernel, :func:`merge_partial_list` / :func:`merge_partials` in XLA).  Scores are kept in
  base 2 with the scale folded in (``exp2`` is one instruction); LSE values returned are
  natural log, float32, ``-inf`` (with ``o = 0``) for a row that saw no key and NaN for a row
  whose state is not finite (a NaN score or value): emptiness is tested as ``l == 0`` /
  ``lse == -inf``, never as "greater than", so a NaN never reads as empty.
* The row layout of the batched kernels: the queries of ``B`` sequences as rows
  ``[Hkv, B * R_pad, D]`` with ``R = Tq * Hq / Hkv`` real rows per sequence (row
  ``t * G + j`` is query position ``t``, head ``h * G + j``), and the per-row metadata arrays
  (pool entry, key limit) the kernels read.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["LOG2E", "LN2", "next_pow2", "cdiv", "kernel_head_dim", "kernel_group", "pad_axis",
           "pad_group", "unpad_group", "partial_state_types", "split_chunk", "online_update", "attend_pool",
           "finite", "flag_nonfinite", "finish_state", "merge_tile_states", "merge_partial_list", "merge_partials",
           "merge_stacked", "MAX_ROWS_PER_TILE", "q_rows_layout", "check_rows_per_tile",
           "rows_from_q", "seq_rows", "pad_rows", "row_meta", "rows_to_out", "rows_128",
           "merge_row_parts"]

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# The batched kernels put one sequence's query rows in one row tile; more rows than this exceed
# an SM's shared memory in the Triton lowering (callers cut Tq into chunks).
MAX_ROWS_PER_TILE = 128
# Merge up to this many partial states as one elementwise fusion (see merge_partial_list).
UNROLL_MERGE = 32


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kernel_head_dim(d: int) -> int:
    """The head_dim a Triton-lowered kernel runs for a ``d``-wide head: a power of two >= 16
    (tiles must be powers of two; callers zero-pad q, k and v to it, which leaves every score
    unchanged, and slice the output back)."""
    return max(16, next_pow2(d))


def kernel_group(g: int) -> int:
    """The GQA group (query heads per kv head) the tree kernels run for a group of ``g``: a power
    of two, so that a block of ``block_rows`` rows holds a power of two of query vectors (callers
    pad each group with zero dummy query heads and drop their outputs)."""
    return next_pow2(g)


def pad_axis(x, axis: int, size: int):
    """``x`` zero-padded at the end of ``axis`` to ``size`` (``x`` itself when already that size)."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def pad_group(x_bth, hkv: int, g_pad: int):
    """``x [B, Tq, Hkv * G(, D)]`` -> ``[B, Tq, Hkv * g_pad(, D)]``: each kv head's ``G`` query heads
    followed by ``g_pad - G`` zero dummy heads (query head ``h * g_pad + j``, ``j < G``, is the
    original head ``h * G + j``)."""
    b, tq, hq = x_bth.shape[:3]
    tail = x_bth.shape[3:]
    x = x_bth.reshape((b, tq, hkv, hq // hkv) + tail)
    return pad_axis(x, 3, g_pad).reshape((b, tq, hkv * g_pad) + tail)


def unpad_group(x_bth, hkv: int, g: int):
    """Inverse of :func:`pad_group`: the real ``G`` heads of each kv head, ``[B, Tq, Hkv * G(, D)]``."""
    b, tq, hq = x_bth.shape[:3]
    tail = x_bth.shape[3:]
    x = x_bth.reshape((b, tq, hkv, hq // hkv) + tail)[:, :, :, :g]
    return x.reshape((b, tq, hkv * g) + tail)


def partial_state_types(parts: int, hkv: int, rows: int, d: int, dtype) -> tuple:
    """Output types of a kernel writing ``parts`` partial attention states per kv head:
    ``(out [parts, hkv, rows, d] dtype, lse [parts, hkv, rows] float32)``."""
    return (jax.ShapeDtypeStruct((parts, hkv, rows, d), dtype),
            jax.ShapeDtypeStruct((parts, hkv, rows), jnp.float32))


def split_chunk(n: int, splits: int, block_k: int) -> int:
    """Keys per program when ``n`` keys are cut into ``splits`` chunks of whole ``block_k`` tiles."""
    return cdiv(cdiv(n, splits), block_k) * block_k


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
    the longest limit of its rows (empty ranges run zero iterations).  Limits are clamped to
    ``[0, seq_len]`` (a negative limit sees nothing; one past the key axis sees the whole axis).

    ``two_phase``: first the tiles below every row's limit without masks, then the ragged tail
    with masks.  It pays only in the unsplit large-M prefix kernel (long key loops over many
    rows) and slows split-prefix and decode launches, so it is off by default (one masked
    loop); measurements: ``docs/performance.md``, "Kernel design measurements".
    """
    cols = lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
    lim = jnp.minimum(lim, seq_len)  # (once per call: keys past the axis do not exist)
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


def finite(x):
    """``x`` is neither NaN nor infinite (two ordered comparisons: every lowering has them)."""
    return (x > -jnp.inf) & (x < jnp.inf)


def flag_nonfinite(o, lse):
    """``lse`` with NaN on the rows where ``o [..., D]`` holds a NaN or an infinity (a row that saw
    a non-finite value: its LSE must read neither as finite nor as ``-inf``, i.e. empty).

    Kernels and merges need no such flag: a NaN score makes ``l`` and the LSE NaN, and a NaN
    value makes ``o`` NaN, which every merge carries into the merged ``o``.  Only a row whose
    NaN came from a value has a finite LSE, so the public entry points apply this once to what
    they return (an XLA reduction over ``D``, and only when the caller asks for the LSE).  The
    test is elementwise, not on a row sum: a float16 row of finite values can sum past 65504."""
    return jnp.where(jnp.all(finite(o), axis=-1), lse, jnp.nan)


def finish_state(acc, m_i, l_i):
    """``(o [BM, D], lse [BM])`` (natural log) from an online-softmax state.  ``l = 0`` is a row
    that saw no key (``o = 0``, ``lse = -inf``); a NaN ``l`` (a NaN score) leaves ``o`` and the
    LSE NaN, never ``-inf`` (emptiness is ``l == 0``, not ``l > 0``)."""
    empty = l_i == 0
    l_safe = jnp.where(empty, 1.0, l_i)
    return acc / l_safe[:, None], jnp.where(empty, -jnp.inf, (m_i + jnp.log2(l_safe)) * LN2)


def merge_tile_states(o_parts, lse_parts):
    """Merge partial states, elementwise over the parts: ``o [..., D]`` (normalised, any float
    dtype) and ``lse [...]`` (natural log, ``-inf`` for none) -> float32 ``(o, lse)``; rows where
    every part is empty get ``o = 0``, ``lse = -inf``.  Used inside the kernels on one row
    tile (``[BM, D]``) and, through :func:`merge_partial_list`, by XLA.  A part is empty only
    where its ``lse`` is exactly ``-inf``: a NaN ``lse`` makes the merged ``o`` and ``lse`` NaN,
    and a non-finite ``o`` of a part that is not empty makes the merged ``o`` NaN."""
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
    empty = tot == 0  # (a NaN part makes tot NaN: the row's merged state is NaN, not empty)
    tot_safe = jnp.where(empty, 1.0, tot)
    return out / tot_safe[..., None], jnp.where(empty, -jnp.inf, m_all + jnp.log(tot_safe))


def merge_partial_list(o_parts, lse_parts, *, unroll: int = UNROLL_MERGE):
    """Merge partial states given as lists ``o_parts [n] x [..., D]`` (normalised, any float
    dtype) and ``lse_parts [n] x [...]`` (natural log, ``-inf`` for none) -> float32 ``(o, lse)``.

    Written elementwise over the ``n`` parts (a static count), so XLA emits one fusion that also
    absorbs the slicing/reshaping that produced the parts; a reduction over a stacked axis is
    two (the max and exp, then the weighted sum) plus the stacking copy.  Rows where every part
    is empty get ``o = 0``, ``lse = -inf``.  More than ``unroll`` parts: stacked and reduced
    (:func:`merge_stacked`)."""
    if len(o_parts) > unroll:
        return merge_stacked(jnp.stack([o.astype(jnp.float32) for o in o_parts]),
                             jnp.stack(lse_parts))
    return merge_tile_states(o_parts, lse_parts)


def merge_partials(o_nhmd: jax.Array, lse_nhm: jax.Array, *, unroll: int = UNROLL_MERGE):
    """Merge float32 partial states over axis 0 (XLA; one fusion up to ``unroll`` parts, see
    :func:`merge_partial_list`)."""
    n = o_nhmd.shape[0]
    if n <= unroll:
        return merge_partial_list([o_nhmd[i] for i in range(n)], [lse_nhm[i] for i in range(n)],
                                  unroll=unroll)
    return merge_stacked(o_nhmd, lse_nhm)


def merge_stacked(o_nhmd, lse_nhm):
    """Merge float32 partial states ``(o [n, ..., D], lse [n, ...])`` over axis 0 by reductions
    (the NaN rules of :func:`merge_tile_states`).  The running maximum is a constant to autodiff
    (it cancels in the result), so gradients stay finite when every part is empty."""
    m = jax.lax.stop_gradient(jnp.max(lse_nhm, axis=0))
    m = jnp.where(m == -jnp.inf, 0.0, m)
    w = jnp.exp(lse_nhm - m)
    tot = jnp.sum(w, axis=0)
    empty = tot == 0
    tot_safe = jnp.where(empty, 1.0, tot)
    o = jnp.sum(w[..., None] * jnp.where((w > 0)[..., None], o_nhmd, 0.0), axis=0) / tot_safe[..., None]
    return o, jnp.where(empty, -jnp.inf, m + jnp.log(tot_safe))


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
                         f"into chunks")


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


def rows_128(q_btqd, hkv: int, g: int):
    """``(q_hmd [Hkv, M128, D], M)``: decode queries ``[B, 1, Hq, D]`` as ``G`` rows per sequence
    and kv head (row ``b * G + j``), ``M = B * G`` padded with zero rows to a multiple of 128
    (the Mosaic GPU kernels' 128-row blocks)."""
    m = q_btqd.shape[0] * g
    m128 = cdiv(m, 128) * 128
    qm = rows_from_q(q_btqd, hkv, g)  # [Hkv, B * G, D]
    return (jnp.pad(qm, ((0, 0), (0, m128 - m), (0, 0))) if m128 > m else qm), m


def merge_row_parts(parts, *, b: int, tq: int, hq: int, r: int, dtype, inv=None,
                    unroll: int = UNROLL_MERGE):
    """One XLA merge of several sets of partial states in the row layout: each part is
    ``(o [n, Hkv, >= B * rows, D], lse [n, Hkv, >= B * rows], rows)`` with sequence ``b``'s
    ``r`` real rows at ``b * rows``.  Returns ``(out [B, Tq, Hq, D] in dtype, lse [B, Tq, Hq])``
    (``inv``: the inverse of a sort of the sequences, or None)."""
    o_all, l_all = [], []
    for o, lse, rows in parts:
        n, hkv, _, d = o.shape
        o_all += list(o[:, :, :b * rows].reshape(n, hkv, b, rows, d)[:, :, :, :r])
        l_all += list(lse[:, :, :b * rows].reshape(n, hkv, b, rows)[:, :, :, :r])
    o, lse = merge_partial_list(o_all, l_all, unroll=unroll)
    hkv, d = o.shape[0], o.shape[-1]
    o = o.astype(dtype).reshape(hkv, b * r, d)
    lse = lse.reshape(hkv, b * r)
    return rows_to_out(o, b, tq, hq, r, inv), rows_to_out(lse, b, tq, hq, r, inv)
