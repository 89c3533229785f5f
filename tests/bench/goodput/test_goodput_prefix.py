"""`rapidkv bench goodput` on workloads of shared prefixes (`shared-prefix`,
`multiturn`): their options and default configurations, the adaptive
routers blind to the instances' caches, aware without fetching, and with;
the servers' KV events; a rate measured from empty caches with the servers'
hits and the router's prefix tokens; and the report of them."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rapidkv.bench.common.output import to_json
from rapidkv.bench.common.reference import Reference
from rapidkv.bench.common.stats import RequestResult
from rapidkv.bench.goodput.options import PREFIX_CONFIGS, Options
from rapidkv.bench.goodput.report import build_report, print_report
from rapidkv.bench.goodput.results import ConfigRun, RateRun, WorkloadRun
from rapidkv.bench.goodput.slo import SLO

pytestmark = pytest.mark.unit


def parse(*argv: str) -> Options:
    from rapidkv.bench.goodput import register

    parser = argparse.ArgumentParser()
    register(parser)
    return Options.from_args(parser.parse_args(list(argv)))


# ---------------------------------------------------------------- options


def test_prefix_workloads_default_to_dp2_and_the_three_adaptive_routers_with_caching() -> None:
    o = parse("--workloads", "multiturn,shared-prefix")
    assert (
        o.configs
        == PREFIX_CONFIGS
        == (
            "dp2",
            "rapidkv-adaptive-blind",
            "rapidkv-kv-aware-nofetch",
            "rapidkv-adaptive",
        )
    )
    assert o.prefix_caching and o.rates["multiturn"] == (0.25, 0.5, 0.75, 1.0, 1.5, 2.0)
    assert o.rates["shared-prefix"] == (0.5, 1.0, 1.5, 2.0, 3.0, 4.0)
    assert o.server_args[:2] == ("--max-model-len", "1280")
    assert parse().prefix_caching is False and parse().workloads == ("prefill-heavy", "chat")
    mixed = parse("--workloads", "chat,shared-prefix")  # every workload's defaults, in turn
    assert mixed.configs == (
        "single", "dp2", "vllm-nixl", "rapidkv", "rapidkv-adaptive", "rapidkv-adaptive-blind",
        "rapidkv-kv-aware-nofetch",
    )  # fmt: skip
    assert mixed.prefix_caching  # on for chat too, its caches emptied before every rate
    assert parse("--workloads", "shared-prefix", "--configs", "dp2").configs == ("dp2",)
    with pytest.raises(ValueError):
        parse("--workloads", "shared-prefix", "--configs", "")


def test_multiturn_counts_whole_conversations_in_requests_and_progress() -> None:
    q = parse("--quick", "--workloads", "shared-prefix,multiturn", "--configs", "dp2",
              "--requests", "6")  # fmt: skip
    assert q.rates == {"shared-prefix": (1.0, 4.0), "multiturn": (0.5, 2.0)}
    assert (q.count("shared-prefix"), q.count("multiturn")) == (6, 8)
    # per workload: reference + c1 + single's warm-up 1; dp2: warm-up 1 + 2 rates
    assert q.units() == (2 * 6 + 1 + 1 + 2 * 6) + (2 * 8 + 1 + 1 + 2 * 8)


# ---------------------------------------------------------------- configurations


def test_the_adaptive_routers_differ_by_what_they_know_of_the_instances_caches() -> None:
    from rapidkv.bench.common.groups import CONFIGS, RunningGroup, _group_plan
    from rapidkv.bench.goodput.options import fixed_fronts, is_adaptive

    _, plan = _group_plan("rapidkv", Path("/model"), Path("/logs"), ())
    servers = {
        "prefill": SimpleNamespace(base_url="http://p"),
        "decode": SimpleNamespace(base_url="http://d"),
    }
    fronts = dict(plan(RunningGroup("rapidkv", servers)))
    argv = {c: fronts[CONFIGS[c].front] for c in PREFIX_CONFIGS[1:]}
    flags = ("--no-prefix-index", "--no-prefix-fetch")
    assert [f for f in flags if f in argv["rapidkv-adaptive"]] == []  # index and fetch
    assert [f for f in flags if f in argv["rapidkv-adaptive-blind"]] == ["--no-prefix-index"]
    assert [f for f in flags if f in argv["rapidkv-kv-aware-nofetch"]] == ["--no-prefix-fetch"]
    for c, a in argv.items():
        assert CONFIGS[c].group == "rapidkv" and not CONFIGS[c].default
        assert a[a.index("--placement") + 1] == "adaptive" and a.count("--instance") == 2
        assert is_adaptive(CONFIGS[c].front)  # started per workload, with its SLOs
    assert fixed_fronts(list(PREFIX_CONFIGS)) == {"router-local"}


def test_the_rapidkv_servers_publish_kv_events_on_ports_of_their_own() -> None:
    from rapidkv.bench.common.groups import kv_events_args, start_group

    a, b = kv_events_args("127.0.0.1"), kv_events_args("127.0.0.1")
    assert a[0] == "--kv-events-config"
    ca, cb = json.loads(a[1]), json.loads(b[1])
    assert ca["enable_kv_cache_events"] is True and ca["publisher"] == "zmq"
    ends = [c[k] for c in (ca, cb) for k in ("endpoint", "replay_endpoint")]
    assert len({e.rpartition(":")[2] for e in ends}) == 4
    # the publisher binds the host alone (IPv4-mapped: vLLM binds only endpoints
    # with "*" or "::"), as the replay socket does
    assert all(c["endpoint"].startswith("tcp://[::ffff:127.0.0.1]:") for c in (ca, cb))
    assert all(c["replay_endpoint"].startswith("tcp://127.0.0.1:") for c in (ca, cb))
    with pytest.raises(ValueError, match="prefix caching"):
        start_group("rapidkv", Path("/model"), Path("/logs"), kv_events=True)


def test_a_router_s_counters_are_read_by_kind_and_as_deltas() -> None:
    from rapidkv.bench.goodput.router_counters import RouterCounters, parse

    def metrics(n: float) -> dict[tuple[str, Any], float]:
        return {
            ("rapidkv_router_placements_total", frozenset({("kind", "fetch"), ("reason", "r")})): n,
            ("rapidkv_router_placements_total", frozenset({("kind", "local"), ("reason", "r")})): 1,
            ("rapidkv_router_prefix_tokens_total", frozenset({("kind", "hit")})): 100 * n,
            ("rapidkv_router_prefix_tokens_total", frozenset({("kind", "fetched")})): 10 * n,
            (
                "rapidkv_router_model_step_seconds",
                frozenset({("upstream", "a"), ("term", "slope")}),
            ): (n / 1000),
        }

    before, after = parse(metrics(1.0)), parse(metrics(3.0))
    d = after.since(before)
    assert d.kinds == {"local": 0.0, "pd": 0.0, "split": 0.0, "fetch": 2.0}
    assert d.reasons == {"r": 2.0}
    assert d.prefix_tokens == {"hit": 200.0, "fetched": 20.0, "computed": 0.0}  # missing: 0
    assert d.learned == {"step_ms": {"a": {"slope": pytest.approx(3.0)}}}  # ms, as learned
    assert parse({}) == RouterCounters(
        dict.fromkeys(("local", "pd", "split", "fetch"), 0.0),
        {},
        dict.fromkeys(("hit", "fetched", "computed"), 0.0),
        {},
    )


# ---------------------------------------------------------------- a rate measured


def _fake_router(log: list[tuple[str, int, float]]):
    """Streams two tokens per completion; its /metrics count each one served
    as a fetch of 100 hit tokens, 10 fetched and 5 computed."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    served = [0]

    async def completions(request: Request) -> StreamingResponse:
        first = (await request.json())["prompt"][0]
        log.append(("start", first, time.monotonic()))

        async def events():
            for t in (7, 8):
                await asyncio.sleep(0.01)
                yield f"data: {json.dumps({'choices': [{'token_ids': [t]}]})}\n\n"
            served[0] += 1
            log.append(("end", first, time.monotonic()))
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def metrics(request: Request) -> PlainTextResponse:
        n = served[0]
        return PlainTextResponse(
            "# TYPE rapidkv_router_placements counter\n"
            f'rapidkv_router_placements_total{{kind="fetch",reason="hit"}} {n}\n'
            "# TYPE rapidkv_router_prefix_tokens counter\n"
            f'rapidkv_router_prefix_tokens_total{{kind="hit"}} {100 * n}\n'
            f'rapidkv_router_prefix_tokens_total{{kind="fetched"}} {10 * n}\n'
            f'rapidkv_router_prefix_tokens_total{{kind="computed"}} {5 * n}\n'
        )

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/metrics", metrics),
        ]
    )


