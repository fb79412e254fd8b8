"""Executes a :class:`SharedPrefixPlan`: the kernel wrappers of each leaf plus their XLA glue.

:func:`run_plan` computes the per-row key limits, then runs the plan's leaf on each chunk of
query positions (one kernel call per chunk) and concatenates the chunks.  The Triton leaves
and the flat leaves are here; the Mosaic GPU leaves are in :mod:`jax_prefix_attn.executor_mgpu`.

Canonical inputs (as validated by :func:`jax_prefix_attn.shared_prefix_attention`):
``q [B, Tq, Hq, D]``, ``prefix_k/v [G, P, Hkv, D]``, ``suffix_k/v [B, S, Hkv, D]``,
``seq_to_prefix [B]``, ``prefix_lengths [G]``, ``suffix_lengths [B]`` (int32).  Outputs:
``(out [B, Tq, Hq, D] in q's dtype, lse [B, Tq, Hq] float32)``.
"""
from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np

from jax_prefix_attn import executor_mgpu as xm
from jax_prefix_attn import leaf_plans
from jax_prefix_attn.device import H100_SXM, device_info
from jax_prefix_attn.plans import (FlatOwn, FlatRows, MgpuJoint, MgpuOneLaunch, MgpuSplit,
                                   MgpuTwoLaunch, SharedPrefixPlan, Shapes, TritonOverlap,
                                   TritonTwoLaunch)
from jax_prefix_attn.reference import clamp_shared_inputs, row_limits
from pallas_kernels._common import (cdiv, check_rows_per_tile, merge_partials, merge_row_parts,
                                    next_pow2, pad_rows, q_rows_layout, row_meta, rows_from_q,
                                    rows_to_out, seq_rows)
from pallas_kernels.decode_attention import Source, ragged_attention
from pallas_kernels.merge_splits import merge_splits
from pallas_kernels.overlap_attention import overlap_partials
from pallas_kernels.prefix_attention import prefix_partials
from pallas_kernels.suffix_attention import suffix_decode_merge

__all__ = ["run_plan", "decode_prefix_partials"]

_MGPU = types.MappingProxyType({MgpuTwoLaunch: xm.mgpu_two_launch,
                               MgpuOneLaunch: xm.mgpu_one_launch, MgpuJoint: xm.mgpu_joint,
                               MgpuSplit: xm.mgpu_split})


def run_plan(plan: SharedPrefixPlan, q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix,
             prefix_lengths, suffix_lengths, scale, interpret):
    """Run the kernels of ``plan`` (``impl`` ``"shared"`` or ``"flat"``) on canonical inputs.

    The clamp rule (:func:`jax_prefix_attn.reference.clamp_shared_inputs`): with several prefix
    groups ``seq_to_prefix`` is clamped here (it feeds XLA's sort and gathers anyway).  When
    decoding, ``row_limits`` is the identity on in-range lengths, and the lengths go to the
    kernels as they are (a bitcast: no XLA launch before the Pallas calls): every kernel clamps
    the limits it reads to its key axis (a negative limit sees nothing).  With ``Tq > 1`` the
    limits are computed from the clamped lengths."""
    g = prefix_k.shape[0]
    if g > 1:
        seq_to_prefix = jnp.clip(seq_to_prefix, 0, g - 1)
    if q.shape[1] == 1:
        lim_p, lim_s = prefix_lengths[seq_to_prefix][:, None], suffix_lengths[:, None]
    else:
        _, prefix_lengths, suffix_lengths = clamp_shared_inputs(
            seq_to_prefix, prefix_lengths, suffix_lengths, g, prefix_k.shape[1], suffix_k.shape[1])
        lim_p, lim_s = row_limits(q.shape[1], prefix_lengths[seq_to_prefix], suffix_lengths)
    fwd = _flat_chunk if plan.impl == "flat" else _shared_chunk
    parts = [fwd(c.leaf, q[:, c.start:c.stop], prefix_k, prefix_v, suffix_k, suffix_v,
                 seq_to_prefix, lim_p[:, c.start:c.stop], lim_s[:, c.start:c.stop], scale=scale,
                 interpret=interpret, prefix_len_g=prefix_lengths)
             for c in plan.chunks]
    if len(parts) == 1:
        return parts[0]
    return (jnp.concatenate([o for o, _ in parts], axis=1),
            jnp.concatenate([l for _, l in parts], axis=1))


