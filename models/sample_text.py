""":class:`SampleText`: the text of one sample as its tokens arrive -- incremental decoding, the
end-of-sequence ids and stop strings that end it, and text deltas that never contain a stop
string.

``push(token, logprob, last)`` returns the text the token adds.  Text that may be the start of
a stop string is held back until the next token decides (so deltas joined equal the final
text); the first occurrence of any stop string cuts the text there (with several stop strings
the one completed first wins) and ends the sample with ``finish == "stop"``; an end-of-sequence
id ends it the same way without adding text; ``last=True`` (the step limit) ends it with
``"length"``.  :func:`stop_strings` checks and normalises a ``stop=`` argument.
"""
from __future__ import annotations

from models.completion import Completion
from models.tokenizer import Tokenizer

__all__ = ["SampleText", "stop_strings"]


def stop_strings(stop) -> tuple[str, ...]:
    """``stop`` (``None``, a string or a sequence of strings) as a tuple of non-empty strings;
    ``ValueError`` otherwise."""
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return stops


class SampleText:
    """Decodes one sample's tokens incrementally; finds stop strings; holds back text that may
    be the start of a stop string, so deltas never contain one (see module docstring).

    Attributes: ``text`` (so far, stop string excluded), ``token_ids``, ``logprobs`` and
    ``finish`` (``None`` while running, else ``"stop"`` or ``"length"``)."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...], eos: frozenset):
        self._dec = tokenizer.stream_decoder(skip_special_tokens=True)
        self._stops = stops
        self._longest = max((len(s) for s in stops), default=0)
        self._eos = eos
        self.text = ""
        self._emitted = 0
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish: str | None = None

    def push(self, token_id: int, logprob: float, last: bool) -> str:
        """Add a token (``last``: the step limit is reached); returns the new text."""
        self.token_ids.append(int(token_id))
        self.logprobs.append(float(logprob))
        if token_id in self._eos:
            return self._add(self._dec.flush(), end="stop")
        piece = self._dec.push(int(token_id))
        if last:
            return self._add(piece + self._dec.flush(), end="length")
        return self._add(piece, end=None)

    def _add(self, piece: str, end: str | None) -> str:
        start = max(0, len(self.text) - self._longest + 1)
        self.text += piece
        hits = [p for p in (self.text.find(s, start) for s in self._stops) if p >= 0]
        if hits:
            cut = max(min(hits), self._emitted)
            self.text, self.finish = self.text[:cut], "stop"
        elif end is not None:
            self.finish = end
        safe = len(self.text) if self.finish else len(self.text) - self._held()
        delta, self._emitted = self.text[self._emitted:safe], max(safe, self._emitted)
        return delta

    def _held(self) -> int:
        """Length of the longest end of the text that is a proper start of a stop string."""
        for k in range(min(self._longest - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(len(s) > k and s.startswith(tail) for s in self._stops):
                return k
        return 0

    def completion(self, logprobs: bool) -> Completion:
        """The :class:`~models.completion.Completion` so far (``logprobs``: include them)."""
        return Completion(text=self.text, token_ids=tuple(self.token_ids), finish_reason=self.finish or "length",
                          logprobs=tuple(self.logprobs) if logprobs else None)
