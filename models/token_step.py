"""One decode step's choice of tokens, shared by the fused loop and the step-by-step loop of
:mod:`models.generate`: penalties (when any is on), sampling, the chosen tokens' raw
log-probabilities, the top-k log-probabilities (when asked) and the update of the per-sequence
token counts -- all on the device, inside the jitted step.

Every optional part is a static choice: ``counts is None`` (no penalty) traces no count array
and no scatter, ``top_k == 0`` no top-k of the log-probabilities, and the sampling config's
:class:`~models.sampling.SamplingMode` picks the sampling and penalty operations, so options
left at their neutral values leave the compiled step as it is without them.  The sampling
values (temperature, top-p, min-p, penalties) may be traced.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.penalties import add_tokens, apply_penalties, prompt_seen_mask
from models.prefix_sharing import PromptBatch
from models.sampling import SamplingConfig, top_logprobs

__all__ = ["check_top_logprobs", "choose_tokens", "initial_counts", "prompt_seen"]


def choose_tokens(model, logits_bv, keys_b, step, done_b, counts, seen, *, cfg: SamplingConfig, pad_id: int,
                  top_k: int):
    """One step's choice: ``(tokens [B], logprobs [B], top, counts)``.  Finished rows (``done_b``)
    give ``pad_id`` / 0 and are not counted; ``top``: ``(ids [B, k], logprobs [B, k])`` of the raw
    distribution, or None (``top_k == 0``); ``counts``: the generated-token counts ``[B, V]``
    updated with this step's tokens, or None (no penalty: nothing is kept); ``seen``: the
    prompt-token mask of a repetition penalty (:func:`prompt_seen`), else None."""
    sample, logprob = model.sample_tokens, model.token_logprobs   # a sharded model samples from its shards
    x = logits_bv if counts is None else apply_penalties(logits_bv, counts, seen, cfg)
    tok = sample(x, keys_b, step, cfg)
    lp = jnp.where(done_b, 0.0, logprob(logits_bv, tok))
    tok = jnp.where(done_b, pad_id, tok)
    top = top_logprobs(logits_bv, top_k, model.config.vocab_size) if top_k else None
    if counts is not None:
        counts = add_tokens(counts, tok, ~done_b)
    return tok, lp, top, counts


def initial_counts(cfg: SamplingConfig, logits_bv) -> jax.Array | None:
    """Zero counts shaped like the logits when a penalty is on, else None."""
    return jnp.zeros(logits_bv.shape, jnp.int32) if cfg.penalized else None


def prompt_seen(cfg: SamplingConfig, prompts: PromptBatch | Sequence[Sequence[int]] | None, batch: int,
                vocab_size: int) -> jax.Array | None:
    """The ``[B, V]`` prompt-token mask a repetition penalty needs (None without one).
    ``prompts``: the batch (each row's whole prompt, :meth:`PromptBatch.full_prompt`) or one
    sequence of token ids per row."""
    if not cfg.mode.repetition:
        return None
    if prompts is None:
        raise ValueError(f"prompt_token_ids: received None, expected the {batch} prompts' token ids "
                         f"(sampling has repetition_penalty={cfg.repetition_penalty})")
    if isinstance(prompts, PromptBatch):
        prompts = [prompts.full_prompt(b) for b in range(prompts.batch)]
    if len(prompts) != batch:
        raise ValueError(f"prompt_token_ids: received {len(prompts)} prompts, expected one per sequence ({batch})")
    return jnp.asarray(prompt_seen_mask(prompts, vocab_size))


def check_top_logprobs(top_logprobs: int) -> int:
    """``top_logprobs`` as an int ``>= 0``; ``ValueError`` naming it otherwise."""
    if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, (int, np.integer)) or top_logprobs < 0:
        raise ValueError(f"top_logprobs: received {top_logprobs!r}, expected an int >= 0 (0 = off)")
    return int(top_logprobs)