class _Group:
    """The rapidkv group as `Sweep.measure` sees it: its front's URL, prefix
    caches to empty, and vLLM counters that grow at every scrape (cached 60
    and computed 40 prompt tokens per server each time)."""

    name = "rapidkv"

    def __init__(self, url: str, log: list[tuple[str, int, float]]) -> None:
        self._url, self.log, self.scrapes = url, log, 0

    def url(self, config: Any) -> str:
        return self._url

    def reset_prefix_cache(self) -> list[str]:
        self.log.append(("reset", -1, time.monotonic()))
        return []

    def scrape(self) -> dict[str, Any]:
        from rapidkv.bench.common.groups import PROMPT_TOKENS_METRIC

        self.scrapes += 1

        def key(source: str) -> tuple[str, frozenset]:
            return (PROMPT_TOKENS_METRIC, frozenset({("source", source)}))

        counts = {key("local_cache_hit"): 60.0 * self.scrapes, key("local_compute"): 40.0}
        counts[key("local_compute")] *= self.scrapes
        return {"prefill": counts, "decode": dict(counts)}

    def prompt_tokens(self, scraped: Any = None) -> dict[str, dict[str, float]]:
        from rapidkv.bench.common.groups import EngineCounters

        return EngineCounters.prompt_tokens(self, scraped)  # type: ignore[arg-type]

    def cpu_seconds(self) -> dict[str, float]:
        return {}


