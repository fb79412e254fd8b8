"""Token sampling: greedy, temperature, top-k and top-p (nucleus), with per-sequence PRNG keys.

:class:`SamplingConfig` is static (hashable): a jit-compiled decode loop is specialised to it.

* ``temperature == 0``: greedy (``argmax``; top-k/top-p are irrelevant);
* otherwise logits are divided by ``temperature``, then masked to ``-inf`` outside the ``top_k``
  largest (``top_k = 0``: off; ties with the k-th value are kept) and outside the nucleus: the
  smallest set of most probable tokens whose probability reaches ``top_p`` (the token that
  crosses ``top_p`` is kept, so the most probable token always survives; ``top_p = 1``: off);
* sequence ``b`` at step ``i`` draws with ``fold_in(keys[b], i)``, so a sequence's samples do not
  depend on the rest of the batch.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["SamplingConfig", "filter_logits", "sample_tokens", "top_k_mask", "top_p_mask"]


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"temperature must be a float >= 0 (0 = greedy), got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def top_k_mask(logits_bv: jax.Array, k: int) -> jax.Array:
    """Boolean ``[B, V]``: True for logits >= the k-th largest of the row."""
    k = min(int(k), logits_bv.shape[-1])
    kth = jax.lax.top_k(logits_bv, k)[0][:, -1:]
    return logits_bv >= kth


def top_p_mask(logits_bv: jax.Array, p: float) -> jax.Array:
    """Boolean ``[B, V]``: True inside the nucleus of probability ``p`` (see module docstring)."""
    sorted_desc = -jnp.sort(-logits_bv, axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = mass_before < p
    # threshold = smallest kept logit; index of the last kept entry (at least 0)
    last = jnp.maximum(jnp.sum(keep_sorted, axis=-1, keepdims=True) - 1, 0)
    threshold = jnp.take_along_axis(sorted_desc, last, axis=-1)
    return logits_bv >= threshold


def filter_logits(logits_bv: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Temperature-scaled logits with masked entries set to ``-inf``."""
    x = logits_bv.astype(jnp.float32) / cfg.temperature
    if cfg.top_k:
        x = jnp.where(top_k_mask(x, cfg.top_k), x, -jnp.inf)
    if cfg.top_p < 1:
        x = jnp.where(top_p_mask(x, cfg.top_p), x, -jnp.inf)
    return x


def sample_tokens(logits_bv: jax.Array, keys_b: jax.Array, step, cfg: SamplingConfig) -> jax.Array:
    """Next tokens ``[B]`` int32; ``keys_b`` is ``[B]`` typed keys (or ``[B, 2]`` raw uint32)."""
    if cfg.greedy:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    x = filter_logits(logits_bv, cfg)
    step_keys = jax.vmap(lambda k: jax.random.fold_in(k, step))(keys_b)
    return jax.vmap(jax.random.categorical)(step_keys, x).astype(jnp.int32)
