"""A watchdog that kills this harness's servers when their parent dies.

A parent-death signal (PR_SET_PDEATHSIG) reaches only a direct child, and a
vLLM server is a tree of processes; `atexit` and `finally` do not run on
SIGKILL. So every harness (one per Python process) starts one watchdog process:

* in its own session (a Ctrl-C on the terminal does not reach it);
* reading a pipe whose write end only the parent holds (the parent keeps it
  close-on-exec; processes the parent *forks* without exec inherit it and delay
  the EOF until they exit);
* told, over that pipe, each process group the parent starts (`add PGID
  STARTTIME`) and stops (`del PGID`), and each temporary directory the parent
  creates for them (`own PATH`) and removes itself (`disown PATH`).

When the pipe reports EOF (the parent exited, crashed or was SIGKILLed) or the
watchdog gets SIGTERM, it SIGTERMs, waits up to a grace period, then SIGKILLs
every process it may kill, until none is left, removes the directories it was
given and the files in /dev/shm that the killed processes held and no living
process holds (`harness.shm`), and exits.

Invariant: it kills only (a) processes whose environment carries this harness's
owner entry `RAPIDKV_HARNESS_OWNER=<token>` (every server the harness starts
gets it, and its descendants inherit it), and (b) members of a registered group
whose leader is still the very process registered (same pid and start time, so
the group id cannot have been reused by a stranger). It removes only directories
the parent named (absolute paths, never followed through a symbolic link), and
only after the processes that used them are gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import IO

from rapidkv.harness import procs, shm

OWNER_ENV_PREFIX = "RAPIDKV_HARNESS_OWNER_"
"""A harness marks its processes with the variable `RAPIDKV_HARNESS_OWNER_<token>=1`.

The token is in the *name*, so marks nest: a server started by a process that
a harness started carries both its own harness's mark and the outer one."""


def owner_entry(token: str) -> tuple[str, str]:
    """The (KEY, VALUE) environment entry marking processes of harness `token`."""
    return f"{OWNER_ENV_PREFIX}{token}", "1"


GRACE_ENV = "RAPIDKV_WATCHDOG_GRACE_S"  # SIGTERM -> SIGKILL grace, seconds
DEFAULT_GRACE_S = 10.0
KILL_DEADLINE_S = 30.0


# ---------------------------------------------------------------- watchdog side


class _Reaper:
    """Watchdog-process state: the owner entry and the registered groups."""

    def __init__(self, token: str, grace: float) -> None:
        key, value = owner_entry(token)
        self.entry = f"{key}={value}".encode()
        self.grace = grace
        self.groups: dict[int, int] = {}  # pgid -> leader start time
        self.dirs: set[str] = set()  # directories to remove once the processes are gone
        self.shm: shm.Held = {}  # /dev/shm files the killed processes held
        # every process it may kill started after the watchdog did
        self.started = procs.started_at(os.getpid()) or time.time()

    def handle(self, line: str) -> None:
        verb, _, rest = line.rstrip("\n").partition(" ")
        parts = rest.split()
        numbers = all(p.isdigit() for p in parts)
        if verb == "add" and len(parts) == 2 and numbers:
            self.groups[int(parts[0])] = int(parts[1])
        elif verb == "del" and len(parts) == 1 and numbers:
            self.groups.pop(int(parts[0]), None)
        elif verb == "own" and os.path.isabs(rest):
            self.dirs.add(rest)
        elif verb == "disown" and rest:
            self.dirs.discard(rest)
        elif line.strip():
            log(f"ignoring malformed command {line!r}")

    def remove_dirs(self) -> int:
        """Remove the directories still owned; return how many were there."""
        removed = 0
        for path in sorted(self.dirs):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
                removed += 1
        self.dirs.clear()
        return removed

    def targets(self) -> set[int]:
        found = set(procs.live_with_env(self.entry))
        for pgid, start in self.groups.items():
            if procs.proc_stat(pgid) is not None and _starttime(pgid) == start:
                found.update(procs.live_in_group(pgid))
        found.discard(os.getpid())
        return found

    def _signal(self, sig: int) -> set[int]:
        hit = self.targets()
        for pid in hit:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        return hit

    def reap(self) -> int:
        """Kill every target; return how many processes were signalled at first."""
        self.shm = shm.held(self.targets())
        first = self._signal(signal.SIGTERM)
        if not first:
            return 0
        log(f"SIGTERM sent to {sorted(first)}")
        deadline = time.monotonic() + self.grace
        while self.targets() and time.monotonic() < deadline:
            time.sleep(0.1)
        deadline = time.monotonic() + KILL_DEADLINE_S
        while time.monotonic() < deadline:
            left = self._signal(signal.SIGKILL)
            if not left:
                break
            log(f"SIGKILL sent to {sorted(left)}")
            time.sleep(0.1)
        else:
            log(f"processes survived SIGKILL: {sorted(self.targets())}")
        return len(first)


