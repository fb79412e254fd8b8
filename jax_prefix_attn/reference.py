"""Pure-JAX reference attention returning ``(out, lse)``: the oracle for every kernel.

Conventions (fixed project-wide, see README):

* layout ``[batch, seq, heads, head_dim]``;
* ``lse`` is the natural-log log-sum-exp of the scaled scores, float32, shape
  ``[batch, seq_q, heads_q]``; a row that sees no key has ``lse = -inf`` and
  ``out = 0`` (with zero gradients), and no other row has ``lse = -inf``;
* a row whose query, or a key or value it sees, holds a NaN gets NaN in ``out`` and ``lse``
  (a non-finite ``out`` always comes with ``lse = NaN``);
* traced lengths are clamped to ``[0, capacity]``;
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
from jax_prefix_attn.merge import merge_attention_states
from pallas_kernels._common import flag_nonfinite

__all__ = ["attention", "attention_mask", "row_limits", "clamp_shared_inputs", "masked_softmax",
           "part_attention", "reference_shared_prefix"]


def attention_mask(tq: int, tk: int, kv_lengths_b: jax.Array | None, causal: bool,
                   batch: int) -> jax.Array:
    """Boolean visibility mask ``[B, Tq, Tk]`` following the project's conventions (lengths
    clamped to ``[0, Tk]``)."""
    lengths_b = (jnp.full((batch,), tk, jnp.int32) if kv_lengths_b is None
                 else jnp.clip(kv_lengths_b.astype(jnp.int32), 0, tk))
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
        contents, NaN included, reach neither the outputs nor the gradients); traced values are
        clamped to ``[0, Tk]``.
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
        kv_lengths = jnp.clip(kv_lengths.astype(jnp.int32), 0, tk)
        live = (jnp.arange(tk, dtype=jnp.int32)[None, :] < kv_lengths[:, None])
        k = jnp.where(live[:, :, None, None], k, 0.0)
        v = jnp.where(live[:, :, None, None], v, 0.0)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, precision=hi) * scale  # [B, Hkv, G, Tq, Tk]
    mask = attention_mask(tq, tk, kv_lengths, causal, b)[:, None, None]  # [B, 1, 1, Tq, Tk]
    s = jnp.where(mask, s, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf))  # (Tk may be 0)
    m = jnp.where(m == -jnp.inf, 0.0, m)  # (NaN stays NaN)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    empty = l == 0  # (a NaN score leaves l NaN: the row is NaN, not empty)
    l_safe = jnp.where(empty, 1.0, l)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p / l_safe, v, precision=hi)       # [B, Tq, Hkv, G, D]
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(l_safe))[..., 0]          # [B, Hkv, G, Tq]
    lse = jnp.transpose(lse, (0, 3, 1, 2))                                 # [B, Tq, Hkv, G]
    lse = flag_nonfinite(jax.lax.stop_gradient(o), lse).reshape(b, tq, hq)
    out = o.reshape(b, tq, hq, d).astype(q_bthd.dtype)
    return out, lse


# ----------------------------------------------------------------------------- shared prefix

def row_limits(tq: int, prefix_len_b: jax.Array, suffix_len_b: jax.Array):
    """Per-row key limits ``(lim_prefix [B, Tq], lim_suffix [B, Tq])`` (int32).

    Query ``i`` of sequence ``b`` sees prefix keys ``j < lim_prefix[b, i]`` and suffix keys
    ``j < lim_suffix[b, i]`` (the causal convention of :func:`attention` on the concatenation ``[prefix[:pl];
    suffix[:sl]]``).
    """
    pl_ = prefix_len_b.astype(jnp.int32)[:, None]
    sl_ = suffix_len_b.astype(jnp.int32)[:, None]
    i = jnp.arange(tq, dtype=jnp.int32)[None, :]
    lim_p = jnp.clip(pl_ + sl_ - tq + i + 1, 0, pl_)
    lim_s = jnp.clip(sl_ - tq + i + 1, 0, sl_)
    return lim_p, lim_s


def clamp_shared_inputs(seq_to_prefix, prefix_lengths, suffix_lengths, groups: int,
                        prefix_cap: int, suffix_cap: int):
    """The clamp rule of shared-prefix attention on traced values: ``seq_to_prefix`` to
    ``[0, groups - 1]``, ``prefix_lengths`` to ``[0, prefix_cap]``, ``suffix_lengths`` to
    ``[0, suffix_cap]`` (int32).  Every implementation computes the masks from these."""
    return (jnp.clip(seq_to_prefix.astype(jnp.int32), 0, groups - 1),
            jnp.clip(prefix_lengths.astype(jnp.int32), 0, prefix_cap),
            jnp.clip(suffix_lengths.astype(jnp.int32), 0, suffix_cap))


# ----------------------------------------------------------------------------- reference

def masked_softmax(scores, mask):
    """Softmax of float32 ``scores [..., K]`` over the keys where ``mask`` (broadcastable to
    ``scores``) holds, by the conventions above: a row that sees no key gets ``p = 0`` and
    ``lse = -inf``, with finite gradients (the row maximum is a constant of the gradient).

    Returns ``(p [..., K]`` normalised, ``lse [..., 1])``, both float32.
    """
    s = jnp.where(mask, scores, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    m = jnp.where(m == -jnp.inf, 0.0, m)  # (NaN stays NaN)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    empty = l == 0  # (a NaN score leaves l NaN: the row is NaN, not empty)
    l_safe = jnp.where(empty, 1.0, l)
    return p / l_safe, jnp.where(empty, -jnp.inf, m + jnp.log(l_safe))


def part_attention(q_bthd, k_nshd, v_nshd, kv_index_b, limit_bt, scale):
    """Attention of each sequence's queries over keys ``k_nshd[kv_index_b[b], :limit_bt[b, i]]``.

    Returns ``(out [B, Tq, Hq, D] float32, lse [B, Tq, Hq] float32)``; rows with no visible key
    give ``out = 0``, ``lse = -inf`` with finite gradients (as :func:`attention`).
    """
    b, tq, hq, d = q_bthd.shape
    n, s, hkv, _ = k_nshd.shape
    grp = hq // hkv
    if s == 0 or b * tq == 0:  # an empty key axis (nothing to see), or no query at all
        return jnp.zeros((b, tq, hq, d), jnp.float32), jnp.full((b, tq, hq), -jnp.inf, jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    q = q_bthd.astype(jnp.float32).reshape(b, tq, hkv, grp, d)
    k = k_nshd.astype(jnp.float32)
    v = v_nshd.astype(jnp.float32)
    # Keys no row sees may hold anything (NaN too): zeroed, so that 0 * NaN reaches neither
    # ``p @ v`` nor, in the backward, ``ds @ k``.  (The last query of a sequence sees the most.)
    j = jnp.arange(s, dtype=jnp.int32)
    if n == 1:  # one pool entry for everyone: no per-sequence copy
        live = (j < jnp.max(limit_bt[:, -1]))[None, :, None, None]
        k, v = jnp.where(live, k, 0.0), jnp.where(live, v, 0.0)
        sc = jnp.einsum("bqhgd,khd->bhgqk", q, k[0], precision=hi)
    else:
        live = (j[None, :] < limit_bt[:, -1:])[:, :, None, None]
        k, v = jnp.where(live, k[kv_index_b], 0.0), jnp.where(live, v[kv_index_b], 0.0)
        sc = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, precision=hi)
    sc = sc * scale
    mask = (j[None, None, :] < limit_bt[:, :, None])[:, None, None]
    pr, lse = masked_softmax(sc, mask)
    if n == 1:
        o = jnp.einsum("bhgqk,khd->bqhgd", pr, v[0], precision=hi)
    else:
        o = jnp.einsum("bhgqk,bkhd->bqhgd", pr, v, precision=hi)
    lse = flag_nonfinite(jax.lax.stop_gradient(o), jnp.transpose(lse[..., 0], (0, 3, 1, 2)))
    return o.reshape(b, tq, hq, d), lse.reshape(b, tq, hq)


def reference_shared_prefix(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix,
                            prefix_lengths, suffix_lengths, scale):
    """Pure-JAX decomposition on canonical inputs (``prefix_k [G, P, Hkv, D]``).

    Out-of-range lengths and groups are clamped (:func:`clamp_shared_inputs`).  Returns
    ``(out [B, Tq, Hq, D]`` in q's dtype, ``lse [B, Tq, Hq]`` float32).
    """
    b, tq = q.shape[:2]
    seq_to_prefix, prefix_lengths, suffix_lengths = clamp_shared_inputs(
        seq_to_prefix, prefix_lengths, suffix_lengths, prefix_k.shape[0], prefix_k.shape[1],
        suffix_k.shape[1])
    lim_p, lim_s = row_limits(tq, prefix_lengths[seq_to_prefix], suffix_lengths)
    o_p, l_p = part_attention(q, prefix_k, prefix_v, seq_to_prefix, lim_p, scale)
    o_s, l_s = part_attention(q, suffix_k, suffix_v, jnp.arange(b, dtype=jnp.int32), lim_s, scale)
    out, lse = merge_attention_states([o_p, o_s], [l_p, l_s])
    return out.astype(q.dtype), lse
