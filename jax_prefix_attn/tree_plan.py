"""Planner of tree attention: static tree metadata + query shapes + platform -> a frozen
:class:`TreePlan`.

The schedules are the tree family's leaves, one module each under
:mod:`jax_prefix_attn.leaves` (``tree_single_level``, ``tree_shallow``, ``tree_levelwise``,
``tree_flatten``, ``tree_hybrid``, ``tree_nodes``; the protocol is
:class:`jax_prefix_attn.leaves.base.TreeLeaf`), kept in the ordered registry
:data:`TREE_LEAVES`.  The tree cost model (:mod:`jax_prefix_attn.tree_cost`) prices the
flatten, level-wise and hybrid schedules when the metadata is built; :func:`choose_schedules`
ranks those leaves by their ``seconds`` (ties to the earlier in the registry) into the
metadata's static ``preferred`` and ``hybrid``, which device metadata keeps when it drops the
times.  :func:`plan_tree_attention` then takes the leaves whose ``why_not`` is ``None`` for the
metadata and shapes: the first unpriced one (each measured to win wherever it accepts the
shapes) if any, else the cheapest by that ranking.  Every input is static: a jitted caller never
sees a stale choice.  ``docs/dispatch.md`` ("Dispatch of tree_attention") lists the order.
"""
from __future__ import annotations

import dataclasses
import math
import types

import jax.numpy as jnp

from jax_prefix_attn.device import device_info
from jax_prefix_attn.leaves import (tree_flatten, tree_hybrid, tree_levelwise, tree_nodes,
                                    tree_shallow, tree_single_level)
from jax_prefix_attn.leaves.base import TreeShapes, tiling_pairs

__all__ = ["TreePlan", "ScheduleCosts", "plan_tree_attention", "choose_schedules", "default_platform",
           "single_level_takes", "shallow_takes", "hybrid_unsupported_shapes", "TREE_IMPLS", "SCHEDULES",
           "PLATFORMS", "TREE_LEAVES", "tree_leaf", "tree_shapes", "tree_candidates", "cost_ranking"]

TREE_IMPLS = ("auto", "levelwise", "flatten", "hybrid", "nodes", "reference")
SCHEDULES = ("single_level", "shallow", "hybrid", "levelwise", "flatten", "nodes", "reference")
PLATFORMS = ("gpu", "cpu")

# The registry of tree schedules, in order of preference: the unpriced leaves that win wherever
# they accept the shapes first (single_level before shallow), then the priced ones in the order
# that breaks ties of modelled time (level-wise, then flatten, then hybrid: the hybrid schedule
# is chosen only when strictly cheaper than both), then the baseline run only when named.
TREE_LEAVES = (tree_single_level, tree_shallow, tree_levelwise, tree_flatten, tree_hybrid,
               tree_nodes)
_BY_SCHEDULE = types.MappingProxyType({leaf.PATH: leaf for leaf in TREE_LEAVES})

_frozen = dataclasses.dataclass(frozen=True)


@_frozen
class ScheduleCosts:
    """Modelled seconds (:mod:`jax_prefix_attn.tree_cost`) of the schedules the cost model
    compares: ``flatten``, ``levelwise`` (the sum of its launches) and ``hybrid`` (``inf`` where
    the metadata has no hybrid schedule: ``tq > 1``)."""
    flatten: float
    levelwise: float
    hybrid: float = math.inf

    def text(self) -> str:
        """``"flatten 12.0 us, levelwise 15.0 us, hybrid 9.0 us"`` (hybrid only when priced)."""
        named = [("flatten", self.flatten), ("levelwise", self.levelwise), ("hybrid", self.hybrid)]
        return ", ".join(f"{n} {c * 1e6:.1f} us" for n, c in named if math.isfinite(c))


def tree_leaf(schedule: str):
    """The registered tree leaf module of ``schedule`` (a :class:`TreePlan`'s ``schedule``)."""
    return _BY_SCHEDULE[schedule]


def _cheapest(leaves: tuple, costs: ScheduleCosts):
    """The leaf of least ``seconds(costs)``, ties to the earlier."""
    best = leaves[0]
    for leaf in leaves[1:]:
        if leaf.seconds(costs) < best.seconds(costs):
            best = leaf
    return best


