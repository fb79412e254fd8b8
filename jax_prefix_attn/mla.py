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

``impl`` names the algorithm: ``"reference"`` (pure JAX, :mod:`jax_prefix_attn.mla_reference`,
differentiable by autodiff), ``"mgpu"``, the Mosaic GPU kernels (:mod:`jax_prefix_attn.mla_kernels`:
the prefix kernel over every row of every head of the sequences of one prefix, the suffix kernel
per sequence; one prefix, or ``G`` groups of equally many contiguous sequences; 16-bit inputs,
``R`` a multiple of 128 up to 512, ``Dr`` 64 or 128; differentiable through the reference's
gradients; ``interpret=True`` runs them in Mosaic GPU's CPU interpreter), or ``"auto"`` (the
default): the kernels on a GPU of compute capability 9.0+ where they take the inputs, else the
reference (:func:`jax_prefix_attn.mla_kernels.auto_impl`).  Traced values the kernels cannot
serve (a ``Tq > 1`` call with a ``suffix_length < Tq - 1``, a ``seq_to_prefix`` other than the
contiguous layout) take the reference on the device, without recompiling.
"""
from __future__ import annotations

import math

import jax

from jax_prefix_attn._validation import (check_array, check_bool, check_impl,
                                         check_prefix_groups, check_same_dtype, check_sm_scale)
from jax_prefix_attn.device import device_info, planning_device_info
from jax_prefix_attn.mla_kernels import auto_impl, kernels_supported, mla_kernels
from jax_prefix_attn.mla_reference import mla_reference

__all__ = ["mla_attention", "IMPLS"]

IMPLS = ("auto", "reference", "mgpu")


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


_mla_reference_jit = jax.jit(mla_reference, static_argnames=("scale",))
_mla_kernels_jit = jax.jit(mla_kernels, static_argnames=("scale", "interpret", "sm_count"))


def mla_attention(q_nope_absorbed, q_rope, prefix_latent, prefix_rope_k, suffix_latent,
                  suffix_rope_k, *, suffix_lengths, prefix_lengths=None, seq_to_prefix=None,
                  sm_scale=None, return_lse: bool = False, check_ranges: bool = False,
                  impl: str = "auto", interpret: bool = False):
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
      impl: ``"auto"``, ``"reference"`` or ``"mgpu"`` (the module docstring; ``"mgpu"``
        raises a ``ValueError`` naming what the kernels cannot run).
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
    if impl == "auto":
        impl, _ = auto_impl(q_nope_absorbed, q_rope, prefix_latent, suffix_latent, device_info())
    if impl == "mgpu":
        why = kernels_supported(q_nope_absorbed, q_rope, prefix_latent, suffix_latent)
        if why is not None:
            raise ValueError(f"impl='mgpu' (Mosaic GPU kernels) cannot run these inputs: {why}; "
                             f"use impl='reference'")
        out, lse = _mla_kernels_jit(q_nope_absorbed, q_rope, prefix_latent, prefix_rope_k,
                                    suffix_latent, suffix_rope_k, seq_to_prefix, prefix_lengths,
                                    suffix_lengths, scale=scale, interpret=interpret,
                                    sm_count=planning_device_info().sm_count)
        return (out, lse) if return_lse else out
    out, lse = _mla_reference_jit(q_nope_absorbed, q_rope, prefix_latent, prefix_rope_k,
                                  suffix_latent, suffix_rope_k, seq_to_prefix, prefix_lengths,
                                  suffix_lengths, scale=scale)
    return (out, lse) if return_lse else out
