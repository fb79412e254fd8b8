"""The pure-JAX oracle of :func:`jax_prefix_attn.mla_attention` (absorbed multi-head latent
attention over shared latent prefixes; the equations in :mod:`jax_prefix_attn.mla`):
:func:`latent_part` (one part: queries against cached latents) and :func:`mla_reference` (the
prefix part and the suffix part merged through their LSE)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_prefix_attn.merge import merge_attention_states
from jax_prefix_attn.reference import clamp_shared_inputs, masked_softmax, row_limits
from pallas_kernels._common import flag_nonfinite

__all__ = ["latent_part", "mla_reference"]


def latent_part(q_nope_bthr, q_rope_bthd, c_nsr, k_rope_nsd, kv_index_b, limit_bt, scale):
    """Absorbed MLA attention of each sequence's queries over the cached tokens
    ``c_nsr[kv_index_b[b], :limit_bt[b, i]]`` (values: the latents themselves).

    Args:
      q_nope_bthr: ``[B, Tq, H, R]`` absorbed queries; q_rope_bthd: ``[B, Tq, H, Dr]``.
      c_nsr, k_rope_nsd: ``[N, S, R]`` latents and ``[N, S, Dr]`` RoPE keys of ``N`` caches.
      kv_index_b: int ``[B]`` the cache of each sequence; limit_bt: int ``[B, Tq]`` key limits.

    Returns ``(out [B, Tq, H, R] float32, lse [B, Tq, H] float32)``; rows with no visible key
    give ``out = 0``, ``lse = -inf`` with finite gradients, as
    :func:`jax_prefix_attn.reference.part_attention`.
    """
    b, tq, h, r = q_nope_bthr.shape
    n, s, _ = c_nsr.shape
    if s == 0 or b * tq == 0:
        return jnp.zeros((b, tq, h, r), jnp.float32), jnp.full((b, tq, h), -jnp.inf, jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    qn = q_nope_bthr.astype(jnp.float32)
    qr = q_rope_bthd.astype(jnp.float32)
    c = c_nsr.astype(jnp.float32)
    kr = k_rope_nsd.astype(jnp.float32)
    # Cached tokens no row sees may hold anything (NaN too): zeroed, so that 0 * NaN reaches
    # neither ``p @ c`` nor, in the backward, ``ds @ c``.  (The last query sees the most.)
    j = jnp.arange(s, dtype=jnp.int32)
    if n == 1:  # one cache for everyone: every head of every sequence in one product
        live = (j < jnp.max(limit_bt[:, -1]))[:, None]
        c, kr = jnp.where(live, c[0], 0.0), jnp.where(live, kr[0], 0.0)
        sc = (jnp.einsum("bqhr,kr->bhqk", qn, c, precision=hi)
              + jnp.einsum("bqhd,kd->bhqk", qr, kr, precision=hi))
    else:
        live = (j[None, :] < limit_bt[:, -1:])[:, :, None]
        c, kr = jnp.where(live, c[kv_index_b], 0.0), jnp.where(live, kr[kv_index_b], 0.0)
        sc = (jnp.einsum("bqhr,bkr->bhqk", qn, c, precision=hi)
              + jnp.einsum("bqhd,bkd->bhqk", qr, kr, precision=hi))
    mask = (j[None, None, :] < limit_bt[:, :, None])[:, None]             # [B, 1, Tq, S]
    pr, lse = masked_softmax(sc * scale, mask)
    if n == 1:
        o = jnp.einsum("bhqk,kr->bqhr", pr, c, precision=hi)
    else:
        o = jnp.einsum("bhqk,bkr->bqhr", pr, c, precision=hi)
    lse = flag_nonfinite(jax.lax.stop_gradient(o), jnp.transpose(lse[..., 0], (0, 2, 1)))
    return o, lse


def mla_reference(q_nope, q_rope, prefix_latent, prefix_rope_k, suffix_latent, suffix_rope_k,
                  seq_to_prefix, prefix_lengths, suffix_lengths, scale):
    """Pure-JAX decomposition on canonical inputs (``prefix_latent [G, P, R]``): the prefix
    part and the suffix part, merged through their LSE.  Out-of-range lengths and groups are
    clamped (:func:`jax_prefix_attn.reference.clamp_shared_inputs`).  Returns
    ``(out [B, Tq, H, R]`` in the queries' dtype, ``lse [B, Tq, H]`` float32)."""
    b, tq = q_nope.shape[:2]
    seq_to_prefix, prefix_lengths, suffix_lengths = clamp_shared_inputs(
        seq_to_prefix, prefix_lengths, suffix_lengths, prefix_latent.shape[0],
        prefix_latent.shape[1], suffix_latent.shape[1])
    lim_p, lim_s = row_limits(tq, prefix_lengths[seq_to_prefix], suffix_lengths)
    o_p, l_p = latent_part(q_nope, q_rope, prefix_latent, prefix_rope_k, seq_to_prefix, lim_p,
                           scale)
    o_s, l_s = latent_part(q_nope, q_rope, suffix_latent, suffix_rope_k,
                           jnp.arange(b, dtype=jnp.int32), lim_s, scale)
    out, lse = merge_attention_states([o_p, o_s], [l_p, l_s])
    return out.astype(q_nope.dtype), lse