def _flat_chunk(leaf, q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, lim_p, lim_s, *,
                scale, interpret, prefix_len_g):
    """Flat decode over shared storage: every sequence reads its prefix (through
    ``seq_to_prefix``, no copy) and its suffix in one launch (plus an XLA merge of the key
    splits).  ``lim_p/lim_s [B, Tq]`` per-row key limits; when decoding with one prefix the
    own-layout kernel takes the prefix length ``prefix_len_g [1]`` as it is."""
    b, tq, hq, d = q.shape
    g, p, hkv, _ = prefix_k.shape
    grp = hq // hkv
    check_rows_per_tile(tq, hq, hkv)
    _, r_pad = q_rows_layout(tq, hq, hkv)
    if isinstance(leaf, FlatOwn):
        # the prefix pool as one span per sequence: entry g's keys start at g * P
        # (one prefix: start 0 and its length, each one [1] array for every sequence: no [B]
        # array to build)
        start = np.zeros((1,), np.int32) if g == 1 else seq_to_prefix.astype(jnp.int32) * p
        span_len = prefix_len_g if g == 1 and prefix_len_g is not None else lim_p[:, 0]
        span = (prefix_k.reshape(g * p, hkv, d), prefix_v.reshape(g * p, hkv, d), start,
                span_len)
        t = leaf.tiling
        o, lse = suffix_decode_merge(q[:, 0].astype(prefix_k.dtype), suffix_k, suffix_v,
                                     lim_s[:, 0], span=span, span_max=p,
                                     num_splits=leaf.num_splits, scale=scale, interpret=interpret,
                                     block_k=t.block_k, num_warps=t.num_warps,
                                     num_stages=t.num_stages)
        if leaf.num_splits > 1:   # one launch for the whole merge (latency-bound sizes)
            n = leaf.num_splits
            o, lse = merge_splits(o.reshape(n, b * hq, d), lse.reshape(n, b * hq), out_dtype=q.dtype,
                                  interpret=interpret)
            o, lse = o.reshape(b, hq, d), lse.reshape(b, hq)
        return o.astype(q.dtype)[:, None], lse[:, None]
    assert isinstance(leaf, FlatRows), leaf
    q_rows = rows_from_q(q.astype(prefix_k.dtype), hkv, r_pad)
    # (pool indices are constants where static: one prefix, and each suffix its own entry)
    s2p = np.zeros((b,), np.int32) if g == 1 else seq_to_prefix
    src_p = Source(prefix_k, prefix_v, seq_rows(s2p, r_pad), row_meta(lim_p, grp, r_pad))
    src_s = Source(suffix_k, suffix_v, seq_rows(np.arange(b, dtype=np.int32), r_pad),
                   row_meta(lim_s, grp, r_pad))
    kw = dict(scale=scale, block_m=r_pad, block_k=leaf.block_k, num_splits=leaf.num_splits,
              num_warps=leaf.num_warps, num_stages=leaf.num_stages, interpret=interpret,
              two_phase=leaf.two_phase)
    if leaf.num_splits == 1:
        o, lse = ragged_attention(q_rows, [src_p, src_s], finalize=True, out_dtype=q.dtype, **kw)
    else:
        o, lse = ragged_attention(q_rows, [src_p, src_s], finalize=False, **kw)
        o, lse = merge_partials(o, lse)
        o = o.astype(q.dtype)
    return rows_to_out(o, b, tq, hq, r_pad), rows_to_out(lse, b, tq, hq, r_pad)


