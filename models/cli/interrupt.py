""":func:`deferred_interrupt`: Ctrl-C during a call whose results reach the host only when it
returns (the Prompt Cache path decodes in one compiled call) lets the call finish, so that its
completions are kept, and stops after the block; a second Ctrl-C stops at once."""
from __future__ import annotations

import contextlib
import signal
import sys
import threading

from models.cli.args import PROG

__all__ = ["deferred_interrupt"]


@contextlib.contextmanager
def deferred_interrupt():
    """While the block runs, SIGINT is noted (and said on stderr) instead of raised; when the
    block ends, a noted SIGINT raises ``KeyboardInterrupt``. A second SIGINT raises at once. Off
    the main thread, or when SIGINT is ignored, the block runs unchanged."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous == signal.SIG_IGN:
        yield
        return
    pending = []

    def note(signum, frame):
        if pending:
            raise KeyboardInterrupt
        pending.append(signum)
        print(f"{PROG}: interrupted; finishing the running generation call to keep its completions (Ctrl-C again "
              f"to stop now)", file=sys.stderr, flush=True)

    signal.signal(signal.SIGINT, note)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)
    if pending:
        raise KeyboardInterrupt
