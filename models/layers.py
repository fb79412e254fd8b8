"""Llama building blocks as pure functions of explicit parameters (no hidden state).

The decoder keeps its parameters in a plain pytree (see :mod:`models.weights`) so that
``jax.jit``, ``lax.scan`` over layers and donation need no framework glue; each block here is a
function of ``(params, inputs)``:

* :func:`embed` -- token embedding lookup ``[B, T] -> [B, T, H]``;
* :func:`rms_norm` -- RMSNorm computed in float32, cast back (as transformers does);
* :func:`rope_inv_freq` / :func:`apply_rope` -- rotary embedding (rotate-half convention of
  transformers' Llama) at explicit, arbitrary integer positions ``[B, T]``; the Llama-3.1
  frequency scaling is applied to the inverse frequencies;
* :func:`swiglu_mlp` -- ``down(silu(x @ gate) * (x @ up))``;
* :func:`lm_head` -- final projection to the vocabulary (tied to the embedding if configured),
  logits in float32.

Matrices are stored ``[in, out]`` (transposed from torch's ``Linear.weight``).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from models.config import LlamaConfig

__all__ = ["apply_rope", "embed", "lm_head", "rms_norm", "rope_inv_freq", "swiglu_mlp", "dense"]


def dense(x: jax.Array, w_io: jax.Array) -> jax.Array:
    """``x [..., in] @ w [in, out]`` in the parameters' dtype; fp32 uses full precision."""
    prec = jax.lax.Precision.HIGHEST if w_io.dtype == jnp.float32 else None
    return jnp.einsum("...i,io->...o", x.astype(w_io.dtype), w_io, precision=prec)


def embed(table_vh: jax.Array, tokens_bt: jax.Array) -> jax.Array:
    """Embedding lookup: ``table [V, H]``, int tokens ``[B, T]`` -> ``[B, T, H]``."""
    return jnp.take(table_vh, tokens_bt, axis=0, mode="clip")


def rms_norm(x: jax.Array, weight_h: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis in float32, result cast to ``x``'s dtype then scaled."""
    x32 = x.astype(jnp.float32)
    var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    y = (x32 * jax.lax.rsqrt(var + eps)).astype(x.dtype)
    return weight_h.astype(x.dtype) * y


def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
    """Inverse frequencies ``[head_dim // 2]`` float32 (numpy, a compile-time constant).

    Plain RoPE: ``theta ** (-2i / head_dim)``.  With :class:`~models.config.Llama3RopeScaling`
    long wavelengths are divided by ``factor``, short ones are kept, and the band between is
    interpolated smoothly (Llama 3.1; transformers' ``rope_type = "llama3"``).
    """
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
    inv = inv.astype(np.float32)
    sc = config.rope_scaling
    if sc is None:
        return inv
    old = float(sc.original_max_position_embeddings)
    low_wavelen = old / sc.low_freq_factor
    high_wavelen = old / sc.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / sc.factor, inv)
    smooth = (old / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
    smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x_bthd: jax.Array, positions_bt: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate ``x [B, T, H, D]`` by the angles ``positions [B, T] * inv_freq``.

    Positions are arbitrary integers (prefix levels, suffixes and padded rows place tokens
    anywhere).  Angles are computed in float32; the rotation is applied in ``x``'s dtype after
    casting cos/sin to it, as transformers does.
    """
    freqs = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [B, T, D]
    cos = jnp.cos(emb).astype(x_bthd.dtype)[:, :, None, :]
    sin = jnp.sin(emb).astype(x_bthd.dtype)[:, :, None, :]
    half = x_bthd.shape[-1] // 2
    rot = jnp.concatenate([-x_bthd[..., half:], x_bthd[..., :half]], axis=-1)
    return x_bthd * cos + rot * sin


def swiglu_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """SwiGLU feed-forward: ``(silu(x @ w_gate) * (x @ w_up)) @ w_down``."""
    return dense(jax.nn.silu(dense(x, w_gate)) * dense(x, w_up), w_down)


def lm_head(x_bth: jax.Array, params: dict) -> jax.Array:
    """Logits ``[..., V]`` float32 from final hidden states (tied embedding when no ``lm_head``)."""
    if params.get("lm_head") is None:
        w = params["embed"]  # [V, H]
        prec = jax.lax.Precision.HIGHEST if w.dtype == jnp.float32 else None
        out = jnp.einsum("...h,vh->...v", x_bth.astype(w.dtype), w, precision=prec,
                         preferred_element_type=jnp.float32)
    else:
        w = params["lm_head"]  # [H, V]
        prec = jax.lax.Precision.HIGHEST if w.dtype == jnp.float32 else None
        out = jnp.einsum("...h,hv->...v", x_bth.astype(w.dtype), w, precision=prec,
                         preferred_element_type=jnp.float32)
    return out.astype(jnp.float32)
