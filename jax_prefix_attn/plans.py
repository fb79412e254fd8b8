"""The frozen, hashable plan of a shared-prefix attention call (what the planner decides and the
executor runs).

A :class:`SharedPrefixPlan` names the implementation (``impl``: ``"shared"``, ``"flat"`` or
``"reference"``), the leaf (``path``, see ``docs/dispatch.md``), the query chunks (``Tq * Hq /
Hkv`` rows per sequence fit one row tile of at most 128 rows: one kernel call per chunk of
consecutive query positions) with one leaf plan per chunk, and the backward choice.  Every field
is static: a plan can be a ``jax.jit`` static argument and a ``custom_vjp`` non-differentiable
argument.  The leaf plan dataclasses live in their leaf modules (:mod:`jax_prefix_attn.leaves`)
and are importable from here too.
"""
from __future__ import annotations

import dataclasses

from jax_prefix_attn.leaves.base import PrefixTiling, Shapes, SuffixTiling
from jax_prefix_attn.leaves.flat_own import FlatOwn
from jax_prefix_attn.leaves.flat_rows import FlatRows
from jax_prefix_attn.leaves.mgpu_joint import MgpuJoint
from jax_prefix_attn.leaves.mgpu_one_launch import MgpuOneLaunch
from jax_prefix_attn.leaves.mgpu_split import MgpuSplit
from jax_prefix_attn.leaves.mgpu_two_launch import MgpuTwoLaunch
from jax_prefix_attn.leaves.triton_overlap import TritonOverlap
from jax_prefix_attn.leaves.triton_two_launch import TritonTwoLaunch

__all__ = ["Shapes", "PrefixTiling", "SuffixTiling", "FlatOwn", "FlatRows", "TritonTwoLaunch",
           "TritonOverlap", "MgpuTwoLaunch", "MgpuOneLaunch", "MgpuJoint", "MgpuSplit",
           "Reference", "ChunkPlan", "BackwardPlan", "SharedPrefixPlan"]

_frozen = dataclasses.dataclass(frozen=True)


@_frozen
class Reference:
    """The pure-JAX decomposition (no kernel)."""
    path = "reference"


@_frozen
class ChunkPlan:
    """Query positions ``[start, stop)`` run by ``leaf`` (a leaf plan)."""
    start: int
    stop: int
    leaf: object


@_frozen
class BackwardPlan:
    """``mode="kernels"``: the Triton flash backward kernels with the merged statistics (prefix
    kernel key / row splits, suffix kernel key splits); ``"mgpu"``: the Mosaic GPU flash
    backward kernels (:mod:`jax_prefix_attn.mgpu_grads`; the splits unused); ``"reference"``:
    autodiff of the reference."""
    mode: str = "kernels"
    prefix_key_splits: int = 1
    prefix_row_splits: int = 1
    suffix_key_splits: int = 1


@_frozen
class SharedPrefixPlan:
    """A complete plan: ``impl`` (``"shared"``, ``"flat"``, ``"reference"``), ``path`` (the
    leaf), the shapes it was made for, its query chunks, the backward and interpret mode, and
    ``reason``: why the planner took this leaf, in one line (with a note where the device has
    no measured profile and the cost model used the nearest one)."""
    impl: str
    path: str
    shapes: Shapes
    chunks: tuple
    backward: BackwardPlan
    interpret: bool = False
    reason: str = ""
