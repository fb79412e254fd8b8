"""Planner of shared-prefix attention: static shapes + :class:`DeviceInfo` -> a frozen plan.

:func:`plan_shared_prefix` walks one decision tree (:func:`_decide`; the same tree with its
reasons is ``docs/dispatch.md``), then builds the chosen leaf's tiling and splits for each query
chunk (:mod:`jax_prefix_attn.leaf_plans`).  Every number here is a static function of the
shapes and the device: a jitted caller never sees a stale choice.  ``impl="auto"`` compares the
shared and the flat family with the cost model (:mod:`jax_prefix_attn.cost_model`) on the plans
built for them.
"""
from __future__ import annotations

import dataclasses
import types

import jax.numpy as jnp

from jax_prefix_attn import cost_model
from jax_prefix_attn import leaf_plans as lp
from jax_prefix_attn.device import H100_SXM, DeviceInfo, device_info
from jax_prefix_attn.plans import (BackwardPlan, ChunkPlan, Reference, SharedPrefixPlan,
                                   Shapes)
from pallas_kernels import prefix_attention_bwd, suffix_attention_bwd
from pallas_kernels._common import cdiv, kernel_head_dim
from pallas_kernels.decode_attention import supported as triton_supported

__all__ = ["plan_shared_prefix", "SharedPrefixPlan", "PATHS", "SHARED_PATHS", "FLAT_PATHS",
           "DECODE_SUFFIX_TILING", "shared_prefix_supported", "suffix_grad_key_splits",
           "row_splits"]

SHARED_PATHS = ("triton_two_launch", "triton_overlap", "mgpu_two_launch", "mgpu_one_launch",
                "mgpu_joint", "mgpu_split")
FLAT_PATHS = ("flat_own", "flat_rows")
PATHS = ("reference",) + FLAT_PATHS + SHARED_PATHS
IMPLS = ("auto", "shared", "flat", "reference")
BACKWARDS = ("kernels", "reference")
# Tiling of the own-layout decode suffix kernel (``suffix_decode_merge``) after a prefix pass.
DECODE_SUFFIX_TILING = types.MappingProxyType(dict(block_k=32, num_warps=2, num_stages=3))
# Below this many (sequence, kv head) suffix programs the Triton family takes the overlap launch.
OVERLAP_BELOW_PROGRAMS = 2048


def shared_prefix_supported(q_shape, dtype, prefix_len: int, suffix_len: int) -> str | None:
    """``None`` when the Pallas kernels handle ``q [B, Tq, Hq, D]`` of ``dtype`` with a prefix of
    ``prefix_len`` keys and suffixes of capacity ``suffix_len``, else the reason.  Any head_dim
    runs: :func:`jax_prefix_attn.shared_prefix_attention` zero-pads it to the kernels' power of
    two (:func:`pallas_kernels._common.kernel_head_dim`, e.g. 96 -> 128)."""
    why = triton_supported(head_dim=kernel_head_dim(q_shape[-1]), dtype=dtype)
    if why is not None:
        return why
    if prefix_len == 0 or suffix_len == 0:
        return (f"prefix and suffix axes must be non-empty, got P={prefix_len} and "
                f"S_max={suffix_len}")
    if q_shape[0] == 0 or q_shape[1] == 0:
        return f"q must hold at least one sequence and one query, got shape {tuple(q_shape)}"
    return None