def choose_schedules(costs: ScheduleCosts) -> tuple:
    """``(preferred, hybrid)``: the priced leaf with a pure-JAX mirror of least modelled time
    (``"flatten"`` only when strictly cheaper than ``"levelwise"``, which comes first in
    :data:`TREE_LEAVES`), and whether the cheapest priced leaf is one without a mirror (the
    hybrid schedule, strictly cheaper than both)."""
    priced = tuple(leaf for leaf in TREE_LEAVES if leaf.PRICED)
    preferred = _cheapest(tuple(leaf for leaf in priced if leaf.MIRROR), costs)
    return preferred.PATH, bool(not _cheapest(priced, costs).MIRROR)


def cost_ranking(meta) -> tuple:
    """The priced leaves from the cheapest, as the metadata's static choices record them:
    ``meta.preferred`` first of those with a mirror, and those without (the hybrid schedule)
    ahead of them when ``meta.hybrid`` (strictly cheaper), else after them.  Device metadata
    keeps these choices but not the times."""
    mirrors = tuple(leaf for leaf in TREE_LEAVES if leaf.PRICED and leaf.MIRROR)
    mirrors = tuple(sorted(mirrors, key=lambda leaf: leaf.PATH != meta.preferred))
    others = tuple(leaf for leaf in TREE_LEAVES if leaf.PRICED and not leaf.MIRROR)
    return others + mirrors if meta.hybrid else mirrors + others


@_frozen
class TreePlan:
    """What one :func:`jax_prefix_attn.tree_attention` call runs.

    ``schedule``: one of :data:`SCHEDULES`; ``platform``: ``"gpu"`` (Pallas kernels) or
    ``"cpu"`` (the pure-JAX mirror of the schedule unless ``interpret``); ``interpret``: the
    kernels run in interpret mode; ``tiling``: ``(name, value)`` pairs of the metadata's static
    choices the schedule runs with (row blocks, key tiles, paddings); ``costs``: the cost model's
    times where the metadata carries them (host metadata; device metadata drops them, as it does
    every host-only number, so that trees of one bucket share a compilation); ``reason``: why,
    naming the competitors and their modelled times."""
    schedule: str
    platform: str
    interpret: bool
    reason: str
    tiling: tuple = ()
    costs: ScheduleCosts | None = None


def default_platform() -> str:
    """``"gpu"`` when the default device (:func:`jax_prefix_attn.device.device_info`) is a GPU,
    else ``"cpu"``: where tree attention runs when ``platform`` is not given."""
    return "gpu" if device_info().platform == "gpu" else "cpu"


def tree_shapes(q_shape, dtype, suffix_len: int, draft: bool) -> TreeShapes:
    """The :class:`~jax_prefix_attn.leaves.base.TreeShapes` of ``q [B, Tq, Hq, D]``."""
    b, tq, hq, d = (int(x) for x in q_shape)
    return TreeShapes(b, tq, hq, d, jnp.dtype(dtype).name, int(suffix_len), bool(draft))


def single_level_takes(meta, q_shape, dtype, suffix_len: int) -> bool:
    """Whether the single-level path takes these shapes: every sequence hangs from a root, a
    suffix axis, and shapes the shared-prefix kernels take."""
    return tree_single_level.takes(meta, tree_shapes(q_shape, dtype, suffix_len, False)) is None


def shallow_takes(meta, q_shape, dtype) -> bool:
    """Whether the shallow path takes these shapes: decoding a shallow forest
    (``meta.shallow_pad > 0``) with shapes the shared-prefix kernels take."""
    return tree_shallow.takes(meta, tree_shapes(q_shape, dtype, 0, False)) is None


def hybrid_unsupported_shapes(meta, q_shape, dtype) -> str | None:
    """``None`` when the hybrid schedule can run these shapes, else why not."""
    return tree_hybrid.unsupported_shapes(meta, tree_shapes(q_shape, dtype, 0, False))


def tree_candidates(meta, s: TreeShapes, platform: str, interpret: bool = False) -> tuple:
    """The registered tree leaves whose ``why_not`` is ``None`` for ``meta`` and shapes ``s`` on
    ``platform``, in registry order."""
    return tuple(leaf for leaf in TREE_LEAVES if leaf.why_not(meta, s, platform, interpret) is None)


