"""AMX tile permission for a process that runs vLLM's bf16 CPU kernels.

Linux enables AMX's tile data (XSTATE component 18, `XTILEDATA`) per process,
on request: until a process has called `arch_prctl(ARCH_REQ_XCOMP_PERM,
XTILEDATA)`, its first tile instruction traps and the kernel kills it with
SIGILL (Documentation/arch/x86/xstate.rst). vLLM's CPU attention for bf16
(`cpu_attention_with_kv_cache`, the "amx" ISA) is chosen from CPUID alone
(`torch.cpu._is_amx_tile_supported()`) and never asks. The only code that asks is
oneDNN (`dnnl::impl::cpu::x64::amx::is_available`), the first time vLLM's bf16
linear layers hand it a GEMM with enough rows (brgemm); a forward of a few
tokens never gets there (measured here: a first forward of 1 or 2 tokens dies,
one of 8 does not). So a worker whose first forward is that small dies
at layer 0's attention: P answering the router's one-token discovery request,
D computing only the last token of a prompt whose KV it loaded. A plain
instance whose first request is a long prompt survives by luck of ordering
(docs/environment.md has the traces).

`request_tile_permission` asks once per process, before anything else could
run tile code. It also asks before any thread of ours exists: the kernel
refuses the request (`ENOSPC`) when a thread of the process has an alternate
signal stack too small for the AMX signal frame, and such a thread could only
be one that a library started.

Invariant: after `request_tile_permission()` returned `"granted"` or
`"already"`, every thread of this process may execute AMX tile instructions.
Importable without vLLM or torch (the bench's start-up hook uses it).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import threading
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

SYS_ARCH_PRCTL = 158  # x86-64
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18

Outcome = Literal["no_amx", "already", "granted", "refused"]

_lock = threading.Lock()
_outcome: tuple[Outcome, str] | None = None


def cpu_has_amx(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this x86-64 Linux CPU advertises AMX tiles (`amx_tile` flag)."""
    if platform.machine() not in ("x86_64", "AMD64") or not cpuinfo.exists():
        return False
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            return "amx_tile" in line.split(":", 1)[1].split()
    return False


def _arch_prctl(code: int, arg: object) -> tuple[int, int]:
    """`arch_prctl(code, arg)` (`arg` a ctypes value or pointer): (result, errno)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc.syscall(SYS_ARCH_PRCTL, code, arg), ctypes.get_errno()


def tile_data_permitted() -> bool:
    """Whether this process may use AMX tile data now (`ARCH_GET_XCOMP_PERM`)."""
    if not cpu_has_amx():
        return False
    mask = ctypes.c_uint64(0)
    rc, _ = _arch_prctl(ARCH_GET_XCOMP_PERM, ctypes.byref(mask))
    return rc == 0 and bool(mask.value >> XFEATURE_XTILEDATA & 1)


def request_tile_permission() -> Outcome:
    """Ask the kernel for AMX tile data for this process, once; log the outcome once.

    `"no_amx"`: the CPU has none (nothing to do); `"already"`: permitted before
    we asked; `"granted"`; `"refused"`: the kernel said no (logged as a warning
    with its errno: bf16 attention will then crash this process at its first
    use, as it would without us).
    """
    global _outcome
    with _lock:
        if _outcome is not None:
            return _outcome[0]
        if not cpu_has_amx():
            _outcome = ("no_amx", "the CPU has no AMX tiles")
        elif tile_data_permitted():
            _outcome = ("already", "AMX tile data already permitted")
        else:
            rc, err = _arch_prctl(ARCH_REQ_XCOMP_PERM, ctypes.c_ulong(XFEATURE_XTILEDATA))
            if rc == 0 and tile_data_permitted():
                _outcome = ("granted", "AMX tile data permission granted")
            else:
                name = errno.errorcode.get(err, str(err))
                _outcome = ("refused", f"AMX tile data permission refused: {name}")
        outcome, text = _outcome
    level = logging.WARNING if outcome == "refused" else logging.INFO
    log.log(level, "rapidkv (pid %d): %s", os.getpid(), text)
    return outcome
