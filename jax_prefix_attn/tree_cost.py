"""Cost model of tree attention's schedules: estimated seconds of a launch, used when the
metadata is built to pick the flatten or level-wise schedule and to decide whether the hybrid
decode schedule pays.  Only the ratios of the rates matter for these choices.

``time = launch + max(bytes / HBM, flops / rate, waves * program, longest item / SM rate)``
+ partial-state traffic: KV bytes streamed (every item re-reads its KV), ``4 * D`` flops per
(query vector, token), program waves over the SMs, and the longest single item, which bounds
the critical path (what node-granular schedules lose on unbalanced trees, DeFT section 3.3).

The rates are the device profile's ``tree_*`` fields
(:class:`jax_prefix_attn.device_profile.DeviceProfile`; ``profile=None``: the planning device's,
:func:`jax_prefix_attn.device_profile.default_profile`).  The costs are estimated at the shapes
``heads_kv``, ``head_dim`` and ``kv_bytes`` (by default Llama-3-8B's heads and 16-bit KV): the
choices depend on the tree, not on these, as long as every schedule is costed at the same ones.
"""
from __future__ import annotations

from jax_prefix_attn.device_profile import DeviceProfile, default_profile
from jax_prefix_attn.tree_schedule import Schedule

__all__ = ["schedule_cost", "root_launch_cost", "exclusive_spans_cost"]


def schedule_cost(sched: Schedule, *, group: int, sm_count: int, head_dim: int = 128,
                  heads_kv: int = 8, kv_bytes: int = 2,
                  profile: DeviceProfile | None = None) -> float:
    """Estimated seconds of one schedule's kernel plus its share of the reduction (module doc);
    flatten items read ``block_kv`` chunks, node items their whole span; ``sm_count`` programs
    run at once (one per SM at these tile sizes)."""
    p = default_profile() if profile is None else profile
    s = dict(sched.stats)
    if s.get("items", 0) == 0:
        return 0.0
    m = sched.block_rows * group
    kv_bytes_read = s["kv_tokens_read"] * heads_kv * head_dim * 2 * kv_bytes
    flops = s["kv_tokens_read"] * heads_kv * m * head_dim * 4
    programs = s["items"] * heads_kv
    waves = -(-programs // sm_count)
    longest = s["max_item_tokens"] * head_dim * 2 * kv_bytes / p.tree_program_bytes_per_s
    # (written, then read)
    partial_bytes = s["partial_rows"] * heads_kv * group * (head_dim * kv_bytes + 4) * 2
    return (p.tree_launch_s + max(kv_bytes_read / p.tree_copy_bytes_per_s,
                                  flops / p.tree_flops_per_s, waves * p.tree_program_s, longest)
            + partial_bytes / p.tree_copy_bytes_per_s)


def root_launch_cost(root_len: int, num_seqs: int, group: int, *, head_dim: int = 128,
                     heads_kv: int = 8, kv_bytes: int = 2,
                     profile: DeviceProfile | None = None) -> float:
    """Estimated seconds of the shared-prefix kernel over one root read by ``num_seqs`` sequences
    (every sequence's query heads as the rows of one matrix product per kv head)."""
    p = default_profile() if profile is None else profile
    tok_bytes = head_dim * 2 * kv_bytes                     # K+V of one token, one kv head
    return p.tree_launch_s + max(root_len * heads_kv * tok_bytes / p.tree_copy_bytes_per_s,
                                 4.0 * num_seqs * group * heads_kv * root_len * head_dim
                                 / p.tree_prefix_flops_per_s)


def exclusive_spans_cost(total_tokens: int, longest: int, *, head_dim: int = 128,
                         heads_kv: int = 8, kv_bytes: int = 2,
                         profile: DeviceProfile | None = None) -> float:
    """Estimated extra seconds of streaming each sequence's exclusive span in the decode suffix
    launch (one program per (sequence, kv head), unsplit): their bytes, or the longest span
    streamed by one program when there are few sequences."""
    p = default_profile() if profile is None else profile
    tok_bytes = head_dim * 2 * kv_bytes
    return max(total_tokens * heads_kv * tok_bytes / p.tree_copy_bytes_per_s,
               longest * tok_bytes / p.tree_program_bytes_per_s)
