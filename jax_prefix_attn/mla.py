"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over shared prefixes, in the absorbed form.

MLA stores one latent vector ``c`` of rank ``R`` (``kv_lora_rank``, 512 in DeepSeek-V2/V3) and
one decoupled RoPE key ``k_rope`` of width ``Dr`` (64) per token, shared by every head.  Head
``h``'s key and value are the up-projections ``K_h = [c W_UK_h ; k_rope]`` and ``V_h = c W_UV_h``
("Efficient Attention" notes, sections 3.2 and 3.2.1).  With ``W_UK`` absorbed into the query,
``q_nope_h . (c W_UK_h) = (q_nope_h W_UK_h^T) . c``, so the score of query head ``h`` against a
cached token is

    s = sm_scale * (q_nope_absorbed_h . c + q_rope_h . k_rope)

and, ``W_UV`` being linear, the attention output in the latent space, ``sum_j p_j c_j [R]``, is
``W_UV_h``-projected by the caller afterwards.  Decoding is then multi-query attention with
``R + Dr``-wide keys and ``R``-wide values, every query head reading the same cache: the best
case for shared-prefix batching (all heads of all sequences that share a prompt attend to the
prompt's latent cache as one matrix product).

:func:`mla_attention` follows :func:`jax_prefix_attn.shared_prefix_attention`'s conventions
(README "Conventions", ``docs/api.md``): one shared prefix or ``G`` prefix groups with
``seq_to_prefix``/``prefix_lengths``, per-sequence suffixes with ``suffix_lengths``, the causal
mask bottom-right aligned on ``[prefix[:pl]; suffix[:sl]]``
(:func:`jax_prefix_attn.reference.row_limits`), the clamp rule for traced lengths and groups
(:func:`jax_prefix_attn.reference.clamp_shared_inputs`), ``check_ranges`` with ``checkify``,
NaN propagation and the LSE convention.  It is computed as a prefix part (one product over
every head of every sequence that shares the prefix) and a suffix part (per sequence), merged
through their log-sum-exp (:func:`jax_prefix_attn.merge_attention_states`).

``impl`` names the algorithm: ``"reference"`` (the default; pure JAX, differentiable by
autodiff) or ``"mgpu"``, the Mosaic GPU kernels (Hopper; ``interpret=True`` runs them in Mosaic
GPU's CPU interpreter): :func:`pallas_kernels.mla_prefix_mgpu.mla_prefix_attention` for the
prefix part (every row of every head of every sequence against the one shared prefix) and
:func:`pallas_kernels.mla_suffix_mgpu.mla_suffix_attention` for the suffix part (each
sequence's rows against its own suffix, causal within it), merged through the LSE as above.
The prefix kernel gives every row the same prefix length: with ``Tq > 1`` that holds when every
``suffix_length >= Tq - 1`` (the earliest query then sees the whole prefix); a call whose
traced lengths break it computes the reference instead (a branch on the device, no
recompilation).  ``"mgpu"`` takes one prefix (no groups), 16-bit inputs, ``R`` a multiple of
128 up to 512 and ``Dr`` 64 or 128, and has no gradient.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_prefix_attn._validation import (check_array, check_bool, check_impl,
                                         check_prefix_groups, check_same_dtype, check_sm_scale)
from jax_prefix_attn.device import planning_device_info
from jax_prefix_attn.merge import merge_attention_states
from jax_prefix_attn.reference import clamp_shared_inputs, masked_softmax, row_limits
from pallas_kernels import mla_prefix_mgpu, mla_suffix_mgpu
from pallas_kernels._common import cdiv, flag_nonfinite

__all__ = ["latent_part", "mla_attention", "mla_reference", "mla_kernels", "kernels_supported",
           "IMPLS"]

IMPLS = ("reference", "mgpu")


def _check_pair(name_c, c, name_k, k, ndim, lead: str, rank: int, rope: int, dtype_of: str, q):
    """``c [*lead, R]`` and ``k_rope [*lead, Dr]`` of one cache: same leading shape, the
    queries' widths, the queries' dtype."""
    check_array(name_c, c, ndim, layout=f"[{lead}, kv_lora_rank]")
    check_array(name_k, k, ndim, layout=f"[{lead}, rope_dim]")
    if c.ndim != k.ndim or c.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"{name_c} and {name_k} must have the same leading shape [{lead}], got "
                         f"{name_c} {tuple(c.shape)} and {name_k} {tuple(k.shape)}")
    if c.shape[-1] != rank:
        raise ValueError(f"{name_c} must have the queries' kv_lora_rank R={rank} on its last "
                         f"axis (q_nope_absorbed [..., R]), got shape {tuple(c.shape)}")
    if k.shape[-1] != rope:
        raise ValueError(f"{name_k} must have q_rope's rope_dim Dr={rope} on its last axis, got "
                         f"shape {tuple(k.shape)}")
    check_same_dtype(dtype_of, q, name_c, c)
    check_same_dtype(dtype_of, q, name_k, k)


def _validate(q_nope, q_rope, prefix_latent, prefix_rope_k, suffix_latent, suffix_rope_k,
              suffix_lengths, prefix_lengths, seq_to_prefix, sm_scale, return_lse, check_ranges):
    """Validate and canonicalise; returns ``(prefix_latent [G, P, R], prefix_rope_k [G, P, Dr],
    seq_to_prefix [B], prefix_lengths [G], suffix_lengths [B])`` (int32)."""
    check_bool("return_lse", return_lse)
    check_bool("check_ranges", check_ranges)
    check_array("q_nope_absorbed", q_nope, 4, layout="[batch, seq_q, heads, kv_lora_rank]")
    check_array("q_rope", q_rope, 4, layout="[batch, seq_q, heads, rope_dim]")
    if q_rope.shape[:3] != q_nope.shape[:3]:
        raise ValueError(f"q_rope must have q_nope_absorbed's [batch, seq_q, heads] = "
                         f"{tuple(q_nope.shape[:3])}, got shape {tuple(q_rope.shape)}")
    check_same_dtype("q_nope_absorbed", q_nope, "q_rope", q_rope)
    b, _, _, r = q_nope.shape
    dr = q_rope.shape[3]
    _check_pair("prefix_latent", prefix_latent, "prefix_rope_k", prefix_rope_k, (2, 3),
                "P] or [G, P", r, dr, "q_nope_absorbed", q_nope)
    _check_pair("suffix_latent", suffix_latent, "suffix_rope_k", suffix_rope_k, 3,
                "batch, S_max", r, dr, "q_nope_absorbed", q_nope)
    if suffix_latent.shape[0] != b:
        raise ValueError(f"suffix_latent must have q_nope_absorbed's batch size {b} on axis 0, "
                         f"got shape {tuple(suffix_latent.shape)}")
    if prefix_latent.ndim == 2:
        prefix_latent, prefix_rope_k = prefix_latent[None], prefix_rope_k[None]
    check_sm_scale(sm_scale)
    seq_to_prefix, prefix_lengths, suffix_lengths = check_prefix_groups(
        "prefix_latent", prefix_latent.shape, b, suffix_lengths=suffix_lengths,
        suffix_cap=suffix_latent.shape[1], prefix_lengths=prefix_lengths,
        seq_to_prefix=seq_to_prefix, check_ranges=check_ranges)
    return prefix_latent, prefix_rope_k, seq_to_prefix, prefix_lengths, suffix_lengths


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


_mla_reference_jit = jax.jit(mla_reference, static_argnames=("scale",))


def _key_splits(ctas: int, n_keys: int, sm_count: int) -> int:
    """Key splits of a kernel with ``ctas`` CTAs per split over ``n_keys`` keys in tiles of 64:
    about one CTA per SM when ``ctas`` alone would leave SMs idle, every split at least one
    tile."""
    n_tiles = cdiv(n_keys, 64)
    per_split = cdiv(n_tiles, max(1, min(n_tiles, cdiv(sm_count, ctas))))
    return cdiv(n_tiles, per_split)


def kernels_supported(q_nope, q_rope, prefix_latent, suffix_latent) -> str | None:
    """``None`` when ``impl="mgpu"`` runs these canonical inputs (``prefix_latent [G, P, R]``),
    else the reason."""
    r, dr, dtype = q_nope.shape[-1], q_rope.shape[-1], q_nope.dtype
    if prefix_latent.shape[0] != 1:
        return f"one shared prefix (got G={prefix_latent.shape[0]} prefix groups)"
    return (mla_prefix_mgpu.supported(rank=r, rope_dim=dr, prefix_len=prefix_latent.shape[1],
                                      dtype=dtype)
            or mla_suffix_mgpu.supported(rank=r, rope_dim=dr, suffix_cap=suffix_latent.shape[1],
                                         dtype=dtype))


def mla_kernels(q_nope, q_rope, prefix_latent, prefix_rope_k, suffix_latent, suffix_rope_k,
                prefix_lengths, suffix_lengths, scale, interpret=False, sm_count=None):
    """The Mosaic GPU decomposition on canonical inputs with one prefix (``prefix_latent
    [1, P, R]``): the prefix kernel over all ``B * Tq * H`` rows, the suffix kernel per
    sequence, merged through their LSE; the reference where a query would see part of the
    prefix only (``Tq > 1`` and a ``suffix_length < Tq - 1``).  Lengths are clamped; the keys
    are split so that each kernel has about ``sm_count`` CTAs (default: the planning device's
    SMs, :func:`jax_prefix_attn.device.planning_device_info`) when its rows alone give fewer.
    Returns ``(out [B, Tq, H, R]`` in the queries' dtype, ``lse [B, Tq, H]`` float32)."""
    if sm_count is None:
        sm_count = planning_device_info().sm_count
    sm_count = max(1, sm_count)
    b, tq, h, r = q_nope.shape
    dr = q_rope.shape[-1]
    p, s = prefix_latent.shape[1], suffix_latent.shape[1]
    p_len = jnp.clip(prefix_lengths[0].astype(jnp.int32), 0, p)
    s_len = jnp.clip(suffix_lengths.astype(jnp.int32), 0, s)

    def kernels():
        o_p, l_p = mla_prefix_mgpu.mla_prefix_attention(
            q_nope.reshape(b * tq * h, r), q_rope.reshape(b * tq * h, dr), prefix_latent[0],
            prefix_rope_k[0], p_len, sm_scale=scale, interpret=interpret,
            num_splits=_key_splits(cdiv(b * tq * h, 64), p, sm_count))
        o_s, l_s = mla_suffix_mgpu.mla_suffix_attention(
            q_nope.reshape(b, tq * h, r), q_rope.reshape(b, tq * h, dr), suffix_latent,
            suffix_rope_k, s_len, sm_scale=scale, seq_q=tq, interpret=interpret,
            num_splits=_key_splits(b * cdiv(tq * h, 64), s, sm_count))
        out, lse = merge_attention_states(
            [o_p.reshape(b, tq, h, r), o_s.reshape(b, tq, h, r)],
            [l_p.reshape(b, tq, h), l_s.reshape(b, tq, h)])
        return out.astype(q_nope.dtype), lse

    if tq == 1:
        return kernels()

    def reference():
        return mla_reference(q_nope, q_rope, prefix_latent, prefix_rope_k, suffix_latent,
                             suffix_rope_k, jnp.zeros((b,), jnp.int32), p_len[None], s_len, scale)
    return jax.lax.cond(jnp.all(s_len >= tq - 1), kernels, reference)


_mla_kernels_jit = jax.jit(mla_kernels, static_argnames=("scale", "interpret", "sm_count"))


def mla_attention(q_nope_absorbed, q_rope, prefix_latent, prefix_rope_k, suffix_latent,
                  suffix_rope_k, *, suffix_lengths, prefix_lengths=None, seq_to_prefix=None,
                  sm_scale=None, return_lse: bool = False, check_ranges: bool = False,
                  impl: str = "reference", interpret: bool = False):
    """Absorbed MLA attention of each sequence over its (shared) latent prefix followed by its
    own latent suffix.

    Args:
      q_nope_absorbed: ``[B, Tq, H, R]``: the non-positional query of each head with the key
        up-projection absorbed (``q_nope_h @ W_UK_h^T``; ``R`` = ``kv_lora_rank``) for the newest
        ``Tq`` tokens of each sequence (``Tq == 1`` is decoding), causal among themselves.
      q_rope: ``[B, Tq, H, Dr]``: the rotated decoupled RoPE query of each head.
      prefix_latent: ``[P, R]`` one shared prefix's latents ``c``, or ``G`` prefix groups
        ``[G, P, R]`` (ragged prefixes padded to ``P``).
      prefix_rope_k: ``[P, Dr]`` or ``[G, P, Dr]``: the prefix's rotated RoPE keys.
      suffix_latent: ``[B, S_max, R]`` each sequence's latents after its prefix.
      suffix_rope_k: ``[B, S_max, Dr]`` each sequence's rotated RoPE keys after its prefix.
      suffix_lengths: int ``[B]`` valid suffix lengths (dynamic: no recompilation).
      prefix_lengths: int ``[G]`` valid prefix lengths (default ``P``).
      seq_to_prefix: int ``[B]`` prefix group of each sequence (required when ``G > 1``).
      sm_scale: score scale, default ``1 / sqrt(R + Dr)`` (the width of the absorbed keys); a
        model passes its own (``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)`` with YaRN's
        ``mscale`` applied, for DeepSeek).
      return_lse: also return the log-sum-exp.
      check_ranges: add ``checkify`` checks of traced lengths and ``seq_to_prefix`` (out-of-range
        values are clamped); the caller wraps the call in
        ``checkify.checkify(..., errors=checkify.user_checks)``.  Off: no check is compiled.
      impl: ``"reference"`` (pure JAX) or ``"mgpu"`` (the Mosaic GPU kernels; see the module
        docstring for what they take: a ``ValueError`` names what they cannot run).
      interpret: with ``impl="mgpu"``, run the kernels in Mosaic GPU's CPU interpreter.

    Returns:
      ``out [B, Tq, H, R]`` in the queries' dtype: ``sum_j p_j c_j`` over the visible tokens
      ``[prefix[:prefix_len]; suffix[:suffix_len]]`` (bottom-right causal), with ``p`` the
      softmax of ``sm_scale * (q_nope_absorbed . c + q_rope . k_rope)``, in the latent space
      (the caller applies ``W_UV`` and ``W_O``); with ``return_lse`` also ``lse [B, Tq, H]``
      float32 (natural log; ``-inf`` for a row that sees no token).
    """
    check_impl(impl, IMPLS)
    check_bool("interpret", interpret)
    prefix_latent, prefix_rope_k, seq_to_prefix, prefix_lengths, suffix_lengths = _validate(
        q_nope_absorbed, q_rope, prefix_latent, prefix_rope_k, suffix_latent, suffix_rope_k,
        suffix_lengths, prefix_lengths, seq_to_prefix, sm_scale, return_lse, check_ranges)
    width = q_nope_absorbed.shape[-1] + q_rope.shape[-1]
    scale = 1.0 / math.sqrt(width) if sm_scale is None else float(sm_scale)
    if impl == "mgpu":
        why = kernels_supported(q_nope_absorbed, q_rope, prefix_latent, suffix_latent)
        if why is not None:
            raise ValueError(f"impl='mgpu' (Mosaic GPU kernels) cannot run these inputs: {why}; "
                             f"use impl='reference'")
        out, lse = _mla_kernels_jit(q_nope_absorbed, q_rope, prefix_latent, prefix_rope_k,
                                    suffix_latent, suffix_rope_k, prefix_lengths,
                                    suffix_lengths, scale=scale, interpret=interpret,
                                    sm_count=planning_device_info().sm_count)
        return (out, lse) if return_lse else out
    out, lse = _mla_reference_jit(q_nope_absorbed, q_rope, prefix_latent, prefix_rope_k,
                                  suffix_latent, suffix_rope_k, seq_to_prefix, prefix_lengths,
                                  suffix_lengths, scale=scale)
    return (out, lse) if return_lse else out
