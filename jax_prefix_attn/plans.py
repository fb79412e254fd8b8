"""The frozen, hashable plan of a shared-prefix attention call (what the planner decides and the
executor runs).

A :class:`SharedPrefixPlan` names the implementation (``impl``: ``"shared"``, ``"flat"`` or
``"reference"``), the leaf of the decision tree (``path``, see ``docs/dispatch.md``), the query
chunks (``Tq * Hq / Hkv`` rows per sequence fit one row tile of at most 128 rows: one kernel
call per chunk of consecutive query positions) with one leaf plan per chunk, and the backward
choice.  Every field is static: a plan can be a ``jax.jit`` static argument and a
``custom_vjp`` non-differentiable argument.
"""
from __future__ import annotations

import dataclasses

__all__ = ["Shapes", "PrefixTiling", "SuffixTiling", "FlatOwn", "FlatRows", "TritonTwoLaunch",
           "TritonOverlap", "MgpuTwoLaunch", "MgpuOneLaunch", "MgpuJoint", "MgpuSplit",
           "Reference", "ChunkPlan", "BackwardPlan", "SharedPrefixPlan"]

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


@_frozen
class Reference:
    """The pure-JAX decomposition (no kernel)."""
    path = "reference"


@_frozen
class FlatOwn:
    """Flat decode in the queries' own layout: ``suffix_decode_merge`` with the prefix as a pool
    span, keys cut into ``num_splits`` chunks (+ one XLA merge when split)."""
    num_splits: int
    tiling: SuffixTiling
    path = "flat_own"


@_frozen
class FlatRows:
    """Flat decode in the row layout: ``ragged_attention`` over [prefix pool; suffix]."""
    num_splits: int
    block_k: int
    num_warps: int
    num_stages: int
    two_phase: bool
    path = "flat_rows"


@_frozen
class TritonTwoLaunch:
    """Triton prefix kernel, then the suffix kernel merging the prefix partials in its epilogue
    (``suffix_splits == 1``), or the split suffix kernel and one XLA merge."""
    prefix: PrefixTiling
    suffix_splits: int
    suffix: SuffixTiling
    path = "triton_two_launch"


@_frozen
class TritonOverlap:
    """One launch of interleaved prefix and suffix programs, then one XLA merge."""
    prefix: PrefixTiling
    suffix_splits: int
    suffix_block_k: int
    path = "triton_overlap"


@_frozen
class MgpuTwoLaunch:
    """Mosaic GPU prefix kernel and the own-layout suffix kernel (independent launches), then
    one XLA merge."""
    num_splits: int
    suffix_splits: int
    suffix: SuffixTiling
    path = "mgpu_two_launch"


@_frozen
class MgpuOneLaunch:
    """Prefix and suffix tasks interleaved in one Mosaic GPU launch, then one XLA merge."""
    num_splits: int
    suffix_splits: int
    block_s: int
    suffix_steps: int
    path = "mgpu_one_launch"


@_frozen
class MgpuJoint:
    """One Mosaic GPU pass streaming each CTA's suffix tiles through the prefix pipeline."""
    num_splits: int
    block_kv: int
    block_s: int
    steps: int
    schedule_barrier: bool
    path = "mgpu_joint"


@_frozen
class MgpuSplit:
    """SMs split by role in one Mosaic GPU launch (persistent prefix CTAs beside suffix-streaming
    CTAs), then one XLA merge."""
    prefix_ctas: int
    stream_ctas: int
    num_splits: int
    smem_bytes: int
    path = "mgpu_split"


@_frozen
class ChunkPlan:
    """Query positions ``[start, stop)`` run by ``leaf`` (one of the leaf plans above)."""
    start: int
    stop: int
    leaf: object


@_frozen
class BackwardPlan:
    """``mode="kernels"``: the flash backward kernels with the merged statistics (prefix kernel
    key / row splits, suffix kernel key splits); ``"reference"``: autodiff of the reference."""
    mode: str = "kernels"
    prefix_key_splits: int = 1
    prefix_row_splits: int = 1
    suffix_key_splits: int = 1


@_frozen
class SharedPrefixPlan:
    """A complete plan: ``impl`` (``"shared"``, ``"flat"``, ``"reference"``), ``path`` (the
    leaf), the shapes it was made for, its query chunks, the backward and interpret mode."""
    impl: str
    path: str
    shapes: Shapes
    chunks: tuple
    backward: BackwardPlan
    interpret: bool = False
