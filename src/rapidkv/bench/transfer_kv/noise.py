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

from rapidkv.harness.procs import tree_cpu_seconds

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
        ours = {c: tree_cpu_seconds(pids()) for c, pids in self.pinned.items()}
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


class NoiseMonitor:
    """A thread that measures `CpuNoise` over consecutive `period_s` windows, so
    that samples and steps that overlap a noisy window (another process used
    more than `NOISY_CORES` of P's or D's core) can be set aside.

    `windows`: `(t0, t1, {core: cores})`, `time.monotonic()`, in order.
    """

    def __init__(
        self, pinned: dict[int, Callable[[], Sequence[int]]], period_s: float = 2.0
    ) -> None:
        import threading

        # resolve the pids once: the pinned trees are stable during a phase
        fixed = {c: tuple(pids()) for c, pids in pinned.items()}
        self._noise = CpuNoise({c: (lambda p=p: p) for c, p in fixed.items()})
        self.period_s = period_s
        self.windows: list[tuple[float, float, dict[int, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-noise", daemon=True)

    def start(self) -> NoiseMonitor:
        self._noise.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._tick()
        self._tick()

    def _tick(self) -> None:
        t0 = self._noise._t0
        cores = self._noise.cores()
        self.windows.append((t0, time.monotonic(), cores))
        self._noise.start()

    def noisy(self, a: float, b: float) -> bool:
        """Did [a, b] overlap a noisy window?"""
        return noisy_between(self.windows, a, b)

    def summary(self) -> dict[str, object]:
        """Mean other-process CPU per core, and the fraction of time that was noisy."""
        total = sum(t1 - t0 for t0, t1, _ in self.windows) or 1.0
        cores = {c for _, _, w in self.windows for c in w}
        return {
            "other_cpu_cores": {
                str(c): round(
                    sum(w.get(c, 0.0) * (t1 - t0) for t0, t1, w in self.windows) / total, 3
                )
                for c in sorted(cores)
            },
            "noisy_time_fraction": round(
                sum(t1 - t0 for t0, t1, w in self.windows if is_noisy(w)) / total, 3
            ),
        }


def is_noisy(cores: dict[int, float]) -> bool:
    return bool(cores) and max(cores.values()) > NOISY_CORES


def noisy_between(
    windows: Sequence[tuple[float, float, dict[int, float]]], a: float, b: float
) -> bool:
    """True if [a, b] overlaps a window whose other-process CPU exceeds
    `NOISY_CORES` on some core."""
    return any(t0 < b and a < t1 and is_noisy(w) for t0, t1, w in windows)
