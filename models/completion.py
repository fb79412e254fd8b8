"""What :class:`models.LLM` returns and yields: :class:`Completion` (one sample), :class:`Timings`,
:class:`Generation` (the completions of a call with its sharing report and timings), and the
events of a run (:class:`PhaseEvent`, :class:`TokenEvent`, :class:`FinishEvent`,
:class:`StepEvent`, :class:`DoneEvent`) that :meth:`models.LLM.events` yields and ``jpa-sample``
displays."""
from __future__ import annotations

import dataclasses

from models.prefix_sharing import SharingReport

__all__ = ["Completion", "DoneEvent", "FinishEvent", "Generation", "PhaseEvent", "StepEvent", "Timings",
           "TokenEvent"]


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sample: ``text``, ``token_ids``, ``finish_reason`` (``"stop"`` | ``"length"``),
    ``logprobs`` (one per token id, or ``None``), ``stop_reason`` (the matched stop string, the
    stop token id of ``stop_token_ids`` that ended it, or ``None``: an end-of-sequence id or the
    length limit), ``top_logprobs`` (``logprobs=k``: per token id, its ``k`` most probable
    alternatives as ``((id, logprob), ...)``, descending) and ``prompt_logprobs``
    (``prompt_logprobs=``: per prompt token, ``None`` for the first, then ``logprob`` or, with
    ``k >= 1``, ``(logprob, ((id, logprob), ...))``); see :mod:`models.llm`."""
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    logprobs: tuple[float, ...] | None = None
    stop_reason: str | int | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    prompt_logprobs: tuple | None = None


@dataclasses.dataclass(frozen=True)
class Timings:
    """Wall times of one call in seconds.

    ``total_s``: the call (for :meth:`~models.LLM.events` and ``stream``: from the call to the
    end of the last step, including the time the consumer spends between events).
    ``compile_s``: JAX tracing and compilation inside it (0 once every shape was compiled
    before).  ``prefill_s``: the prefill phase -- the prompt log-probabilities
    (``prompt_logprobs=``, :mod:`models.prompt_logprobs`), the prefill and the compilation they
    need -- up to the moment decoding starts: step by step, when the first tokens reach the host
    (the first sampling included); in the fused loop, when the decode loop can start on the
    device: the loop is traced and compiled while the prefill runs on the device, so this is
    the later of the prefill's end and the loop's dispatch.  ``first_token_s``: call start to
    the same moment (the fused loop draws its first token on the device as it starts).
    ``decode_s``: from there to the last token; ``decode_compile_s``: the compilation inside
    ``decode_s`` (the step-by-step decode step's; none in the fused loop, compiled before).
    The phases do not overlap: ``prefill_s + decode_s <= total_s``.  ``new_tokens``: all
    generated tokens; ``decode_tokens``: those after each sample's first.  The optional fields
    are filled by every :class:`models.LLM` call; they default to ``None`` for code that builds
    a ``Timings`` without measuring them."""
    total_s: float
    compile_s: float
    new_tokens: int
    decode_tokens: int
    prefill_s: float | None = None
    first_token_s: float | None = None
    decode_s: float | None = None
    decode_compile_s: float | None = None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Decode rate without the decode step's compilation (``None`` when not measured)."""
        if self.decode_s is None:
            return None
        busy = self.decode_s - (self.decode_compile_s or 0.0)
        return self.decode_tokens / busy if busy > 0 else None


class Generation(list):
    """``list[list[Completion]]`` (prompt, then sample) with ``.sharing``
    (:class:`~models.prefix_sharing.SharingReport`), ``.timings`` (:class:`Timings`) and
    ``.seed`` (the seed the samples were drawn with -- the random one drawn for ``seed=None``;
    pass it as ``seed=`` to reproduce the call)."""

    def __init__(self, completions, *, sharing: SharingReport, timings: Timings, seed: int | None = None):
        super().__init__(completions)
        self.sharing = sharing
        self.timings = timings
        self.seed = seed


@dataclasses.dataclass(frozen=True)
class PhaseEvent:
    """A phase starts: ``"prefill"`` (including compilation) or ``"decode"``."""
    name: str


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """A generated token of sample ``sample_index`` of prompt ``prompt_index`` and the text it
    adds (``""`` while a character or a possible stop string is incomplete); ``logprob`` its raw
    log-probability, ``top_logprobs`` its ``k`` most probable alternatives ``((id, logprob),
    ...)`` with ``logprobs=k``, else ``None``."""
    prompt_index: int
    sample_index: int
    token_id: int
    logprob: float
    text: str
    top_logprobs: tuple[tuple[int, float], ...] | None = None


@dataclasses.dataclass(frozen=True)
class FinishEvent:
    """A sample ended (after its last :class:`TokenEvent`)."""
    prompt_index: int
    sample_index: int
    completion: Completion


@dataclasses.dataclass(frozen=True)
class StepEvent:
    """A decode step ended: ``step`` steps taken, ``new_tokens`` generated, ``running`` samples."""
    step: int
    new_tokens: int
    running: int


@dataclasses.dataclass(frozen=True)
class DoneEvent:
    """The run ended; ``result`` is what :meth:`models.LLM.generate` returns for it."""
    result: Generation
