"""DeepSeek's decoupled rotary embedding: YaRN inverse frequencies, the cos/sin scaling and the
interleaved pair layout.

* :func:`rope_inv_freq` -- ``[qk_rope_head_dim // 2]`` float32 (numpy, a compile-time constant):
  plain RoPE ``theta ** (-2i / Dr)``, or with :class:`~models.deepseek.config.YarnRopeScaling`
  the YaRN blend of interpolated (``/ factor``) and extrapolated frequencies over a linear ramp
  between the correction dimensions of ``beta_fast`` and ``beta_slow``.
* :func:`apply_rope` -- rotate ``x [B, T, H, Dr]`` at integer positions ``[B, T]``; cos and sin
  are multiplied by YaRN's attention factor (so the rotary part of every score is scaled by its
  square).  ``interleave=True`` (DeepSeek's layout) rotates the pairs ``(x0, x1), (x2, x3), ...``
  and returns the rotated evens then the rotated odds; queries and keys are both returned in that
  order, so their dot products are those of the interleaved rotation.  ``interleave=False`` is
  the rotate-half layout.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from models.deepseek.config import DeepseekConfig

__all__ = ["apply_rope", "rope_cos_sin_factor", "rope_inv_freq"]


def rope_inv_freq(config: DeepseekConfig) -> np.ndarray:
    """Inverse frequencies ``[qk_rope_head_dim // 2]`` float32 (see the module docstring)."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    pos_freqs = (base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))).astype(np.float32)
    inv = (1.0 / pos_freqs).astype(np.float32)
    sc = config.rope_scaling
    if sc is None:
        return inv

    def correction_dim(rotations):
        return (dim * math.log(sc.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(base)))

    low, high = correction_dim(sc.beta_fast), correction_dim(sc.beta_slow)
    if sc.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    interpolated = (1.0 / (np.float32(sc.factor) * pos_freqs)).astype(np.float32)
    return (interpolated * (1 - extrapolation) + inv * extrapolation).astype(np.float32)


def rope_cos_sin_factor(config: DeepseekConfig) -> float:
    """The factor on cos and sin: YaRN's attention factor, 1 without scaling."""
    return 1.0 if config.rope_scaling is None else config.rope_scaling.cos_sin_factor


def apply_rope(x_bthd: jax.Array, positions_bt: jax.Array, inv_freq: np.ndarray, *,
               factor: float = 1.0, interleave: bool = True) -> jax.Array:
    """Rotate ``x [B, T, H, Dr]`` by the angles ``positions [B, T] * inv_freq`` (module docstring).

    Angles are float32; cos and sin (times ``factor``) are cast to ``x``'s dtype."""
    freqs = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    cos = (jnp.cos(freqs) * factor).astype(x_bthd.dtype)[:, :, None, :]        # [B, T, 1, Dr/2]
    sin = (jnp.sin(freqs) * factor).astype(x_bthd.dtype)[:, :, None, :]
    if interleave:
        x1, x2 = x_bthd[..., 0::2], x_bthd[..., 1::2]
    else:
        half = x_bthd.shape[-1] // 2
        x1, x2 = x_bthd[..., :half], x_bthd[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
