"""Planner of shared-prefix attention: static shapes + :class:`DeviceInfo` -> a frozen plan;
and of tree attention (:func:`plan_tree_attention`, a :class:`TreePlan`, over the tree family's
ordered registry :data:`TREE_LEAVES`, from :mod:`jax_prefix_attn.tree_plan`).

The planner keeps an ordered registry of leaf modules (:data:`LEAVES`, each following
:class:`jax_prefix_attn.leaves.base.Leaf`).  It takes the leaves of the asked family (both
families for ``impl="auto"`` on a GPU) whose ``why_not`` is ``None`` for the shapes, and picks
the one of least modelled seconds (:mod:`jax_prefix_attn.cost_model`), ties to the earlier
leaf of the registry; then it builds the leaf's tiling and splits for each query chunk.  Every
number here is a static function of the shapes and the device: a jitted caller never sees a
stale choice.  ``docs/dispatch.md`` lists the leaves, their regions and how to add one.
"""
from __future__ import annotations

import dataclasses
import types

import jax.numpy as jnp

from jax_prefix_attn.device import DeviceInfo, device_info
from jax_prefix_attn.device_profile import device_profile
from jax_prefix_attn.leaves import (flat_mgpu_stream, flat_own, flat_rows, mgpu_joint,
                                    mgpu_one_launch, mgpu_split, mgpu_stream_two_launch,
                                    mgpu_two_launch, triton_overlap, triton_two_launch)
from jax_prefix_attn.leaves.base import (planning_part, query_chunks, shared_prefix_supported,
                                         supported)
from jax_prefix_attn.mgpu_grads import mgpu_backward_why_not
from jax_prefix_attn.plans import (BackwardPlan, ChunkPlan, Reference, SharedPrefixPlan,
                                   Shapes)
from jax_prefix_attn.tree_plan import (TREE_LEAVES, TreePlan, plan_tree_attention, tree_candidates,
                                       tree_leaf)
from pallas_kernels import prefix_attention_bwd, suffix_attention_bwd

__all__ = ["plan_shared_prefix", "SharedPrefixPlan", "LEAVES", "leaf_module", "candidates",
           "PATHS", "SHARED_PATHS", "FLAT_PATHS", "shared_prefix_supported",
           "suffix_grad_key_splits", "row_splits", "plan_tree_attention", "TreePlan",
           "TREE_LEAVES", "tree_leaf", "tree_candidates", "FLAT_DECODE_MAX_TQ", "use_flat_decode",
           "BACKWARDS"]

# The registry, in order of preference among leaves of equal modelled cost: the one-launch
# Mosaic GPU leaves are charged as the two launches they replace, and each was measured to beat
# those launches (and the ones after it) in its region.
LEAVES = (mgpu_split, mgpu_joint, mgpu_one_launch, mgpu_stream_two_launch, mgpu_two_launch,
          triton_overlap, triton_two_launch, flat_mgpu_stream, flat_own, flat_rows)
_BY_PATH = types.MappingProxyType({leaf.PATH: leaf for leaf in LEAVES})
SHARED_PATHS = ("triton_two_launch", "triton_overlap", "mgpu_two_launch", "mgpu_one_launch",
                "mgpu_joint", "mgpu_split", "mgpu_stream_two_launch")
FLAT_PATHS = ("flat_own", "flat_rows", "flat_mgpu_stream")
PATHS = ("reference",) + FLAT_PATHS + SHARED_PATHS
IMPLS = ("auto", "shared", "flat", "reference")
BACKWARDS = ("auto", "kernels", "mgpu", "reference")
# Queries per sequence up to which attention over per-sequence buffers (no shared prefix) runs
# the flat decode kernels rather than flash attention (:func:`use_flat_decode`).
FLAT_DECODE_MAX_TQ = 8


def leaf_module(leaf_plan):
    """The registered leaf module that builds and runs ``leaf_plan`` (by its ``path``)."""
    return _BY_PATH[leaf_plan.path]


def use_flat_decode(q_shape, dtype, kv_len: int, *, impl: str = "auto",
                    device: DeviceInfo | None = None) -> bool:
    """Whether causal attention of ``q [B, T, Hq, D]`` (the newest ``T`` tokens) over
    per-sequence buffers of ``kv_len`` keys runs through ``shared_prefix_attention(impl="flat")``
    behind an empty prefix rather than flash attention: ``impl="auto"`` on a GPU, ``T <=``
    :data:`FLAT_DECODE_MAX_TQ` and shapes the kernels take.  The flat decode kernels put the
    ``Hq / Hkv`` query heads of a kv head in one tile, so each key is read once per kv head
    rather than once per query head."""
    dev = device_info() if device is None else device
    if impl != "auto" or dev.platform != "gpu" or q_shape[1] > FLAT_DECODE_MAX_TQ:
        return False
    return shared_prefix_supported(tuple(q_shape), dtype, 1, kv_len) is None


