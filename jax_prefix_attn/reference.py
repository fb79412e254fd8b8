"""Pure-JAX reference attention returning ``(out, lse)``: the oracle for every kernel.

Conventions (fixed project-wide, see README):

* layout ``[batch, seq, heads, head_dim]``;
* ``lse`` is the natural-log log-sum-exp of the scaled scores, float32, shape
  ``[batch, seq_q, heads_q]``; a row that sees no key has ``lse = -inf`` and
  ``out = 0`` (never NaN, also in gradients);
* GQA: query head ``h`` uses kv head ``h // (heads_q // heads_kv)``;
* causal masking is bottom-right aligned to each sequence's valid length
  ``L_b``: query ``i`` of ``Tq`` sees keys ``j < L_b`` with ``j <= i + L_b - Tq``;
* default scale ``1 / sqrt(head_dim)``.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_prefix_attn._validation import check_bool, check_qkv

__all__ = ["attention", "attention_mask"]


def attention_mask(tq: int, tk: int, kv_lengths_b: jax.Array | None, causal: bool,
                   batch: int) -> jax.Array:
    """Boolean visibility mask ``[B, Tq, Tk]`` following the project's conventions."""
    lengths_b = (jnp.full((batch,), tk, jnp.int32) if kv_lengths_b is None
                 else kv_lengths_b.astype(jnp.int32))
    j = jnp.arange(tk, dtype=jnp.int32)[None, None, :]
    i = jnp.arange(tq, dtype=jnp.int32)[None, :, None]
    length = lengths_b[:, None, None]
    mask = j < length
    if causal:
        mask = mask & (j <= i + length - tq)
    return mask


def attention(q_bthd: jax.Array, k_bshd: jax.Array, v_bshd: jax.Array, *, causal: bool = False,
              kv_lengths: jax.Array | None = None, sm_scale: float | None = None,
              ) -> tuple[jax.Array, jax.Array]:
    """Exact softmax attention in float32.

    Args:
      q_bthd: queries ``[B, Tq, Hq, D]``.
      k_bshd, v_bshd: keys/values ``[B, Tk, Hkv, D]`` with ``Hq % Hkv == 0``.
      causal: bottom-right causal mask aligned to each sequence's valid length.
      kv_lengths: optional int ``[B]``: keys at positions ``>= kv_lengths[b]`` are masked (their
        contents, NaN included, reach neither the outputs nor the gradients).
      sm_scale: score scale, default ``1/sqrt(D)``.

    Returns:
      ``out [B, Tq, Hq, D]`` in ``q``'s dtype and ``lse [B, Tq, Hq]`` float32.
    """
    check_qkv(q_bthd, k_bshd, v_bshd, kv_lengths=kv_lengths, sm_scale=sm_scale)
    check_bool("causal", causal)
    b, tq, hq, d = q_bthd.shape
    tk, hkv = k_bshd.shape[1], k_bshd.shape[2]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    hi = jax.lax.Precision.HIGHEST

    q = q_bthd.astype(jnp.float32).reshape(b, tq, hkv, g, d)
    k = k_bshd.astype(jnp.float32)
    v = v_bshd.astype(jnp.float32)
    if kv_lengths is not None:  # keys past a length may hold anything (NaN too): zeroed, so
        # that 0 * NaN reaches neither ``p @ v`` nor, in the backward, ``ds @ k``
        live = (jnp.arange(tk, dtype=jnp.int32)[None, :] < kv_lengths.astype(jnp.int32)[:, None])
        k = jnp.where(live[:, :, None, None], k, 0.0)
        v = jnp.where(live[:, :, None, None], v, 0.0)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, precision=hi) * scale  # [B, Hkv, G, Tq, Tk]
    mask = attention_mask(tq, tk, kv_lengths, causal, b)[:, None, None]  # [B, 1, 1, Tq, Tk]
    s = jnp.where(mask, s, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf))  # (Tk may be 0)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    has_key = l > 0
    l_safe = jnp.where(has_key, l, 1.0)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p / l_safe, v, precision=hi)
    lse = jnp.where(has_key, m + jnp.log(l_safe), -jnp.inf)[..., 0]  # [B, Hkv, G, Tq]
    out = o.reshape(b, tq, hq, d).astype(q_bthd.dtype)
    lse = jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, tq, hq)
    return out, lse
