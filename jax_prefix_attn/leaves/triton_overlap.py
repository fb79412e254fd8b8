"""Leaf ``triton_overlap``: one launch of interleaved Triton prefix and suffix programs, then one
XLA merge.

The shared family's leaf wherever the Mosaic GPU region does not hold and the (sequence, kv
head) suffix programs are too few to fill the GPU alone (``B * Hkv`` below the device's
``overlap_below_programs``):
the prefix programs run beside them.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jax_prefix_attn import cost_model
from jax_prefix_attn.device_profile import planning_profile
from jax_prefix_attn.leaves.base import (PrefixTiling, Shapes, suffix_splits, supported,
                                         tuning, two_per_sm)
from jax_prefix_attn.leaves.triton_prefix import prefix_rows, prefix_tiling, triton_why_not
from pallas_kernels._common import (merge_row_parts, next_pow2, q_rows_layout, row_meta,
                                    rows_from_q, seq_rows)
from pallas_kernels.overlap_attention import overlap_partials

__all__ = ["TritonOverlap", "PATH", "FAMILY", "PLAN", "unsupported", "why_not", "build",
           "seconds", "run"]


@dataclasses.dataclass(frozen=True)
class TritonOverlap:
    """One launch of interleaved prefix and suffix programs, then one XLA merge."""
    prefix: PrefixTiling
    suffix_splits: int
    suffix_block_k: int
    path = "triton_overlap"


PATH = "triton_overlap"
FAMILY = "shared"
PLAN = TritonOverlap


def unsupported(s: Shapes, dev, interpret: bool) -> str | None:
    return supported(s)


def why_not(s: Shapes, dev, interpret: bool = False) -> str | None:
    return triton_why_not(s, dev, interpret, overlap=True)


def build(s: Shapes, dev, interpret: bool) -> TritonOverlap:
    return TritonOverlap(
        prefix=prefix_tiling(s.batch, s.tq * s.group, s.heads_kv, s.prefix_len, two_per_sm(dev),
                             tuned=tuning(dev)),
        suffix_splits=suffix_splits(s, dev), suffix_block_k=64)


def seconds(s: Shapes, dev, interpret: bool) -> float:
    return cost_model.triton_overlap_seconds(s, build(s, dev, interpret).suffix_splits,
                                             planning_profile(dev))


def run(leaf: TritonOverlap, q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, lim_p,
        lim_s, *, scale, interpret, prefix_len_g):
    """One launch of the prefix programs (compact rows, ``R2`` per sequence, sorted by group:
    its merge reads only the real rows) and the suffix programs (the suffix keys split so that
    a small batch with a long suffix does not leave ``B * Hkv`` programs walking it alone),
    then one XLA merge."""
    b, tq, hq, _ = q.shape
    g, _, hkv, _ = prefix_k.shape
    grp = hq // hkv
    r, r16 = q_rows_layout(tq, hq, hkv)
    r2 = next_pow2(r)
    q = q.astype(prefix_k.dtype)
    cfg = leaf.prefix
    order, inv, qp, grp_rows, lim_rows = prefix_rows(cfg, q, seq_to_prefix, lim_p, groups=g,
                                                     hkv=hkv, r2=r2, tail_rows=0)
    if g == 1 and tq == 1 and prefix_len_g is not None:
        # decoding with one prefix: no per-row arrays, one pool entry and its length
        grp_rows, lim_rows = None, prefix_len_g.reshape(1)
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
