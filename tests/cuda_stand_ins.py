"""CUDA stood in for where there is no GPU (tests of `kvt.device_ready` and of
the connector's worker side over "CUDA" caches): `FakeEvent`, a
`torch.cuda.Event` that completes when the test says, and `install`, which
makes `torch.cuda` report a device and hand out FakeEvents."""

from __future__ import annotations

import threading
from typing import ClassVar

import pytest
import torch


class FakeEvent:
    """Stands in for torch.cuda.Event: completes when the test says
    (`fired.set()`); keeps how it was made and where it was recorded."""

    made: ClassVar[list[FakeEvent]] = []

    def __init__(self, blocking: bool = False) -> None:
        self.blocking = blocking
        self.stream: str | None = None
        self.thread = ""  # the thread that recorded it
        self.fired = threading.Event()
        FakeEvent.made.append(self)

    def record(self, stream: str) -> None:
        self.stream = stream
        self.thread = threading.current_thread().name

    def query(self) -> bool:
        return self.fired.is_set()

    def synchronize(self) -> None:
        assert self.fired.wait(10), "event never completed"


def install(monkeypatch: pytest.MonkeyPatch) -> type[FakeEvent]:
    """`torch.cuda` with device 0 available, whose events are FakeEvents and
    whose current stream is a name ("forward stream of cuda:0")."""
    FakeEvent.made = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"forward stream of {device}")
    return FakeEvent
