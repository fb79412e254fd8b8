"""Leaf ``mgpu_two_launch``: the Mosaic GPU prefix kernel and the own-layout suffix kernel
(independent launches), then one XLA merge.

The shared family's leaf in the Mosaic GPU region (:mod:`jax_prefix_attn.leaves.mgpu_prefix`)
where no one-launch Mosaic GPU leaf takes the shapes: its wgmma + TMA prefix kernel outruns the
Triton one there.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_prefix_attn import cost_model
from jax_prefix_attn.device_profile import planning_profile
from jax_prefix_attn.leaves.base import Shapes, SuffixTiling, decode_suffix_tiling, supported
from jax_prefix_attn.leaves.mgpu_prefix import (decode_operands, mgpu_prefix_partials,
                                                mgpu_splits, mgpu_suffix_splits,
                                                mosaic_unsupported, region_why_not)
from pallas_kernels._common import merge_row_parts, next_pow2
from pallas_kernels.suffix_attention import suffix_decode_merge

__all__ = ["MgpuTwoLaunch", "PATH", "FAMILY", "PLAN", "unsupported", "why_not", "build",
           "seconds", "run"]


@dataclasses.dataclass(frozen=True)
class MgpuTwoLaunch:
    """Mosaic GPU prefix kernel and the own-layout suffix kernel (independent launches), then
    one XLA merge."""
    num_splits: int
    suffix_splits: int
    suffix: SuffixTiling
    path = "mgpu_two_launch"


PATH = "mgpu_two_launch"
FAMILY = "shared"
PLAN = MgpuTwoLaunch


def unsupported(s: Shapes, dev, interpret: bool) -> str | None:
    return supported(s) or mosaic_unsupported(s, dev, interpret)


def why_not(s: Shapes, dev, interpret: bool = False) -> str | None:
    return unsupported(s, dev, interpret) or region_why_not(s, dev, interpret)


def build(s: Shapes, dev, interpret: bool) -> MgpuTwoLaunch:
    return MgpuTwoLaunch(num_splits=mgpu_splits(s, dev), suffix_splits=mgpu_suffix_splits(s, dev),
                         suffix=decode_suffix_tiling(dev))


def seconds(s: Shapes, dev, interpret: bool) -> float:
    """The modelled seconds of this leaf's plan; the one-launch Mosaic GPU leaves are charged
    the same (an overestimate where they run)."""
    leaf = build(s, dev, interpret)
    return cost_model.mgpu_two_launch_seconds(s, leaf.num_splits, leaf.suffix_splits,
                                              planning_profile(dev))


def run(leaf: MgpuTwoLaunch, q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, lim_p,
        lim_s, *, scale, interpret, prefix_len_g):
    """The prefix kernel, and the own-layout suffix kernel without incoming states (it does not
    wait for the prefix partials; its keys cut into ``leaf.suffix_splits`` chunks), then one XLA
    merge."""
    q, pk, pv, p_len = decode_operands(q, prefix_k, prefix_v, lim_p, prefix_len_g)
    b, _, hq, d = q.shape
    hkv = pk.shape[1]
    r = hq // hkv
    r2 = next_pow2(r)
    o_pre, lse_pre = mgpu_prefix_partials(q[:, 0], pk, pv, p_len, scale=scale,
                                          num_splits=leaf.num_splits, interpret=interpret)
    n = leaf.suffix_splits
    t = leaf.suffix
    o_s, lse_s = suffix_decode_merge(q[:, 0], suffix_k, suffix_v, lim_s[:, 0], None, scale=scale,
                                     num_splits=n, interpret=interpret, block_k=t.block_k,
                                     num_warps=t.num_warps, num_stages=t.num_stages)
    # the suffix states [n, B, Hq(, D)] in the partials' row layout [n, Hkv, B * G(, D)]
    o_s = jnp.swapaxes(o_s.reshape(n, b, hkv, r, d), 1, 2).reshape(n, hkv, b * r, d)
    lse_s = jnp.swapaxes(lse_s.reshape(n, b, hkv, r), 1, 2).reshape(n, hkv, b * r)
    return merge_row_parts([(o_pre, lse_pre, r2), (o_s, lse_s, r)], b=b, tq=1, hq=hq, r=r,
                           dtype=q.dtype, inv=None)
