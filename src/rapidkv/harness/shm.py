"""Shared-memory files a stopped process tree left in /dev/shm.

vLLM's processes keep their message queues (`psm_*`, Python's
`multiprocessing.shared_memory`), the CPU TP ranks' buffers (`vllm_dist_*`)
and multiprocessing's semaphores (`sem.mp-*`) as files in /dev/shm, which is
memory. They unlink them when they shut down, and so does Python's resource
tracker when its clients die; a tree killed with SIGKILL (a test's crash, the
watchdog's last resort) takes the tracker with it, and the files stay until
the machine reboots: hundreds of megabytes a test session.

So whoever signals a tree (`ManagedProcess.signal` and `stop`, the watchdog)
notes the files its processes map or hold open (`held`) first, and once the
tree is gone (`stop`, the watchdog) removes those that no living process maps
or holds (`remove_orphans`).

Invariant: a file is removed only if a process of the stopped tree held it,
it was made (its inode changed: `st_ctime`) after the tree started, it is
still the file that was held (same inode), and no process still alive holds
it (as far as /proc shows this user); an unlinked file ("(deleted)") is never
named. A named semaphore (`sem.*`, 32 bytes) that only its creator holds is
not seen (glibc maps it under a temporary name, then links the real one);
one a spawned process opened by its name is.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping

from rapidkv.harness import procs

SHM_DIR = "/dev/shm"
_DELETED = " (deleted)"

CTIME_SLACK_S = 0.02  # the kernel stamps ctime from a clock a tick (<= 10 ms) coarse

Held = dict[str, int]
"""Files under /dev/shm, each with its inode when noted."""


def held(pids: Iterable[int]) -> Held:
    """The files under /dev/shm that processes `pids` map or have open."""
    found: set[str] = set()
    for pid in pids:
        base = procs.PROC / str(pid)
        with contextlib.suppress(OSError):
            for line in (base / "maps").read_text(errors="replace").splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6:
                    _note(found, fields[5])
        with contextlib.suppress(OSError):
            for fd in (base / "fd").iterdir():
                with contextlib.suppress(OSError):
                    _note(found, os.readlink(fd))
    out: Held = {}
    for path in found:
        with contextlib.suppress(OSError):
            out[path] = os.lstat(path).st_ino
    return out


def _note(found: set[str], path: str) -> None:
    if path.startswith(SHM_DIR + "/") and not path.endswith(_DELETED):
        found.add(path)


def remove_orphans(noted: Mapping[str, int], since: float) -> list[str]:
    """Unlink those of the `noted` files (`held` by a tree that started at
    `since`, wall clock) that are still the noted files, were made since, and
    that no living process holds; the paths removed, sorted."""

    def ours(path: str, inode: int) -> bool:
        try:
            st = os.lstat(path)
        except OSError:
            return False
        return st.st_ino == inode and st.st_ctime >= since - CTIME_SLACK_S

    wanted = {p for p, ino in noted.items() if os.path.dirname(p) == SHM_DIR and ours(p, ino)}
    if not wanted:
        return []
    wanted -= set(held(procs.all_pids()))
    removed = []
    for path in sorted(wanted):
        if not ours(path, noted[path]):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    return removed
