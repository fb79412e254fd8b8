"""Tree leaf ``hybrid`` (decoding, ``Tq == 1``): at most three launches, the root read by
several sequences through the shared-prefix path's prefix kernel (every sequence's query heads
as the rows of one matrix product), the other shared nodes through the tree kernel, and each
sequence's exclusive node streamed in place by the decode suffix kernel together with its
suffix, which merges everything in its epilogue
(:func:`jax_prefix_attn.tree_paths.hybrid_attention`).

Priced by the tree cost model when the metadata is built (``meta.hybrid``: strictly cheaper
than both tree-kernel schedules, so at equal time those are preferred); kernels only.
"""
from __future__ import annotations

import dataclasses

from jax_prefix_attn.leaves.base import (TreeCall, TreeForwards, TreeShapes, tree_backend,
                                         tree_auto_why_not, tree_kernels_supported)

__all__ = ["HybridTiling", "PATH", "FAMILY", "PLAN", "PRICED", "MIRROR", "PREFERENCE",
           "unsupported_shapes", "unsupported", "why_not", "build", "seconds", "run"]


@dataclasses.dataclass(frozen=True)
class HybridTiling:
    """Whether the root goes through the prefix kernel, and the inner-node launch's mode and
    tiling (``None`` when the metadata has no inner nodes)."""
    root: bool
    mid_mode: str | None = None
    mid_block_rows: int | None = None
    mid_block_kv: int | None = None
    path = "hybrid"


PATH = "hybrid"
FAMILY = "tree"
PLAN = HybridTiling
PRICED = True
MIRROR = False
PREFERENCE = ""


def unsupported_shapes(meta, s: TreeShapes) -> str | None:
    """``None`` when its kernels run these shapes (metadata built for decoding, one query per
    sequence, a head_dim and dtype the kernels take), else why not."""
    if meta.excl_span is None or s.tq != 1:
        return f"it decodes one query per sequence (seq_q == 1), got seq_q={s.tq}"
    return tree_kernels_supported(s)


def unsupported(meta, s: TreeShapes, platform: str, interpret: bool) -> str | None:
    """``None`` when a named ``impl="hybrid"`` runs: the shapes, no draft token tree, and a GPU
    or interpret mode."""
    why = unsupported_shapes(meta, s) or ("it does not take draft_parents" if s.draft else None)
    if why is not None:
        return f"cannot run these inputs: {why}"
    if platform != "gpu" and not interpret:
        return "runs Pallas GPU kernels and needs a GPU; pass interpret=True on the CPU"
    return None


def why_not(meta, s: TreeShapes, platform: str, interpret: bool) -> str | None:
    """``None`` when ``impl="auto"`` may choose it: on a GPU (auto runs kernels only there),
    without draft token trees, shapes its kernels run."""
    return tree_auto_why_not(s, platform, unsupported_shapes(meta, s))


def build(meta) -> HybridTiling:
    """The root flag and the inner-node launch's tiling."""
    mid = meta.mid
    if mid is None:
        return HybridTiling(root=meta.hybrid_root)
    return HybridTiling(root=meta.hybrid_root, mid_mode=mid.mode, mid_block_rows=mid.block_rows,
                        mid_block_kv=mid.block_kv)


def seconds(costs) -> float:
    """The modelled seconds of its launches (``ScheduleCosts.hybrid``; ``inf`` unless
    decoding)."""
    return costs.hybrid


def run(plan, call: TreeCall, forwards: TreeForwards):
    """The hybrid forward, with the tree kernels' backward."""
    return forwards.tree_kernels(call, PATH, tree_backend(plan))
