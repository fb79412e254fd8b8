"""The leaves' regions, tilings and split rules under one name, for the benchmarks and kernel
tests that evaluate them (each is defined in its leaf module of :mod:`jax_prefix_attn.leaves`).

The device facts come from a :class:`~jax_prefix_attn.device.DeviceInfo`: ``sm_count`` sizes
the grids (two programs per SM fill the GPU), ``smem_per_block`` bounds the Mosaic GPU kernels'
pipelines.  The measurements behind each region and tiling are in ``docs/performance.md``
("Planner regions and tilings").
"""
from __future__ import annotations

from jax_prefix_attn.leaves.base import DECODE_SUFFIX, query_chunks, suffix_splits
from jax_prefix_attn.leaves.flat_own import (FLAT_OWN_MAX_CHUNK, FLAT_OWN_MAX_SPLITS,
                                             FLAT_OWN_MIN_SPLIT_KEYS, FLAT_TILES, busy_splits,
                                             flat_layout, flat_own_leaf, flat_own_tiling)
from jax_prefix_attn.leaves.flat_rows import flat_splits
from jax_prefix_attn.leaves.mgpu_joint import joint_region
from jax_prefix_attn.leaves.mgpu_one_launch import one_launch_region
from jax_prefix_attn.leaves.mgpu_prefix import (choose_splits, even_enough, mgpu_splits,
                                                mosaic_region)
from jax_prefix_attn.leaves.mgpu_split import plan_roles, split_region
from jax_prefix_attn.leaves.triton_prefix import LARGE_M_TILING, large_m_layout, prefix_tiling

__all__ = ["DECODE_SUFFIX", "query_chunks", "suffix_splits", "FLAT_OWN_MAX_CHUNK",
           "FLAT_OWN_MAX_SPLITS", "FLAT_OWN_MIN_SPLIT_KEYS", "FLAT_TILES", "busy_splits",
           "flat_layout", "flat_own_leaf", "flat_own_tiling", "flat_splits", "joint_region",
           "one_launch_region", "choose_splits", "even_enough", "mgpu_splits", "mosaic_region",
           "plan_roles", "split_region", "LARGE_M_TILING", "large_m_layout", "prefix_tiling"]
