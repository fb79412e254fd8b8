"""Repetition, presence and frequency penalties, defined as vLLM defines them, on device.

The decode loop keeps, per sequence, ``counts [B, V]`` int32: how often each token id was
*generated* so far (the prompt is not counted), and, with a repetition penalty, ``prompt_seen
[B, V]`` bool: which ids occur in the sequence's prompt.  Both live on the device and are
updated inside the jitted step (one scatter-add per step), so penalties add no host round trip.
Rows of a shared-prefix batch share the prefix's KV cache, not these arrays: each row's prompt
is its whole path (shared prefix nodes and its own suffix, :meth:`PromptBatch.full_prompt`).

:func:`apply_penalties` on raw logits ``x`` (before temperature), for each row:

* repetition penalty ``r`` (1 = off): every id seen in the prompt or the generated tokens has
  ``x / r`` if ``x > 0`` else ``x * r`` (``r > 1`` makes repeats less likely);
* frequency penalty ``f`` (0 = off): ``x - f * count``;
* presence penalty ``p`` (0 = off): ``x - p * (count > 0)``.

Which penalties run is a static choice (:attr:`SamplingConfig.mode`): without any,
:attr:`SamplingConfig.penalized` is False and the decode loop neither keeps the arrays nor calls
this function; a repetition penalty adds the prompt mask, a presence or frequency penalty the
subtraction of both terms.  The values themselves may be traced scalars (one compilation for
every value).  The log-probabilities the loop reports
are those of the raw logits (before penalties), as vLLM reports by default.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.sampling import SamplingConfig

__all__ = ["add_tokens", "apply_penalties", "prompt_seen_mask"]


def prompt_seen_mask(prompts: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """``[len(prompts), width]`` bool: True where the id occurs in that row's prompt."""
    seen = np.zeros((len(prompts), width), bool)
    for b, p in enumerate(prompts):
        seen[b, np.asarray(p, np.int64)] = True
    return seen


def add_tokens(counts_bv: jax.Array, tokens_b: jax.Array, active_b: jax.Array) -> jax.Array:
    """``counts`` with ``tokens[b]`` counted once more in each active row."""
    rows = jnp.arange(counts_bv.shape[0])
    return counts_bv.at[rows, tokens_b].add(active_b.astype(counts_bv.dtype))


def apply_penalties(logits_bv: jax.Array, counts_bv: jax.Array, prompt_seen_bv: jax.Array | None,
                    cfg: SamplingConfig) -> jax.Array:
    """Penalised logits ``[B, V]`` float32 (module docstring).  ``prompt_seen_bv`` may be None
    unless ``cfg.mode.repetition``; its width may be smaller than the logits' (columns past it
    are padding of a split vocabulary and count as unseen)."""
    x = logits_bv.astype(jnp.float32)
    mode = cfg.mode
    if mode.repetition:
        if prompt_seen_bv is None:
            raise ValueError("apply_penalties: a repetition penalty needs prompt_seen_bv (the prompt's token ids)")
        pad = x.shape[-1] - prompt_seen_bv.shape[-1]
        seen = jnp.pad(prompt_seen_bv, ((0, 0), (0, pad))) if pad else prompt_seen_bv
        seen = seen | (counts_bv > 0)
        r = jnp.asarray(cfg.repetition_penalty, jnp.float32)
        x = jnp.where(seen, jnp.where(x > 0, x / r, x * r), x)
    if mode.additive:
        x = x - jnp.asarray(cfg.frequency_penalty, jnp.float32) * counts_bv.astype(jnp.float32)
        x = x - jnp.asarray(cfg.presence_penalty, jnp.float32) * (counts_bv > 0).astype(jnp.float32)
    return x
