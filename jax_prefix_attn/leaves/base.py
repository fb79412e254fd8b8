"""What every plan leaf shares: the static shapes a leaf is planned for, the kernel tilings
several leaves use, the :class:`Leaf` protocol of a shared-prefix leaf module and the
:class:`TreeLeaf` protocol of a tree-attention schedule's module (with the tree family's
shapes, call and forward paths), and the split rules common to several leaves.

Each leaf is one module of :mod:`jax_prefix_attn.leaves` holding its frozen plan dataclass, the
reason it cannot be chosen for given shapes (:func:`Leaf.why_not`), its modelled cost, its
builder (tiling and splits for one chunk of query positions) and how it runs its kernels.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Protocol, runtime_checkable

import jax.numpy as jnp

from jax_prefix_attn.device import H100_SXM, DeviceInfo
from jax_prefix_attn.device_profile import Tuning, device_profile
from pallas_kernels._common import MAX_ROWS_PER_TILE, cdiv, kernel_head_dim
from pallas_kernels.decode_attention import supported as triton_supported

__all__ = ["Shapes", "PrefixTiling", "SuffixTiling", "Leaf", "shared_prefix_supported",
           "supported", "query_chunks", "planning_part", "tuning", "suffix_tiling",
           "decode_suffix_tiling", "describe_regions", "measured_region_why_not", "two_per_sm", "splits_to_fill",
           "suffix_splits", "TreeShapes", "TreeCall", "TreeForwards", "TreeLeaf",
           "tree_kernels_supported", "tree_auto_why_not", "tiling_pairs", "tree_backend"]

_frozen = dataclasses.dataclass(frozen=True)


@_frozen
class Shapes:
    """Static shapes of a call: ``q [batch, tq, heads_q, head_dim]``, ``groups`` prefixes of
    ``prefix_len`` keys, suffixes of capacity ``suffix_len``, ``dtype`` the name of q's dtype."""
    batch: int
    tq: int
    heads_q: int
    heads_kv: int
    head_dim: int
    groups: int
    prefix_len: int
    suffix_len: int
    dtype: str

    @property
    def group(self) -> int:
        """Query heads per kv head, ``G = Hq / Hkv``."""
        return self.heads_q // self.heads_kv


@_frozen
class PrefixTiling:
    """Tiling of the Triton prefix kernel (``pallas_kernels.prefix_attention.prefix_partials``)."""
    block_m: int
    block_k: int
    num_splits: int
    num_warps: int
    num_stages: int
    two_phase: bool = False


@_frozen
class SuffixTiling:
    """Tiling of a suffix / decode kernel."""
    block_k: int
    num_warps: int
    num_stages: int


@functools.cache
def suffix_tiling(tiling: tuple) -> SuffixTiling:
    """The :class:`SuffixTiling` of a data file's ``(block_k, num_warps, num_stages)``."""
    return SuffixTiling(*tiling)


def tuning(dev: DeviceInfo) -> Tuning:
    """The tuned regions and tilings of ``dev``'s profile (the nearest measured part's where it
    has none: :func:`jax_prefix_attn.device_profile.device_profile`)."""
    return device_profile(dev)[0].tuning


def decode_suffix_tiling(dev: DeviceInfo) -> SuffixTiling:
    """The own-layout decode suffix kernel's tiling on ``dev`` (its ``decode_suffix_tiling``):
    the suffix pass after a prefix pass, which merges the prefix partials in its epilogue (the
    two-launch leaves, the hybrid tree schedule's suffix launch)."""
    return suffix_tiling(tuning(dev).decode_suffix_tiling)


def describe_regions(regions: tuple, extra: tuple = ()) -> str:
    """``"P 1024-4096 and S 64-64 (G >= 4), or ..."``: a region list of a data file in words;
    ``extra`` names the counts after the bounds (e.g. ``("G >=", "CTAs >=")``)."""
    def one(r):
        (p0, p1), (s0, s1) = r[0], r[1]
        more = ", ".join(f"{name} {v}" for name, v in zip(extra, r[2:]))
        return f"P {p0}-{p1} and S {s0}-{s1}" + (f" ({more})" if more else "")
    return ", or ".join(one(r) for r in regions)


def measured_region_why_not(s: Shapes, regions: tuple, dev) -> str | None:
    """``None`` when ``(P, S)`` of ``s`` lies in one of a data file's ``((prefix, suffix), ...)``
    regions, else the reason (an empty list: the leaf was never timed on ``dev``, so only
    ``path=`` runs it)."""
    if any(p0 <= s.prefix_len <= p1 and s0 <= s.suffix_len <= s1
           for (p0, p1), (s0, s1) in regions):
        return None
    return (f"outside its measured region ({describe_regions(regions)})" if regions else
            f"no measured region on {dev.name} (path= forces it)")


