"""`bench/common/nixl_tuning.py`: the affinity guard and the NIXL agent
config patch."""

from __future__ import annotations

import types

import pytest

from rapidkv.bench.common.nixl_tuning import guarded_setaffinity, parse_cpus, patch_nixl_api


@pytest.mark.unit
def test_affinity_guard_keeps_threads_on_the_instances_cpus() -> None:
    calls: list[tuple[int, frozenset[int]]] = []
    notes: list[str] = []
    guard = guarded_setaffinity(
        lambda pid, mask: calls.append((pid, frozenset(mask))), parse_cpus("0"), notes.append
    )
    guard(0, [0])  # inside: passed on
    guard(0, [1])  # outside (what vLLM's NIXL worker asks on P): ignored
    guard(0, {0, 1})  # partly outside: narrowed
    assert calls == [(0, frozenset({0})), (0, frozenset({0}))]
    assert len(notes) == 2
    assert parse_cpus("0-2,5") == frozenset({0, 1, 2, 5})


@pytest.mark.unit
def test_nixl_agent_config_defaults_to_no_progress_thread_once_patched() -> None:
    class nixl_agent_config:  # the shape of nixl._api.nixl_agent_config
        def __init__(self, enable_prog_thread: bool = True, num_threads: int = 0) -> None:
            self.enable_pthread = enable_prog_thread
            self.num_threads = num_threads

    module = types.ModuleType("fake_nixl_api")
    module.nixl_agent_config = nixl_agent_config  # type: ignore[attr-defined]
    patch_nixl_api(module)
    patch_nixl_api(module)  # idempotent
    assert nixl_agent_config(num_threads=4).enable_pthread is False
    assert nixl_agent_config(enable_prog_thread=True).enable_pthread is True
    assert nixl_agent_config(True).enable_pthread is True  # positional: untouched
