"""Planner of tree attention: static tree metadata + query shapes + platform -> a frozen
:class:`TreePlan`.

The schedules (``tree_attention``'s module doc describes them): ``"single_level"`` and
``"shallow"`` (the roots through shared-prefix attention), ``"hybrid"`` (decoding: root, inner
nodes and exclusive spans in three kernels), ``"levelwise"``, ``"flatten"`` and ``"nodes"``
(one tree-kernel schedule each).  The tree cost model (:mod:`jax_prefix_attn.tree_cost`) prices
the flatten, level-wise and hybrid schedules when the metadata is built
(:func:`choose_schedules` turns those times into the metadata's static ``preferred`` and
``hybrid``); :func:`plan_tree_attention` then decides, from those static fields and the query
shapes, what ``impl="auto"`` runs.  Every input is static: a jitted caller never sees a stale
choice.  ``docs/dispatch.md`` ("Tree attention") lists the order.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from jax_prefix_attn.device import device_info

__all__ = ["TreePlan", "ScheduleCosts", "plan_tree_attention", "choose_schedules", "default_platform",
           "single_level_takes", "shallow_takes", "hybrid_unsupported_shapes", "TREE_IMPLS", "SCHEDULES",
           "PLATFORMS"]

TREE_IMPLS = ("auto", "levelwise", "flatten", "hybrid", "nodes", "reference")
SCHEDULES = ("single_level", "shallow", "hybrid", "levelwise", "flatten", "nodes", "reference")
PLATFORMS = ("gpu", "cpu")

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


def choose_schedules(costs: ScheduleCosts) -> tuple:
    """``(preferred, hybrid)``: the tree-kernel schedule of least modelled time (``"flatten"``
    only when strictly cheaper, else ``"levelwise"``), and whether the hybrid schedule is
    strictly cheaper than both."""
    preferred = "flatten" if costs.flatten < costs.levelwise else "levelwise"
    return preferred, bool(costs.hybrid < min(costs.flatten, costs.levelwise))


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


def _kernel_dtype_and_dim(q_shape, dtype) -> str | None:
    d = q_shape[-1]
    if d < 16 or d & (d - 1):
        return f"head_dim must be a power of two >= 16, got {d}"
    if jnp.dtype(dtype) not in (jnp.float32, jnp.bfloat16, jnp.float16):
        return f"dtype must be float32, bfloat16 or float16, got {jnp.dtype(dtype)}"
    return None


def single_level_takes(meta, q_shape, dtype, suffix_len: int) -> bool:
    """Whether the single-level path takes these shapes: every sequence hangs from a root, a
    suffix axis, and shapes the shared-prefix kernels take."""
    return meta.single_level and suffix_len > 0 and _kernel_dtype_and_dim(q_shape, dtype) is None


def shallow_takes(meta, q_shape, dtype) -> bool:
    """Whether the shallow path takes these shapes: decoding a shallow forest
    (``meta.shallow_pad > 0``) with shapes the shared-prefix kernels take."""
    return (meta.shallow_pad > 0 and meta.tq == 1 and q_shape[1] == 1
            and _kernel_dtype_and_dim(q_shape, dtype) is None)


def hybrid_unsupported_shapes(meta, q_shape, dtype) -> str | None:
    """``None`` when the hybrid schedule can run these shapes, else why not."""
    if meta.excl_span is None or q_shape[1] != 1:
        return f"it decodes one query per sequence (seq_q == 1), got seq_q={q_shape[1]}"
    return _kernel_dtype_and_dim(q_shape, dtype)


def _tiling(meta, schedule: str) -> tuple:
    if schedule in ("flatten", "nodes"):
        sched = meta.flatten if schedule == "flatten" else meta.nodes
        return (("block_rows", sched.block_rows), ("block_kv", sched.block_kv))
    if schedule == "levelwise":
        return (("block_rows", tuple(lv.block_rows for lv in meta.levels)),
                ("block_kv", tuple(lv.block_kv for lv in meta.levels)))
    if schedule == "hybrid":
        mid = meta.mid
        return (("root", meta.hybrid_root),) + (() if mid is None else (
            ("mid_mode", mid.mode), ("mid_block_rows", mid.block_rows), ("mid_block_kv", mid.block_kv)))
    if schedule == "shallow":
        return (("root_pad", meta.root_pad), ("shallow_pad", meta.shallow_pad))
    if schedule == "single_level":
        return (("root_pad", meta.root_pad),)
    return ()


def _auto(meta, q_shape, dtype, suffix_len: int, draft: bool, platform: str, times: str) -> tuple:
    """``(schedule, reason)`` of ``impl="auto"``."""
    pref = meta.preferred
    if platform != "gpu":
        return pref, (f"{pref}: impl='auto' on {platform} runs the pure-JAX mirror of the schedule of least "
                      f"modelled time ({times})")
    if draft:
        return pref, (f"{pref}: draft_parents given (only the tree-kernel schedules take draft token trees); "
                      f"least modelled time ({times})")
    if single_level_takes(meta, q_shape, dtype, suffix_len):
        return "single_level", (f"single_level: every sequence hangs from a root, so shared-prefix attention "
                                f"runs it, before the tree schedules ({times})")
    if shallow_takes(meta, q_shape, dtype):
        return "shallow", (f"shallow: decoding a shallow forest, the shallow path measured faster than the "
                           f"tree schedules and hybrid ({times})")
    why = hybrid_unsupported_shapes(meta, q_shape, dtype)
    if meta.hybrid and why is None:
        return "hybrid", f"hybrid: least modelled time ({times})"
    note = f"; hybrid, the cheapest, cannot run: {why}" if meta.hybrid else ""
    return pref, f"{pref}: least modelled time ({times}){note}"


def plan_tree_attention(meta, *, q_shape, dtype, suffix_len: int, draft: bool = False, impl: str = "auto",
                        platform: str | None = None, interpret: bool = False) -> TreePlan:
    """Plan :func:`jax_prefix_attn.tree_attention` for a
    :class:`~jax_prefix_attn.tree_metadata.TreeMetadata` built for these shapes.

    ``q_shape``: ``(B, Tq, Hq, D)`` of the kernels' queries (group and head_dim padded as
    ``tree_attention`` pads them), ``dtype`` q's dtype, ``suffix_len`` the suffix capacity,
    ``draft``: ``draft_parents`` is given.  ``impl="auto"``: off the GPU, or with draft token
    trees, the metadata's ``preferred``; on the GPU, in order: a single-level forest with a suffix
    axis goes to the shared-prefix path; when decoding, a shallow forest to the shallow path
    (on speculative trees the hybrid schedule measured slower at most sizes:
    ``docs/performance.md``), else the hybrid schedule where the cost model prefers it
    (``meta.hybrid``); then ``meta.preferred``.  Auto runs kernels only on a GPU, so off it
    ``interpret`` is dropped.  A named ``impl`` is forced; ``"hybrid"`` raises ``ValueError``
    where it cannot run.
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
    if impl == "auto":
        schedule, reason = _auto(meta, q_shape, dtype, suffix_len, draft, platform, times)
        interpret = interpret and platform == "gpu"
    else:
        if impl == "hybrid":
            why = hybrid_unsupported_shapes(meta, q_shape, dtype) or (
                "it does not take draft_parents" if draft else None)
            if why is not None:
                raise ValueError(f"impl='hybrid' cannot run these inputs: {why}")
            if platform != "gpu" and not interpret:
                raise ValueError("impl='hybrid' runs Pallas GPU kernels and needs a GPU; pass interpret=True "
                                 "on the CPU")
        schedule, reason = impl, f"impl={impl!r} forced ({times})"
    return TreePlan(schedule=schedule, platform=platform, interpret=bool(interpret), reason=reason,
                    tiling=_tiling(meta, schedule), costs=costs)