@runtime_checkable
class Leaf(Protocol):
    """A leaf module.  ``PATH``: its name (the plan's ``path``, ``path=`` of the planner);
    ``FAMILY``: ``"shared"`` (prefix pass batched over the sequences) or ``"flat"`` (one ragged
    decode over shared storage); ``PLAN``: its frozen plan dataclass.

    * ``unsupported(s, dev, interpret)``: ``None`` when its kernels run shapes ``s`` on ``dev``
      (what a forced ``path=`` needs), else the reason.
    * ``why_not(s, dev, interpret)``: ``None`` when the planner may choose it for ``s``: its
      kernels run and ``s`` lies in the region where it was measured to pay; else the reason.
    * ``build(s, dev, interpret)``: its plan for one chunk of query positions.
    * ``seconds(s, dev, interpret)``: the modelled seconds the planner compares it by.
    * ``run(leaf, q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, lim_p, lim_s, *,
      scale, interpret, prefix_len_g)``: ``(out [B, Tq, Hq, D], lse [B, Tq, Hq])`` of one chunk
      (``jax_prefix_attn.executor.run_plan`` gives the inputs).
    """
    PATH: str
    FAMILY: str
    PLAN: type

    def unsupported(self, s: Shapes, dev, interpret: bool) -> str | None: ...

    def why_not(self, s: Shapes, dev, interpret: bool) -> str | None: ...

    def build(self, s: Shapes, dev, interpret: bool): ...

    def seconds(self, s: Shapes, dev, interpret: bool) -> float: ...

    def run(self, leaf, q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, lim_p, lim_s,
            *, scale, interpret, prefix_len_g): ...


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


def supported(s: Shapes) -> str | None:
    """:func:`shared_prefix_supported` of shapes ``s``: what every leaf needs first."""
    return shared_prefix_supported((s.batch, s.tq, s.heads_q, s.head_dim), s.dtype, s.prefix_len,
                                   s.suffix_len)


