"""`rapidkv bench goodput`'s sweep order: with every group up at once, each
rate runs on every configuration in turn (order reversed at every other rate),
all groups start before the first request and stop after the last, and a
group that fails fails its own configurations only."""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import pytest

from rapidkv.bench.common.groups import CONFIGS
from rapidkv.bench.goodput.options import Options, fixed_fronts
from rapidkv.bench.goodput.results import ConfigRun, WorkloadRun
from rapidkv.bench.goodput.run import Sweep

pytestmark = pytest.mark.unit


def options(*argv: str) -> Options:
    from rapidkv.bench.goodput import register

    parser = argparse.ArgumentParser()
    register(parser)
    return Options.from_args(parser.parse_args(list(argv)))


class FakeGroup:
    def __init__(self, name: str, log: list[tuple[Any, ...]]) -> None:
        self.name, self.log = name, log

    def url(self, config: Any) -> str:
        return f"http://{self.name}/{config.name}"

    def crashes(self) -> list[str]:
        return []

    def stop(self) -> None:
        self.log.append(("stop", self.name))


def sweep_of(
    opts: Options, log: list[tuple[Any, ...]], failing: frozenset[str] = frozenset()
) -> Sweep:
    """A Sweep with its I/O replaced: groups are FakeGroups, `measure` records
    (configuration, rate) and raises for the groups in `failing`."""
    sweep = object.__new__(Sweep)
    sweep.opts = opts
    sweep.progress = SimpleNamespace(
        stage=lambda *_: None, say=lambda *_: None, advance=lambda *_: None
    )
    slo = SimpleNamespace(ttft_ms=250.0, tpot_ms=18.0)
    sweep.workloads = {"chat": WorkloadRun("chat", [16], [[1, 2]], 0, slo=slo)}
    sweep.configs = {c: ConfigRun(c) for c in opts.configs}
    groups: dict[str, FakeGroup] = {}

    def start(name: str, members: list[str], fronts: Any) -> FakeGroup:
        log.append(("start", name))
        return groups.setdefault(name, FakeGroup(name, log))

    def measure(name: str, group: FakeGroup, w: Any, rate: float) -> None:
        log.append(("measure", name, rate))
        if group.name in failing:
            raise RuntimeError("a server died")

    sweep.start = start  # type: ignore[method-assign]
    sweep.measure = measure  # type: ignore[method-assign]
    sweep.warm_up = lambda *a: log.append(("warm_up", a[0]))  # type: ignore[method-assign]
    sweep.start_adaptive = lambda *a: log.append(("router", a[0]))  # type: ignore[method-assign]
    return sweep


def test_every_group_is_up_while_each_rate_runs_on_every_configuration_in_turn() -> None:
    opts = options("--configs", "dp2,vllm-nixl,rapidkv,rapidkv-adaptive", "--rates", "chat=2,4,6")
    assert opts.together
    log: list[tuple[Any, ...]] = []
    sweep = sweep_of(opts, log)
    sweep.run_groups_together(
        {"dp2": ["dp2"], "vllm-nixl": ["vllm-nixl"], "rapidkv": ["rapidkv", "rapidkv-adaptive"]}
    )
    kinds = [e[0] for e in log]
    assert kinds[:3] == ["start"] * 3 and kinds[-3:] == ["stop"] * 3
    assert ("router", "rapidkv-adaptive") in log
    measured = [(e[1], e[2]) for e in log if e[0] == "measure"]
    order = ["dp2", "vllm-nixl", "rapidkv", "rapidkv-adaptive"]
    assert measured == (
        [(c, 2.0) for c in order] + [(c, 4.0) for c in order[::-1]] + [(c, 6.0) for c in order]
    )
    assert not any(sweep.configs[c].error for c in order)


def test_a_group_that_fails_fails_its_own_configurations_and_the_others_go_on() -> None:
    opts = options("--configs", "dp2,rapidkv,rapidkv-adaptive", "--rates", "chat=2,4")
    log: list[tuple[Any, ...]] = []
    sweep = sweep_of(opts, log, failing=frozenset({"rapidkv"}))
    sweep.run_groups_together({"dp2": ["dp2"], "rapidkv": ["rapidkv", "rapidkv-adaptive"]})
    measured = [(e[1], e[2]) for e in log if e[0] == "measure"]
    assert measured == [("dp2", 2.0), ("rapidkv", 2.0), ("dp2", 4.0)]
    for c in ("rapidkv", "rapidkv-adaptive"):
        assert (
            "rapidkv failed while measured: RuntimeError: a server died" in sweep.configs[c].error
        )
    assert sweep.configs["dp2"].error is None
    assert [e for e in log if e[0] == "stop"] == [("stop", "dp2"), ("stop", "rapidkv")]


def test_one_group_at_a_time_starts_sweeps_and_stops_each_in_turn() -> None:
    opts = options("--configs", "dp2,rapidkv", "--rates", "chat=2,4", "--one-group-at-a-time")
    assert not opts.together
    log: list[tuple[Any, ...]] = []
    sweep = sweep_of(opts, log)
    for name, members in {"dp2": ["dp2"], "rapidkv": ["rapidkv"]}.items():
        sweep.run_group(name, members)
    assert [e[:2] if e[0] != "measure" else e for e in log if e[0] != "warm_up"] == [
        ("start", "dp2"),
        ("measure", "dp2", 2.0),
        ("measure", "dp2", 4.0),
        ("stop", "dp2"),
        ("start", "rapidkv"),
        ("measure", "rapidkv", 2.0),
        ("measure", "rapidkv", 4.0),
        ("stop", "rapidkv"),
    ]


def test_every_adaptive_router_front_waits_for_the_workloads_slos() -> None:
    adaptive = [c for c in CONFIGS if c.startswith("rapidkv-adaptive")]
    assert len(adaptive) >= 3  # the plain one and its variants
    assert fixed_fronts(["rapidkv", *adaptive]) == {CONFIGS["rapidkv"].front}
    assert fixed_fronts(["single"]) == {CONFIGS["single"].front}  # no front: served directly
    assert fixed_fronts(adaptive) == set()