def _starttime(pid: int) -> int | None:
    st = procs.proc_stat(pid)
    return None if st is None else st.starttime


def log(msg: str) -> None:
    print(f"[watchdog {os.getpid()} {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class _Terminate(Exception):
    pass


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminate


def main(argv: list[str] | None = None) -> int:
    """Watchdog entry point; argv is `TOKEN [GRACE_S]`."""
    argv = sys.argv[1:] if argv is None else argv
    token = argv[0]
    grace = float(argv[1]) if len(argv) > 1 else DEFAULT_GRACE_S
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    reaper = _Reaper(token, grace)
    log(f"watching parent {os.getppid()}")
    try:
        for raw in sys.stdin.buffer:
            reaper.handle(raw.decode(errors="replace"))
        log("parent pipe closed")
    except _Terminate:
        log("SIGTERM received")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    n = reaper.reap()
    d = reaper.remove_dirs()
    f = 0 if reaper.targets() else len(shm.remove_orphans(reaper.shm, reaper.started))
    log(
        f"done ({n} process(es) had to be killed; removed {d} directory(ies), {f} /dev/shm file(s))"
    )
    return 0


# ---------------------------------------------------------------- parent side

# `-m rapidkv.harness.watchdog` would import this module twice (once through the
# package), so the watchdog is started through a one-line entry instead.
_ENTRY = "import sys; from rapidkv.harness.watchdog import main; sys.exit(main(sys.argv[1:]))"


class Watchdog:
    """Parent-side handle of the watchdog process. One per Python process.

    `env_entry` must be put into the environment of every process the harness
    starts; `register` each new process group right after it is created.
    """

    def __init__(self, log_path: Path | None = None, grace: float = DEFAULT_GRACE_S) -> None:
        self.token = uuid.uuid4().hex
        self.owner_pid = os.getpid()
        self._lock = threading.Lock()
        src_dir = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src_dir, env.get("PYTHONPATH")]))
        out: IO[bytes] | int = subprocess.DEVNULL
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            out = open(log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _ENTRY, self.token, str(grace)],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                close_fds=True,
            )
        finally:
            if not isinstance(out, int):
                out.close()
        assert self._proc.stdin is not None
        self._pipe = self._proc.stdin

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def env_entry(self) -> tuple[str, str]:
        """(KEY, VALUE) that marks a process as started by this harness."""
        return owner_entry(self.token)

    def alive(self) -> bool:
        return self._proc.poll() is None

    def _send(self, line: str) -> None:
        with self._lock:
            if self._pipe.closed:
                raise RuntimeError("watchdog already closed")
            try:
                self._pipe.write(line.encode() + b"\n")
                self._pipe.flush()
            except BrokenPipeError as e:
                raise RuntimeError(
                    f"watchdog {self.pid} died (rc={self._proc.poll()}); "
                    "servers would not be cleaned up if this process were killed"
                ) from e

    def register(self, pgid: int, starttime: int) -> None:
        """Tell the watchdog to kill group `pgid` (leader start time `starttime`) on our death."""
        self._send(f"add {pgid} {starttime}")

    def unregister(self, pgid: int) -> None:
        """Forget group `pgid` (call once the group is gone, before its leader is reaped)."""
        self._send(f"del {pgid}")

    def own(self, path: Path) -> None:
        """Have the watchdog remove directory `path` (absolute) after killing our processes."""
        if not path.is_absolute() or "\n" in str(path):
            raise ValueError(f"not an absolute one-line path: {path!r}")
        self._send(f"own {path}")

    def disown(self, path: Path) -> None:
        """Forget directory `path` (we removed it ourselves)."""
        self._send(f"disown {path}")

    def close(self, timeout: float = 60.0) -> None:
        """Close the pipe (the watchdog kills whatever is left) and wait for it to exit."""
        with self._lock:
            if not self._pipe.closed:
                with contextlib.suppress(BrokenPipeError):
                    self._pipe.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=timeout)


_watchdog: Watchdog | None = None
_watchdog_lock = threading.Lock()


def get_watchdog(log_dir: Path | None = None) -> Watchdog:
    """The watchdog of this Python process, started on first use.

    A forked child gets a watchdog of its own (the inherited one watches the parent).
    Raises if this process's watchdog has exited: it never does while its parent
    lives unless someone SIGTERMed it, which also killed every server it guarded.
    """
    global _watchdog
    with _watchdog_lock:
        if _watchdog is not None and _watchdog.owner_pid == os.getpid():
            if not _watchdog.alive():
                raise RuntimeError(
                    f"watchdog {_watchdog.pid} exited; it has killed this harness's servers"
                )
            return _watchdog
        log_path = None if log_dir is None else log_dir / f"watchdog-{os.getpid()}.log"
        grace = float(os.environ.get(GRACE_ENV, DEFAULT_GRACE_S))
        _watchdog = Watchdog(log_path, grace=grace)
        return _watchdog


if __name__ == "__main__":
    sys.exit(main())
