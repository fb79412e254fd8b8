"""Leaf ``flat_mgpu_stream``: flat decode on Mosaic GPU.

The stream-only Mosaic GPU launch (:func:`pallas_kernels.suffix_decode_mgpu.suffix_decode_partials_mgpu`)
twice: over each sequence's prefix (the rows of its group in ``prefix_k/v [G, P, Hkv, D]``,
read through ``seq_to_prefix``: no copy) and over its own suffix, then one XLA merge.  Like the
other flat leaves it reads the prefix once per sequence, so it pays where the batch is small.
It runs where the stream role takes both key axes (decode, ``Hq / Hkv`` a power of two up to
16, head_dim 64 or 128, ``P`` and ``S`` multiples of 64); the planner chooses it only inside the
device's ``flat_stream_regions`` (a device whose data file lists none leaves it to ``path=``).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_prefix_attn.leaves import flat_rows
from jax_prefix_attn.leaves.base import Shapes, measured_region_why_not, supported, tuning
from pallas_kernels import suffix_decode_mgpu, suffix_stream_mgpu
from pallas_kernels._common import cdiv, merge_row_parts, rows_128

__all__ = ["FlatMgpuStream", "PATH", "FAMILY", "PLAN", "unsupported", "why_not", "build",
           "seconds", "run"]


@dataclasses.dataclass(frozen=True)
class FlatMgpuStream:
    """The stream-only launch over the prefixes (``prefix_ctas`` CTAs) and over the suffixes
    (``suffix_ctas``), ``stream_wgs`` workers per CTA, then one XLA merge."""
    prefix_ctas: int
    suffix_ctas: int
    stream_wgs: int
    smem_bytes: int
    path = "flat_mgpu_stream"


PATH = "flat_mgpu_stream"
FAMILY = "flat"
PLAN = FlatMgpuStream


def unsupported(s: Shapes, dev, interpret: bool) -> str | None:
    why = supported(s)
    if why is not None:
        return why
    if s.tq != 1:
        return f"the Mosaic GPU decode leaves take Tq=1, got Tq={s.tq}"
    if not interpret and not dev.mosaic_gpu_ok:
        return f"Mosaic GPU kernels need a GPU of compute capability >= 9.0, got {dev.name}"
    for what, cap in (("prefix", s.prefix_len), ("suffix", s.suffix_len)):
        why = suffix_decode_mgpu.suffix_decode_supported(
            batch=s.batch, heads_q=s.heads_q, heads_kv=s.heads_kv, suffix_cap=cap,
            head_dim=s.head_dim, dtype=s.dtype, smem_bytes=dev.smem_per_block)
        if why is not None:
            return f"the {what} axis: {why}"
    return None


def why_not(s: Shapes, dev, interpret: bool = False) -> str | None:
    why = unsupported(s, dev, interpret)
    if why is not None:
        return why
    if interpret:
        return "interpret mode runs a Mosaic GPU leaf only when the plan forces it"
    return measured_region_why_not(s, tuning(dev).flat_stream_regions, dev)


def build(s: Shapes, dev, interpret: bool) -> FlatMgpuStream:
    tasks = cdiv(s.batch * s.group, suffix_stream_mgpu.cols_for(s.group)) * s.heads_kv
    ctas = min(2 if interpret else dev.sm_count, tasks)   # (the interpreter simulates each CTA)
    return FlatMgpuStream(prefix_ctas=ctas, suffix_ctas=ctas,
                          stream_wgs=suffix_decode_mgpu.STREAM_WGS,
                          smem_bytes=dev.smem_per_block)


def seconds(s: Shapes, dev, interpret: bool) -> float:
    """Charged as the row-layout flat decode (:mod:`flat_rows`), which reads the same bytes."""
    return flat_rows.seconds(s, dev, interpret)


def run(leaf: FlatMgpuStream, q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, lim_p,
        lim_s, *, scale, interpret, prefix_len_g):
    """The prefix pass (each sequence through its group's row) and the suffix pass, then one
    XLA merge."""
    b, _, hq, d = q.shape
    hkv = prefix_k.shape[2]
    g = hq // hkv
    q = q.astype(prefix_k.dtype)
    qm, _ = rows_128(q, hkv, g)
    kw = dict(scale=float(scale), group=g, smem_bytes=leaf.smem_bytes,
              stream_wgs=leaf.stream_wgs, interpret=interpret)
    o_p, lse_p = suffix_decode_mgpu.suffix_decode_partials_mgpu(
        qm, prefix_k, prefix_v, lim_p[:, 0], stream_ctas=leaf.prefix_ctas,
        kv_rows=seq_to_prefix.astype(jnp.int32), **kw)
    o_s, lse_s = suffix_decode_mgpu.suffix_decode_partials_mgpu(
        qm, suffix_k, suffix_v, lim_s[:, 0], stream_ctas=leaf.suffix_ctas, **kw)
    return merge_row_parts([(o_p, lse_p, g), (o_s, lse_s, g)], b=b, tq=1, hq=hq, r=g,
                           dtype=q.dtype, inv=None)
