"""Leaf ``triton_two_launch``: the Triton prefix kernel over all sequences' rows, then the
suffix kernel merging the prefix partials in its epilogue (``suffix_splits == 1``), or the split
suffix kernel and one XLA merge.

The shared family's leaf wherever the Mosaic GPU region does not hold and the (sequence, kv
head) suffix programs fill the GPU alone (``B * Hkv`` from the device's
``overlap_below_programs``).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jax_prefix_attn import cost_model
from jax_prefix_attn.device_profile import planning_profile
from jax_prefix_attn.leaves.base import (PrefixTiling, Shapes, SuffixTiling,
                                         decode_suffix_tiling, suffix_splits, suffix_tiling,
                                         supported, tuning, two_per_sm)
from jax_prefix_attn.leaves.triton_prefix import prefix_rows, prefix_tiling, triton_why_not
from pallas_kernels._common import (merge_row_parts, next_pow2, q_rows_layout, row_meta,
                                    rows_from_q, rows_to_out, seq_rows)
from pallas_kernels.decode_attention import Source, ragged_attention
from pallas_kernels.prefix_attention import prefix_partials
from pallas_kernels.suffix_attention import suffix_decode_merge

__all__ = ["TritonTwoLaunch", "PATH", "FAMILY", "PLAN", "unsupported", "why_not", "build",
           "seconds", "run"]


@dataclasses.dataclass(frozen=True)
class TritonTwoLaunch:
    """Triton prefix kernel, then the suffix kernel merging the prefix partials in its epilogue
    (``suffix_splits == 1``), or the split suffix kernel and one XLA merge."""
    prefix: PrefixTiling
    suffix_splits: int
    suffix: SuffixTiling
    path = "triton_two_launch"


PATH = "triton_two_launch"
FAMILY = "shared"
PLAN = TritonTwoLaunch


def unsupported(s: Shapes, dev, interpret: bool) -> str | None:
    return supported(s)


def why_not(s: Shapes, dev, interpret: bool = False) -> str | None:
    return triton_why_not(s, dev, interpret, overlap=False)


def build(s: Shapes, dev, interpret: bool) -> TritonTwoLaunch:
    """The suffix pass: the own-layout decode tiling when it merges the prefix partials in its
    epilogue (decoding, unsplit), else the row-layout tiling."""
    ss = suffix_splits(s, dev)
    t = tuning(dev)
    return TritonTwoLaunch(
        prefix=prefix_tiling(s.batch, s.tq * s.group, s.heads_kv, s.prefix_len, two_per_sm(dev),
                             tuned=t),
        suffix_splits=ss, suffix=(decode_suffix_tiling(dev) if s.tq == 1 and ss == 1
                                  else suffix_tiling(t.row_suffix_tiling)))


def seconds(s: Shapes, dev, interpret: bool) -> float:
    return cost_model.triton_two_launch_seconds(s, build(s, dev, interpret).suffix_splits,
                                                planning_profile(dev))


def run(leaf: TritonTwoLaunch, q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, lim_p,
        lim_s, *, scale, interpret, prefix_len_g):
    """The prefix pass over all sequences' rows (sorted by prefix group, ``R2`` rows each, +
    ``R16`` rows: the suffix pass reads whole ``R16``-row tiles of the partials past the last
    sequence), then the suffix pass merging them."""
    g, _, hkv, _ = prefix_k.shape
    r, r16 = q_rows_layout(q.shape[1], q.shape[2], hkv)
    r2 = next_pow2(r)
    q = q.astype(prefix_k.dtype)
    cfg = leaf.prefix
    order, inv, qp, grp_rows, lim_rows = prefix_rows(cfg, q, seq_to_prefix, lim_p, groups=g,
                                                     hkv=hkv, r2=r2, tail_rows=r16)
    o_pre, lse_pre = prefix_partials(qp, prefix_k, prefix_v, grp_rows, lim_rows, scale=scale,
                                     block_m=cfg.block_m, block_k=cfg.block_k,
                                     num_splits=cfg.num_splits, num_warps=cfg.num_warps,
                                     num_stages=cfg.num_stages, interpret=interpret,
                                     two_phase=cfg.two_phase)
    return _suffix_with_merge(leaf, q, suffix_k, suffix_v, lim_s, o_pre, lse_pre, order, inv,
                              r=r, r2=r2, r16=r16, scale=scale, interpret=interpret)


def _suffix_with_merge(leaf: TritonTwoLaunch, q, suffix_k, suffix_v, lim_s, o_pre, lse_pre,
                       order, inv, *, r, r2, r16, scale, interpret):
    """The suffix pass, merging the prefix partials ``(o_pre [splits, Hkv, >= M + R16, D],
    lse_pre)`` (rows ``R2`` per sequence) in its epilogue; split suffix keys: partial states and
    one XLA merge."""
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
