"""Cost model choosing between the shared and the flat path of shared-prefix attention.

Both paths are exact; they differ in memory traffic, tensor-core work and launches.  With
``B`` sequences, ``Tq`` queries each, ``Hq``/``Hkv`` heads of size ``D``, ``G`` prefix groups of
padded length ``P``, suffix capacity ``S`` and ``e`` bytes per element, one token of K+V is
``kv = 2 * Hkv * D * e`` bytes, and

* **flat** (one ragged split-KV decode launch, + one small merge when keys are split):
  ``bytes = B * (P + S) * kv`` (every sequence reads its prefix through the index map),
  flops are matrix-vector (never the bound);
  ``t_flat = bytes / BW + launches * t_launch``.
* **shared** (batched prefix kernel + suffix kernel with fused merge: 2 launches):
  prefix ``bytes = G * P * kv * reread`` (each tile read about once per group, ``reread``
  accounts for the row blocks that do not share it in L2), prefix
  ``flops = 4 * B * R2 * Hkv * P * D`` (``R2`` = rows per sequence and kv head padded to a power
  of two) at the Triton tensor-core rate ``MMA``, suffix ``bytes = B * S * kv`` plus the float32
  partials written and read back; ``t_shared = max(bytes_p / BW, flops / MMA) + bytes_s / BW +
  2 * t_launch``.

``BW``, ``MMA`` and ``t_launch`` default to values measured for these kernels on an H100/H200
(see ``bench/results/shared_prefix_*.json``); the choice depends only on static shapes.
RelayAttention's model ``p = (s + c + 2) / (s / b + c + 7)`` is the same comparison with the
flops term dropped.
"""
from __future__ import annotations

import dataclasses

__all__ = ["PathCosts", "estimate", "choose_path"]

BW = 2.6e12          # bytes/s the decode kernels stream at (about 80-85% of copy bandwidth)
MMA = 1.8e14         # FLOP/s of the Triton-lowered prefix kernel's dots
T_LAUNCH = 5e-6      # seconds per extra kernel launch / dependent stage
REREAD = 1.25        # prefix tile traffic multiplier of the batched kernel (L2 misses)


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class PathCosts:
    flat_s: float
    shared_s: float
    flat_bytes: float
    shared_bytes: float
    shared_flops: float

    @property
    def choice(self) -> str:
        return "shared" if self.shared_s <= self.flat_s else "flat"


def estimate(*, batch: int, tq: int, heads_q: int, heads_kv: int, head_dim: int, groups: int,
             prefix_len: int, suffix_len: int, itemsize: int, bw: float = BW, mma: float = MMA,
             t_launch: float = T_LAUNCH) -> PathCosts:
    """Modelled seconds of both paths (see the module docstring)."""
    kv = 2 * heads_kv * head_dim * itemsize
    q_bytes = 2 * batch * tq * heads_q * head_dim * itemsize  # q in, out written
    flat_bytes = batch * (prefix_len + suffix_len) * kv + q_bytes
    flat_programs = batch * heads_kv
    flat_launches = 1 if flat_programs >= 264 else 2
    flat_s = flat_bytes / bw + flat_launches * t_launch

    rows = batch * _next_pow2(tq * heads_q // heads_kv)
    prefix_bytes = min(groups, batch) * prefix_len * kv * REREAD
    prefix_flops = 4.0 * rows * heads_kv * prefix_len * head_dim
    partial_bytes = 2 * rows * heads_kv * (head_dim + 1) * 4 * 2
    suffix_bytes = batch * suffix_len * kv + q_bytes + partial_bytes
    shared_s = (max(prefix_bytes / bw, prefix_flops / mma) + suffix_bytes / bw + 2 * t_launch)
    return PathCosts(flat_s=flat_s, shared_s=shared_s, flat_bytes=flat_bytes,
                     shared_bytes=prefix_bytes / REREAD + suffix_bytes, shared_flops=prefix_flops)


def choose_path(**shapes) -> str:
    """``"shared"`` or ``"flat"``, whichever :func:`estimate` finds faster."""
    return estimate(**shapes).choice
