"""Cost model of the planner: modelled seconds of the kernels of each leaf plan (each leaf
module of :mod:`jax_prefix_attn.leaves` charges itself through these functions).

Both families are exact; they differ in memory traffic, tensor-core work, parallelism and
launches.  With ``B`` sequences, ``Tq`` queries each, ``Hq``/``Hkv`` heads of size ``D``, ``G``
prefix groups of padded length ``P``, suffix capacity ``S`` and ``e`` bytes per element, one
token of K+V is ``kv = 2 * Hkv * D * e`` bytes.  Each kernel costs

    t = max(max(bytes / BW, flops / MMA) / util, serial_keys * T_KEY) + T_LAUNCH
    util = min(1, programs / slots)       # serial_keys: one program's chain of keys (latency)

(``util`` models a grid too small to fill the GPU; ``slots``: the profile's ``slots_per_sm``
programs per SM), and

* **flat** (one ragged split-KV decode launch over shared storage, + one small XLA merge when
  the plan splits the keys): DRAM ``bytes = (G * P + B * S) * kv``; the other
  ``(B - G) * P * kv`` bytes of prefix re-reads by every sequence come from L2 (all sequences
  stream the same prefix at the same time), charged at ``L2``.  Matrix-vector flops never
  bind.
* **shared**, Triton leaves: prefix ``bytes = G * P * kv``, ``flops = 4 * rows * Hkv * P * D``
  (``R2`` = query rows per sequence and kv head, padded to a power of two, in row blocks of 128
  or 64 rows, the prefix split to fill the GPU) at the Triton tensor-core rate ``MMA``; suffix
  ``bytes = B * S * kv`` plus the float32 partials, split as the plan splits it.  The two-launch
  leaf runs them in sequence (+ one XLA merge when the suffix is split); the overlap leaf
  ``max`` of the two plus the profile's ``overlap_serial_share`` of the smaller (imperfect
  overlap) + one XLA merge.
* **shared**, Mosaic GPU leaves: q row gather, the prefix kernel (one CTA per SM, ``MMA_MGPU``,
  the plan's prefix splits; no per-key latency term: 128-key TMA tiles prefetched two ahead),
  the suffix kernel (the plan's suffix splits) and one XLA merge, in sequence.  The planner
  charges the one-launch, one-pass and role-split leaves as this two-launch leaf: an
  overestimate where they run, where the flat family is several times slower, so no choice
  changes.

Every function takes the device profile
(:func:`jax_prefix_attn.device_profile.planning_profile`, :func:`rates`): ``BW`` is the share
``copy_share`` of the profile's copy rate that the decode kernels stream at, ``MMA`` and
``MMA_MGPU`` the shares ``mma_share`` and ``mma_mgpu_share`` of its matmul rate that the Triton
and the Mosaic GPU prefix kernels reach, ``L2``, ``T_LAUNCH``, ``T_KEY`` its
``l2_bytes_per_s``, ``launch_s`` and ``key_latency_s`` (``flat_key_latency_s`` in the flat
kernel), and the SM count the device's.  Each part's values are in its data file
(``jax_prefix_attn/device_data/``).
RelayAttention's speedup model ``p = (s + c + 2) / (s / b + c + 7)`` is this comparison without
the flops, parallelism and L2 terms.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_prefix_attn.device_profile import DeviceProfile
from jax_prefix_attn.leaves.base import Shapes
from pallas_kernels._common import cdiv, next_pow2

__all__ = ["Rates", "rates", "flat_seconds", "mgpu_two_launch_seconds",
           "triton_two_launch_seconds", "triton_overlap_seconds"]


@dataclasses.dataclass(frozen=True)
class Rates:
    """The kernels' rates on one device: bytes/s of the decode kernels (``bw``), FLOP/s of the
    Triton (``mma``) and of the Mosaic GPU (``mma_mgpu``) prefix kernels, bytes/s of prefix
    re-reads served by L2 (``l2``), seconds per launch (``launch``) and per key on a program's
    critical path (``t_key``; ``t_key_flat`` in the flat kernel), programs per SM that reach
    full bandwidth (``slots_per_sm``), the share of the smaller of two overlapped launches that
    stays serial (``overlap_serial_share``)."""
    bw: float
    mma: float
    mma_mgpu: float
    l2: float
    launch: float
    t_key: float
    t_key_flat: float
    slots_per_sm: float
    overlap_serial_share: float


def rates(profile: DeviceProfile) -> Rates:
    """The kernels' :class:`Rates` from a device profile
    (:func:`jax_prefix_attn.device_profile.planning_profile`)."""
    return Rates(profile.copy_share * profile.copy_bytes_per_s,
                 profile.mma_share * profile.matmul_flops_per_s,
                 profile.mma_mgpu_share * profile.matmul_flops_per_s, profile.l2_bytes_per_s,
                 profile.launch_s, profile.key_latency_s, profile.flat_key_latency_s,
                 profile.slots_per_sm, profile.overlap_serial_share)


def _kernel_s(r: Rates, nbytes: float, flops: float, programs: int, slots: float, *,
              l2_bytes: float = 0.0, serial_keys: float = 0.0, mgpu: bool = False,
              flat: bool = False) -> float:
    util = min(1.0, programs / slots)
    throughput = max(nbytes / r.bw + l2_bytes / r.l2,
                     flops / (r.mma_mgpu if mgpu else r.mma)) / util
    return max(throughput, serial_keys * (r.t_key_flat if flat else r.t_key)) + r.launch


def _common_terms(s: Shapes):
    e = jnp.dtype(s.dtype).itemsize
    kv = 2 * s.heads_kv * s.head_dim * e
    q_bytes = 2 * s.batch * s.tq * s.heads_q * s.head_dim * e  # q in, out written
    return kv, q_bytes, min(s.groups, s.batch)


def flat_seconds(s: Shapes, num_splits: int, profile: DeviceProfile) -> float:
    """Modelled seconds of a flat decode leaf with ``num_splits`` key splits."""
    r = rates(profile)
    b, p, sl, hkv = s.batch, s.prefix_len, s.suffix_len, s.heads_kv
    kv, q_bytes, g = _common_terms(s)
    slots = r.slots_per_sm * profile.sm_count
    splits = num_splits
    t = _kernel_s(r, (g * p + b * sl) * kv + q_bytes, 0.0, b * hkv * splits, slots,
                  l2_bytes=(b - g) * p * kv, serial_keys=cdiv(p + sl, splits), flat=True)
    if splits > 1:  # XLA merge of float32 partials: the real rows when decoding, else rows
        # padded to >= 16 per (sequence, kv head)
        rows_m = b * s.heads_q if s.tq == 1 else b * hkv * max(16, next_pow2(s.tq * s.group))
        t += _kernel_s(r, 2 * splits * rows_m * (s.head_dim + 1) * 4, 0.0, 2 * profile.sm_count,
                       slots)
    return t


def mgpu_two_launch_seconds(s: Shapes, num_splits: int, suffix_splits: int,
                            profile: DeviceProfile) -> float:
    """Modelled seconds of the Mosaic GPU two-launch leaf (``num_splits`` prefix splits,
    ``suffix_splits`` suffix splits): q gather, prefix kernel, suffix kernel, XLA merge."""
    r = rates(profile)
    b, p, sl, hkv, d = s.batch, s.prefix_len, s.suffix_len, s.heads_kv, s.head_dim
    kv, q_bytes, g = _common_terms(s)
    sms = profile.sm_count
    slots = r.slots_per_sm * sms
    r2 = next_pow2(s.tq * s.group)
    e = jnp.dtype(s.dtype).itemsize
    m128 = cdiv(b * r2, 128) * 128
    ctas = hkv * (m128 // 128) * num_splits
    part16 = num_splits * hkv * m128 * (d * e + 4)
    t_prefix = _kernel_s(r, g * p * kv + part16, 4.0 * m128 * hkv * p * d, ctas, sms, mgpu=True)
    ss = suffix_splits
    t_suffix = _kernel_s(r, b * sl * kv + q_bytes, 0.0, b * hkv * ss, slots,
                         serial_keys=cdiv(sl, ss))
    n_parts = num_splits + ss
    t_merge = _kernel_s(r, part16 + n_parts * b * s.heads_q * (d + 1) * 4 + q_bytes, 0.0,
                        2 * sms, slots)
    t_gather = _kernel_s(r, q_bytes, 0.0, 2 * sms, slots)
    return t_gather + t_prefix + t_suffix + t_merge


def triton_two_launch_seconds(s: Shapes, suffix_splits: int, profile: DeviceProfile) -> float:
    """Modelled seconds of the Triton two-launch leaf: the prefix kernel, then the suffix
    kernel reading its partials (+ one XLA merge when the suffix is split)."""
    return _triton_seconds(s, suffix_splits, profile, overlap=False)


def triton_overlap_seconds(s: Shapes, suffix_splits: int, profile: DeviceProfile) -> float:
    """Modelled seconds of the Triton overlap leaf: ``max`` of its prefix and suffix programs
    plus the profile's ``overlap_serial_share`` of the smaller (imperfect overlap), then one XLA
    merge."""
    return _triton_seconds(s, suffix_splits, profile, overlap=True)


def _triton_seconds(s: Shapes, ss: int, profile: DeviceProfile, *, overlap: bool) -> float:
    r = rates(profile)
    b, p, sl, hkv, d = s.batch, s.prefix_len, s.suffix_len, s.heads_kv, s.head_dim
    kv, q_bytes, g = _common_terms(s)
    sms = profile.sm_count
    slots = r.slots_per_sm * sms
    # the Triton prefix kernel as the model sizes it: row blocks of 128 or 64 rows, the prefix
    # split to fill the GPU
    rows = b * next_pow2(s.tq * s.group)
    block_m = 128 if rows >= 1024 else 64
    n_rb = cdiv(rows + 16, block_m)
    p_splits = (1 if hkv * n_rb >= 2 * sms
                else max(1, min(cdiv(2 * sms, hkv * n_rb), cdiv(p, 256))))
    merge_rows = b * s.tq * s.heads_q * (d + 1) * 4
    if overlap:
        # its suffix programs do not read the prefix partials (its XLA merge does), and its
        # prefix rows are not padded for a suffix pass
        t_suffix = _kernel_s(r, b * sl * kv + q_bytes, 0.0, b * hkv * ss, slots,
                             serial_keys=cdiv(sl, ss))
        n_rb = cdiv(rows, block_m)
        t_prefix = _kernel_s(r, g * p * kv + p_splits * n_rb * block_m * hkv * (d + 1) * 4,
                             4.0 * n_rb * block_m * hkv * p * d, hkv * n_rb * p_splits, slots,
                             serial_keys=cdiv(p, p_splits))
        return (max(t_prefix, t_suffix) + r.overlap_serial_share * min(t_prefix, t_suffix)
                + _kernel_s(r, 2 * (p_splits + ss) * merge_rows, 0.0, 2 * sms, slots))
    partial_bytes = p_splits * n_rb * block_m * hkv * (d + 1) * 4
    t_prefix = _kernel_s(r, g * p * kv + partial_bytes, 4.0 * n_rb * block_m * hkv * p * d,
                         hkv * n_rb * p_splits, slots, serial_keys=cdiv(p, p_splits))
    t = t_prefix + _kernel_s(r, b * sl * kv + q_bytes + partial_bytes, 0.0, b * hkv * ss, slots,
                             serial_keys=cdiv(sl, ss))
    if ss > 1:
        t += _kernel_s(r, (p_splits + ss) * merge_rows, 0.0, 2 * sms, slots)
    return t
