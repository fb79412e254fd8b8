"""Leaf ``mgpu_split``: the SMs split by role in one Mosaic GPU launch (persistent prefix CTAs
on the tensor cores beside suffix-streaming CTAs on HBM), then one XLA merge.

Taken in the Mosaic GPU region with ``G`` the device's ``split_group``, ``B * G`` at least its
``split_min_rows``, ``D = 128`` and (prefix, suffix) in one of its ``split_regions``; the role
split itself comes from a two-term time model (:func:`plan_roles`, with the profile's role
rates).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_prefix_attn.leaves import mgpu_two_launch
from jax_prefix_attn.device_profile import DeviceProfile, default_profile, device_profile
from jax_prefix_attn.leaves.base import Shapes, describe_regions, supported, tuning
from jax_prefix_attn.leaves.mgpu_prefix import (decode_operands, mosaic_unsupported,
                                                region_why_not)
from pallas_kernels import split_decode_mgpu, suffix_stream_mgpu
from pallas_kernels._common import cdiv, merge_row_parts, rows_128

__all__ = ["MgpuSplit", "PATH", "FAMILY", "PLAN", "plan_roles", "split_region", "unsupported",
           "why_not", "build", "seconds", "run"]


@dataclasses.dataclass(frozen=True)
class MgpuSplit:
    """SMs split by role in one Mosaic GPU launch (persistent prefix CTAs beside suffix-streaming
    CTAs), then one XLA merge."""
    prefix_ctas: int
    stream_ctas: int
    num_splits: int
    smem_bytes: int
    path = "mgpu_split"


PATH = "mgpu_split"
FAMILY = "shared"
PLAN = MgpuSplit


def _kernel_why_not(s: Shapes, dev) -> str | None:
    return split_decode_mgpu.split_supported(
        batch=s.batch, heads_q=s.heads_q, heads_kv=s.heads_kv, prefix_len=s.prefix_len,
        suffix_cap=s.suffix_len, head_dim=s.head_dim, dtype=s.dtype,
        smem_bytes=dev.smem_per_block)


def split_region(s: Shapes, dev) -> bool:
    """Where the role split was measured to beat the other Mosaic GPU leaves (given the Mosaic
    GPU region): the device's ``split_group``, ``split_min_rows`` and ``split_regions``."""
    t = tuning(dev)
    return (_kernel_why_not(s, dev) is None and s.group == t.split_group
            and s.batch * s.group >= t.split_min_rows and s.head_dim == 128
            and any(p0 <= s.prefix_len <= p1 and s0 <= s.suffix_len <= s1
                    for (p0, p1), (s0, s1) in t.split_regions))


def plan_roles(s: Shapes, sms: int, profile: DeviceProfile | None = None) -> tuple[int, int, int]:
    """``(prefix_ctas, num_splits, stream_ctas)`` of the role-split launch: the split of the
    ``sms`` SMs that a two-term time model finds fastest.  For prefix splits ``c`` in (1, 2, 4,
    8) dividing the 128-key tiles and each number of rounds ``r`` of its ``T`` tasks (on
    ``n = ceil(T / r)`` CTAs): ``max(r * (task flops / F + T0), suffix bytes / (m * W))`` with
    ``m = sms - n`` stream CTAs (at most the suffix tasks).  ``F``, ``T0``, ``W``: the profile's
    ``role_prefix_flops_per_cta`` (the prefix role's rate per CTA), ``role_task_s`` (fixed cost
    of a prefix task: pipeline fill, q load, output) and ``role_stream_bytes_per_s`` (suffix K/V
    bytes per stream CTA, latency bound); default the planning device's profile."""
    p = default_profile() if profile is None else profile
    g = s.group
    m_blocks = cdiv(s.batch * g, 128)
    n_tiles = s.prefix_len // 128
    s_tasks = cdiv(s.batch * g, suffix_stream_mgpu.cols_for(g)) * s.heads_kv
    s_bytes = 2 * s.batch * s.suffix_len * s.heads_kv * s.head_dim * jnp.dtype(s.dtype).itemsize
    best = None
    for splits in (1, 2, 4, 8):
        if n_tiles % splits:
            continue
        tasks = s.heads_kv * m_blocks * splits
        t_task = (4.0 * 128 * (s.prefix_len // splits) * s.head_dim / p.role_prefix_flops_per_cta
                  + p.role_task_s)
        for rounds in range(1, tasks + 1):
            n = cdiv(tasks, rounds)
            if n > sms - 1:
                continue
            m = min(sms - n, s_tasks)
            t = max(rounds * t_task, s_bytes / (m * p.role_stream_bytes_per_s))
            if best is None or t < best[0] * (1 - 1e-9):
                best = (t, n, splits, m)
            if n == 1:
                break
    return best[1], best[2], best[3]


def unsupported(s: Shapes, dev, interpret: bool) -> str | None:
    return supported(s) or mosaic_unsupported(s, dev, interpret) or _kernel_why_not(s, dev)


def why_not(s: Shapes, dev, interpret: bool = False) -> str | None:
    why = unsupported(s, dev, interpret) or region_why_not(s, dev, interpret)
    if why is None and not split_region(s, dev):
        t = tuning(dev)
        why = (f"outside the role split's region (G = {t.split_group}, B * G >= "
               f"{t.split_min_rows}, D = 128, {describe_regions(t.split_regions)})")
    return why


def build(s: Shapes, dev, interpret: bool) -> MgpuSplit:
    # (Mosaic GPU's CPU interpreter simulates every CTA: there, a 4-SM split of the work)
    n, splits, m = plan_roles(s, 4 if interpret else dev.sm_count, device_profile(dev)[0])
    return MgpuSplit(prefix_ctas=n, stream_ctas=m, num_splits=splits,
                     smem_bytes=dev.smem_per_block)


def seconds(s: Shapes, dev, interpret: bool) -> float:
    """Charged as the two launches it replaces (:func:`mgpu_two_launch.seconds`)."""
    return mgpu_two_launch.seconds(s, dev, interpret)


def run(leaf: MgpuSplit, q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, lim_p, lim_s,
        *, scale, interpret, prefix_len_g):
    q, pk, pv, p_len = decode_operands(q, prefix_k, prefix_v, lim_p, prefix_len_g)
    b, _, hq, d = q.shape
    hkv = pk.shape[1]
    g = hq // hkv
    qm, _ = rows_128(q, hkv, g)
    (o_pre, l_pre), (o_s, l_s) = split_decode_mgpu.split_decode_partials_mgpu(
        qm, pk, pv, p_len, suffix_k, suffix_v, lim_s[:, 0], scale=float(scale), group=g,
        prefix_ctas=leaf.prefix_ctas, stream_ctas=leaf.stream_ctas, num_splits=leaf.num_splits,
        smem_bytes=leaf.smem_bytes, schedule_barrier=True, interpret=interpret)
    return merge_row_parts([(o_pre, l_pre, g), (o_s, l_s, g)], b=b, tq=1, hq=hq, r=g,
                           dtype=q.dtype, inv=None)
