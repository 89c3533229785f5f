"""The /proc views a benchmark accounts with: CPU time and CPU placement."""

from __future__ import annotations

import os
import time

import pytest

from rapidkv.harness.procs import machine_busy_cpu_seconds, tree_affinity, tree_cpu_seconds

pytestmark = pytest.mark.unit


def burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_cpu_seconds_count_this_process_and_the_machine() -> None:
    mine, machine = tree_cpu_seconds([os.getpid()]), machine_busy_cpu_seconds()
    burn(0.3)
    assert tree_cpu_seconds([os.getpid()]) - mine >= 0.2
    assert machine_busy_cpu_seconds() - machine >= 0.2


def test_a_vanished_pid_counts_nothing() -> None:
    assert tree_cpu_seconds([2**22 + 1]) == 0.0
    assert tree_affinity([2**22 + 1]) == []


def test_affinity_lists_the_cpus_this_process_may_run_on() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    (listed,) = tree_affinity([os.getpid()])
    allowed = set()
    for part in listed.split(","):
        lo, _, hi = part.partition("-")
        allowed.update(range(int(lo), int(hi or lo) + 1))
    assert sorted(allowed) == cpus
