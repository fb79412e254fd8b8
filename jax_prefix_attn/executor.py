"""Executes a :class:`SharedPrefixPlan`: each chunk of query positions through its leaf module.

:func:`run_plan` computes the per-row key limits, then runs each chunk's leaf plan through the
registered leaf module that made it (:func:`jax_prefix_attn.planner.leaf_module`; the kernels
and their XLA glue live in :mod:`jax_prefix_attn.leaves`) and concatenates the chunks.
:func:`decode_prefix_partials` runs the shared family's prefix pass alone.

Canonical inputs (as validated by :func:`jax_prefix_attn.shared_prefix_attention`):
``q [B, Tq, Hq, D]``, ``prefix_k/v [G, P, Hkv, D]``, ``suffix_k/v [B, S, Hkv, D]``,
``seq_to_prefix [B]``, ``prefix_lengths [G]``, ``suffix_lengths [B]`` (int32).  Outputs:
``(out [B, Tq, Hq, D] in q's dtype, lse [B, Tq, Hq] float32)``.
"""
from __future__ import annotations

import jax.numpy as jnp

from jax_prefix_attn.device import device_info
from jax_prefix_attn.leaves.base import Shapes, planning_part
from jax_prefix_attn.leaves.mgpu_prefix import mgpu_prefix_partials, mgpu_splits, mosaic_region
from jax_prefix_attn.leaves.triton_prefix import prefix_tiling
from jax_prefix_attn.planner import leaf_module
from jax_prefix_attn.plans import SharedPrefixPlan
from jax_prefix_attn.reference import clamp_shared_inputs, row_limits
from pallas_kernels._common import cdiv, check_rows_per_tile, next_pow2, q_rows_layout, rows_from_q
from pallas_kernels.prefix_attention import prefix_partials

__all__ = ["run_plan", "decode_prefix_partials"]


def run_plan(plan: SharedPrefixPlan, q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix,
             prefix_lengths, suffix_lengths, scale, interpret):
    """Run the kernels of ``plan`` (``impl`` ``"shared"`` or ``"flat"``) on canonical inputs.

    The clamp rule (:func:`jax_prefix_attn.reference.clamp_shared_inputs`): with several prefix
    groups ``seq_to_prefix`` is clamped here (it feeds XLA's sort and gathers anyway).  When
    decoding, ``row_limits`` is the identity on in-range lengths, and the lengths go to the
    kernels as they are (a bitcast: no XLA launch before the Pallas calls): every kernel clamps
    the limits it reads to its key axis (a negative limit sees nothing).  With ``Tq > 1`` the
    limits are computed from the clamped lengths.  Each leaf gets the prefix lengths
    ``prefix_len_g [G]`` too: when decoding with one prefix the kernels take that length as it
    is instead of per-row arrays."""
    g = prefix_k.shape[0]
    hq, hkv = q.shape[2], prefix_k.shape[2]
    if g > 1:
        seq_to_prefix = jnp.clip(seq_to_prefix, 0, g - 1)
    if q.shape[1] == 1:
        lim_p, lim_s = prefix_lengths[seq_to_prefix][:, None], suffix_lengths[:, None]
    else:
        _, prefix_lengths, suffix_lengths = clamp_shared_inputs(
            seq_to_prefix, prefix_lengths, suffix_lengths, g, prefix_k.shape[1], suffix_k.shape[1])
        lim_p, lim_s = row_limits(q.shape[1], prefix_lengths[seq_to_prefix], suffix_lengths)
    parts = []
    for c in plan.chunks:
        check_rows_per_tile(c.stop - c.start, hq, hkv)
        parts.append(leaf_module(c.leaf).run(
            c.leaf, q[:, c.start:c.stop], prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix,
            lim_p[:, c.start:c.stop], lim_s[:, c.start:c.stop], scale=scale, interpret=interpret,
            prefix_len_g=prefix_lengths))
    if len(parts) == 1:
        return parts[0]
    return (jnp.concatenate([o for o, _ in parts], axis=1),
            jnp.concatenate([l for _, l in parts], axis=1))


def decode_prefix_partials(q_bhd, prefix_k, prefix_v, length, *, scale, interpret=False,
                           device=None):
    """The shared family's prefix pass alone, for one prefix and one query per sequence (e.g.
    the root of a prefix tree): every sequence's ``Hq`` query rows attend ``prefix_k/v
    [P, Hkv, D]`` keys ``[0, length)`` (``length`` an int32 scalar, dynamic) as one batched
    matrix product per kv head (the Mosaic GPU kernel where the planner's Mosaic GPU region
    holds on ``device``, default the one JAX runs on; else the Triton kernel, split along the
    prefix when the rows are few).

    ``q_bhd [B, Hq, D]``.  Returns ``(o [n, Hkv, M, D], lse [n, Hkv, M] float32, stride)``:
    ``n`` prefix splits of normalised partials (``lse = -inf`` where a split saw nothing); query
    head ``h * G + j`` of sequence ``b`` is row ``b * stride + j`` of kv head ``h``, and
    ``M >= (B - 1) * stride + suffix_rows(Hq, Hkv)`` (the layout
    ``suffix_attention.suffix_decode_merge`` takes as ``incoming``).
    """
    b, hq, d = q_bhd.shape
    p, hkv, _ = prefix_k.shape
    dev = device_info() if device is None else device
    s = Shapes(b, 1, hq, hkv, d, 1, p, 1, jnp.dtype(prefix_k.dtype).name)
    q_bhd = q_bhd.astype(prefix_k.dtype)
    r, r16 = q_rows_layout(1, hq, hkv)
    r2 = next_pow2(r)
    if mosaic_region(s, dev, interpret):
        o, lse = mgpu_prefix_partials(q_bhd, prefix_k, prefix_v, length, scale=scale,
                                      num_splits=mgpu_splits(s, dev), interpret=interpret)
        return o, lse, r2
    cfg = prefix_tiling(b, r, hkv, p, 2 * planning_part(dev).sm_count)
    m = b * r2
    m_pad = cdiv(m + r16, cfg.block_m) * cfg.block_m
    qp = jnp.pad(rows_from_q(q_bhd[:, None], hkv, r2), ((0, 0), (0, m_pad - m), (0, 0)))
    lim_rows = jnp.full((m_pad,), length, jnp.int32)
    o, lse = prefix_partials(qp, prefix_k[None], prefix_v[None], jnp.zeros((m_pad,), jnp.int32),
                             lim_rows, scale=scale, block_m=cfg.block_m, block_k=cfg.block_k,
                             num_splits=cfg.num_splits, num_warps=cfg.num_warps,
                             num_stages=cfg.num_stages, interpret=interpret,
                             two_phase=cfg.two_phase)
    return o, lse, r2