def test_a_multiturn_rate_starts_cold_sends_turns_after_answers_and_counts_hits() -> None:
    from rapidkv.bench.goodput.run import Sweep
    from rapidkv.router.server import ThreadedServer

    opts = parse("--workloads", "multiturn", "--configs", "rapidkv-adaptive", "--rates", "4")
    sweep = object.__new__(Sweep)
    sweep.opts = opts
    sweep.progress = SimpleNamespace(
        stage=lambda *_: None, say=lambda *_: None, advance=lambda *_: None
    )
    follows = [t > 0 for _ in range(2) for t in range(4)]
    w = WorkloadRun("multiturn", (2,) * 8, [[c * 10 + t] for c in range(2) for t in range(4)], 0)
    w.follows, w.think_s = follows, tuple(0.05 if f else 0.0 for f in follows)
    sweep.workloads = {"multiturn": w}
    sweep.configs = {"rapidkv-adaptive": ConfigRun("rapidkv-adaptive")}
    log: list[tuple[str, int, float]] = []
    with ThreadedServer(_fake_router(log)) as server:
        group = _Group(server.url, log)
        sweep.measure("rapidkv-adaptive", group, w, 4.0)
    run = sweep.configs["rapidkv-adaptive"].rates["multiturn"][4.0]
    assert log[0][0] == "reset"  # every rate from empty caches
    at = {(e, p): t for e, p, t in log}
    for c in range(2):
        for t in range(1, 4):
            assert at[("start", c * 10 + t)] >= at[("end", c * 10 + t - 1)] + 0.04
    assert all(r.error is None for r in run.results) and len(run.results) == 8
    assert sum(math.isnan(a) for a in run.arrivals) == 6  # the later turns follow
    assert run.prompt_tokens == {
        "prefill": {"external": 0.0, "local": 40.0, "cached": 60.0},
        "decode": {"external": 0.0, "local": 40.0, "cached": 60.0},
    }
    assert run.placements == {"local": 0.0, "pd": 0.0, "split": 0.0, "fetch": 8.0}
    assert run.prefix_tokens == {"hit": 800.0, "fetched": 80.0, "computed": 40.0}


