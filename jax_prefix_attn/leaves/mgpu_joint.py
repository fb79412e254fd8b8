"""Leaf ``mgpu_joint``: one Mosaic GPU pass streaming each CTA's suffix tiles through the prefix
pipeline (no second launch), + one XLA merge when the prefix is split.

Taken in the Mosaic GPU region with (prefix, suffix, G, CTAs) in one of the device's
``joint_regions`` unless the role split (``mgpu_split``) takes the shapes.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_prefix_attn.leaves import mgpu_two_launch
from jax_prefix_attn.leaves.base import Shapes, describe_regions, supported, tuning
from jax_prefix_attn.leaves.mgpu_prefix import (decode_operands, mosaic_unsupported,
                                                region_why_not)
from pallas_kernels import joint_decode_mgpu
from pallas_kernels._common import cdiv, merge_row_parts, rows_128, rows_to_out

__all__ = ["MgpuJoint", "PATH", "FAMILY", "PLAN", "joint_region", "unsupported", "why_not",
           "build", "seconds", "run"]


@dataclasses.dataclass(frozen=True)
class MgpuJoint:
    """One Mosaic GPU pass streaming each CTA's suffix tiles through the prefix pipeline."""
    num_splits: int
    block_kv: int
    block_s: int
    steps: int
    schedule_barrier: bool
    path = "mgpu_joint"


PATH = "mgpu_joint"
FAMILY = "shared"
PLAN = MgpuJoint


def _tiles(s: Shapes, dev) -> tuple[int, int]:
    return joint_decode_mgpu.joint_tiles(s.head_dim, dev.smem_per_block,
                                         jnp.dtype(s.dtype).itemsize, tuning(dev).joint_stages)


def _kernel_why_not(s: Shapes, dev) -> str | None:
    return joint_decode_mgpu.joint_supported(
        batch=s.batch, heads_q=s.heads_q, heads_kv=s.heads_kv, prefix_len=s.prefix_len,
        suffix_cap=s.suffix_len, head_dim=s.head_dim, dtype=s.dtype, block_s=_tiles(s, dev)[1])


def joint_region(s: Shapes, dev) -> bool:
    """Where the one pass was measured to beat the two launches (given the Mosaic GPU region):
    (prefix keys, suffix capacity, minimum G, minimum CTAs before splitting) in one of the
    device's ``joint_regions``."""
    ctas = s.heads_kv * cdiv(s.batch * s.group, 128)
    return (_kernel_why_not(s, dev) is None
            and any(p0 <= s.prefix_len <= p1 and s0 <= s.suffix_len <= s1 and s.group >= g_min
                    and ctas >= c_min
                    for (p0, p1), (s0, s1), g_min, c_min in tuning(dev).joint_regions))


def unsupported(s: Shapes, dev, interpret: bool) -> str | None:
    return supported(s) or mosaic_unsupported(s, dev, interpret) or _kernel_why_not(s, dev)


def why_not(s: Shapes, dev, interpret: bool = False) -> str | None:
    why = unsupported(s, dev, interpret) or region_why_not(s, dev, interpret)
    if why is None and not joint_region(s, dev):
        why = (f"outside the one pass's region "
               f"({describe_regions(tuning(dev).joint_regions, ('G >=', 'CTAs >='))})")
    return why


def build(s: Shapes, dev, interpret: bool) -> MgpuJoint:
    """Prefix splits: the largest power of two up to 16 dividing the tiles with the CTAs
    within one wave; the device's ``joint_stages`` and ``joint_schedule_barrier`` (without
    ping-pong turns a warpgroup's suffix tile does not hold the other at its next turn)."""
    t = tuning(dev)
    block_kv, block_s = _tiles(s, dev)
    ctas = s.heads_kv * cdiv(s.batch * s.group, 128)
    n_tiles = s.prefix_len // block_kv
    splits = 1
    for c in (2, 4, 8, 16):
        if n_tiles % c == 0 and ctas * c <= dev.sm_count:
            splits = c
    return MgpuJoint(num_splits=splits, block_kv=block_kv, block_s=block_s, steps=t.joint_stages,
                     schedule_barrier=t.joint_schedule_barrier)


def seconds(s: Shapes, dev, interpret: bool) -> float:
    """Charged as the two launches it replaces (:func:`mgpu_two_launch.seconds`)."""
    return mgpu_two_launch.seconds(s, dev, interpret)


def run(leaf: MgpuJoint, q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, lim_p, lim_s,
        *, scale, interpret, prefix_len_g):
    """With one prefix split the pass's output is the attention itself (a layout change only),
    else one XLA merge of the splits."""
    q, pk, pv, p_len = decode_operands(q, prefix_k, prefix_v, lim_p, prefix_len_g)
    b, _, hq, d = q.shape
    hkv = pk.shape[1]
    g = hq // hkv
    qm, m = rows_128(q, hkv, g)
    o, lse = joint_decode_mgpu.joint_decode_mgpu(
        qm, pk, pv, p_len, suffix_k, suffix_v, lim_s[:, 0], scale=scale, group=g,
        num_splits=leaf.num_splits, block_kv=leaf.block_kv, block_s=leaf.block_s,
        interpret=interpret, schedule_barrier=leaf.schedule_barrier, steps=leaf.steps,
        _cpu_check=interpret)
    if o.shape[0] == 1:
        return (rows_to_out(o[0, :, :m], b, 1, hq, g).astype(q.dtype),
                rows_to_out(lse[0, :, :m], b, 1, hq, g))
    return merge_row_parts([(o, lse, g)], b=b, tq=1, hq=hq, r=g, dtype=q.dtype, inv=None)
