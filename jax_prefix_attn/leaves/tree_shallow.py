"""Tree leaf ``shallow`` (decoding, ``Tq == 1``, ``meta.shallow_pad > 0``): the roots through
shared-prefix attention with each sequence's few path tokens below its root gathered into a
per-sequence suffix, then the decode suffix kernel over the real suffix merging that state in
its epilogue (:func:`jax_prefix_attn.tree_paths.shallow_attention`).

Not priced: on speculative trees it measured faster than the tree schedules and the hybrid
schedule at most sizes (``docs/performance.md``, "Kernel design measurements"), so it runs
before them wherever it accepts the shapes (GPU only; ``impl="auto"`` chooses it).
"""
from __future__ import annotations

import dataclasses

from jax_prefix_attn.leaves.base import (TreeCall, TreeForwards, TreeShapes,
                                         tree_auto_why_not, tree_kernels_supported)

__all__ = ["ShallowTiling", "PATH", "FAMILY", "PLAN", "PRICED", "MIRROR", "PREFERENCE", "takes",
           "unsupported", "why_not", "build", "seconds", "run"]


@dataclasses.dataclass(frozen=True)
class ShallowTiling:
    """The padded lengths of the gathered roots and of each sequence's tokens below its root."""
    root_pad: int
    shallow_pad: int
    path = "shallow"


PATH = "shallow"
FAMILY = "tree"
PLAN = ShallowTiling
PRICED = False
MIRROR = False
PREFERENCE = ("decoding a shallow forest, the shallow path measured faster than the tree "
              "schedules and hybrid")


def takes(meta, s: TreeShapes) -> str | None:
    """``None`` when the shallow path takes these shapes: decoding a shallow forest
    (``meta.shallow_pad > 0``) with a head_dim and dtype the shared-prefix kernels take."""
    if meta.shallow_pad <= 0:
        return "the forest is not shallow (meta.shallow_pad == 0)"
    if meta.tq != 1 or s.tq != 1:
        return f"it decodes one query per sequence (seq_q == 1), got seq_q={s.tq}"
    return tree_kernels_supported(s)


def unsupported(meta, s: TreeShapes, platform: str, interpret: bool) -> str | None:
    """``None`` when its path runs these shapes (:func:`takes`)."""
    return takes(meta, s)


def why_not(meta, s: TreeShapes, platform: str, interpret: bool) -> str | None:
    """``None`` when ``impl="auto"`` may choose it: on a GPU, without draft token trees, shapes
    its path takes."""
    return tree_auto_why_not(s, platform, takes(meta, s))


def build(meta) -> ShallowTiling:
    """The roots' and the per-sequence tokens' paddings."""
    return ShallowTiling(root_pad=meta.root_pad, shallow_pad=meta.shallow_pad)


def seconds(costs) -> None:
    """Not priced (``None``)."""
    return None


def run(plan, call: TreeCall, forwards: TreeForwards):
    """The shallow path (its shared-prefix call's impl ``"shared"`` in interpret mode, else
    ``"auto"``)."""
    return forwards.shallow(call.q, call.meta, call.k_pool, call.v_pool, call.suffix_k,
                            call.suffix_v, call.suffix_lengths, scale=call.scale,
                            shared_impl="shared" if plan.interpret else "auto",
                            interpret=plan.interpret)