def test_a_shared_prefix_rate_warms_the_caches_first_and_counts_only_what_follows() -> None:
    """After the caches are emptied, the warm-up prompts are sent at the rate
    and answered before the first measured one is sent; the rate's results
    and the router's counters are the measured requests' alone."""
    from rapidkv.bench.goodput.run import Sweep
    from rapidkv.router.server import ThreadedServer

    opts = parse("--workloads", "shared-prefix", "--configs", "rapidkv-adaptive", "--rates", "8")
    sweep = object.__new__(Sweep)
    sweep.opts = opts
    sweep.progress = SimpleNamespace(
        stage=lambda *_: None, say=lambda *_: None, advance=lambda *_: None
    )
    w = WorkloadRun("shared-prefix", (2,) * 3, [[100 + k] for k in range(3)], 0)
    w.warm_prompts, w.warm_max_tokens = [[k] for k in range(4)], (2,) * 4
    sweep.workloads = {"shared-prefix": w}
    sweep.configs = {"rapidkv-adaptive": ConfigRun("rapidkv-adaptive")}
    log: list[tuple[str, int, float]] = []
    with ThreadedServer(_fake_router(log)) as server:
        sweep.measure("rapidkv-adaptive", _Group(server.url, log), w, 8.0)
    run = sweep.configs["rapidkv-adaptive"].rates["shared-prefix"][8.0]
    assert log[0][0] == "reset"
    warm_ends = [t for e, p, t in log if e == "end" and p < 100]
    measured_starts = [t for e, p, t in log if e == "start" and p >= 100]
    assert len(warm_ends) == 4 and len(measured_starts) == 3
    assert max(warm_ends) <= min(measured_starts)
    assert len(run.results) == 3 and all(r.error is None for r in run.results)
    assert run.placements == {"local": 0.0, "pd": 0.0, "split": 0.0, "fetch": 3.0}


def test_shared_prefix_s_requests_put_its_warm_up_first_in_one_plan(tiny_model: Path) -> None:
    """The warm-up is the first `warm_up` requests of a plan of warm_up + n
    (what `bench simulate` warms), `--rate-warm-up` sets it, and the JSON
    says how many were sent."""
    from rapidkv.bench.common.shared_prefix import SHARED_PREFIX
    from rapidkv.bench.goodput.workloads import requests_of

    w = requests_of("shared-prefix", tiny_model, 10, 3, "random")
    assert len(w.warm_prompts) == SHARED_PREFIX.warm_up == 32 and w.requests == 10
    plan = SHARED_PREFIX.plan(42, 3)
    assert w.warm_max_tokens + w.max_tokens == plan.max_tokens
    sent = w.warm_prompts + w.prompts
    system = {g: p[: SHARED_PREFIX.system_len] for g, p in zip(plan.groups, sent, strict=True)}
    for g, p in zip(plan.groups, sent, strict=True):  # a group's requests share its prompt
        assert p[: SHARED_PREFIX.system_len] == system[g]
    assert len({tuple(p) for p in system.values()}) == len(system)
    none = requests_of("shared-prefix", tiny_model, 10, 3, "random", warm_up=0)
    assert none.warm_prompts == [] and none.prompts == w.warm_prompts[:10]
    assert parse("--workloads", "shared-prefix", "--quick").rate_warm_up == 4
    assert parse("--workloads", "shared-prefix", "--rate-warm-up", "7").rate_warm_up == 7
    assert parse("--workloads", "shared-prefix").rate_warm_up is None  # the workload's own


# ---------------------------------------------------------------- the report