def _shared_chunk(leaf, q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, lim_p, lim_s,
                  *, scale, interpret, prefix_len_g):
    """The shared family on one chunk: the leaf's prefix pass over all sequences' rows batched
    (sorted by prefix group), its suffix pass and merge.  ``prefix_len_g [G]``: when decoding
    with one prefix, the kernels take that length as it is instead of per-row arrays."""
    b, tq, hq, d = q.shape
    g, p, hkv, _ = prefix_k.shape
    grp = hq // hkv
    check_rows_per_tile(tq, hq, hkv)
    r, r16 = q_rows_layout(tq, hq, hkv)
    r2 = next_pow2(r)
    q = q.astype(prefix_k.dtype)
    # decoding with one prefix and its length given: that length for every row
    one_len = prefix_len_g.reshape(1) if g == 1 and tq == 1 and prefix_len_g is not None else None
    if type(leaf) in _MGPU:
        p_len = jnp.max(lim_p) if one_len is None else one_len.reshape(())
        s_len = lim_s if isinstance(leaf, MgpuTwoLaunch) else lim_s[:, 0]
        return _MGPU[type(leaf)](leaf, q, prefix_k[0], prefix_v[0], p_len, suffix_k, suffix_v,
                                 s_len, scale=scale, interpret=interpret)
    if g == 1:
        order = inv = None
        s2p_sorted = np.zeros((b,), np.int32)  # (a constant: see ``seq_rows``)
    else:
        order = jnp.argsort(seq_to_prefix, stable=True).astype(jnp.int32)
        inv = jnp.argsort(order).astype(jnp.int32)
        s2p_sorted = seq_to_prefix[order]
    # The prefix pass over compact rows (R2 per sequence), sorted by group.  (+R16 rows for the
    # two-launch leaf: its suffix pass reads whole R16-row tiles of the partials past the last
    # sequence; the overlap leaf's merge reads only the real rows.)
    cfg = leaf.prefix
    overlap = isinstance(leaf, TritonOverlap)
    m = b * r2
    m_pad = cdiv(m + (0 if overlap else r16), cfg.block_m) * cfg.block_m
    qp = rows_from_q(q, hkv, r2, order)
    qp = jnp.pad(qp, ((0, 0), (0, m_pad - m), (0, 0))) if m_pad > m else qp
    grp_rows = pad_rows(seq_rows(s2p_sorted, r2), m_pad - m, mode="edge")
    # tail padding rows (zero queries, results never used): the last real row's entry and
    # limit, so they load no key that the real rows of their block do not (a prefix may hold
    # anything, NaN included, past its length: 0 * NaN in ``p @ v`` would reach those rows)
    lim_rows = pad_rows(row_meta(lim_p, grp, r2, order), m_pad - m, mode="edge")
    if overlap:
        if one_len is not None:  # no per-row arrays: one pool entry, one length
            grp_rows, lim_rows = None, one_len
        return _overlap(leaf, q, prefix_k, prefix_v, suffix_k, suffix_v, qp, grp_rows, lim_rows,
                        lim_s, order, inv, scale=scale, interpret=interpret)
    assert isinstance(leaf, TritonTwoLaunch), leaf
    o_pre, lse_pre = prefix_partials(qp, prefix_k, prefix_v, grp_rows, lim_rows, scale=scale,
                                     block_m=cfg.block_m, block_k=cfg.block_k,
                                     num_splits=cfg.num_splits, num_warps=cfg.num_warps,
                                     num_stages=cfg.num_stages, interpret=interpret,
                                     two_phase=cfg.two_phase)
    return _suffix_with_merge(leaf, q, suffix_k, suffix_v, lim_s, o_pre, lse_pre, order, inv,
                              r=r, r2=r2, r16=r16, scale=scale, interpret=interpret)


def _suffix_with_merge(leaf: TritonTwoLaunch, q, suffix_k, suffix_v, lim_s, o_pre, lse_pre,
                       order, inv, *, r, r2, r16, scale, interpret):
    """The two-launch leaf's suffix pass, merging the prefix partials ``(o_pre [splits, Hkv,
    >= M + R16, D], lse_pre)`` (rows ``R2`` per sequence) in its epilogue; split suffix keys:
    partial states and one XLA merge."""
    b, tq, hq, _ = q.shape
    hkv = suffix_k.shape[2]
    grp = hq // hkv
    t = leaf.suffix
    if tq == 1 and leaf.suffix_splits == 1:
        # Decoding: the suffix kernel reads q and writes out/lse in their own layout (no padded
        # row copies); sequence b's prefix partials are rows block inv[b] (sorted by group).
        out, lse = suffix_decode_merge(q[:, 0], suffix_k, suffix_v, lim_s[:, 0], (o_pre, lse_pre),
                                       in_stride=r2, position_b=inv, scale=scale,
                                       interpret=interpret, block_k=t.block_k,
                                       num_warps=t.num_warps, num_stages=t.num_stages)
        return out[:, None], lse[:, None]
    # Per-sequence suffix rows (R16 per sequence, same sorted order); the epilogue merges the
    # prefix partials of rows [rb * R2, rb * R2 + R16).
    qs = rows_from_q(q, hkv, r16, order)
    b_sorted = np.arange(b, dtype=np.int32) if order is None else order
    src_s = Source(suffix_k, suffix_v, seq_rows(b_sorted, r16), row_meta(lim_s, grp, r16, order))
    if leaf.suffix_splits > 1:
        o_s, lse_s = ragged_attention(qs, [src_s], scale=scale, block_m=r16, block_k=t.block_k,
                                      num_splits=leaf.suffix_splits, finalize=False,
                                      num_warps=t.num_warps, num_stages=t.num_stages,
                                      interpret=interpret)
        return merge_row_parts([(o_pre, lse_pre, r2), (o_s, lse_s, r16)], b=b, tq=tq, hq=hq,
                               r=r, dtype=q.dtype, inv=inv)
    o, lse = ragged_attention(qs, [src_s], scale=scale, block_m=r16, block_k=t.block_k,
                              num_splits=1, incoming=(o_pre, lse_pre), in_stride=r2,
                              finalize=True, out_dtype=q.dtype, num_warps=t.num_warps,
                              num_stages=t.num_stages, interpret=interpret,
                              two_phase=leaf.prefix.two_phase)
    return rows_to_out(o, b, tq, hq, r16, inv), rows_to_out(lse, b, tq, hq, r16, inv)


