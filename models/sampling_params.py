""":class:`SamplingParams`: every option of one :meth:`models.LLM.generate` / ``stream`` /
``events`` call that decides which tokens are drawn, when a sample ends and what it reports --
the names and rules of vLLM's ``SamplingParams``.

    from models import LLM, SamplingParams
    params = SamplingParams(n=2, temperature=0.7, min_p=0.05, repetition_penalty=1.1, stop=["\\n"],
                            logprobs=5, seed=None)
    out = LLM.load().generate(["The capital of France is"], params)
    out.seed                     # the seed drawn for seed=None: pass it back to reproduce the run

The same fields are accepted as keyword arguments (``llm.generate(prompts, n=2, min_p=0.05)``);
:func:`resolve_params` merges the two and refuses a keyword whose value differs from the given
object's.  Each field is checked when the object is built (``ValueError`` / ``TypeError``
naming the field, what was received and what was expected); a sampling number (``temperature``,
``top_k``, ``top_p``, ``min_p``, the penalties) of another type -- a string, None, a bool -- is
a ``TypeError``, one out of range a ``ValueError`` (NumPy numbers are accepted).

Fields (defaults in brackets):

* ``n`` [1] samples per prompt; ``max_new_tokens`` [64] generated tokens at most per sample;
* ``temperature`` [0.8] (0 = greedy), ``top_k`` [50] (0 = off), ``top_p`` [0.95] (1 = off),
  ``min_p`` [0] (0 = off): keep the tokens whose probability is at least ``min_p`` times the
  most probable token's, after temperature, before top-k / top-p (:mod:`models.sampling`);
* ``repetition_penalty`` [1] (> 0, 1 = off), ``presence_penalty`` [0] and
  ``frequency_penalty`` [0] (in [-2, 2], 0 = off), applied to the raw logits before temperature
  (:mod:`models.penalties`): the repetition penalty divides positive logits and multiplies
  negative ones of every id seen in the prompt or the generated tokens; presence subtracts its
  value from every id generated at least once, frequency its value times the id's count;
* ``seed`` [0]: an int in ``[0, 2**32 - 1]``, or None for a random one (drawn by
  :func:`resolve_seed` and reported as :attr:`Generation.seed <models.completion.Generation>`);
* ``stop`` [None]: a string or a list of non-empty strings ending a sample at the first
  occurrence; ``stop_token_ids`` [()] ids that end a sample like an end-of-sequence id;
  ``ignore_eos`` [False]: the model's end-of-sequence ids do not end a sample (only
  ``stop_token_ids``, ``stop`` and ``max_new_tokens`` do); ``include_stop_str_in_output``
  [False]: the matched stop string (or the stop token's text) stays in ``text``;
* ``logprobs`` [False]: ``True`` (or 0) reports each generated token's raw log-probability;
  an int ``k >= 1`` also the ``k`` most probable ids with theirs; ``prompt_logprobs`` [False]:
  the same for each prompt token given the ones before it (the first has none; one forward
  pass of the unsplit model, so not with ``tensor_parallel > 1``).
"""
from __future__ import annotations

import dataclasses
import secrets
from typing import Any, Mapping, Sequence

import numpy as np

from models.sample_text import stop_strings
from models.sampling import DEFAULT_SAMPLING, SEED_MAX, SamplingConfig

__all__ = ["SamplingParams", "logprobs_count", "resolve_params", "resolve_seed"]

DEFAULT_MAX_NEW_TOKENS = 64


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def logprobs_count(name: str, v) -> int | None:
    """A ``logprobs`` / ``prompt_logprobs`` value as ``None`` (off), 0 (the chosen tokens' only)
    or ``k >= 1`` (also the top ``k``): False / None -> None, True -> 0, an int -> itself."""
    if v is None or v is False:
        return None
    if v is True:
        return 0
    if not _is_int(v) or v < 0:
        raise ValueError(f"{name}: received {v!r}, expected a bool or an int k >= 0 (k >= 1: the top-k "
                         f"log-probabilities too)")
    return int(v)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """The sampling options of one call (module docstring).  ``stop`` is kept as a tuple of
    strings and ``stop_token_ids`` as a tuple of ints."""
    n: int = 1
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = DEFAULT_SAMPLING.temperature
    top_k: int = DEFAULT_SAMPLING.top_k
    top_p: float = DEFAULT_SAMPLING.top_p
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = 0
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: bool | int = False
    prompt_logprobs: bool | int = False

    def __post_init__(self):
        for name in ("n", "max_new_tokens"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        self.config()  # checks the sampling numbers
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be an int in [0, {SEED_MAX}] or None (random), got {self.seed!r}")
        object.__setattr__(self, "stop", stop_strings(self.stop))
        ids = self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple, np.ndarray)):
            raise TypeError(f"stop_token_ids: received {type(ids).__name__} {ids!r}, expected a list of ints")
        if not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids: received {list(ids)!r}, expected token ids (ints >= 0)")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: received {getattr(self, name)!r}, expected a bool")
        logprobs_count("logprobs", self.logprobs)
        logprobs_count("prompt_logprobs", self.prompt_logprobs)

    def config(self) -> SamplingConfig:
        """The :class:`~models.sampling.SamplingConfig` the decode loop runs with (compiled for
        its :class:`~models.sampling.SamplingMode`, the values passed as traced scalars)."""
        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                              repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty)

    @property
    def top_logprobs(self) -> int:
        """``k`` of ``logprobs=k`` (0: none)."""
        return logprobs_count("logprobs", self.logprobs) or 0

    def stop_ids(self, eos_token_ids: Sequence[int]) -> tuple[int, ...]:
        """The ids that end a sample: ``eos_token_ids`` (unless ``ignore_eos``) and ``stop_token_ids``."""
        eos = () if self.ignore_eos else tuple(eos_token_ids)
        return tuple(sorted(set(eos) | set(self.stop_token_ids)))


FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def resolve_params(sampling: SamplingParams | None, options: Mapping[str, Any]) -> SamplingParams:
    """``sampling`` with the keyword ``options`` (field names of :class:`SamplingParams`):
    ``TypeError`` for an unknown name or a ``sampling`` that is not a SamplingParams,
    ``ValueError`` for an option that differs from the given ``sampling``'s value."""
    unknown = sorted(set(options) - set(FIELDS))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {', '.join(map(repr, unknown))}; expected fields of "
                        f"SamplingParams: {', '.join(FIELDS)}")
    if sampling is None:
        return SamplingParams(**options)
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling: received {type(sampling).__name__}, expected SamplingParams or None")
    given = dataclasses.replace(sampling, **options) if options else sampling
    clash = [k for k in options if getattr(given, k) != getattr(sampling, k)]
    if clash:
        raise ValueError("sampling= and keyword arguments conflict: " + ", ".join(
            f"{k}={options[k]!r} vs sampling.{k}={getattr(sampling, k)!r}" for k in clash))
    return sampling


def resolve_seed(params: SamplingParams) -> SamplingParams:
    """``params`` with ``seed=None`` replaced by a random seed (from :mod:`secrets`)."""
    if params.seed is not None:
        return params
    return dataclasses.replace(params, seed=secrets.randbelow(SEED_MAX + 1))
