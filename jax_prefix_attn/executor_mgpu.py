"""The Mosaic GPU leaves of the shared family (decoding, ``Tq == 1``, one prefix): each runs its
kernel(s) and the one XLA merge of the partial states (row layout, see
``pallas_kernels._common.merge_row_parts``).

Shapes: ``q [B, 1, Hq, D]`` (in the keys' dtype), ``pk/pv [P, Hkv, D]``, ``p_len`` int32 scalar
(the prefix length, dynamic), ``suffix_k/v [B, S, Hkv, D]``, ``s_len [B]`` int32.  Every leaf
returns ``(out [B, 1, Hq, D] in q's dtype, lse [B, 1, Hq] float32)``.
"""
from __future__ import annotations

import jax.numpy as jnp

from jax_prefix_attn.plans import MgpuJoint, MgpuOneLaunch, MgpuSplit, MgpuTwoLaunch
from pallas_kernels import joint_decode_mgpu, shared_decode_mgpu, split_decode_mgpu
from pallas_kernels._common import (cdiv, merge_row_parts, next_pow2, q_rows_layout, rows_128,
                                    rows_from_q, rows_to_out)
from pallas_kernels.prefix_attention_mgpu import prefix_partials_mgpu
from pallas_kernels.suffix_attention import suffix_decode_merge

__all__ = ["mgpu_prefix_partials", "mgpu_two_launch", "mgpu_one_launch", "mgpu_joint",
           "mgpu_split"]


def mgpu_prefix_partials(q_bhd, k_phd, v_phd, length, *, scale, num_splits, interpret):
    """The Mosaic GPU prefix kernel on ``q_bhd [B, Hq, D]``: rows ``R2 = next_pow2(G)`` per
    sequence, 128-row blocks over the real rows only.  A suffix pass reading whole
    ``R16``-row tiles of the partials reads up to row ``M - R2 + R16``: those rows are allocated
    but left unwritten (they only feed discarded padding rows).  Returns ``(o [n, Hkv, M', D],
    lse [n, Hkv, M'])`` with query head ``h * G + j`` of sequence ``b`` at row ``b * R2 + j``."""
    b, hq, d = q_bhd.shape
    hkv = k_phd.shape[1]
    r, r16 = q_rows_layout(1, hq, hkv)
    r2 = next_pow2(r)
    m = b * r2
    m128 = cdiv(m, 128) * 128
    qm = rows_from_q(q_bhd[:, None], hkv, r2)  # [Hkv, m, D]
    qm = jnp.pad(qm, ((0, 0), (0, m128 - m), (0, 0))) if m128 > m else qm
    # (interpret: Mosaic GPU's CPU interpreter, with its operand-form substitutions)
    return prefix_partials_mgpu(qm, k_phd, v_phd, length, scale=scale, interpret=interpret,
                                num_splits=num_splits, out_rows=max(m128, m - r2 + r16),
                                schedule_barrier=True, _cpu_check=interpret)


def mgpu_two_launch(leaf: MgpuTwoLaunch, q, pk, pv, p_len, suffix_k, suffix_v, lim_s, *, scale,
                    interpret):
    """The prefix kernel, and the own-layout suffix kernel without incoming states (it does not
    wait for the prefix partials; its keys cut into ``leaf.suffix_splits`` chunks), then one XLA
    merge.  ``lim_s [B, 1]``."""
    b, _, hq, d = q.shape
    hkv = pk.shape[1]
    r = hq // hkv
    r2 = next_pow2(r)
    o_pre, lse_pre = mgpu_prefix_partials(q[:, 0], pk, pv, p_len, scale=scale,
                                          num_splits=leaf.num_splits, interpret=interpret)
    n = leaf.suffix_splits
    t = leaf.suffix
    o_s, lse_s = suffix_decode_merge(q[:, 0], suffix_k, suffix_v, lim_s[:, 0], None, scale=scale,
                                     num_splits=n, interpret=interpret, block_k=t.block_k,
                                     num_warps=t.num_warps, num_stages=t.num_stages)
    # the suffix states [n, B, Hq(, D)] in the partials' row layout [n, Hkv, B * G(, D)]
    o_s = jnp.swapaxes(o_s.reshape(n, b, hkv, r, d), 1, 2).reshape(n, hkv, b * r, d)
    lse_s = jnp.swapaxes(lse_s.reshape(n, b, hkv, r), 1, 2).reshape(n, hkv, b * r)
    return merge_row_parts([(o_pre, lse_pre, r2), (o_s, lse_s, r)], b=b, tq=1, hq=hq, r=r,
                           dtype=q.dtype, inv=None)