def _overlap(leaf: TritonOverlap, q, prefix_k, prefix_v, suffix_k, suffix_v, qp, grp_rows,
             lim_rows, lim_s, order, inv, *, scale, interpret):
    """The overlap leaf: one launch of interleaved prefix and suffix programs (the suffix keys
    split so that a small batch with a long suffix does not leave ``B * Hkv`` programs walking
    it alone), then one XLA merge."""
    b, tq, hq, d = q.shape
    hkv = prefix_k.shape[2]
    grp = hq // hkv
    r, r16 = q_rows_layout(tq, hq, hkv)
    r2 = next_pow2(r)
    cfg = leaf.prefix
    qs = rows_from_q(q, hkv, r16, order)
    sidx = seq_rows(np.arange(b, dtype=np.int32) if order is None else order, r16)
    # decoding: one key limit per sequence, broadcast to its rows in the kernel
    lims = lim_s[:, 0] if tq == 1 and order is None else row_meta(lim_s, grp, r16, order)
    o_pre, lse_pre, o_s, lse_s = overlap_partials(
        qp, grp_rows, lim_rows, prefix_k, prefix_v, qs, sidx, lims, suffix_k, suffix_v,
        scale=scale, block_m=cfg.block_m, block_k=cfg.block_k, num_splits=cfg.num_splits,
        r16=r16, suffix_block_k=leaf.suffix_block_k, suffix_splits=leaf.suffix_splits,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, interpret=interpret)
    return merge_row_parts([(o_pre, lse_pre, r2), (o_s, lse_s, r16)], b=b, tq=tq, hq=hq, r=r,
                           dtype=q.dtype, inv=inv)


def decode_prefix_partials(q_bhd, prefix_k, prefix_v, length, *, scale, interpret=False,
                           device=None):
    """The shared family's prefix pass alone, for one prefix and one query per sequence (e.g.
    the root of a prefix tree): every sequence's ``Hq`` query rows attend ``prefix_k/v
    [P, Hkv, D]`` keys ``[0, length)`` (``length`` an int32 scalar, dynamic) as one batched
    matrix product per kv head (the Mosaic GPU kernel where the planner's Mosaic GPU region
    holds on ``device``, default the one JAX runs on; else the Triton kernel, split along the
    prefix when the rows are few).

    ``q_bhd [B, Hq, D]``.  Returns ``(o [n, Hkv, M, D], lse [n, Hkv, M] float32, stride)``:
    ``n`` prefix splits of normalised partials (``lse = -inf`` where a split saw nothing); query
    head ``h * G + j`` of sequence ``b`` is row ``b * stride + j`` of kv head ``h``, and
    ``M >= (B - 1) * stride + suffix_rows(Hq, Hkv)`` (the layout
    ``suffix_attention.suffix_decode_merge`` takes as ``incoming``).
    """
    b, hq, d = q_bhd.shape
    p, hkv, _ = prefix_k.shape
    dev = device_info() if device is None else device
    s = Shapes(b, 1, hq, hkv, d, 1, p, 1, jnp.dtype(prefix_k.dtype).name)
    q_bhd = q_bhd.astype(prefix_k.dtype)
    r, r16 = q_rows_layout(1, hq, hkv)
    r2 = next_pow2(r)
    if leaf_plans.mosaic_region(s, dev, interpret):
        o, lse = xm.mgpu_prefix_partials(q_bhd, prefix_k, prefix_v, length, scale=scale,
                                         num_splits=leaf_plans.mgpu_splits(s, dev),
                                         interpret=interpret)
        return o, lse, r2
    tdev = dev if dev.is_gpu else H100_SXM
    cfg = leaf_plans.prefix_tiling(b, r, hkv, p, 2 * tdev.sm_count)
    m = b * r2
    m_pad = cdiv(m + r16, cfg.block_m) * cfg.block_m
    qp = jnp.pad(rows_from_q(q_bhd[:, None], hkv, r2), ((0, 0), (0, m_pad - m), (0, 0)))
    lim_rows = jnp.full((m_pad,), length, jnp.int32)
    o, lse = prefix_partials(qp, prefix_k[None], prefix_v[None], jnp.zeros((m_pad,), jnp.int32),
                             lim_rows, scale=scale, block_m=cfg.block_m, block_k=cfg.block_k,
                             num_splits=cfg.num_splits, num_warps=cfg.num_warps,
                             num_stages=cfg.num_stages, interpret=interpret,
                             two_phase=cfg.two_phase)
    return o, lse, r2
