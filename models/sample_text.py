""":class:`SampleText`: the text of one sample as its tokens arrive -- incremental decoding, the
end-of-sequence ids and stop strings that end it, and text deltas that never contain a stop
string.

``push(token, logprob, last)`` returns the text the token adds.  Text that may be the start of
a stop string is held back until the next token decides (so deltas joined equal the final
text); the first occurrence of any stop string cuts the text there (with several stop strings
the one completed first wins) and ends the sample with ``finish == "stop"``; an end-of-sequence
id (``eos``, which includes any stop token ids) ends it the same way without adding text;
``last=True`` (the step limit) ends it with ``"length"``.  ``include_stop=True`` keeps the
matched stop string (or the ending token's text) in the text.  ``stop_reason`` is the matched
stop string, the ending id when it is one of ``stop_token_ids``, else None (vLLM's
``stop_reason``).  :func:`stop_strings` checks and normalises a ``stop=`` argument.
"""
from __future__ import annotations

from models.completion import Completion
from models.tokenizer import Tokenizer

__all__ = ["SampleText", "stop_strings"]


def stop_strings(stop) -> tuple[str, ...]:
    """``stop`` (``None``, a string or a list / tuple of strings) as a tuple of non-empty
    strings; ``TypeError`` naming ``stop`` for another type, ``ValueError`` for an empty string
    or a non-string item."""
    if stop is None:
        return ()
    if not isinstance(stop, (str, list, tuple)):
        raise TypeError(f"stop: received {type(stop).__name__} {stop!r}, expected a string or a list of strings")
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return stops


class SampleText:
    """Decodes one sample's tokens incrementally; finds stop strings; holds back text that may
    be the start of a stop string, so deltas never contain one (see module docstring).

    Attributes: ``text`` (so far, stop string excluded unless ``include_stop``), ``token_ids``,
    ``logprobs``, ``top_logprobs`` (per token, ``((id, logprob), ...)`` or None),
    ``stop_reason`` and ``finish`` (``None`` while running, else ``"stop"`` or ``"length"``)."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...], eos: frozenset, *,
                 stop_token_ids: frozenset = frozenset(), include_stop: bool = False):
        self._dec = tokenizer.stream_decoder(skip_special_tokens=True)
        self._stops = stops
        self._longest = max((len(s) for s in stops), default=0)
        self._eos = eos
        self._stop_ids = stop_token_ids
        self._include = include_stop
        self.stop_reason: str | int | None = None
        self.top_logprobs: list[tuple[tuple[int, float], ...]] = []
        self.text = ""
        self._emitted = 0
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish: str | None = None

    def push(self, token_id: int, logprob: float, last: bool, top=None) -> str:
        """Add a token (``last``: the step limit is reached; ``top``: its ``((id, logprob), ...)``
        top-k alternatives); returns the new text."""
        self.token_ids.append(int(token_id))
        self.logprobs.append(float(logprob))
        if top is not None:
            self.top_logprobs.append(tuple(top))
        if token_id in self._eos:
            self.stop_reason = int(token_id) if token_id in self._stop_ids else None
            piece = self._dec.push(int(token_id)) if self._include else ""
            return self._add(piece + self._dec.flush(), end="stop")
        piece = self._dec.push(int(token_id))
        if last:
            return self._add(piece + self._dec.flush(), end="length")
        return self._add(piece, end=None)

    def _add(self, piece: str, end: str | None) -> str:
        start = max(0, len(self.text) - self._longest + 1)
        self.text += piece
        hits = [(p, s) for p, s in ((self.text.find(s, start), s) for s in self._stops) if p >= 0]
        if hits:
            at, stop = min(hits, key=lambda h: h[0])
            cut = max(at + len(stop) if self._include else at, self._emitted)
            self.text, self.finish, self.stop_reason = self.text[:cut], "stop", stop
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

    def completion(self, logprobs: bool, prompt_logprobs=None) -> Completion:
        """The :class:`~models.completion.Completion` so far (``logprobs``: include them, and the
        top-k alternatives when they were pushed; ``prompt_logprobs``: passed through)."""
        return Completion(text=self.text, token_ids=tuple(self.token_ids), finish_reason=self.finish or "length",
                          logprobs=tuple(self.logprobs) if logprobs else None, stop_reason=self.stop_reason,
                          top_logprobs=tuple(self.top_logprobs) if logprobs and self.top_logprobs else None,
                          prompt_logprobs=prompt_logprobs)
