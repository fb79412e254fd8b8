"""Tree leaf ``single_level``: every sequence hangs from a root, so the forest is plain
shared-prefix attention with one prefix group per root
(:func:`jax_prefix_attn.tree_paths.single_level_attention`; the roots' spans gathered, a copy of
the shared tokens only).

Not priced: the shared-prefix planner picks its own leaf, and it runs before the tree schedules
wherever it accepts the shapes (GPU only; ``impl="auto"`` chooses it, it is never named).
"""
from __future__ import annotations

import dataclasses

from jax_prefix_attn.leaves.base import (TreeCall, TreeForwards, TreeShapes,
                                         tree_auto_why_not, tree_kernels_supported)

__all__ = ["SingleLevelTiling", "PATH", "FAMILY", "PLAN", "PRICED", "MIRROR", "PREFERENCE",
           "takes", "unsupported", "why_not", "build", "seconds", "run"]


@dataclasses.dataclass(frozen=True)
class SingleLevelTiling:
    """The padded length of the gathered roots."""
    root_pad: int
    path = "single_level"


PATH = "single_level"
FAMILY = "tree"
PLAN = SingleLevelTiling
PRICED = False
MIRROR = False
PREFERENCE = ("every sequence hangs from a root, so shared-prefix attention runs it, before the "
              "tree schedules")


def takes(meta, s: TreeShapes) -> str | None:
    """``None`` when the single-level path takes these shapes: every sequence hangs from a
    root, a suffix axis, and a head_dim and dtype the shared-prefix kernels take."""
    if not meta.single_level:
        return "not every sequence hangs from a root"
    if s.suffix_len <= 0:
        return "no suffix axis"
    return tree_kernels_supported(s)


def unsupported(meta, s: TreeShapes, platform: str, interpret: bool) -> str | None:
    """``None`` when its path runs these shapes (:func:`takes`)."""
    return takes(meta, s)


def why_not(meta, s: TreeShapes, platform: str, interpret: bool) -> str | None:
    """``None`` when ``impl="auto"`` may choose it: on a GPU, without draft token trees, shapes
    its path takes."""
    return tree_auto_why_not(s, platform, takes(meta, s))


def build(meta) -> SingleLevelTiling:
    """The roots' padding."""
    return SingleLevelTiling(root_pad=meta.root_pad)


def seconds(costs) -> None:
    """Not priced (``None``)."""
    return None


def run(plan, call: TreeCall, forwards: TreeForwards):
    """Shared-prefix attention over the gathered roots (its own impl ``"shared"`` in interpret
    mode, else ``"auto"``)."""
    return forwards.single_level(call.q, call.meta, call.k_pool, call.v_pool, call.suffix_k,
                                 call.suffix_v, call.suffix_lengths, scale=call.scale,
                                 shared_impl="shared" if plan.interpret else "auto",
                                 interpret=plan.interpret)
