"""CPU that other processes take from the benchmark's two cores during a phase.

P's whole process tree is pinned to one core and this process to the other, so
per core: other = the core's busy time (/proc/stat) - what the pinned tree used
(/proc/PID/stat of its live processes). On a shared machine this says how much
of a phase's step length was someone else's work; `rapidkv bench transfer-kv`
reports it and warns above `NOISY_CORES`.

Invariant: read-only (/proc only); a process that exits during the window is
counted as "other" for the CPU it used (P's tree is stable during a phase).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

NOISY_CORES = 0.2
_TICK = os.sysconf("SC_CLK_TCK")


def core_busy_seconds(cpu: int) -> float:
    """CPU seconds core `cpu` spent not idle since boot."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith(f"cpu{cpu} "):
            user, nice, system, _idle, _iowait, irq, softirq, steal = (
                int(v) for v in line.split()[1:9]
            )
            return (user + nice + system + irq + softirq + steal) / _TICK
    raise ValueError(f"no cpu{cpu} in /proc/stat")


def pids_cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds of the live processes `pids` (all threads)."""
    total = 0
    for pid in pids:
        try:
            raw = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        rest = raw[raw.rindex(")") + 2 :].split()
        total += int(rest[11]) + int(rest[12])  # utime, stime
    return total / _TICK


class CpuNoise:
    """`{core: pids_of}`: the processes pinned to each core. `start()`, then
    `cores()` -> {core: other processes' CPU on it, in cores (0..1)}."""

    def __init__(self, pinned: dict[int, Callable[[], Sequence[int]]]) -> None:
        self.pinned = pinned
        self._t0 = 0.0
        self._busy: dict[int, float] = {}
        self._ours: dict[int, float] = {}

    def _read(self) -> tuple[dict[int, float], dict[int, float]]:
        busy = {c: core_busy_seconds(c) for c in self.pinned}
        ours = {c: pids_cpu_seconds(pids()) for c, pids in self.pinned.items()}
        return busy, ours

    def start(self) -> CpuNoise:
        self._t0 = time.monotonic()
        self._busy, self._ours = self._read()
        return self

    def cores(self) -> dict[int, float]:
        wall = time.monotonic() - self._t0
        busy, ours = self._read()
        return {
            c: round(max(0.0, (busy[c] - self._busy[c]) - (ours[c] - self._ours[c])) / wall, 3)
            for c in self.pinned
        }
