"""The Triton prefix pass shared by the ``triton_two_launch`` and ``triton_overlap`` leaves (and
the row layout of ``flat_rows``): its tiling and the prefix rows it reads.

The prefix pass batches all sequences' query rows (``R2`` rows per sequence and kv head, sorted
by prefix group) into row blocks of one kernel call; its tiling fills the GPU with two programs
per SM by splitting the prefix when the (kv head, row block) programs are fewer.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_prefix_attn.device_profile import Tuning, default_profile
from jax_prefix_attn.leaves.base import PrefixTiling, Shapes, supported, tuning
from jax_prefix_attn.leaves.mgpu_prefix import mosaic_region
from pallas_kernels._common import cdiv, next_pow2, pad_rows, row_meta, rows_from_q, seq_rows

__all__ = ["large_m_layout", "prefix_tiling", "triton_why_not", "prefix_rows"]


def large_m_layout(batch: int, rows_per_seq: int, heads_kv: int, target: int) -> bool:
    """Enough rows that the Triton prefix kernel runs unsplit 128-row blocks (the configuration
    of the two-phase key loop)."""
    m = batch * next_pow2(rows_per_seq)
    return m >= 1024 and heads_kv * cdiv(m + 16, 128) >= target


def prefix_tiling(batch: int, rows_per_seq: int, heads_kv: int, prefix_len: int,
                  target: int, *, tuned: Tuning | None = None) -> PrefixTiling:
    """Tiling of the Triton prefix kernel: ``target`` programs (two per SM) by splitting the
    prefix when the (kv head, row block) programs are fewer.  ``tuned``: the device's tuning
    (its ``prefix_tiling``, and ``large_m_tiling`` with the two-phase key loop where the rows
    run unsplit 128-row blocks); default the planning device's."""
    t = default_profile().tuning if tuned is None else tuned
    block_k, num_warps, num_stages = t.prefix_tiling
    r2 = next_pow2(rows_per_seq)
    m = batch * r2
    block_m = 128 if m >= 1024 else 64 if m >= 64 else max(32, next_pow2(m))
    block_m = max(block_m, r2)
    programs = heads_kv * cdiv(m + 16, block_m)  # +16: the suffix pass reads past the last row
    splits = 1
    if programs < target:
        splits = max(1, min(cdiv(target, programs), cdiv(prefix_len, 4 * block_k)))
    if splits == 1 and block_m == 128 and large_m_layout(batch, rows_per_seq, heads_kv, target):
        large_k, large_warps, large_stages = t.large_m_tiling
        return PrefixTiling(block_m, large_k, 1, large_warps, large_stages, two_phase=True)
    return PrefixTiling(block_m, block_k, splits, num_warps, num_stages)


def triton_why_not(s: Shapes, dev, interpret: bool, *, overlap: bool) -> str | None:
    """``None`` where the planner may choose the Triton overlap leaf (``overlap``) or the
    two-launch leaf: the kernels run, the Mosaic GPU region does not hold, and the (sequence,
    kv head) suffix programs are fewer than the device's ``overlap_below_programs`` (overlap) or
    not."""
    why = supported(s)
    below = tuning(dev).overlap_below_programs
    if why is None and mosaic_region(s, dev, interpret):
        why = "the Mosaic GPU region holds: its prefix kernel is faster than the Triton one"
    programs = s.batch * s.heads_kv
    if why is None and overlap and programs >= below:
        why = (f"B * Hkv = {programs} >= {below} suffix programs fill the GPU: two launches "
               f"(triton_two_launch) are faster")
    if why is None and not overlap and programs < below:
        why = (f"B * Hkv = {programs} < {below} suffix programs: the overlap launch "
               f"(triton_overlap) is faster")
    return why


def prefix_rows(cfg: PrefixTiling, q, seq_to_prefix, lim_p, *, groups: int, hkv: int, r2: int,
                tail_rows: int):
    """The prefix pass's rows: ``(order, inv, qp [Hkv, M_pad, D], grp_rows [M_pad],
    lim_rows [M_pad])``.  ``order``/``inv``: the sequences sorted by prefix group and back
    (``None`` with one group); ``R2`` rows per sequence, padded by ``tail_rows`` (rows a suffix
    pass reads past the last sequence) up to whole ``cfg.block_m`` blocks.  Padding rows (zero
    queries, results never used) take the last real row's entry and limit, so they load no key
    that the real rows of their block do not (a prefix may hold anything, NaN included, past its
    length: ``0 * NaN`` in ``p @ v`` would reach those rows)."""
    b = q.shape[0]
    grp = q.shape[2] // hkv
    if groups == 1:
        order = inv = None
        s2p_sorted = np.zeros((b,), np.int32)  # (a constant: see ``seq_rows``)
    else:
        order = jnp.argsort(seq_to_prefix, stable=True).astype(jnp.int32)
        inv = jnp.argsort(order).astype(jnp.int32)
        s2p_sorted = seq_to_prefix[order]
    m = b * r2
    m_pad = cdiv(m + tail_rows, cfg.block_m) * cfg.block_m
    qp = rows_from_q(q, hkv, r2, order)
    qp = jnp.pad(qp, ((0, 0), (0, m_pad - m), (0, 0))) if m_pad > m else qp
    grp_rows = pad_rows(seq_rows(s2p_sorted, r2), m_pad - m, mode="edge")
    lim_rows = pad_rows(row_meta(lim_p, grp, r2, order), m_pad - m, mode="edge")
    return order, inv, qp, grp_rows, lim_rows
