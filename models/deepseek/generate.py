"""Greedy continuation of a batch of sequences that share one prompt, through the latent cache.

:func:`greedy_generate` prefills the prompt once (:meth:`Deepseek.prefill_prefix`), appends each
sequence's own tokens to its suffix buffer (:meth:`Deepseek.extend`, absorbed MLA over the shared
latent prompt), then decodes ``max_new_tokens`` argmax tokens per sequence
(:meth:`Deepseek.decode_step`).  Every sequence gets exactly ``max_new_tokens`` tokens (no stop
token).
"""
from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np

from models.deepseek.cache import init_latent_cache
from models.deepseek.model import Deepseek

__all__ = ["greedy_generate"]


def greedy_generate(model: Deepseek, params: dict, prompt: Sequence[int],
                    continuations: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """The ``max_new_tokens`` greedy tokens after ``prompt + continuations[b]`` for each ``b``
    (``prompt`` non-empty, stored once; continuations may be empty)."""
    if len(prompt) < 1:
        raise ValueError("prompt must hold at least one token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    prefix = model.prefill_prefix_jit(params, jnp.asarray([list(prompt)], jnp.int32))
    b = len(continuations)
    t = max(len(c) for c in continuations)
    cache = init_latent_cache(model.config, prefix, np.zeros(b, np.int32), t + max_new_tokens)
    logits = jnp.broadcast_to(prefix.last_logits[0], (b, prefix.last_logits.shape[1]))
    if t > 0:
        tokens = np.zeros((b, t), np.int32)
        for i, cont in enumerate(continuations):
            if len(cont):
                tokens[i, t - len(cont):] = cont
        n_new = np.asarray([len(c) for c in continuations], np.int32)
        new_logits, cache = model.extend_jit(params, cache, jnp.asarray(tokens), jnp.asarray(n_new))
        logits = jnp.where(jnp.asarray(n_new > 0)[:, None], new_logits, logits)
    out = []
    for step in range(max_new_tokens):
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        out.append(np.asarray(tok))
        if step + 1 < max_new_tokens:
            logits, cache = model.decode_step_jit(params, cache, tok)
    return np.stack(out, axis=1).tolist()
