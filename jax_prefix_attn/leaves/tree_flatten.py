"""Tree leaf ``flatten`` (DeFT-Flatten): one launch of the tree kernel over equal-sized chunks
of the node spans flattened depth-first, each paired with the rows that see it, and a
tree-topology-aware reduction per row; the suffix is one more launch.

Equal-sized items keep every SM busy on unbalanced trees, where a node-granular item is bounded
by its longest node.  Priced by the tree cost model when the metadata is built; off the GPU it
runs its pure-JAX mirror, so it takes every input.
"""
from __future__ import annotations

import dataclasses

from jax_prefix_attn.leaves.base import TreeCall, TreeForwards, TreeShapes, tree_backend

__all__ = ["FlattenTiling", "PATH", "FAMILY", "PLAN", "PRICED", "MIRROR", "PREFERENCE", "launches",
           "unsupported", "why_not", "build", "seconds", "run"]


@dataclasses.dataclass(frozen=True)
class FlattenTiling:
    """Rows per item and tokens per chunk of the metadata's flatten schedule."""
    block_rows: int
    block_kv: int
    path = "flatten"


PATH = "flatten"
FAMILY = "tree"
PLAN = FlattenTiling
PRICED = True
MIRROR = True
PREFERENCE = ""


def launches(meta) -> tuple:
    """The metadata's schedules its tree-kernel launches run: the flatten schedule."""
    return (meta.flatten,)


def unsupported(meta, s: TreeShapes, platform: str, interpret: bool) -> str | None:
    """``None``: the tree kernel (or its mirror) runs every input."""
    return None


def why_not(meta, s: TreeShapes, platform: str, interpret: bool) -> str | None:
    """``None``: ``impl="auto"`` may choose it for every input."""
    return None


def build(meta) -> FlattenTiling:
    """The flatten schedule's tiling."""
    return FlattenTiling(block_rows=meta.flatten.block_rows, block_kv=meta.flatten.block_kv)


def seconds(costs) -> float:
    """The modelled seconds of its launch and reduction (``ScheduleCosts.flatten``)."""
    return costs.flatten


def run(plan, call: TreeCall, forwards: TreeForwards):
    """The tree-kernel forward of this schedule, with the tree kernels' backward."""
    return forwards.tree_kernels(call, PATH, tree_backend(plan))
