"""Read-only views of processes through /proc (Linux).

Used to decide which processes belong to a server this harness started, to
prove, in tests, that none is left, and to account the CPU time and placement of
the processes a benchmark started. Nothing here sends signals.

Invariants: a process that vanishes while being read is treated as absent; a
zombie is treated as dead (it runs nothing and holds no resources but its pid).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class ProcStat:
    """The fields of /proc/PID/stat the harness needs."""

    pid: int
    state: str
    ppid: int
    pgrp: int
    session: int
    starttime: int  # clock ticks after boot; (pid, starttime) names one process for ever

    @property
    def alive(self) -> bool:
        """True unless the process is a zombie or dead."""
        return self.state not in ("Z", "X", "x")


def proc_stat(pid: int) -> ProcStat | None:
    """Parse /proc/PID/stat, or None if the process does not exist."""
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm may contain spaces and parentheses: split after the last ')'.
    rest = raw[raw.rindex(")") + 2 :].split()
    return ProcStat(
        pid=pid,
        state=rest[0],
        ppid=int(rest[1]),
        pgrp=int(rest[2]),
        session=int(rest[3]),
        starttime=int(rest[19]),
    )


def all_pids() -> list[int]:
    """Every pid visible in /proc now."""
    return [int(name) for name in os.listdir(PROC) if name.isdigit()]


def live_in_group(pgid: int) -> list[int]:
    """Pids of non-zombie processes whose process group is `pgid`."""
    out = []
    for pid in all_pids():
        st = proc_stat(pid)
        if st is not None and st.pgrp == pgid and st.alive:
            out.append(pid)
    return out


def environ(pid: int) -> list[bytes]:
    """The initial environment of `pid` as `KEY=VALUE` entries ([] if unreadable)."""
    try:
        data = (PROC / str(pid) / "environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return []
    return [e for e in data.split(b"\0") if e]


def environ_has(pid: int, entry: bytes) -> bool:
    """True if the initial environment of `pid` contains the exact `KEY=VALUE` entry."""
    return entry in environ(pid)


def live_with_env(entry: bytes) -> list[int]:
    """Pids of non-zombie processes whose environment contains `entry` (KEY=VALUE)."""
    out = []
    for pid in all_pids():
        if pid == os.getpid():
            continue
        st = proc_stat(pid)
        if st is not None and st.alive and environ_has(pid, entry):
            out.append(pid)
    return out


def started_at(pid: int) -> float | None:
    """When `pid` started, wall clock (to its start time's clock tick); None if
    it does not exist."""
    st = proc_stat(pid)
    if st is None:
        return None
    uptime = float((PROC / "uptime").read_text().split()[0])
    return time.time() - (uptime - st.starttime / os.sysconf("SC_CLK_TCK"))


def is_alive(pid: int, starttime: int | None = None) -> bool:
    """True if `pid` runs (not a zombie) and, when given, started at `starttime`."""
    st = proc_stat(pid)
    if st is None or not st.alive:
        return False
    return starttime is None or st.starttime == starttime


_TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds of the live processes `pids` (all their threads)."""
    total = 0
    for pid in pids:
        try:
            raw = (PROC / str(pid) / "stat").read_text()
        except OSError:
            continue
        rest = raw[raw.rindex(")") + 2 :].split()
        total += int(rest[11]) + int(rest[12])  # utime, stime (fields 14, 15)
    return total / _TICK


def machine_busy_cpu_seconds() -> float:
    """CPU seconds every core of the machine spent not idle since boot (/proc/stat)."""
    fields = (PROC / "stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / _TICK


def tree_affinity(pids: Sequence[int]) -> list[str]:
    """The distinct `Cpus_allowed_list` values of every thread of `pids`."""
    seen: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(PROC / str(pid) / "task"):
                with contextlib.suppress(OSError):
                    for line in (
                        (PROC / str(pid) / "task" / tid / "status").read_text().splitlines()
                    ):
                        if line.startswith("Cpus_allowed_list:"):
                            seen.add(line.split(":", 1)[1].strip())
    return sorted(seen)


def cpu_model(cpuinfo: Path = PROC / "cpuinfo") -> str | None:
    """The first `model name` of /proc/cpuinfo (what benchmarks record), if any."""
    with contextlib.suppress(OSError):
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() == "model name":
                return value.strip()
    return None
