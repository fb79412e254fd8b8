"""Tree leaf ``nodes`` (the DeFT-Node analogue): every node one item of one tree-kernel launch,
looping over its whole span; the suffix one more launch.

A baseline: bounded by the longest node on unbalanced trees, it is not priced and runs only
when named (``impl="nodes"``); off the GPU it runs its pure-JAX mirror.
"""
from __future__ import annotations

import dataclasses

from jax_prefix_attn.leaves.base import TreeCall, TreeForwards, TreeShapes, tree_backend

__all__ = ["NodesTiling", "PATH", "FAMILY", "PLAN", "PRICED", "MIRROR", "PREFERENCE", "launches",
           "unsupported", "why_not", "build", "seconds", "run"]


@dataclasses.dataclass(frozen=True)
class NodesTiling:
    """Rows per item and tokens per key tile of the metadata's node schedule."""
    block_rows: int
    block_kv: int
    path = "nodes"


PATH = "nodes"
FAMILY = "tree"
PLAN = NodesTiling
PRICED = False
MIRROR = True
PREFERENCE = ""


def launches(meta) -> tuple:
    """The metadata's schedules its tree-kernel launches run: the node schedule."""
    return (meta.nodes,)


def unsupported(meta, s: TreeShapes, platform: str, interpret: bool) -> str | None:
    """``None``: the tree kernel (or its mirror) runs every input."""
    return None


def why_not(meta, s: TreeShapes, platform: str, interpret: bool) -> str | None:
    """Never chosen by ``impl="auto"``: a baseline."""
    return "a baseline, run only when named (impl='nodes')"


def build(meta) -> NodesTiling:
    """The node schedule's tiling."""
    return NodesTiling(block_rows=meta.nodes.block_rows, block_kv=meta.nodes.block_kv)


def seconds(costs) -> None:
    """Not priced (``None``)."""
    return None


def run(plan, call: TreeCall, forwards: TreeForwards):
    """The tree-kernel forward of this schedule, with the tree kernels' backward."""
    return forwards.tree_kernels(call, PATH, tree_backend(plan))
