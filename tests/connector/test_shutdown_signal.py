"""The scheduler side learns that vLLM's engine is shutting down from the
engine's own SIGTERM/SIGINT handler, in front of which it chains a flag's write
(`connector.shutdown_signal`): vLLM's handler still runs, and a process whose
handler is no Python function keeps it."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest

from rapidkv.connector.config import ConnectorConfig
from rapidkv.connector.scheduler_side import SchedulerSide
from rapidkv.connector.shutdown_signal import chain_shutdown_signals

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.fixture
def restored_handlers() -> Iterator[None]:
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_sigterm_sets_closing_then_runs_vllms_handler(restored_handlers: None) -> None:
    calls: list[str] = []
    # as vLLM's EngineCore does before it builds its scheduler (and our side)
    signal.signal(signal.SIGTERM, lambda signum, frame: calls.append("vllm"))
    side = SchedulerSide(ConnectorConfig(transport="tcp"), "P", 16, 1, "fingerprint")
    try:
        assert not side.shared.closing
        os.kill(os.getpid(), signal.SIGTERM)
        assert side.shared.closing and calls == ["vllm"]
    finally:
        side.close()


def test_a_default_or_keyboard_interrupt_handler_is_left_alone(restored_handlers: None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    assert chain_shutdown_signals(lambda: None) == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_off_the_main_thread_nothing_is_chained(restored_handlers: None) -> None:
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(chain_shutdown_signals(lambda: None)))
    thread.start()
    thread.join()
    assert out == [[]]