def row_splits(programs: int, row_blocks: int, sms: int) -> int:
    """Splits of a backward kernel's rows (or key tiles) across programs: enough programs for
    about two per SM, at most one per block and at most 16."""
    if programs >= 2 * sms:
        return 1
    return max(1, min(-(-2 * sms // max(programs, 1)), row_blocks, 16))


def suffix_grad_key_splits(batch: int, heads_kv: int, suffix_len: int,
                           device: DeviceInfo | None = None) -> int:
    """Key splits of ``suffix_attention_bwd.suffix_grads`` for ``B * Hkv`` programs."""
    dev = _tdev(device_info() if device is None else device)
    return row_splits(batch * heads_kv, suffix_attention_bwd.suffix_grad_tiles(suffix_len),
                      dev.sm_count)


def _decide(s: Shapes, dev: DeviceInfo, impl: str, interpret: bool) -> str:
    """The decision tree: which leaf runs these shapes (``docs/dispatch.md``)."""
    if impl == "reference":
        return "reference"
    if impl == "auto" and (dev.platform != "gpu" or _unsupported(s) is not None):
        return "reference"                                  # no GPU kernels here
    # The flat family: one ragged decode launch over shared storage.
    flat = ("flat_own" if s.tq == 1 and lp.flat_layout(s, _tdev(dev)) == "own"
            else "flat_rows")
    # The shared family.  Decoding with one prefix on Hopper, enough 128-row CTAs: Mosaic GPU.
    if s.groups == 1 and s.tq == 1 and lp.mosaic_region(s, dev, interpret):
        if lp.split_region(s, dev):           # G = 4, B * G >= 2048, D = 128, P 4K-16K, S 64-256
            shared = "mgpu_split"
        elif lp.joint_region(s, dev):         # P 1K-4K, S = 64 (G >= 4) or S <= 256 (G >= 8)
            shared = "mgpu_joint"
        elif lp.one_launch_region(s, dev):    # P = 4K, S 128-256, or G >= 8 P = 16K S = 1K
            shared = "mgpu_one_launch"
        else:
            shared = "mgpu_two_launch"
    elif s.batch * s.heads_kv < OVERLAP_BELOW_PROGRAMS:  # few suffix programs: overlap them
        shared = "triton_overlap"
    else:
        shared = "triton_two_launch"
    if impl == "flat":
        return flat
    if impl == "shared":
        return shared
    # auto on a GPU: the cheaper family by the cost model (one-launch leaves charged as the
    # two launches they replace, an overestimate where they run).
    costed = "mgpu_two_launch" if shared.startswith("mgpu") else shared
    t_shared = cost_model.shared_seconds(s, lp.build_leaf(costed, s, _tdev(dev), interpret),
                                         _tdev(dev))
    t_flat = cost_model.flat_seconds(s, lp.build_leaf(flat, s, _tdev(dev), interpret), _tdev(dev))
    return shared if t_shared <= t_flat else flat


def _tdev(dev: DeviceInfo) -> DeviceInfo:
    return dev if dev.is_gpu else H100_SXM


def _unsupported(s: Shapes) -> str | None:
    return shared_prefix_supported((s.batch, s.tq, s.heads_q, s.head_dim), s.dtype, s.prefix_len,
                                   s.suffix_len)


def _why_not(path: str, s: Shapes, dev: DeviceInfo, interpret: bool) -> str | None:
    """``None`` when leaf ``path`` can run these shapes on ``dev``, else the reason."""
    if path == "reference":
        return None
    why = _unsupported(s)
    if why is not None or path in ("flat_rows", "triton_two_launch", "triton_overlap"):
        return why
    if path == "flat_own":
        return None if s.tq == 1 else f"flat_own decodes one query per sequence, got Tq={s.tq}"
    return lp.mosaic_why_not(path, s, dev, interpret)


def _build(path: str, s: Shapes, dev: DeviceInfo, interpret: bool, forced: bool = True) -> tuple:
    """The chunk plans of leaf ``path``: one per chunk of query positions.  Unless ``forced``,
    each chunk takes the leaf the tree gives for its own shapes within ``path``'s family (a
    chunk of one position is a decode step)."""
    if path == "reference":
        return (ChunkPlan(0, s.tq, Reference()),)
    tdev = _tdev(dev)
    family = "flat" if path in FLAT_PATHS else "shared"
    chunks = []
    for a, b in lp.query_chunks(s.tq, s.group):
        s_c = dataclasses.replace(s, tq=b - a)
        path_c = path if forced or s_c == s else _decide(s_c, dev, family, interpret)
        chunks.append(ChunkPlan(a, b, lp.build_leaf(path_c, s_c, tdev, interpret)))
    return tuple(chunks)


def _backward(s: Shapes, dev: DeviceInfo, mode: str) -> BackwardPlan:
    if mode not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}, got {mode!r}")
    sms = _tdev(dev).sm_count
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
                       interpret: bool = False, backward: str = "kernels") -> SharedPrefixPlan:
    """Plan ``shared_prefix_attention`` for these static shapes (``q [batch, tq, heads_q,
    head_dim]``, ``groups`` prefixes of ``prefix_len`` keys, suffix capacity ``suffix_len``).

    ``impl``: ``"auto"`` (on a GPU the cheaper of the shared and flat family by the cost model,
    elsewhere the reference), ``"shared"`` / ``"flat"`` (the best leaf of that family),
    ``"reference"``.  ``path``: force one leaf (:data:`PATHS`); raises ``ValueError`` naming the
    path and the reason when it cannot run these shapes.  ``device``: default
    :func:`device_info` (tests pass a known part such as ``device.H100_SXM``).  ``interpret``:
    the plan's kernels run in interpret mode (CPU); Mosaic GPU leaves are then taken only when
    forced.  ``backward``: ``"kernels"`` (flash backward kernels) or ``"reference"`` (autodiff
    of the pure-JAX decomposition).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    s = Shapes(int(batch), int(tq), int(heads_q), int(heads_kv), int(head_dim), int(groups),
               int(prefix_len), int(suffix_len), jnp.dtype(dtype).name)
    dev = device_info() if device is None else device
    forced = path is not None
    if path is None:
        path = _decide(s, dev, impl, interpret)
        why = _why_not(path, s, dev, interpret)
        if why is not None:
            raise ValueError(f"impl={impl!r} (Pallas kernels) cannot run these shapes: {why}; "
                             f"use impl='reference'")
    else:
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        why = _why_not(path, s, dev, interpret)
        if why is not None:
            raise ValueError(f"path={path!r} cannot run these shapes: {why}")
    family = ("reference" if path == "reference" else "flat" if path in FLAT_PATHS
              else "shared")
    return SharedPrefixPlan(impl=family, path=path, shapes=s,
                            chunks=_build(path, s, dev, interpret, forced=forced),
                            backward=_backward(s, dev, backward), interpret=bool(interpret))
