""":class:`Progress`: the live status line ``jpa-sample`` draws on stderr (phase, elapsed time,
whether JAX is compiling, decode rate), redrawn by a thread while calls block."""
from __future__ import annotations

import contextlib
import sys
import threading
import time

from models.compile_watch import CompileWatch

__all__ = ["Progress"]


class Progress:
    """The live status line on stderr: the phase, its elapsed time, whether JAX is compiling,
    and in decode the step, tokens and tokens/s; redrawn by a thread while calls block.
    Disabled, it writes nothing (piped output stays plain text)."""

    def __init__(self, enabled: bool, watch: CompileWatch, err=None):
        self.enabled = enabled
        self._watch = watch
        self._err = err or sys.stderr
        self._lock = threading.Lock()
        self._phase, self._since, self._detail = "", time.perf_counter(), ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True) if enabled else None

    def __enter__(self) -> "Progress":
        if self._thread:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stops the line for good (clears it)."""
        if self._thread and not self._stop.is_set():
            self._stop.set()
            self._thread.join()
            with self._lock:
                self._clear()
        self.enabled = False

    def phase(self, name: str) -> None:
        """A new phase starts (its clock too)."""
        with self._lock:
            self._phase, self._since, self._detail = name, time.perf_counter(), ""
            self._draw()

    def decode(self, step: int, steps: int, tokens: int, running: int) -> None:
        """A decode step ended: ``step`` of ``steps``, ``tokens`` so far, ``running`` samples."""
        rate = tokens / max(time.perf_counter() - self._since, 1e-9)
        with self._lock:
            self._detail = f"step {step}/{steps}, {tokens} tokens, {rate:.1f} tok/s, {running} running"
            self._draw()

    def write_out(self, text: str, out=None) -> None:
        """Writes to stdout with the status line cleared first and redrawn after."""
        out = out or sys.stdout
        with self.paused():
            out.write(text)
            out.flush()

    @contextlib.contextmanager
    def paused(self):
        """While the block writes (e.g. a JSONL record to stdout) the status line is cleared;
        it is redrawn after."""
        with self._lock:
            self._clear()
            try:
                yield
            finally:
                self._draw()

    def _tick(self) -> None:
        while not self._stop.wait(0.25):
            with self._lock:
                self._draw()

    def _clear(self) -> None:
        if self.enabled:
            self._err.write("\r\x1b[K")
            self._err.flush()

    def _draw(self) -> None:
        if not self.enabled or not self._phase:
            return
        busy = ", compiling" if self._watch.compiling else ""
        text = f"[{self._phase}{busy}] {time.perf_counter() - self._since:.1f} s {self._detail}"
        self._err.write("\r\x1b[K" + text.rstrip())
        self._err.flush()
