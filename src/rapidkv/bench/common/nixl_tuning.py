"""The tuned vLLM NixlConnector baseline: three changes made at interpreter start-up.

`rapidkv bench serve` starts the tuned `vllm-nixl` servers with a directory on
`PYTHONPATH` whose `sitecustomize.py` calls `install()` (`write_sitecustomize`
creates it), so every Python process of those servers gets, without editing vLLM:

1. NIXL agents default to `enable_prog_thread=False`. vLLM builds
   `nixl_agent_config(num_threads=..., capture_telemetry=True)` and cannot turn
   the UCX progress thread off; that thread busy-polls about one core per
   instance, on a machine with one core per instance (environment.md).
   Implemented as an import hook on NIXL's `_api` module, so NIXL is imported
   exactly when vLLM imports it (vLLM sets `UCX_RCACHE_MAX_UNRELEASED` first).
2. `os.sched_setaffinity` refuses to move a thread outside the instance's CPUs
   (`RAPIDKV_INSTANCE_CPUS`, e.g. "0"; default: the CPUs the process started
   with). On CPU, vLLM's NIXL worker moves itself, the thread that runs the
   forward, to the last core of each NUMA node: with P pinned to core 0 and D to
   core 1 that puts P's compute on D's core. A call within the instance's CPUs
   goes through; one partly outside is narrowed to the instance's CPUs; one
   entirely outside is ignored. Each refusal is logged once on stderr.
3. On a CPU with AMX, the process asks the kernel for AMX tile data first
   (`rapidkv.connector.amx`, what rapidkv's connector does in its worker):
   vLLM's bf16 attention runs AMX instructions without asking, and D's first
   forward after loading a prompt's KV, one token, would die of SIGILL. The
   outcome is logged on stderr.

Nothing else changes: the `vllm-nixl-stock` configuration runs without it.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

CPUS_ENV = "RAPIDKV_INSTANCE_CPUS"
NIXL_API_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api", "nixl_rocm._api")

SITECUSTOMIZE = "from rapidkv.bench.common.nixl_tuning import install\n\ninstall()\n"


def write_sitecustomize(directory: Path) -> Path:
    """Create `directory/sitecustomize.py` calling `install()`; returns `directory`
    (to put on the tuned servers' `PYTHONPATH`, with rapidkv importable)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return directory


def install() -> None:
    """Apply the three changes in this process (idempotent)."""
    if getattr(os.sched_setaffinity, "_rapidkv_guard", False):
        return
    from rapidkv.connector.amx import request_tile_permission

    amx = request_tile_permission()
    if amx != "no_amx":
        _note(f"AMX tile data: {amx}")
    env = os.environ.get(CPUS_ENV)
    allowed = parse_cpus(env) if env else frozenset(os.sched_getaffinity(0))
    os.sched_setaffinity = guarded_setaffinity(os.sched_setaffinity, allowed, _note)
    sys.meta_path.insert(0, _PatchOnImport(NIXL_API_MODULES, patch_nixl_api))


def parse_cpus(text: str) -> frozenset[int]:
    """A taskset-style CPU list ("0", "0,2", "0-3") as a set."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(cpus)


def guarded_setaffinity(
    original: Callable[[int, Iterable[int]], None],
    allowed: frozenset[int],
    note: Callable[[str], None],
) -> Callable[[int, Iterable[int]], None]:
    """`os.sched_setaffinity` that keeps every thread within `allowed` (see module doc)."""

    def sched_setaffinity(pid: int, mask: Iterable[int]) -> None:
        wanted = frozenset(mask)
        kept = wanted & allowed
        if kept == wanted:
            return original(pid, wanted)
        if kept:
            note(f"sched_setaffinity({pid}, {sorted(wanted)}) narrowed to {sorted(kept)}")
            return original(pid, kept)
        note(f"sched_setaffinity({pid}, {sorted(wanted)}) ignored: instance CPUs {sorted(allowed)}")
        return None

    sched_setaffinity._rapidkv_guard = True  # type: ignore[attr-defined]
    return sched_setaffinity


def patch_nixl_api(module: ModuleType) -> None:
    """Make `module.nixl_agent_config` default to `enable_prog_thread=False`."""
    cls = getattr(module, "nixl_agent_config", None)
    if cls is None or getattr(cls.__init__, "_rapidkv_guard", False):
        return
    original = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if not args:  # the first positional parameter is enable_prog_thread
            kwargs.setdefault("enable_prog_thread", False)
        original(self, *args, **kwargs)

    __init__._rapidkv_guard = True  # type: ignore[attr-defined]
    cls.__init__ = __init__
    _note(f"{module.__name__}.nixl_agent_config: enable_prog_thread defaults to False")


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs `patch(module)` right after any of `names` is first executed."""

    def __init__(self, names: Sequence[str], patch: Callable[[ModuleType], None]) -> None:
        self.names = frozenset(names)
        self.patch = patch
        self._busy: set[str] = set()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.names or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, patch = spec.loader, self.patch

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                loader.exec_module(module)  # type: ignore[attr-defined]
                patch(module)

        spec.loader = _Loader()
        return spec


_noted: set[str] = set()


def _note(message: str) -> None:
    if message not in _noted:
        _noted.add(message)
        with contextlib.suppress(Exception):
            print(f"[rapidkv nixl tuning pid {os.getpid()}] {message}", file=sys.stderr, flush=True)