def _result(i: int, ttft: float) -> RequestResult:
    times = (ttft, ttft + 5.0)
    return RequestResult(i, (1, 2), times, times[-1] + 1, 0.0)


def test_the_report_has_hits_pulled_tokens_and_the_prefix_baselines(tmp_path: Path) -> None:
    opts = parse("--workloads", "shared-prefix", "--rates", "1,2", "--requests", "2")
    w = WorkloadRun("shared-prefix", (2, 2), [[7] * 100, [8] * 60], 0)
    w.references = [Reference((1, 2), (1.0, 1.0))] * 2
    w.slo = SLO(100.0, 10.0)
    configs = {}
    for name in opts.configs:
        c = ConfigRun(name)
        fast = name == "rapidkv-adaptive"
        for rate in (1.0, 2.0):
            ttft = 50.0 if fast or rate == 1.0 else 150.0
            run = RateRun(rate, [0.0, 0.5 / rate], [_result(0, ttft), _result(1, ttft)], 1.0)
            run.prompt_tokens = {"a": {"external": 0.0, "local": 60.0, "cached": 100.0}}
            if name != "dp2":
                run.placements = {"local": 1.0, "pd": 0.0, "split": 0.0, "fetch": 1.0}
                run.reasons = {"r": 2.0}
                run.prefix_tokens = {"hit": 100.0, "fetched": 40.0, "computed": 20.0}
            c.rates["shared-prefix"] = {**c.rates.get("shared-prefix", {}), rate: run}
        configs[name] = c
    sweep = SimpleNamespace(workloads={"shared-prefix": w}, configs=configs)
    report = json.loads(to_json(build_report(sweep, opts, Path("/logs"), 1.0, None)))
    assert report["meta"]["prefix_caching"] is True and report["meta"]["kv_events"] is True
    assert "--no-enable-prefix-caching" not in report["meta"]["server_args"]
    entry = report["workloads"]["shared-prefix"]
    assert entry["prefix_caching"] is True and entry["groups"] == 12 and entry["requests"] == 2
    assert entry["warm_up"] == 0  # the run's WorkloadRun had no warm-up prompts
    assert entry["prompt_len_sent"] == {"min": 60, "max": 100, "mean": 80.0}
    dp2 = entry["configs"]["dp2"]
    r1 = dp2["rates"]["1"]
    assert r1["prefix_cache_hit_fraction"] == pytest.approx(100 / 160)
    assert r1["cached_over_sent"] == pytest.approx(100 / 160) and r1["prompt_tokens_sent"] == 160
    assert r1["router_prefix_tokens"] is None and dp2["router_prefix_tokens"] is None
    fetch = entry["configs"]["rapidkv-adaptive"]
    assert fetch["rates"]["2"]["router_prefix_tokens"] == {
        "hit": 100.0, "fetched": 40.0, "computed": 20.0
    }  # fmt: skip
    assert fetch["rates"]["2"]["fetched_fraction"] == pytest.approx(0.25)
    assert fetch["router_prefix_tokens"] == {"hit": 200.0, "fetched": 80.0, "computed": 40.0}
    assert fetch["prefix_cache_hit_fraction"] == pytest.approx(100 / 160)
    assert fetch["rates"]["2"]["placements"]["fetch"] == 1.0
    a = entry["acceptance"]  # against dp2 and the blind adaptive router
    assert set(a["baselines_goodput_req_s"]) == {"dp2", "rapidkv-adaptive-blind"}
    assert a["adaptive_goodput_req_s"] == 2.0 and a["best_baseline_goodput_req_s"] == 1.0
    assert a["met"] is True
    out = io.StringIO()
    print_report(report, out)
    text = out.getvalue()
    assert "prefix caching on" in text and "tokens 100/40/20" in text
    assert "fetch 1" in text and "(hit 62%, fetched 80 tokens)" in text
    from rapidkv.bench.goodput.plot import plot

    assert plot(report, tmp_path / "goodput.png").stat().st_size > 0