def mgpu_one_launch(leaf: MgpuOneLaunch, q, pk, pv, p_len, suffix_k, suffix_v, s_len, *, scale,
                    interpret):
    """Prefix and suffix tasks interleaved in one launch, then one XLA merge."""
    b, _, hq, d = q.shape
    hkv = pk.shape[1]
    g = hq // hkv
    qm, _ = rows_128(q, hkv, g)
    o_pre, lse_pre, o_suf, lse_suf = shared_decode_mgpu.shared_decode_partials_mgpu(
        qm, pk, pv, p_len, suffix_k, suffix_v, s_len, scale=scale, group=g,
        num_splits=leaf.num_splits, suffix_splits=leaf.suffix_splits, block_s=leaf.block_s,
        suffix_steps=leaf.suffix_steps, schedule_barrier=True, interpret=interpret,
        _cpu_check=interpret)
    return merge_row_parts([(o_pre, lse_pre, g), (o_suf, lse_suf, g)], b=b, tq=1, hq=hq, r=g,
                           dtype=q.dtype, inv=None)


def mgpu_joint(leaf: MgpuJoint, q, pk, pv, p_len, suffix_k, suffix_v, s_len, *, scale,
               interpret):
    """The one-pass kernel; with one prefix split its output is the attention itself (a layout
    change only), else one XLA merge of the splits."""
    b, _, hq, d = q.shape
    hkv = pk.shape[1]
    g = hq // hkv
    qm, m = rows_128(q, hkv, g)
    o, lse = joint_decode_mgpu.joint_decode_mgpu(
        qm, pk, pv, p_len, suffix_k, suffix_v, s_len, scale=scale, group=g,
        num_splits=leaf.num_splits, block_kv=leaf.block_kv, block_s=leaf.block_s,
        interpret=interpret, schedule_barrier=leaf.schedule_barrier, steps=leaf.steps,
        _cpu_check=interpret)
    if o.shape[0] == 1:
        return (rows_to_out(o[0, :, :m], b, 1, hq, g).astype(q.dtype),
                rows_to_out(lse[0, :, :m], b, 1, hq, g))
    return merge_row_parts([(o, lse, g)], b=b, tq=1, hq=hq, r=g, dtype=q.dtype, inv=None)


def mgpu_split(leaf: MgpuSplit, q, pk, pv, p_len, suffix_k, suffix_v, s_len, *, scale,
               interpret):
    """The role-split launch, then one XLA merge."""
    q_bhd = q[:, 0]
    b, hq, d = q_bhd.shape
    hkv = pk.shape[1]
    g = hq // hkv
    qm, _ = rows_128(q_bhd[:, None], hkv, g)
    (o_pre, l_pre), (o_s, l_s) = split_decode_mgpu.split_decode_partials_mgpu(
        qm, pk, pv, p_len, suffix_k, suffix_v, s_len, scale=float(scale), group=g,
        prefix_ctas=leaf.prefix_ctas, stream_ctas=leaf.stream_ctas, num_splits=leaf.num_splits,
        smem_bytes=leaf.smem_bytes, schedule_barrier=True, interpret=interpret)
    out, lse = merge_row_parts([(o_pre, l_pre, g), (o_s, l_s, g)], b=b, tq=1, hq=hq, r=g,
                               dtype=q_bhd.dtype, inv=None)
    out, lse = out[:, 0], lse[:, 0]
    return out[:, None], lse[:, None]
