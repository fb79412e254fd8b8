"""Leaf ``flat_rows``: flat decode in the row layout.

One launch of ``ragged_attention`` over [prefix pool; suffix] per sequence's padded query rows
(+ one XLA merge of the key splits).  The flat family's leaf with several queries per sequence,
and when decoding where few programs each stream a long prefix chunk (``flat_own`` otherwise).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jax_prefix_attn import cost_model
from jax_prefix_attn.device_profile import planning_profile
from jax_prefix_attn.leaves import flat_own
from jax_prefix_attn.leaves.base import (Shapes, planning_part, splits_to_fill, supported,
                                         tuning, two_per_sm)
from jax_prefix_attn.leaves.triton_prefix import large_m_layout
from pallas_kernels._common import (merge_partials, q_rows_layout, row_meta, rows_from_q,
                                    rows_to_out, seq_rows)
from pallas_kernels.decode_attention import Source, ragged_attention

__all__ = ["FlatRows", "PATH", "FAMILY", "PLAN", "flat_splits", "unsupported", "why_not",
           "build", "seconds", "run"]


@dataclasses.dataclass(frozen=True)
class FlatRows:
    """Flat decode in the row layout: ``ragged_attention`` over [prefix pool; suffix]."""
    num_splits: int
    block_k: int
    num_warps: int
    num_stages: int
    two_phase: bool
    path = "flat_rows"


PATH = "flat_rows"
FAMILY = "flat"
PLAN = FlatRows


def flat_splits(s: Shapes, dev) -> int:
    """Key splits toward two (sequence, kv head, split) programs per SM."""
    block_k = tuning(dev).flat_rows_tiling[0]
    return splits_to_fill(s.batch * s.heads_kv, s.prefix_len + s.suffix_len, block_k,
                          two_per_sm(dev))


def unsupported(s: Shapes, dev, interpret: bool) -> str | None:
    return supported(s)


def why_not(s: Shapes, dev, interpret: bool = False) -> str | None:
    why = unsupported(s, dev, interpret)
    if why is None and s.tq == 1 and flat_own.flat_layout(s, planning_part(dev)) == "own":
        why = ("decoding with enough programs or short prefix chunks: the own layout (flat_own) "
               "is faster")
    return why


def build(s: Shapes, dev, interpret: bool) -> FlatRows:
    block_k, num_warps, num_stages = tuning(dev).flat_rows_tiling
    two_phase = large_m_layout(s.batch, s.tq * s.group, s.heads_kv, two_per_sm(dev))
    return FlatRows(num_splits=flat_splits(s, dev), block_k=block_k, num_warps=num_warps,
                    num_stages=num_stages, two_phase=two_phase)


def seconds(s: Shapes, dev, interpret: bool) -> float:
    return cost_model.flat_seconds(s, build(s, dev, interpret).num_splits,
                                   planning_profile(dev))


def run(leaf: FlatRows, q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, lim_p, lim_s,
        *, scale, interpret, prefix_len_g):
    """Every sequence's padded query rows read its prefix (through ``seq_to_prefix``, no copy)
    and its suffix in one launch (plus one XLA merge of the key splits)."""
    b, tq, hq, _ = q.shape
    g, _, hkv, _ = prefix_k.shape
    grp = hq // hkv
    _, r_pad = q_rows_layout(tq, hq, hkv)
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
