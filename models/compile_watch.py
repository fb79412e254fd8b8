""":class:`CompileWatch`: the seconds JAX spends tracing, lowering and compiling while a block
runs, and whether a compilation is running now (for a live display)."""
from __future__ import annotations

from typing import Any

import jax

__all__ = ["CompileWatch"]

_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
_LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_COMPILE_START_EVENT = "/jax/compilation_cache/compile_requests_use_cache"


class CompileWatch:
    """While active (``with CompileWatch() as w``): ``w.seconds`` of JAX tracing, lowering and
    compilation so far, and ``w.compiling`` (a compilation is running; read from another thread
    for a live display).  Built on ``jax.monitoring`` listeners."""

    def __init__(self):
        self.seconds = 0.0
        self.compiling = False

    def _on_duration(self, event: str, duration: float, **_: Any) -> None:
        if event in (_TRACE_EVENT, _LOWER_EVENT, _COMPILE_EVENT):
            self.seconds += duration
            self.compiling = event != _COMPILE_EVENT

    def _on_event(self, event: str, **_: Any) -> None:
        if event == _COMPILE_START_EVENT:
            self.compiling = True

    def __enter__(self) -> "CompileWatch":
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on_duration)
        jax.monitoring.unregister_event_listener(self._on_event)
        self.compiling = False
