"""The leaves' regions, tilings and split rules under one name, for the benchmarks and kernel
tests that evaluate them (each is defined in its leaf module of :mod:`jax_prefix_attn.leaves`).

The device facts come from a :class:`~jax_prefix_attn.device.DeviceInfo`: ``sm_count`` sizes
the grids (two programs per SM fill the GPU), ``smem_per_block`` bounds the Mosaic GPU kernels'
pipelines; the tuned regions and tilings are those of its profile (:func:`tuning`,
:func:`decode_suffix_tiling`, :func:`flat_tilings`).  The measurements behind each region and
tiling are in ``docs/performance.md`` ("Planner regions and tilings").
"""
from __future__ import annotations

from jax_prefix_attn.leaves.base import (decode_suffix_tiling, query_chunks, suffix_splits,
                                         tuning)
from jax_prefix_attn.leaves.flat_own import (busy_splits, flat_layout, flat_own_leaf,
                                             flat_own_tiling, flat_tilings)
from jax_prefix_attn.leaves.flat_rows import flat_splits
from jax_prefix_attn.leaves.mgpu_joint import joint_region
from jax_prefix_attn.leaves.mgpu_one_launch import one_launch_region
from jax_prefix_attn.leaves.mgpu_prefix import (choose_splits, even_enough, mgpu_splits,
                                                mosaic_region)
from jax_prefix_attn.leaves.mgpu_split import plan_roles, split_region
from jax_prefix_attn.leaves.triton_prefix import large_m_layout, prefix_tiling

__all__ = ["tuning", "decode_suffix_tiling", "query_chunks", "suffix_splits", "busy_splits",
           "flat_layout", "flat_own_leaf", "flat_own_tiling", "flat_tilings", "flat_splits",
           "joint_region", "one_launch_region", "choose_splits", "even_enough", "mgpu_splits",
           "mosaic_region", "plan_roles", "split_region", "large_m_layout", "prefix_tiling"]
