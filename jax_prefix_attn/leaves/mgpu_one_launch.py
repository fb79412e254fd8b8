"""Leaf ``mgpu_one_launch``: prefix and suffix tasks interleaved in one Mosaic GPU launch, then
one XLA merge.

Taken in the Mosaic GPU region with an unsplit suffix, ``G`` at least the device's
``one_launch_min_group`` (the suffix tasks spend ``64 / G`` times the useful tensor-core work),
at least ``one_launch_min_ctas`` prefix CTAs and (prefix, suffix, minimum G) in one of its
``one_launch_regions``.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_prefix_attn.leaves import mgpu_two_launch
from jax_prefix_attn.leaves.base import Shapes, describe_regions, supported, tuning
from jax_prefix_attn.leaves.mgpu_prefix import (decode_operands, mgpu_suffix_splits,
                                                mosaic_unsupported, region_why_not)
from pallas_kernels import shared_decode_mgpu
from pallas_kernels._common import cdiv, merge_row_parts, rows_128

__all__ = ["MgpuOneLaunch", "PATH", "FAMILY", "PLAN", "one_launch_region", "unsupported",
           "why_not", "build", "seconds", "run"]


@dataclasses.dataclass(frozen=True)
class MgpuOneLaunch:
    """Prefix and suffix tasks interleaved in one Mosaic GPU launch, then one XLA merge."""
    num_splits: int
    suffix_splits: int
    block_s: int
    suffix_steps: int
    path = "mgpu_one_launch"


PATH = "mgpu_one_launch"
FAMILY = "shared"
PLAN = MgpuOneLaunch


def _kernel_why_not(s: Shapes) -> str | None:
    return shared_decode_mgpu.fused_supported(
        batch=s.batch, heads_q=s.heads_q, heads_kv=s.heads_kv, prefix_len=s.prefix_len,
        suffix_cap=s.suffix_len, head_dim=s.head_dim, dtype=s.dtype, block_s=64)


def one_launch_region(s: Shapes, dev) -> bool:
    """Where the one launch was measured to beat the two launches (given the Mosaic GPU
    region)."""
    t = tuning(dev)
    ctas = s.heads_kv * cdiv(s.batch * s.group, 128)
    return (mgpu_suffix_splits(s, dev) == 1 and s.group >= t.one_launch_min_group
            and _kernel_why_not(s) is None and ctas >= t.one_launch_min_ctas
            and any(p0 <= s.prefix_len <= p1 and s0 <= s.suffix_len <= s1 and s.group >= g_min
                    for (p0, p1), (s0, s1), g_min in t.one_launch_regions))


def unsupported(s: Shapes, dev, interpret: bool) -> str | None:
    return supported(s) or mosaic_unsupported(s, dev, interpret) or _kernel_why_not(s)


def why_not(s: Shapes, dev, interpret: bool = False) -> str | None:
    why = unsupported(s, dev, interpret) or region_why_not(s, dev, interpret)
    if why is None and not one_launch_region(s, dev):
        t = tuning(dev)
        why = (f"outside the one launch's region (unsplit suffix, G >= {t.one_launch_min_group}, "
               f">= {t.one_launch_min_ctas} CTAs, "
               f"{describe_regions(t.one_launch_regions, ('G >=',))})")
    return why


def build(s: Shapes, dev, interpret: bool) -> MgpuOneLaunch:
    """64-key suffix tiles, as many stages (up to 5) as fit; suffix splits so that the suffix
    tasks number at most about one wave, or more where needed to keep each task to at most 8
    tiles per sequence; the prefix unsplit."""
    block_s = 64
    stage = 4 * block_s * s.head_dim * jnp.dtype(s.dtype).itemsize   # k, v of each warpgroup
    steps = max(1, min(5, (dev.smem_per_block - 2 * 64 * s.head_dim * 2 - 8192) // stage))
    ctas = s.heads_kv * cdiv(s.batch * s.group, 128)
    n_tiles = s.suffix_len // block_s
    ss = 1
    for c in range(1, n_tiles + 1):
        if n_tiles % c == 0 and ctas * c <= dev.sm_count:
            ss = c
        if n_tiles % c == 0 and n_tiles // c <= 8 and ctas * c > dev.sm_count:
            ss = c
            break
    return MgpuOneLaunch(num_splits=1, suffix_splits=ss, block_s=block_s, suffix_steps=steps)


def seconds(s: Shapes, dev, interpret: bool) -> float:
    """Charged as the two launches it replaces (:func:`mgpu_two_launch.seconds`)."""
    return mgpu_two_launch.seconds(s, dev, interpret)


def run(leaf: MgpuOneLaunch, q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, lim_p,
        lim_s, *, scale, interpret, prefix_len_g):
    q, pk, pv, p_len = decode_operands(q, prefix_k, prefix_v, lim_p, prefix_len_g)
    b, _, hq, d = q.shape
    hkv = pk.shape[1]
    g = hq // hkv
    qm, _ = rows_128(q, hkv, g)
    o_pre, lse_pre, o_suf, lse_suf = shared_decode_mgpu.shared_decode_partials_mgpu(
        qm, pk, pv, p_len, suffix_k, suffix_v, lim_s[:, 0], scale=scale, group=g,
        num_splits=leaf.num_splits, suffix_splits=leaf.suffix_splits, block_s=leaf.block_s,
        suffix_steps=leaf.suffix_steps, schedule_barrier=True, interpret=interpret,
        _cpu_check=interpret)
    return merge_row_parts([(o_pre, lse_pre, g), (o_suf, lse_suf, g)], b=b, tq=1, hq=hq, r=g,
                           dtype=q.dtype, inv=None)
