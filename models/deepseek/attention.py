"""Multi-head latent attention (MLA) of one DeepSeek layer, in its two forms.

Per token (notes "Efficient Attention", 3.2 and 3.2.1): the query ``[q_nope ; q_rope]`` of each
of the ``Hn`` heads (from ``x`` directly, or through the low-rank ``wq_a``, its RMSNorm and
``wq_b``); one latent ``c = RMSNorm((x @ wkv_a)[:R])`` and one rotary key
``k_rope = RoPE((x @ wkv_a)[R:])`` shared by all heads.  ``wkv_b [R, Hn*(Dn+Dv)]`` holds the up
projections ``W_UK [R, Hn, Dn]`` and ``W_UV [R, Hn, Dv]``.

* :func:`attend_expanded` -- the non-absorbed form (prefill): keys ``[c W_UK_h ; k_rope]`` and
  values ``c W_UV_h`` are built for every head and causal attention runs through
  :func:`jax_prefix_attn.attention` (the flash kernel on a GPU); query/key and value widths
  differ, so the narrower side is zero-padded (scores and outputs unchanged).
* :func:`attend_absorbed` -- the absorbed form (decoding over the latent cache): the query is
  ``q_nope_h W_UK_h^T [R]``, attention reads the latents and rotary keys themselves through
  :func:`jax_prefix_attn.mla_attention` (a shared latent prefix plus per-sequence suffixes), and
  ``W_UV`` is applied to its latent-space output.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jax_prefix_attn as jpa
from models.deepseek.config import DeepseekConfig
from models.deepseek.rope import apply_rope
from models.layers import dense, rms_norm

__all__ = ["LORA_NORM_EPS", "attend_absorbed", "attend_expanded", "mla_inputs", "up_projections"]

# The q/kv low-rank RMSNorms use their module default in the reference code, not rms_norm_eps.
LORA_NORM_EPS = 1e-6


def _mm(eq: str, a: jax.Array, b: jax.Array) -> jax.Array:
    prec = jax.lax.Precision.HIGHEST if b.dtype == jnp.float32 else None
    return jnp.einsum(eq, a.astype(b.dtype), b, precision=prec)


def mla_inputs(config: DeepseekConfig, lp: dict, x_bth: jax.Array, pos_bt: jax.Array,
               inv_freq: np.ndarray, rope_factor: float):
    """``(q_nope [B, T, Hn, Dn], q_rope [B, T, Hn, Dr], latent [B, T, R], rope_k [B, T, Dr])``
    of the layer's input ``x [B, T, H]`` at positions ``[B, T]`` (rotary parts rotated)."""
    c = config
    b, t, _ = x_bth.shape
    if "wq" in lp:
        q = dense(x_bth, lp["wq"])
    else:
        q = dense(rms_norm(dense(x_bth, lp["wq_a"]), lp["q_a_norm"], LORA_NORM_EPS), lp["wq_b"])
    q = q.reshape(b, t, c.num_attention_heads, c.qk_head_dim)
    q_nope, q_rope = q[..., :c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:]
    kv = dense(x_bth, lp["wkv_a"])
    latent = rms_norm(kv[..., :c.kv_lora_rank], lp["kv_a_norm"], LORA_NORM_EPS)
    rot = lambda z: apply_rope(z, pos_bt, inv_freq, factor=rope_factor,  # noqa: E731
                               interleave=c.rope_interleave)
    return q_nope, rot(q_rope), latent, rot(kv[..., None, c.kv_lora_rank:])[:, :, 0]


def up_projections(config: DeepseekConfig, wkv_b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(W_UK [R, Hn, Dn], W_UV [R, Hn, Dv])`` from ``wkv_b [R, Hn*(Dn+Dv)]``."""
    c = config
    w = wkv_b.reshape(c.kv_lora_rank, c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim)
    return w[..., :c.qk_nope_head_dim], w[..., c.qk_nope_head_dim:]


def attend_expanded(config: DeepseekConfig, lp: dict, q_nope, q_rope, latent_btr, rope_k_btd, *,
                    impl: str, interpret: bool) -> jax.Array:
    """Causal self-attention of ``T`` tokens over themselves in the non-absorbed form:
    ``[B, T, Hn, Dv]`` (the module docstring)."""
    c = config
    b, t, hn, _ = q_nope.shape
    w_uk, w_uv = up_projections(c, lp["wkv_b"])
    k_nope = _mm("btr,rhn->bthn", latent_btr, w_uk).astype(q_nope.dtype)
    v = _mm("btr,rhv->bthv", latent_btr, w_uv).astype(q_nope.dtype)
    k_rope = jnp.broadcast_to(rope_k_btd[:, :, None, :], (b, t, hn, c.qk_rope_head_dim))
    q = jnp.concatenate([q_nope, q_rope], axis=-1)
    k = jnp.concatenate([k_nope, k_rope.astype(k_nope.dtype)], axis=-1)
    width = max(c.qk_head_dim, c.v_head_dim)
    pad = lambda z: jnp.pad(z, ((0, 0),) * 3 + ((0, width - z.shape[-1]),))  # noqa: E731
    out, _ = jpa.attention(pad(q), pad(k), pad(v), causal=True, sm_scale=c.softmax_scale, impl=impl,
                           interpret=interpret)
    return out[..., :c.v_head_dim]


def attend_absorbed(config: DeepseekConfig, lp: dict, q_nope, q_rope, prefix_latent, prefix_rope_k,
                    suffix_latent, suffix_rope_k, *, suffix_lengths, prefix_lengths,
                    seq_to_prefix, impl: str = "auto") -> jax.Array:
    """Attention of the newest ``T`` tokens of each sequence over its latent prefix and suffix
    in the absorbed form: ``[B, T, Hn, Dv]`` (the module docstring; the cache layout, the
    lengths and ``impl`` as :func:`jax_prefix_attn.mla_attention`)."""
    w_uk, w_uv = up_projections(config, lp["wkv_b"])
    q_abs = _mm("bthn,rhn->bthr", q_nope, w_uk).astype(prefix_latent.dtype)
    o = jpa.mla_attention(q_abs, q_rope.astype(prefix_latent.dtype), prefix_latent, prefix_rope_k,
                          suffix_latent, suffix_rope_k, suffix_lengths=suffix_lengths,
                          prefix_lengths=prefix_lengths, seq_to_prefix=seq_to_prefix,
                          sm_scale=config.softmax_scale, impl=impl)
    return _mm("bthr,rhv->bthv", o, w_uv)
