"""Log-probabilities of prompt tokens (``prompt_logprobs=`` of :meth:`models.LLM.generate`): for
each token of a prompt, ``log_softmax(logits)[token]`` of the model given the tokens before it,
as vLLM's ``prompt_logprobs`` (the first token has no context: ``None``).

Each distinct prompt is computed once (identical prompts share the result): one causal pass of
the layers over it (:meth:`~models.llama.Llama.layer_forward`, the cache-free scoring path of
:mod:`models.training.logprobs`; another family's ``prompt_hidden``, e.g.
:meth:`models.deepseek.Deepseek.prompt_hidden`), padded on the right to :func:`~models.prefix_sharing.bucket_length` so
prompts of similar lengths reuse one compiled function (padding comes after the real tokens and
a causal model never attends to it).  The final norm and the LM head then run over chunks of
``chunk`` positions (``lax.map``): each chunk's ``[chunk, V]`` float32 logits give its
log-softmax at the next tokens (and, with ``k >= 1``, the ``k`` most probable ids), so the
logits take O(``chunk`` x V) memory -- 256 MB at ``chunk = 512`` and a 128K vocabulary -- where
the whole ``[T, V]`` would take 4 GB at ``T = 8192``.  Only the ``[T]`` log-probabilities (and
the ``[T, k]`` ids and theirs) leave the device.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jax_prefix_attn
from models.layer_layout import layer_loop
from models.layers import embed, lm_head, rms_norm
from models.llama import Llama
from models.prefix_sharing import bucket_length
from models.sampling import top_logprobs

__all__ = ["PROMPT_CHUNK", "prompt_logprob_arrays", "prompt_logprobs", "prompt_token_logprobs"]

PROMPT_CHUNK = 512   # positions per LM-head chunk


def _check(k, chunk) -> tuple[int, int]:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise ValueError(f"k: received {k!r}, expected an int >= 0 (0: the prompt tokens' log-probabilities only)")
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"chunk: received {chunk!r}, expected an int >= 1 (positions per LM-head chunk)")
    return int(k), int(chunk)


@functools.partial(jax.jit, static_argnames=("model", "k", "chunk"))
def prompt_logprob_arrays(model: Llama, params: dict, tokens_1t: jax.Array, *, k: int = 0,
                          chunk: int = PROMPT_CHUNK):
    """``(chosen [T], top)`` for one right-padded prompt ``tokens [1, T]`` (``T`` a multiple of
    ``chunk``): ``chosen[i]`` is the log-probability of token ``i + 1`` given tokens ``0..i``
    (the last entry, with no next token, is meaningless), ``top`` the ``(ids [T, k], logprobs
    [T, k])`` most probable at each position, or None (``k = 0``).  The logits are computed
    ``chunk`` positions at a time (module docstring)."""
    t = tokens_1t.shape[1]
    if t % chunk:
        raise ValueError(f"tokens_1t: received length {t}, expected a multiple of chunk={chunk}")
    tokens_1t = tokens_1t.astype(jnp.int32)
    pos = jnp.arange(t, dtype=jnp.int32)[None]

    def attend(q, kk, v):
        return jax_prefix_attn.attention(q, kk, v, causal=True, impl=model.impl, interpret=model.interpret)[0]

    if isinstance(model, Llama):
        x = embed(params["embed"], tokens_1t).astype(params["embed"].dtype)
        x = layer_loop(lambda x, lp: model.layer_forward(lp, x, pos, attend)[0], x, params["layers"], False, None)
        h = rms_norm(x[0], params["final_norm"], model.config.rms_norm_eps)          # [T, H]
    else:                                                                            # another family
        h = model.prompt_hidden(params, tokens_1t)[0]
    targets = jnp.concatenate([tokens_1t[0, 1:], jnp.zeros((1,), jnp.int32)])       # position i predicts i + 1

    def one(args):
        h_ch, tgt_c = args
        logits = lm_head(h_ch, params)                                                # [chunk, V] float32
        chosen = jnp.take_along_axis(logits, tgt_c[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(logits, axis=-1)
        return chosen, (top_logprobs(logits, k) if k else None)

    chosen, top = jax.lax.map(one, (h.reshape(t // chunk, chunk, -1), targets.reshape(t // chunk, chunk)))
    return chosen.reshape(t), (None if top is None else tuple(a.reshape(t, k) for a in top))


def prompt_token_logprobs(model: Llama, params: dict, ids: Sequence[int], k: int = 0, *,
                          chunk: int = PROMPT_CHUNK) -> tuple:
    """One prompt's entries: ``None`` for the first token, then each token's log-probability
    given the tokens before it, or with ``k >= 1`` ``(logprob, ((id, logprob), ...))`` -- the
    ``k`` most probable ids at that position, descending."""
    k, chunk = _check(k, chunk)
    t = len(ids)
    width = bucket_length(t)
    step = min(chunk, width)
    width = -(-width // step) * step
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :t] = ids
    chosen, top = prompt_logprob_arrays(model, params, jnp.asarray(tokens), k=k, chunk=step)
    chosen = np.asarray(chosen)[:t - 1].tolist()
    if top is None:
        return (None, *chosen)
    top_ids, top_lps = (np.asarray(a)[:t - 1].tolist() for a in top)
    return (None, *((c, tuple(zip(i, l))) for c, i, l in zip(chosen, top_ids, top_lps)))


def prompt_logprobs(model: Llama, params: dict, prompts: Sequence[Sequence[int]], k: int = 0, *,
                    chunk: int = PROMPT_CHUNK) -> list[tuple]:
    """Per prompt, its :func:`prompt_token_logprobs` entries; each distinct prompt is computed
    once and identical prompts get the same tuple."""
    k, chunk = _check(k, chunk)
    done: dict[tuple[int, ...], tuple] = {}
    out = []
    for ids in prompts:
        key = tuple(int(t) for t in ids)
        if key not in done:
            done[key] = prompt_token_logprobs(model, params, key, k, chunk=chunk)
        out.append(done[key])
    return out
