"""Log-probabilities of prompt tokens (``prompt_logprobs=`` of :meth:`models.LLM.generate`): for
each token of a prompt, ``log_softmax(logits)[token]`` of the model given the tokens before it,
as vLLM's ``prompt_logprobs`` (the first token has no context: ``None``).

One causal forward pass per distinct prompt (its samples share the result), padded on the right
to :func:`~models.prefix_sharing.bucket_length` so prompts of similar lengths reuse one compiled
function; padding comes after the real tokens and a causal model never attends to it.  Only the
``[T]`` log-probabilities (and, with ``k >= 1``, the ``[T, k]`` most probable ids and theirs)
leave the device, not the ``[T, V]`` logits.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.llama import Llama
from models.prefix_sharing import bucket_length
from models.sampling import top_logprobs

__all__ = ["prompt_logprobs"]


@functools.partial(jax.jit, static_argnames=("model", "k"))
def _prompt_lp(model: Llama, params, tokens_1t, *, k: int):
    logits = model.forward(params, tokens_1t)[0, :-1].astype(jnp.float32)       # [T-1, V]: predicts t + 1
    targets = tokens_1t[0, 1:]
    chosen = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(logits, axis=-1)
    return chosen, (top_logprobs(logits, k) if k else None)


def prompt_logprobs(model: Llama, params: dict, prompts: Sequence[Sequence[int]], k: int = 0) -> list[tuple]:
    """Per prompt, a tuple with one entry per token: ``None`` for the first, then the token's
    log-probability given the tokens before it, or with ``k >= 1`` ``(logprob, ((id, logprob),
    ...))`` -- the ``k`` most probable ids at that position, descending."""
    out = []
    for ids in prompts:
        t = len(ids)
        tokens = np.zeros((1, bucket_length(t)), np.int32)
        tokens[0, :t] = ids
        chosen, top = _prompt_lp(model, params, jnp.asarray(tokens), k=int(k))
        chosen = np.asarray(chosen)[:t - 1].tolist()
        if top is None:
            out.append((None, *chosen))
            continue
        top_ids, top_lps = (np.asarray(a)[:t - 1].tolist() for a in top)
        out.append((None, *((c, tuple(zip(i, l))) for c, i, l in zip(chosen, top_ids, top_lps))))
    return out
