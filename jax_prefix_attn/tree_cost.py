"""Cost model of tree attention's schedules: estimated seconds of a launch on an H100/H200
class GPU, used when the metadata is built to pick the flatten or level-wise schedule and to
decide whether the hybrid decode schedule pays.  Only the ratios of the rates matter for these
choices.

``time = launch + max(bytes / HBM, flops / rate, waves * program, longest item / SM rate)``
+ partial-state traffic: KV bytes streamed (every item re-reads its KV), ``4 * D`` flops per
(query vector, token), program waves over the SMs, and the longest single item, which bounds
the critical path (what node-granular schedules lose on unbalanced trees, DeFT section 3.3).
"""
from __future__ import annotations

import types

from jax_prefix_attn.tree_schedule import Schedule

__all__ = ["COST_MODEL", "schedule_cost", "root_launch_cost", "exclusive_spans_cost"]

COST_MODEL = types.MappingProxyType({
    "hbm_bytes_per_s": 3.0e12,
    "sm_bytes_per_s": 6.0e10,  # what one program streams alone (a long node read by one SM)
    "flops_per_s": 2.5e14,   # Pallas/Triton attention matmul rate
    "launch_s": 4e-6,        # per kernel launch
    "program_s": 1.5e-6,     # fixed cost of one program (scheduling, q load, partial store)
    "prefix_flops_per_s": 4.5e14,  # shared-prefix kernel on a Hopper GPU (Mosaic GPU)
})

# Shapes the costs are estimated at (Llama-3-8B heads, 16-bit KV): the choices depend on the
# tree, not on these, as long as every schedule is costed at the same ones.
HEADS_KV, HEAD_DIM, KV_BYTES = 8, 128, 2


def schedule_cost(sched: Schedule, *, group: int, sm_count: int, head_dim: int = HEAD_DIM,
                  heads_kv: int = HEADS_KV, kv_bytes: int = KV_BYTES) -> float:
    """Estimated seconds of one schedule's kernel plus its share of the reduction (module doc);
    flatten items read ``block_kv`` chunks, node items their whole span; ``sm_count`` programs
    run at once (one per SM at these tile sizes)."""
    cm = COST_MODEL
    s = dict(sched.stats)
    if s.get("items", 0) == 0:
        return 0.0
    m = sched.block_rows * group
    kv_bytes_read = s["kv_tokens_read"] * heads_kv * head_dim * 2 * kv_bytes
    flops = s["kv_tokens_read"] * heads_kv * m * head_dim * 4
    programs = s["items"] * heads_kv
    waves = -(-programs // sm_count)
    longest = s["max_item_tokens"] * head_dim * 2 * kv_bytes / cm["sm_bytes_per_s"]
    partial_bytes = s["partial_rows"] * heads_kv * group * (head_dim * kv_bytes + 4) * 2  # write + read
    return (cm["launch_s"] + max(kv_bytes_read / cm["hbm_bytes_per_s"], flops / cm["flops_per_s"],
                                 waves * cm["program_s"], longest)
            + partial_bytes / cm["hbm_bytes_per_s"])


def root_launch_cost(root_len: int, num_seqs: int, group: int) -> float:
    """Estimated seconds of the shared-prefix kernel over one root read by ``num_seqs`` sequences
    (every sequence's query heads as the rows of one matrix product per kv head)."""
    cm = COST_MODEL
    tok_bytes = HEAD_DIM * 2 * KV_BYTES                     # K+V of one token, one kv head
    return cm["launch_s"] + max(root_len * HEADS_KV * tok_bytes / cm["hbm_bytes_per_s"],
                                4.0 * num_seqs * group * HEADS_KV * root_len * HEAD_DIM / cm["prefix_flops_per_s"])


def exclusive_spans_cost(total_tokens: int, longest: int) -> float:
    """Estimated extra seconds of streaming each sequence's exclusive span in the decode suffix
    launch (one program per (sequence, kv head), unsplit): their bytes, or the longest span
    streamed by one program when there are few sequences."""
    cm = COST_MODEL
    tok_bytes = HEAD_DIM * 2 * KV_BYTES
    return max(total_tokens * HEADS_KV * tok_bytes / cm["hbm_bytes_per_s"], longest * tok_bytes / cm["sm_bytes_per_s"])
