"""Running a `rapidkv bench` command as a user does, for the smoke tests."""

from __future__ import annotations

import subprocess
import sys
import time


def run_bench(*args: str, timeout: float = 280) -> tuple[subprocess.CompletedProcess[str], float]:
    """``python -m rapidkv.cli bench ARGS...`` in a subprocess, its output
    captured: the finished process and its wall time in seconds."""
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "rapidkv.cli", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.monotonic() - t0
