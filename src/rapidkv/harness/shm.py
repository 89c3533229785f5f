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

Invariant: a file is removed only if a process of the stopped tree held it
and no process still alive does (as far as /proc shows this user); an unlinked
file ("(deleted)") is never named. Named semaphores (`sem.*`, 32 bytes each)
are not seen: glibc maps one under a temporary name before it links the real
one, so no process is seen holding it, and a live tree's may not be removed
(a process it spawns opens it by name).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

from rapidkv.harness import procs

SHM_DIR = "/dev/shm"
_DELETED = " (deleted)"


def held(pids: Iterable[int]) -> set[str]:
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
    return found


def _note(found: set[str], path: str) -> None:
    if path.startswith(SHM_DIR + "/") and not path.endswith(_DELETED):
        found.add(path)


def remove_orphans(paths: Iterable[str]) -> list[str]:
    """Unlink those of `paths` that exist and that no living process holds
    (`held` over every process); the paths removed, sorted."""
    wanted = {p for p in paths if os.path.dirname(p) == SHM_DIR and os.path.lexists(p)}
    if not wanted:
        return []
    wanted -= held(procs.all_pids())
    removed = []
    for path in sorted(wanted):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    return removed
