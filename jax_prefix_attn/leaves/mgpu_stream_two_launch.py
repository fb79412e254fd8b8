"""Leaf ``mgpu_stream_two_launch``: the Mosaic GPU prefix kernel and the stream-only Mosaic GPU
suffix launch (:mod:`pallas_kernels.suffix_decode_mgpu`, every CTA streaming suffixes), then one
XLA merge: the two-launch decode step with no Triton kernel.

It runs where the Mosaic GPU prefix kernel and the stream role take the shapes (decode,
``Hq / Hkv`` a power of two up to 16, head_dim 64 or 128, whole 128-key prefix tiles, suffix
capacity a multiple of 64), with one prefix or several: with several, each prefix group's rows
take row blocks of their own and each block reads its group's prefix
(:func:`jax_prefix_attn.leaves.mgpu_prefix.mgpu_grouped_prefix_partials`).  The planner chooses
it only inside the device's ``stream_two_launch_regions`` (within the Mosaic GPU region, one
prefix); a device whose data file lists none leaves it to ``path=``.
"""
from __future__ import annotations

import dataclasses

from jax_prefix_attn.leaves import mgpu_two_launch
from jax_prefix_attn.leaves.base import Shapes, measured_region_why_not, supported, tuning
from jax_prefix_attn.leaves.mgpu_prefix import (decode_operands, mgpu_grouped_prefix_partials,
                                                mgpu_prefix_partials, mgpu_splits,
                                                region_why_not)
from pallas_kernels import suffix_decode_mgpu, suffix_stream_mgpu
from pallas_kernels._common import cdiv, merge_row_parts, next_pow2, rows_128
from pallas_kernels.prefix_attention_mgpu import mgpu_supported

__all__ = ["MgpuStreamTwoLaunch", "PATH", "FAMILY", "PLAN", "unsupported", "why_not", "build",
           "seconds", "run"]

@dataclasses.dataclass(frozen=True)
class MgpuStreamTwoLaunch:
    """The Mosaic GPU prefix kernel (``num_splits`` key splits) and the stream-only suffix
    launch (``stream_ctas`` CTAs of ``stream_wgs`` workers), then one XLA merge."""
    num_splits: int
    stream_ctas: int
    stream_wgs: int
    smem_bytes: int
    path = "mgpu_stream_two_launch"


PATH = "mgpu_stream_two_launch"
FAMILY = "shared"
PLAN = MgpuStreamTwoLaunch


def _stream_why_not(s: Shapes, dev) -> str | None:
    return suffix_decode_mgpu.suffix_decode_supported(
        batch=s.batch, heads_q=s.heads_q, heads_kv=s.heads_kv, suffix_cap=s.suffix_len,
        head_dim=s.head_dim, dtype=s.dtype, smem_bytes=dev.smem_per_block)


def _prefix_why_not(s: Shapes, dev, interpret: bool) -> str | None:
    if s.tq != 1:
        return f"the Mosaic GPU decode leaves take Tq=1, got Tq={s.tq}"
    if not interpret and not dev.mosaic_gpu_ok:
        return f"Mosaic GPU kernels need a GPU of compute capability >= 9.0, got {dev.name}"
    blocks = cdiv(s.batch * next_pow2(s.group), 128) + s.groups - 1     # (grouped_rows)
    return mgpu_supported(rows=blocks * 128, prefix_len=s.prefix_len, head_dim=s.head_dim,
                          dtype=s.dtype)


def unsupported(s: Shapes, dev, interpret: bool) -> str | None:
    return supported(s) or _prefix_why_not(s, dev, interpret) or _stream_why_not(s, dev)


def why_not(s: Shapes, dev, interpret: bool = False) -> str | None:
    why = unsupported(s, dev, interpret) or region_why_not(s, dev, interpret)
    if why is not None:
        return why
    return measured_region_why_not(s, tuning(dev).stream_two_launch_regions, dev)


def build(s: Shapes, dev, interpret: bool) -> MgpuStreamTwoLaunch:
    tasks = cdiv(s.batch * s.group, suffix_stream_mgpu.cols_for(s.group)) * s.heads_kv
    ctas = 2 if interpret else dev.sm_count   # (Mosaic GPU's CPU interpreter simulates every CTA)
    return MgpuStreamTwoLaunch(num_splits=mgpu_splits(s, dev), stream_ctas=min(ctas, tasks),
                               stream_wgs=suffix_decode_mgpu.STREAM_WGS,
                               smem_bytes=dev.smem_per_block)


def seconds(s: Shapes, dev, interpret: bool) -> float:
    """Charged as the two launches of :mod:`mgpu_two_launch`."""
    return mgpu_two_launch.seconds(s, dev, interpret)


def run(leaf: MgpuStreamTwoLaunch, q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix,
        lim_p, lim_s, *, scale, interpret, prefix_len_g):
    """The prefix kernel (one prefix, or each group's rows in blocks of their own) and the
    stream-only suffix launch (independent), then one XLA merge."""
    b, _, hq, d = q.shape
    hkv = prefix_k.shape[2]
    g = hq // hkv
    if prefix_k.shape[0] == 1:
        q, pk, pv, p_len = decode_operands(q, prefix_k, prefix_v, lim_p, prefix_len_g)
        o_pre, lse_pre = mgpu_prefix_partials(q[:, 0], pk, pv, p_len, scale=scale,
                                              num_splits=leaf.num_splits, interpret=interpret)
    else:
        q = q.astype(prefix_k.dtype)
        o_pre, lse_pre = mgpu_grouped_prefix_partials(
            q[:, 0], prefix_k, prefix_v, prefix_len_g, seq_to_prefix, scale=scale,
            num_splits=leaf.num_splits, interpret=interpret)
    qm, _ = rows_128(q, hkv, g)
    o_s, lse_s = suffix_decode_mgpu.suffix_decode_partials_mgpu(
        qm, suffix_k, suffix_v, lim_s[:, 0], scale=float(scale), group=g,
        stream_ctas=leaf.stream_ctas, smem_bytes=leaf.smem_bytes, stream_wgs=leaf.stream_wgs,
        interpret=interpret)
    return merge_row_parts([(o_pre, lse_pre, next_pow2(g)), (o_s, lse_s, g)], b=b, tq=1, hq=hq,
                           r=g, dtype=q.dtype, inv=None)
