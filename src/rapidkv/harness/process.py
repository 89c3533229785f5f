"""A process tree started in its own session and stopped by process group.

Invariants:
* The leader is started with `start_new_session=True`, so its pid is the group
  id (pgid) of the whole tree, and it is registered with the watchdog before
  `ManagedProcess.start` returns.
* The leader is never reaped before its group is empty. While a process (even a
  zombie) has a pid, that number cannot be reused, so signalling the group
  `pgid` can only ever reach processes of this tree.
* Every process of the tree also carries `RAPIDKV_HARNESS_PROC_<uuid>=1` in its
  environment; `stop` kills processes with that entry that left the group
  (including trees a harness inside the tree started: marks nest).
* `stop` is idempotent and, when it returns, no process of the tree is alive,
  and no file in /dev/shm that the tree made and held when it was signalled
  (by `stop` or `signal`) is left unless a living process holds it
  (`harness.shm`, which says what it cannot see).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from rapidkv.harness import procs, shm
from rapidkv.harness.waiting import wait_until
from rapidkv.harness.watchdog import Watchdog, get_watchdog

PROC_ENV_PREFIX = "RAPIDKV_HARNESS_PROC_"


class ProcessLeftBehind(RuntimeError):
    """Processes of a tree survived SIGKILL (should not happen; reported loudly)."""


class ManagedProcess:
    """One process tree: argv started with env, output appended to `log_path`."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        *,
        name: str = "proc",
        watchdog: Watchdog | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.proc_id = uuid.uuid4().hex
        self._watchdog = watchdog if watchdog is not None else get_watchdog(log_path.parent)
        self._lock = threading.Lock()
        self._stopped = False
        self._shm: shm.Held = {}  # /dev/shm files the tree held when signalled
        self._shm_lock = threading.Lock()
        self._started = time.time()  # files made before are not the tree's
        self.exit_code: int | None = None

        full_env = dict(env)
        key, value = self._watchdog.env_entry
        full_env[key] = value
        full_env[PROC_ENV_PREFIX + self.proc_id] = "1"
        self._entry = f"{PROC_ENV_PREFIX}{self.proc_id}=1".encode()

        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            log.write(f"==== {time.strftime('%F %T')} start {name}: {shlex.join(argv)}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=full_env,
                start_new_session=True,
                close_fds=True,
            )
        self.pid = self.popen.pid
        self.pgid = self.pid  # start_new_session: the leader leads its own group
        st = procs.proc_stat(self.pid)
        # The leader is unreaped, so it is in /proc (possibly as a zombie).
        self.starttime = st.starttime if st is not None else 0
        try:
            self._watchdog.register(self.pgid, self.starttime)
        except BaseException:
            self._kill_now()
            raise

    # ----------------------------------------------------------- inspection

    def returncode(self) -> int | None:
        """The leader's exit status if it has exited, else None. Never reaps it."""
        if self.exit_code is not None:
            return self.exit_code
        try:
            res = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return self.popen.returncode
        if res is None:
            return None
        if res.si_code == os.CLD_EXITED:
            return res.si_status
        return -res.si_status

    def live_pids(self) -> list[int]:
        """Pids of this tree still running (group members and processes with our entry)."""
        pids = set(procs.live_with_env(self._entry))
        if not self._reaped:
            pids.update(procs.live_in_group(self.pgid))
        return sorted(pids)

    @property
    def _reaped(self) -> bool:
        return self.popen.returncode is not None

    def log_tail(self, lines: int = 80) -> str:
        """The last `lines` lines of the log file."""
        try:
            data = self.log_path.read_bytes()[-200_000:]
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(data.decode(errors="replace").splitlines()[-lines:])

    # ----------------------------------------------------------- stopping

    def signal(self, sig: int) -> None:
        """Send `sig` to every process of the tree (e.g. SIGSTOP / SIGCONT)."""
        self._signal_all(sig)

    def _signal_all(self, sig: int, note: bool = True) -> None:
        if note:  # `stop` removes what a kill leaves
            self._note_shm()
        if not self._reaped:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, sig)
        for pid in procs.live_with_env(self._entry):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def _note_shm(self) -> None:
        found = shm.held(self.live_pids())
        with self._shm_lock:
            self._shm.update(found)

    def _remove_shm(self) -> list[str]:
        with self._shm_lock:
            noted = dict(self._shm)
        return shm.remove_orphans(noted, self._started)

    def _kill_now(self) -> None:
        self._signal_all(signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: not self.live_pids(), 10.0, what=f"{self.name} to die")
        self.exit_code = self.popen.wait()
        if not self.live_pids():
            self._remove_shm()

    def stop(self, grace: float = 10.0, kill_timeout: float = 15.0) -> int | None:
        """SIGTERM the tree, wait up to `grace` s, SIGKILL what is left; reap the leader.
        With `grace` <= 0 the tree gets SIGKILL only (no SIGTERM first), as in a
        crash: no process of it gets to run a shutdown handler.

        Returns the leader's exit status. Raises `ProcessLeftBehind` if processes
        survive SIGKILL for `kill_timeout` s. Safe to call more than once.
        """
        with self._lock:
            if self._stopped:
                return self.exit_code
            self._note_shm()  # what it leaves if it cannot clean up
            try:
                if grace <= 0:
                    raise TimeoutError
                self._signal_all(signal.SIGTERM, note=False)
                wait_until(lambda: not self.live_pids(), grace, what=f"{self.name} to exit")
            except TimeoutError:

                def killed() -> bool:
                    self._signal_all(signal.SIGKILL, note=False)  # noted above
                    return not self.live_pids()

                try:
                    wait_until(killed, kill_timeout, interval=0.1, what=f"{self.name} to die")
                except TimeoutError as e:
                    raise ProcessLeftBehind(
                        f"{self.name}: pids {self.live_pids()} survived SIGKILL"
                    ) from e
            self.exit_code = self.popen.wait()
            self._stopped = True
            with contextlib.suppress(RuntimeError):
                self._watchdog.unregister(self.pgid)
            left = self._remove_shm()
            with open(self.log_path, "ab") as log:
                removed = f", removed {len(left)} file(s) it left in /dev/shm" if left else ""
                log.write(
                    f"==== {time.strftime('%F %T')} stopped {self.name} "
                    f"(rc={self.exit_code}){removed}\n".encode()
                )
            return self.exit_code

    @property
    def stopped(self) -> bool:
        return self._stopped