def row_splits(programs: int, row_blocks: int, sms: int) -> int:
    """Splits of a backward kernel's rows (or key tiles) across programs: enough programs for
    about two per SM, at most one per block and at most 16."""
    if programs >= 2 * sms:
        return 1
    return max(1, min(-(-2 * sms // max(programs, 1)), row_blocks, 16))


def suffix_grad_key_splits(batch: int, heads_kv: int, suffix_len: int,
                           device: DeviceInfo | None = None) -> int:
    """Key splits of ``suffix_attention_bwd.suffix_grads`` for ``B * Hkv`` programs."""
    dev = planning_part(device_info() if device is None else device)
    return row_splits(batch * heads_kv, suffix_attention_bwd.suffix_grad_tiles(suffix_len),
                      dev.sm_count)


def candidates(s: Shapes, dev: DeviceInfo, family: str, interpret: bool = False) -> tuple:
    """The registered leaves of ``family`` (``"shared"``, ``"flat"``, or ``"auto"``: both) whose
    ``why_not`` is ``None`` for shapes ``s`` on ``dev``, in registry order."""
    return tuple(leaf for leaf in LEAVES if family in ("auto", leaf.FAMILY)
                 and leaf.why_not(s, dev, interpret) is None)


def _choose(s: Shapes, dev: DeviceInfo, family: str, interpret: bool) -> tuple:
    """``(leaf, reason)``: the candidate of least modelled seconds, ties to the earlier in the
    registry."""
    found = candidates(s, dev, family, interpret)
    if not found:   # every family has a leaf for every supported shape (tests/jax_prefix_attn)
        raise AssertionError(f"no {family} leaf accepts {s}")
    if len(found) == 1:
        return found[0], f"{found[0].PATH}: the only leaf (impl={family!r}) whose why_not is None"
    tdev = planning_part(dev)
    cost = [leaf.seconds(s, tdev, interpret) for leaf in found]
    best = min(range(len(found)), key=lambda i: (cost[i], i))
    costs = ", ".join(f"{leaf.PATH} {c * 1e6:.1f} us" for leaf, c in zip(found, cost))
    return found[best], (f"{found[best].PATH}: least modelled time, ties to the registry order "
                         f"({costs})")


def _build(leaf, s: Shapes, dev: DeviceInfo, interpret: bool, forced: bool) -> tuple:
    """The chunk plans of ``leaf``: one per chunk of query positions.  Unless ``forced``, each
    chunk takes the leaf the planner picks for its own shapes within ``leaf``'s family (a chunk
    of one position is a decode step)."""
    tdev = planning_part(dev)
    chunks = []
    for a, b in query_chunks(s.tq, s.group):
        s_c = dataclasses.replace(s, tq=b - a)
        leaf_c = leaf if forced or s_c == s else _choose(s_c, dev, leaf.FAMILY, interpret)[0]
        chunks.append(ChunkPlan(a, b, leaf_c.build(s_c, tdev, interpret)))
    return tuple(chunks)


def _backward(s: Shapes, dev: DeviceInfo, mode: str, interpret: bool, kernels: bool) -> BackwardPlan:
    """The backward of a plan; ``kernels``: whether the plan runs kernels (a reference plan
    differentiates the reference whatever ``mode`` says)."""
    if mode not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}, got {mode!r}")
    if mode == "auto":
        min_tq = device_profile(planning_part(dev))[0].tuning.mgpu_backward_min_tq
        mode = "mgpu" if (kernels and not interpret and dev.mosaic_gpu_ok and s.tq >= min_tq
                          and mgpu_backward_why_not(s.batch, s.tq, s.heads_q, s.heads_kv,
                                                    s.head_dim, s.groups, s.prefix_len,
                                                    s.suffix_len, s.dtype) is None) else "kernels"
    if mode == "mgpu" and kernels:
        why = mgpu_backward_why_not(s.batch, s.tq, s.heads_q, s.heads_kv, s.head_dim, s.groups,
                                    s.prefix_len, s.suffix_len, s.dtype)
        if why is None and not interpret and not dev.mosaic_gpu_ok:
            why = f"{dev.name}: Mosaic GPU needs compute capability 9.0 or newer"
        if why is not None:
            raise ValueError(f"backward='mgpu' cannot run these shapes: {why}")
    sms = planning_part(dev).sm_count
    dq_blocks, dq_tiles, dkv_blocks, dkv_rows = prefix_attention_bwd.prefix_grad_grid(
        s.batch * s.tq, s.prefix_len)
    return BackwardPlan(
        mode=mode,
        prefix_key_splits=row_splits(dq_blocks * s.heads_q, dq_tiles, sms),
        prefix_row_splits=row_splits(dkv_blocks * s.groups * s.heads_kv, dkv_rows, sms),
        suffix_key_splits=row_splits(s.batch * s.heads_kv,
                                     suffix_attention_bwd.suffix_grad_tiles(s.suffix_len), sms))


def plan_shared_prefix(*, batch: int, tq: int, heads_q: int, heads_kv: int, head_dim: int,
                       groups: int, prefix_len: int, suffix_len: int, dtype, impl: str = "auto",
                       path: str | None = None, device: DeviceInfo | None = None,
                       interpret: bool = False, backward: str = "auto") -> SharedPrefixPlan:
    """Plan ``shared_prefix_attention`` for these static shapes (``q [batch, tq, heads_q,
    head_dim]``, ``groups`` prefixes of ``prefix_len`` keys, suffix capacity ``suffix_len``).

    ``impl``: ``"auto"`` (on a GPU the cheapest leaf of both families by the cost model,
    elsewhere the reference), ``"shared"`` / ``"flat"`` (the cheapest leaf of that family),
    ``"reference"``.  ``path``: force one leaf (:data:`PATHS`); raises ``ValueError`` naming the
    path and the reason when it cannot run these shapes.  ``device``: default
    :func:`device_info` (tests pass a known part such as ``device.H100_SXM``).  ``interpret``:
    the plan's kernels run in interpret mode (CPU); Mosaic GPU leaves are then taken only when
    forced.  ``backward``: ``"auto"`` (``"mgpu"`` where the plan's kernels run compiled on a
    Mosaic GPU device, the kernels take the shapes and ``tq`` reaches the device's
    ``mgpu_backward_min_tq``; else ``"kernels"``), ``"kernels"`` (the Triton flash backward
    kernels), ``"mgpu"`` (the Mosaic GPU flash backward kernels,
    :mod:`jax_prefix_attn.mgpu_grads`; ``ValueError`` where the plan's kernels run and they
    cannot) or ``"reference"`` (autodiff of the pure-JAX decomposition); a reference plan
    differentiates the reference either way.  The plan's ``backward.mode`` is the resolved
    one.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    s = Shapes(int(batch), int(tq), int(heads_q), int(heads_kv), int(head_dim), int(groups),
               int(prefix_len), int(suffix_len), jnp.dtype(dtype).name)
    dev = device_info() if device is None else device
    if path is not None:
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        leaf = None if path == "reference" else _BY_PATH[path]
        why = None if leaf is None else leaf.unsupported(s, dev, interpret)
        if why is not None:
            raise ValueError(f"path={path!r} cannot run these shapes: {why}")
        reason = f"path={path!r} forced"
    elif impl == "reference":
        leaf, reason = None, "impl='reference'"
    else:
        why = supported(s)
        if impl == "auto" and dev.platform != "gpu":
            leaf, reason = None, f"impl='auto' on {dev.platform}: no GPU kernels"
        elif impl == "auto" and why is not None:
            leaf, reason = None, f"impl='auto': the kernels cannot run these shapes: {why}"
        elif why is not None:
            raise ValueError(f"impl={impl!r} (Pallas kernels) cannot run these shapes: {why}; "
                             f"use impl='reference'")
        else:
            leaf, reason = _choose(s, dev, impl, interpret)
    backward_plan = _backward(s, dev, backward, interpret, kernels=leaf is not None)
    if leaf is None:
        return SharedPrefixPlan(impl="reference", path="reference", shapes=s,
                                chunks=(ChunkPlan(0, s.tq, Reference()),),
                                backward=backward_plan, interpret=bool(interpret), reason=reason)
    _, note = device_profile(planning_part(dev))
    return SharedPrefixPlan(impl=leaf.FAMILY, path=leaf.PATH, shapes=s,
                            chunks=_build(leaf, s, dev, interpret, forced=path is not None),
                            backward=backward_plan, interpret=bool(interpret),
                            reason=f"{reason}; {note}" if note else reason)
