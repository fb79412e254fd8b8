"""Tree leaf ``levelwise`` (Hydragen section 3.3): one tree-kernel launch per tree depth, an
item being (node, block of the rows of every sequence below it) looping over the node's span;
the partials merged along each path, the suffix one more launch.

Fewer, longer items than ``flatten``: it pays where the nodes of a depth are balanced.  Priced by
the tree cost model (the sum of its launches) when the metadata is built; preferred to
``flatten`` at equal modelled time; off the GPU it runs its pure-JAX mirror.
"""
from __future__ import annotations

import dataclasses

from jax_prefix_attn.leaves.base import TreeCall, TreeForwards, TreeShapes, tree_backend

__all__ = ["LevelwiseTiling", "PATH", "FAMILY", "PLAN", "PRICED", "MIRROR", "PREFERENCE", "launches",
           "unsupported", "why_not", "build", "seconds", "run"]


@dataclasses.dataclass(frozen=True)
class LevelwiseTiling:
    """Rows per item and tokens per key tile of each depth's launch."""
    block_rows: tuple
    block_kv: tuple
    path = "levelwise"


PATH = "levelwise"
FAMILY = "tree"
PLAN = LevelwiseTiling
PRICED = True
MIRROR = True
PREFERENCE = ""


def launches(meta) -> tuple:
    """The metadata's schedules its tree-kernel launches run: one node schedule per depth."""
    return tuple(meta.levels)


def unsupported(meta, s: TreeShapes, platform: str, interpret: bool) -> str | None:
    """``None``: the tree kernel (or its mirror) runs every input."""
    return None


def why_not(meta, s: TreeShapes, platform: str, interpret: bool) -> str | None:
    """``None``: ``impl="auto"`` may choose it for every input."""
    return None


def build(meta) -> LevelwiseTiling:
    """The tiling of each depth's launch."""
    return LevelwiseTiling(block_rows=tuple(lv.block_rows for lv in meta.levels),
                           block_kv=tuple(lv.block_kv for lv in meta.levels))


def seconds(costs) -> float:
    """The modelled seconds of its launches (``ScheduleCosts.levelwise``)."""
    return costs.levelwise


def run(plan, call: TreeCall, forwards: TreeForwards):
    """The tree-kernel forward of this schedule, with the tree kernels' backward."""
    return forwards.tree_kernels(call, PATH, tree_backend(plan))