def _auto(meta, s: TreeShapes, platform: str, interpret: bool, times: str) -> tuple:
    """``(leaf, reason)`` of ``impl="auto"``: the first candidate if the cost model does not
    price it, else the cheapest candidate by :func:`cost_ranking`."""
    found = tree_candidates(meta, s, platform, interpret)
    if not found:   # levelwise and flatten accept every input (tests/jax_prefix_attn)
        raise AssertionError(f"no tree leaf accepts {s} on {platform}")
    if not found[0].PRICED:
        return found[0], f"{found[0].PATH}: {found[0].PREFERENCE} ({times})"
    ranking = cost_ranking(meta)
    leaf = next(leaf for leaf in ranking if leaf in found)
    if platform != "gpu":
        return leaf, (f"{leaf.PATH}: impl='auto' on {platform} runs the pure-JAX mirror of the schedule "
                      f"of least modelled time ({times})")
    if s.draft:
        return leaf, (f"{leaf.PATH}: draft_parents given (only the tree-kernel schedules take draft "
                      f"token trees); least modelled time ({times})")
    refused = ranking[:ranking.index(leaf)]
    note = "".join(f"; {r.PATH}, the cheapest, cannot run: {r.why_not(meta, s, platform, interpret)}"
                   for r in refused)
    return leaf, f"{leaf.PATH}: least modelled time ({times}){note}"


def plan_tree_attention(meta, *, q_shape, dtype, suffix_len: int, draft: bool = False, impl: str = "auto",
                        platform: str | None = None, interpret: bool = False) -> TreePlan:
    """Plan :func:`jax_prefix_attn.tree_attention` for a
    :class:`~jax_prefix_attn.tree_metadata.TreeMetadata` built for these shapes.

    ``q_shape``: ``(B, Tq, Hq, D)`` of the kernels' queries (group and head_dim padded as
    ``tree_attention`` pads them), ``dtype`` q's dtype, ``suffix_len`` the suffix capacity,
    ``draft``: ``draft_parents`` is given.  ``impl="auto"``: the registered leaves whose
    ``why_not`` is ``None`` compete; the first if unpriced, else the cheapest by the metadata's
    ranking.  So off the GPU, or with draft token trees, the metadata's ``preferred``; on the
    GPU, in order: a single-level forest with a suffix axis goes to the shared-prefix path; when
    decoding, a shallow forest to the shallow path (on speculative trees the hybrid schedule
    measured slower at most sizes: ``docs/performance.md``), else the hybrid schedule where the
    cost model prefers it (``meta.hybrid``); then ``meta.preferred``.  Auto runs kernels only on
    a GPU, so off it ``interpret`` is dropped.  A named ``impl`` is forced; a leaf whose
    ``unsupported`` says why (``"hybrid"`` where it cannot run) raises ``ValueError``.
    """
    if impl not in TREE_IMPLS:
        raise ValueError(f"impl must be one of {TREE_IMPLS}, got {impl!r}")
    platform = platform or default_platform()
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be None or one of {PLATFORMS}, got {platform!r}")
    costs = getattr(meta, "costs", None)
    times = costs.text() if costs is not None else (
        f"flatten and levelwise priced when the metadata was built, preferred={meta.preferred}, "
        f"hybrid={meta.hybrid}; device metadata does not carry the times")
    s = tree_shapes(q_shape, dtype, suffix_len, draft)
    if impl == "auto":
        interpret = interpret and platform == "gpu"
        leaf, reason = _auto(meta, s, platform, interpret, times)
    else:
        leaf = None if impl == "reference" else tree_leaf(impl)
        why = None if leaf is None else leaf.unsupported(meta, s, platform, interpret)
        if why is not None:
            raise ValueError(f"impl={impl!r} {why}")
        reason = f"impl={impl!r} forced ({times})"
    return TreePlan(schedule=impl if leaf is None else leaf.PATH, platform=platform,
                    interpret=bool(interpret), reason=reason,
                    tiling=() if leaf is None else tiling_pairs(leaf.build(meta)), costs=costs)
