"""When vLLM's engine is asked to shut down: its SIGTERM / SIGINT handler.

vLLM's EngineCore process installs a handler for SIGTERM and SIGINT before it
builds its scheduler (and so our scheduler side): the signal sets the engine's
shutdown state, and the engine goes on stepping while it `has_work` (requests
running, or finished ones whose blocks a connector still holds) for up to
`--shutdown-timeout` seconds, after which its parent kills it. No connector
hook says that a shutdown began, so the scheduler side chains its own call in
front of that handler (`chain_shutdown_signals`): the call only sets a flag
(it runs on the engine's main thread, between two bytecodes of whatever that
thread was doing, maybe under the connector's own lock), and the engine thread
acts on it at its next step (`SchedulerSide.build_meta`).

Chained only where the handler is somebody's Python function (vLLM's), on the
main thread: a process that left SIGTERM to its default action, or SIGINT to
Python's `KeyboardInterrupt`, keeps it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def chain_shutdown_signals(on_signal: Callable[[], None]) -> list[signal.Signals]:
    """Call `on_signal()` (a flag's write: nothing that takes a lock or
    blocks), then the handler installed now, on each shutdown signal whose
    handler is a Python function; the signals chained."""
    if threading.current_thread() is not threading.main_thread():
        return []
    chained = []
    for sig in SHUTDOWN_SIGNALS:
        previous = signal.getsignal(sig)
        if not callable(previous) or previous is signal.default_int_handler:
            continue

        def handler(signum: int, frame: Any, previous: Callable[..., Any] = previous) -> None:
            on_signal()
            previous(signum, frame)

        signal.signal(sig, handler)
        chained.append(sig)
    return chained
