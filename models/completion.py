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
    """One sample: ``text``, ``token_ids``, ``finish_reason`` (``"stop"`` | ``"length"``) and
    ``logprobs`` (one per token id, or ``None``); see :mod:`models.llm`."""
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    logprobs: tuple[float, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Timings:
    """Wall times of one call in seconds.  ``compile_s``: JAX tracing and compilation inside it
    (0 once every shape was compiled before).  ``prefill_s`` (prefill and the first sampling),
    ``first_token_s`` (call start to the first tokens on the host), ``decode_s`` (first to last
    token) and ``decode_compile_s`` are ``None`` for the fused loop, which returns only at the end.
    ``new_tokens``: all generated tokens; ``decode_tokens``: those after each sample's first."""
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
    (:class:`~models.prefix_sharing.SharingReport`) and ``.timings`` (:class:`Timings`)."""

    def __init__(self, completions, *, sharing: SharingReport, timings: Timings):
        super().__init__(completions)
        self.sharing = sharing
        self.timings = timings


@dataclasses.dataclass(frozen=True)
class PhaseEvent:
    """A phase starts: ``"prefill"`` (including compilation) or ``"decode"``."""
    name: str


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """A generated token of sample ``sample_index`` of prompt ``prompt_index`` and the text it
    adds (``""`` while a character or a possible stop string is incomplete)."""
    prompt_index: int
    sample_index: int
    token_id: int
    logprob: float
    text: str


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
