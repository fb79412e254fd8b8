"""The latent KV cache of a DeepSeek (MLA) decoder: functional pytrees passed into and returned
from every model call.

Per token and layer MLA stores the latent ``c [R]`` (``kv_lora_rank``) and the rotated RoPE key
``k_rope [Dr]``, shared by all heads (instead of ``2 x heads x head_dim`` keys and values).

* :class:`LatentPrefix` -- ``G`` prompts stored once: per layer ``latent [G, P, R]`` and
  ``rope_k [G, P, Dr]`` (rows ``>= lengths[g]`` are padding), ``lengths [G]`` and the logits
  after each prompt's last token, ``last_logits [G, V]``.  Reusable by any number of batches.
* :class:`LatentCache` -- a decoding batch of ``B`` sequences: the prefix it hangs from
  (``seq_to_prefix [B]``), per layer a suffix buffer ``latent [B, S_max, R]`` and
  ``rope_k [B, S_max, Dr]``, and the valid suffix entries ``lengths [B]``.  Suffix entry ``j`` of
  sequence ``b`` sits at position ``prefix.lengths[seq_to_prefix[b]] + j``.

Shapes are static and lengths are int32 device arrays, so everything here runs under
``jax.jit``; writing past ``S_max`` drops the entry (size the buffer for the whole run).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from models.deepseek.config import DeepseekConfig

__all__ = ["LatentCache", "LatentPrefix", "check_latent_cache", "init_latent_cache"]


@struct.dataclass
class LatentPrefix:
    """``G`` shared prompts' latent caches (module docstring)."""
    latent: tuple           # per layer [G, P, R]
    rope_k: tuple           # per layer [G, P, Dr]
    lengths: jax.Array      # [G] int32
    last_logits: jax.Array  # [G, V] float32


@struct.dataclass
class LatentCache:
    """A batch's latent suffix buffers over a :class:`LatentPrefix` (module docstring)."""
    prefix: LatentPrefix
    latent: tuple             # per layer [B, S_max, R]
    rope_k: tuple             # per layer [B, S_max, Dr]
    lengths: jax.Array        # [B] int32
    seq_to_prefix: jax.Array  # [B] int32

    @property
    def positions(self) -> jax.Array:
        """``[B]`` the position of each sequence's next token."""
        return self.prefix.lengths[self.seq_to_prefix] + self.lengths


def init_latent_cache(config: DeepseekConfig, prefix: LatentPrefix, seq_to_prefix_b, capacity: int,
                      dtype=None) -> LatentCache:
    """An empty batch over ``prefix``: ``seq_to_prefix [B]`` picks each sequence's prompt,
    ``capacity`` is ``S_max`` (the suffix tokens each sequence can hold)."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be a positive int, got {capacity!r}")
    s2p = jnp.asarray(seq_to_prefix_b, jnp.int32)
    if s2p.ndim != 1:
        raise ValueError(f"seq_to_prefix must have shape [batch], got {tuple(s2p.shape)}")
    b = s2p.shape[0]
    dtype = prefix.latent[0].dtype if dtype is None else dtype
    zeros = lambda w: tuple(jnp.zeros((b, capacity, w), dtype)  # noqa: E731
                            for _ in range(config.num_hidden_layers))
    return LatentCache(prefix=prefix, latent=zeros(config.kv_lora_rank), rope_k=zeros(config.qk_rope_head_dim),
                       lengths=jnp.zeros((b,), jnp.int32), seq_to_prefix=s2p)


def check_latent_cache(config: DeepseekConfig, cache: LatentCache) -> None:
    """``ValueError`` naming the field when ``cache``'s buffers do not fit ``config`` (layers,
    ``kv_lora_rank``, ``qk_rope_head_dim``, batch and prompt axes)."""
    b = cache.lengths.shape[0] if cache.lengths.ndim == 1 else None
    if b is None or cache.seq_to_prefix.shape != (b,):
        raise ValueError(f"cache.lengths and cache.seq_to_prefix must have shape [batch], got "
                         f"{tuple(cache.lengths.shape)} and {tuple(cache.seq_to_prefix.shape)}")
    g = cache.prefix.lengths.shape[0]
    for where, bufs_lat, bufs_rope, lead in (
            ("cache.prefix", cache.prefix.latent, cache.prefix.rope_k, f"[G={g}, P"),
            ("cache", cache.latent, cache.rope_k, f"[batch={b}, S_max")):
        for field, bufs, width, wname in (("latent", bufs_lat, config.kv_lora_rank, "kv_lora_rank"),
                                          ("rope_k", bufs_rope, config.qk_rope_head_dim, "qk_rope_head_dim")):
            if len(bufs) != config.num_hidden_layers:
                raise ValueError(f"{where}.{field} must hold one buffer per layer "
                                 f"({config.num_hidden_layers}), got {len(bufs)}")
            for i, x in enumerate(bufs):
                first = g if where == "cache.prefix" else b
                if x.ndim != 3 or x.shape[0] != first or x.shape[2] != width:
                    raise ValueError(f"{where}.{field}[{i}] must have shape {lead}, {wname}={width}], "
                                     f"got {tuple(x.shape)}")
