"""One call of :class:`models.LLM` prepared for the decode loop: the forms a prompt may take, the
argument checks, and :class:`Request` -- the prompts' token ids planned into a shared-prefix batch
(:func:`~models.prefix_sharing.plan_prompt_batch`), padded to a bucketed size
(:func:`~models.batch_buckets.pad_batch`), with one sampling key per row and the call's
:class:`~models.sampling_params.SamplingParams` (its seed resolved).

Row ``j * n + i`` is sample ``i`` of prompt ``j`` and draws with
``sample_keys(seed, j, i)``; a padding row gets the key of the real row it copies.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from models.batch_buckets import PaddedBatch, pad_batch
from models.generate import resolve_attention
from models.prefix_sharing import MIN_SHARED_TOKENS, PromptBatch, SharingReport, plan_prompt_batch, sharing_report
from models.sampling import SamplingConfig, sample_keys
from models.sampling_params import SamplingParams, logprobs_count

__all__ = ["Request", "check_int", "check_prompt_text", "is_messages", "is_token_ids", "plan_request", "prompt_list"]


def is_messages(x) -> bool:
    """``x`` is a non-empty list of chat messages (dicts)."""
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(m, dict) for m in x)


def is_token_ids(x) -> bool:
    """``x`` is a non-empty sequence of integer token ids."""
    return (isinstance(x, (list, tuple, np.ndarray)) and len(x) > 0
            and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in x))


def prompt_list(prompts) -> list:
    """``prompts`` as a list of prompts (one prompt -- text, token ids or messages -- becomes a
    list of one)."""
    if isinstance(prompts, str) or is_messages(prompts) or is_token_ids(prompts):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a string, token ids, chat messages or a list of them, "
                        f"got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts must hold at least one prompt, got an empty list")
    return list(prompts)


def check_prompt_text(j: int, text: str) -> None:
    """``ValueError`` naming ``prompts`` when prompt ``j``'s text is empty or only whitespace."""
    if not text.strip():
        raise ValueError(f"prompts: prompt {j} is {text!r}, expected text with at least one non-whitespace "
                         f"character")


def check_int(name: str, v, lo: int) -> None:
    """``ValueError`` naming ``name`` unless ``v`` is an int ``>= lo``."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")


@dataclasses.dataclass(frozen=True)
class Request:
    """A prepared call.  ``batch``: the planned batch of the real rows (what ``sharing``
    describes); ``padded``: the batch the decode loop runs (real rows first) and ``keys``
    ``[padded.batch.batch, 2]`` its rows' sampling keys; ``params``: the options, ``seed`` an int."""
    prompt_ids: tuple[tuple[int, ...], ...]
    batch: PromptBatch
    padded: PaddedBatch
    attention: str
    params: SamplingParams
    keys: Any
    sharing: SharingReport

    @property
    def rows(self) -> int:
        """Real rows (prompts x samples)."""
        return self.batch.batch

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def max_new_tokens(self) -> int:
        return self.params.max_new_tokens

    @property
    def sampling(self) -> SamplingConfig:
        return self.params.config()

    @property
    def stops(self) -> tuple[str, ...]:
        return self.params.stop

    @property
    def logprobs(self) -> bool:
        """Whether the completions report log-probabilities."""
        return logprobs_count("logprobs", self.params.logprobs) is not None


def plan_request(ids: Sequence[Sequence[int]], *, params: SamplingParams, attention: str, explicit_share: bool,
                 vocab_size: int, context: int, bytes_per_token: int, data_parallel: int = 1,
                 nested_prefixes: bool = True) -> Request:
    """The :class:`Request` of tokenized prompts ``ids``: checks their lengths against
    ``context`` and ``params.stop_token_ids`` against ``vocab_size``, plans the shared-prefix
    batch (``explicit_share``: a common prefix is shared whatever its length), resolves
    ``attention`` on it and pads it to a bucketed multiple of ``data_parallel`` rows.
    ``nested_prefixes=False`` (a model whose cache holds one level of shared prompts): the
    batch's levels are folded into one (:meth:`PromptBatch.single_level`), so the batch and its
    sharing report are what the cache stores.
    ``params.seed`` must be an int (:func:`~models.sampling_params.resolve_seed`)."""
    n, max_new_tokens = params.n, params.max_new_tokens
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids: received {bad}, expected ids below the vocabulary size {vocab_size}")
    for j, p in enumerate(ids):
        if not p:
            raise ValueError(f"empty prompt: prompt {j} has 0 tokens")
        if len(p) + max_new_tokens > context:
            raise ValueError(f"prompt {j} ({len(p)} tokens) + max_new_tokens ({max_new_tokens}) = "
                             f"{len(p) + max_new_tokens} exceeds the model's context of {context} tokens")
    batch = plan_prompt_batch(ids, n, min_shared_tokens=1 if explicit_share else MIN_SHARED_TOKENS)
    if not nested_prefixes:
        batch = batch.single_level()
    batch.validate(vocab_size, max_new_tokens=max_new_tokens)
    layout = resolve_attention(batch, attention)
    padded = pad_batch(batch, multiple=data_parallel)
    rows = padded.source
    keys = sample_keys(params.seed, rows // n, rows % n)
    report = sharing_report(batch, attention=layout, bytes_per_token=bytes_per_token, max_new_tokens=max_new_tokens)
    return Request(prompt_ids=tuple(tuple(p) for p in ids), batch=batch, padded=padded, attention=layout,
                   params=params, keys=keys, sharing=report)
