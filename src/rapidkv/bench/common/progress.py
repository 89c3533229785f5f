"""A benchmark's progress on stderr."""

from __future__ import annotations

import sys
import time
from typing import IO


class Progress:
    """A progress line on stderr: one unit per request, the current stage, elapsed time.

    On a terminal the line is redrawn in place; otherwise each stage is a line.
    Without a `total` (a benchmark that does not count its requests) there is no
    bar: every stage and message is a line of its own, with the elapsed time.
    """

    def __init__(self, total: int | None = None, stream: IO[str] = sys.stderr) -> None:
        self.total = None if total is None else max(total, 1)
        self.done = 0
        self.stream = stream
        self.tty = stream.isatty() and total is not None
        self.label = ""
        self.t0 = time.monotonic()
        self._last = 0.0

    def stage(self, label: str) -> None:
        self.label = label
        if not self.tty:
            print(f"[{self._elapsed()}] {label}", file=self.stream, flush=True)
        self._draw(force=True)

    def advance(self, n: int = 1) -> None:
        self.done += n
        self._draw()

    def say(self, message: str) -> None:
        if self.tty:
            print("\r\033[K", end="", file=self.stream)
        elif self.total is None:
            message = f"[{self._elapsed()}] {message}"
        print(message, file=self.stream, flush=True)
        self._draw(force=True)

    def close(self) -> None:
        if self.tty:
            print(file=self.stream, flush=True)

    def _elapsed(self) -> str:
        s = int(time.monotonic() - self.t0)
        return f"{s // 60}:{s % 60:02d}"

    def _draw(self, force: bool = False) -> None:
        if not self.tty or self.total is None:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(frac * 24)
        line = f"\r\033[K[{bar:<24}] {frac * 100:3.0f}% {self._elapsed()}  {self.label}"
        print(line, end="", file=self.stream, flush=True)