def query_chunks(tq: int, group: int, max_rows: int = MAX_ROWS_PER_TILE) -> list:
    """``[(start, stop), ...]`` over ``Tq`` so that each chunk has at most ``max_rows`` rows
    (``chunk * group`` rows, at least one position per chunk)."""
    step = max(1, max_rows // group)
    return [(c, min(c + step, tq)) for c in range(0, tq, step)]


def planning_part(dev: DeviceInfo) -> DeviceInfo:
    """The part grids and costs are sized for: ``dev`` on a GPU, else :data:`H100_SXM` (so that
    interpret mode off the GPU makes the choices that GPU would)."""
    return dev if dev.is_gpu else H100_SXM


def two_per_sm(dev) -> int:
    """Programs that fill the GPU: two per SM."""
    return 2 * dev.sm_count


def splits_to_fill(programs: int, keys: int, block_k: int, target: int) -> int:
    """Key splits so that ``programs * splits`` reaches ``target``, at least two tiles each."""
    if programs >= target:
        return 1
    return max(1, min(cdiv(target, programs), cdiv(keys, 2 * block_k)))


def suffix_splits(s: Shapes, dev) -> int:
    """Splits of the suffix keys when ``B * Hkv`` programs cannot fill the GPU."""
    return splits_to_fill(s.batch * s.heads_kv, s.suffix_len, 64, two_per_sm(dev))


@_frozen
class TreeShapes:
    """Static shapes of a tree-attention call on the kernels' shapes: ``q [batch, tq, heads_q,
    head_dim]`` (group and head_dim padded to powers of two), ``dtype`` the name of q's dtype,
    ``suffix_len`` the suffix capacity, ``draft``: ``draft_parents`` is given."""
    batch: int
    tq: int
    heads_q: int
    head_dim: int
    dtype: str
    suffix_len: int
    draft: bool


@_frozen
class TreeCall:
    """The inputs of one tree-attention call on the kernels' shapes, as a tree leaf's ``run``
    takes them: the arrays (``meta`` a :class:`~jax_prefix_attn.tree_metadata.TreeMetadata` of
    device arrays, ``draft_parents`` or ``None``), the score ``scale`` and the ``backward``
    (``"kernels"`` or ``"mirror"``) of the tree-kernel schedules."""
    q: Any
    meta: Any
    k_pool: Any
    v_pool: Any
    suffix_k: Any
    suffix_v: Any
    suffix_lengths: Any
    draft_parents: Any
    scale: float
    backward: str


@_frozen
class TreeForwards:
    """The forward paths tree leaves run through, given to their ``run`` by
    :func:`jax_prefix_attn.tree_attention.tree_attention`.  They compose the shared-prefix
    family's entry points, which plan through the planner that holds the tree registry, so a
    leaf module takes them as an argument rather than importing them.

    * ``tree_kernels(call, schedule, backend)``: a tree-kernel schedule by name (``"flatten"``,
      ``"levelwise"``, ``"nodes"``, ``"hybrid"``) with its backward
      (:func:`jax_prefix_attn.tree_paths.schedule_forward`);
    * ``single_level`` and ``shallow``: :func:`jax_prefix_attn.tree_paths.single_level_attention`
      and :func:`jax_prefix_attn.tree_paths.shallow_attention`.
    """
    tree_kernels: Callable
    single_level: Callable
    shallow: Callable


@runtime_checkable
class TreeLeaf(Protocol):
    """A tree-attention schedule's module: the :class:`Leaf` protocol with the tree metadata as
    an argument.  ``PATH``: the schedule's name (:class:`~jax_prefix_attn.tree_plan.TreePlan`'s
    ``schedule``, a named ``impl``); ``FAMILY``: ``"tree"``; ``PLAN``: its frozen tiling
    dataclass; ``PRICED``: the tree cost model prices it when the metadata is built
    (:class:`~jax_prefix_attn.tree_plan.ScheduleCosts`); ``MIRROR``: it runs a pure-JAX mirror
    off the GPU, so it takes every input; ``PREFERENCE``: why it wins wherever it accepts the
    shapes (unpriced leaves), else ``""``.

    * ``unsupported(meta, s, platform, interpret)``: ``None`` when a named ``impl`` may run it,
      else the reason, phrased after ``"impl='x' "``.
    * ``why_not(meta, s, platform, interpret)``: ``None`` when ``impl="auto"`` may choose it.
    * ``build(meta)``: its ``PLAN``, the metadata's tiling it runs with.
    * ``seconds(costs)``: its modelled seconds from the metadata's times (``None`` unpriced).
    * ``run(plan, call, forwards)``: ``(out [B, Tq, Hq, D], lse [B, Tq, Hq])`` of a
      :class:`TreeCall` planned by ``plan``, through :class:`TreeForwards`.
    """
    PATH: str
    FAMILY: str
    PLAN: type
    PRICED: bool
    MIRROR: bool
    PREFERENCE: str

    def unsupported(self, meta, s: TreeShapes, platform: str, interpret: bool) -> str | None: ...

    def why_not(self, meta, s: TreeShapes, platform: str, interpret: bool) -> str | None: ...

    def build(self, meta): ...

    def seconds(self, costs) -> float | None: ...

    def run(self, plan, call: TreeCall, forwards: TreeForwards): ...


def tree_kernels_supported(s: TreeShapes) -> str | None:
    """``None`` when the kernels of the shared-prefix and hybrid paths take ``s``'s head_dim
    and dtype, else the reason."""
    d = s.head_dim
    if d < 16 or d & (d - 1):
        return f"head_dim must be a power of two >= 16, got {d}"
    if jnp.dtype(s.dtype) not in (jnp.float32, jnp.bfloat16, jnp.float16):
        return f"dtype must be float32, bfloat16 or float16, got {jnp.dtype(s.dtype)}"
    return None


def tree_auto_why_not(s: TreeShapes, platform: str, takes_reason: str | None) -> str | None:
    """``why_not`` of a tree leaf that runs GPU kernels: ``None`` when ``impl="auto"`` may choose
    it (on a GPU, without draft token trees, ``takes_reason`` None: its path takes the shapes),
    else the reason."""
    if platform != "gpu":
        return f"it runs GPU kernels and impl='auto' runs kernels only on a GPU, not {platform}"
    if s.draft:
        return "it does not take draft_parents"
    return takes_reason


def tiling_pairs(plan) -> tuple:
    """A tree leaf's ``PLAN`` as the ``(name, value)`` pairs of ``TreePlan.tiling`` (fields that
    are ``None`` left out)."""
    return tuple((f.name, getattr(plan, f.name)) for f in dataclasses.fields(plan)
                 if getattr(plan, f.name) is not None)


def tree_backend(plan) -> str:
    """How a tree plan's tree kernels run: ``"interpret"`` (Pallas interpret mode),
    ``"pallas"`` (compiled, on the GPU) or ``"mirror"`` (the pure-JAX mirror)."""
    return "interpret" if plan.interpret else "pallas" if plan.platform == "gpu" else "mirror"
