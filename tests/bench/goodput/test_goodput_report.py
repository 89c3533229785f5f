"""`rapidkv bench goodput`: its options, the JSON it writes (built from a
made-up sweep), the acceptance, the plot, the client's per-request
`max_tokens` and arrivals, and the adaptive router's command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from rapidkv.bench.common.output import to_json
from rapidkv.bench.common.reference import Reference
from rapidkv.bench.common.stats import RequestResult
from rapidkv.bench.goodput.options import Options
from rapidkv.bench.goodput.report import acceptance, build_report, print_report
from rapidkv.bench.goodput.results import ConfigRun, RateRun, WorkloadRun
from rapidkv.bench.goodput.slo import SLO

pytestmark = pytest.mark.unit


def parse(*argv: str) -> Options:
    from rapidkv.bench.goodput import register

    parser = argparse.ArgumentParser()
    register(parser)
    return Options.from_args(parser.parse_args(list(argv)))


def test_options_default_quick_and_given_rates() -> None:
    o = parse()
    assert o.configs == ("single", "dp2", "vllm-nixl", "rapidkv", "rapidkv-adaptive")
    assert o.workloads == ("prefill-heavy", "chat") and o.requests == 40 and o.warmup == 2
    assert (o.ttft_slo_factor, o.tpot_slo_factor) == (4.0, 1.5)
    assert o.server_args[:2] == ("--max-model-len", "1280")
    q = parse("--quick", "--workloads", "chat")
    assert q.requests == 8 and q.warmup == 1 and q.rates == {"chat": (1.0, 4.0)}
    r = parse("--rates", "8,2,4.5", "--server-args", "--max-num-seqs 4")
    assert r.rates == {"prefill-heavy": (2.0, 4.5, 8.0), "chat": (2.0, 4.5, 8.0)}
    assert r.server_args[-2:] == ("--max-num-seqs", "4") and o.router_args == ()
    assert parse("--router-args", "--tpot-margin 1").router_args == ("--tpot-margin", "1")
    r = parse("--rates", "chat=1,0.5", "--rates", "3,6")  # a named list wins, in any order
    assert r.rates == {"prefill-heavy": (3.0, 6.0), "chat": (0.5, 1.0)}
    g = parse("--tpot-slo-ms", "12.5")
    assert (g.ttft_slo_ms, g.tpot_slo_ms) == (None, 12.5) and o.tpot_slo_ms is None
    r = parse("--rates", "chat=2")
    assert r.rates["chat"] == (2.0,) and r.rates["prefill-heavy"] == o.rates["prefill-heavy"]
    for bad in (
        ["--rates", "0,2"],
        ["--rates", "2,2"],
        ["--rates", "x"],
        ["--rates", "chat="],
        ["--rates", "nope=1,2"],
        ["--workloads", "chat", "--rates", "prefill-heavy=1"],
        ["--workloads", "nope"],
        ["--configs", "nope"],
        ["--configs", "dp2,dp2"],
        ["--requests", "1"],
        ["--ttft-slo-factor", "0"],
        ["--tpot-slo-ms", "0"],
    ):
        with pytest.raises(ValueError):
            parse(*bad)


def test_progress_units_count_references_c1_warm_ups_and_sweeps() -> None:
    o = parse("--requests", "10", "--warmup", "2", "--rates", "1,2,3", "--configs", "single,dp2")
    # per workload: reference 10 + single's warm-up 2 + c1 10; single 3 x 10; dp2 2 + 3 x 10
    assert o.units() == 2 * (22 + 30 + 32)


# ---------------------------------------------------------------- the report


def _result(i: int, ttft: float, tpot: float, tokens: tuple[int, ...], error: str | None = None):
    if error:
        return RequestResult(i, (), (), math.nan, 0.0, error=error)
    times = tuple(ttft + k * tpot for k in range(len(tokens)))
    return RequestResult(i, tokens, times, times[-1] + 1, 0.0)


REFS = [Reference((1, 2, 3), (1.0, 1.0, 1.0)), Reference((4, 5, 6), (1.0, 0.01, 1.0))]


def _sweep(adaptive_fast: bool = True) -> tuple[SimpleNamespace, Options]:
    opts = parse(
        "--workloads",
        "prefill-heavy",
        "--rates",
        "2,4",
        "--requests",
        "2",
        "--configs",
        "single,dp2,vllm-nixl,rapidkv,rapidkv-adaptive",
    )
    w = WorkloadRun("prefill-heavy", (3, 3), [[7] * 5, [8] * 6], 0, references=REFS)
    w.slo = SLO(100.0, 10.0)
    w.single_c1 = [_result(0, 25.0, 5.0, (1, 2, 3)), _result(1, 25.0, 5.0, (4, 5, 6))]
    w.single_c1_wall_s = 0.2
    w.single_c1_other_cpu_s = 0.01
    good = [_result(0, 50.0, 5.0, (1, 2, 3)), _result(1, 60.0, 6.0, (4, 9, 9))]  # a near-tie
    slow = [_result(0, 50.0, 5.0, (1, 2, 3)), _result(1, 160.0, 6.0, (4, 5, 6))]
    arrivals = [0.0, 0.4]
    configs = {}
    for name, at2, at4 in (
        ("single", good, slow),
        ("dp2", good, slow),
        ("vllm-nixl", slow, slow),
        ("rapidkv", good, slow),
        ("rapidkv-adaptive", good, good if adaptive_fast else slow),
    ):
        c = ConfigRun(name, startup_s=10.0)
        c.rates["prefill-heavy"] = {
            2.0: RateRun(
                2.0,
                arrivals,
                at2,
                1.0,
                {"local": 1.0, "pd": 1.0, "split": 0.0},
                {"lowest-ttft": 1.0, "tpot-slo": 1.0},
            ),
            4.0: RateRun(4.0, arrivals, at4, 0.5),
        }
        c.rates["prefill-heavy"][2.0].server_cpu_s = {"a": 0.9}
        c.rates["prefill-heavy"][2.0].other_cpu_s = 0.05
        if name == "rapidkv":
            c.rates["prefill-heavy"][4.0].other_cpu_s = 0.15  # over 0.5 s: 0.3 cores
        configs[name] = c
    configs["rapidkv-adaptive"].router_args["prefill-heavy"] = ["--tpot-slo-ms", "10.000"]
    return SimpleNamespace(workloads={"prefill-heavy": w}, configs=configs), opts


def test_the_json_has_the_documented_keys_and_goodputs() -> None:
    sweep, opts = _sweep()
    report = json.loads(to_json(build_report(sweep, opts, Path("/logs"), 12.0, "rapidkv ...")))
    assert set(report) == {"meta", "noisy", "workloads", "acceptance", "failed_baselines", "ok"}
    assert report["meta"]["command"] == "rapidkv ..." and "cpu" in report["meta"]
    assert report["meta"]["requests_per_rate"] == 2 and report["meta"]["git"]
    assert report["meta"]["include_usage"] is True
    assert parse("--no-include-usage").include_usage is False
    w = report["workloads"]["prefill-heavy"]
    assert w["slo"]["ttft_ms"] == 100.0 and w["slo"]["attainment_target"] == 0.9
    assert w["single_c1"]["ttft_ms"]["p50"] == 25.0 and w["single_c1"]["hard_mismatches"] == 0
    assert w["single_c1"]["other_cpu_cores"] == pytest.approx(0.05)
    goodputs = {name: c["goodput_req_s"] for name, c in w["configs"].items()}
    assert goodputs == {
        "single": 2.0,
        "dp2": 2.0,
        "vllm-nixl": 0.0,
        "rapidkv": 2.0,
        "rapidkv-adaptive": 4.0,
    }
    dp2 = w["configs"]["dp2"]
    assert dp2["attainment"] == {"2": 1.0, "4": 0.5}
    assert dp2["goodput_bound"] == "within" and dp2["attainment_monotonic"] is True
    assert w["configs"]["vllm-nixl"]["goodput_bound"] == "below_sweep"
    r2 = dp2["rates"]["2"]
    assert r2["requests"] == 2 and r2["errors"] == 0 and r2["attainment"] == 1.0
    assert (r2["matches"], r2["near_tie_mismatches"], r2["hard_mismatches"]) == (1, 1, 0)
    assert r2["ttft_ms"]["p50"] == 55.0 and r2["ttft_ms"]["p90"] == pytest.approx(59.0)
    assert r2["tpot_ms"]["p50"] == 5.5 and r2["offered_req_s"] == pytest.approx(2.5)
    assert r2["placements"] == {"local": 1.0, "pd": 1.0, "split": 0.0}
    assert r2["reasons"] == {"lowest-ttft": 1.0, "tpot-slo": 1.0}
    assert r2["other_cpu_cores"] == pytest.approx(0.05) and r2["server_cpu_s"] == {"a": 0.9}
    assert report["noisy"] == ["prefill-heavy rapidkv 4"]  # 0.3 cores of others at 4 req/s
    assert dp2["rates"]["4"]["ttft_attainment"] == 0.5 and dp2["rates"]["4"]["placements"] is None
    assert w["configs"]["rapidkv-adaptive"]["router_args"] == ["--tpot-slo-ms", "10.000"]
    a = w["acceptance"]
    assert a["best_baseline_goodput_req_s"] == 2.0 and a["ratio"] == 2.0 and a["met"] is True
    # per request, in request order: what the acceptance's interval resamples
    assert r2["attained"] == [True, True] and dp2["rates"]["4"]["attained"] == [True, False]
    iv = a["interval"]  # 2 requests are one block: every resample is the run itself
    assert (iv["ratio_low"], iv["ratio_high"], iv["p_met"]) == (2.0, 2.0, 1.0)
    assert iv["goodput_interval"]["dp2"] == [2.0, 2.0] == dp2["goodput_interval_req_s"]
    assert report["acceptance"]["met"] is True and report["ok"] is True
    assert report["acceptance"]["hard_mismatches_all_configs"] == 0


def test_a_hard_mismatch_or_a_failed_rapidkv_request_fails_the_run_a_baseline_does_not() -> None:
    sweep, opts = _sweep()
    runs = sweep.configs["vllm-nixl"].rates["prefill-heavy"]
    runs[4.0].results = [_result(0, 1.0, 1.0, (), error="HTTP 500"), runs[4.0].results[1]]
    report = build_report(sweep, opts, Path("/logs"), 1.0, None)
    assert report["ok"] is True and report["failed_baselines"] == ["vllm-nixl"]
    runs = sweep.configs["rapidkv"].rates["prefill-heavy"]
    runs[2.0].results = [_result(0, 1.0, 1.0, (), error="HTTP 500"), runs[2.0].results[1]]
    assert build_report(sweep, opts, Path("/logs"), 1.0, None)["ok"] is False
    sweep, opts = _sweep()
    runs = sweep.configs["dp2"].rates["prefill-heavy"]
    runs[2.0].results = [_result(0, 1.0, 1.0, (1, 2, 7)), runs[2.0].results[1]]  # hard
    report = build_report(sweep, opts, Path("/logs"), 1.0, None)
    dp2 = report["workloads"]["prefill-heavy"]["configs"]["dp2"]
    assert dp2["hard_mismatches"] == 1 and dp2["attainment"]["2"] == 0.5  # not good output
    assert report["ok"] is False and report["acceptance"]["met"] is False
    sweep, opts = _sweep()
    sweep.workloads["prefill-heavy"].slo = None  # no SLO: nothing is judged
    sweep.workloads["prefill-heavy"].error = "single's c1 TTFT p50 is nan"
    report = build_report(sweep, opts, Path("/logs"), 1.0, None)
    w = report["workloads"]["prefill-heavy"]
    assert report["ok"] is False and w["configs"]["dp2"]["goodput_bound"] == "no_data"
    assert w["configs"]["dp2"]["attainment"] == {"2": None, "4": None}


def test_acceptance_needs_every_baseline_and_none_above_the_sweep() -> None:
    def c(g: float | None, bound: str = "within") -> dict:
        return {"goodput_req_s": g, "goodput_bound": bound}

    base = ("dp2", "vllm-nixl", "rapidkv")
    configs = {"dp2": c(8.0), "vllm-nixl": c(6.0), "rapidkv": c(10.0), "rapidkv-adaptive": c(11.0)}
    a = acceptance(configs, base, "rapidkv-adaptive")
    assert a["best_baseline"] == "rapidkv" and a["ratio"] == pytest.approx(1.1) and a["met"]
    configs["rapidkv-adaptive"] = c(10.5)
    assert not acceptance(configs, base, "rapidkv-adaptive")["met"]
    configs["rapidkv-adaptive"] = c(24.0, "above_sweep")  # a lower bound: still a win
    assert acceptance(configs, base, "rapidkv-adaptive")["met"]
    configs["dp2"] = c(24.0, "above_sweep")
    a = acceptance(configs, base, "rapidkv-adaptive")
    assert not a["met"] and "raise --rates" in a["why_not"]
    del configs["dp2"]
    a = acceptance(configs, base, "rapidkv-adaptive")
    assert not a["met"] and a["why_not"] == "not measured: dp2"
    zero = {"dp2": c(0.0), "vllm-nixl": c(0.0), "rapidkv": c(0.0), "rapidkv-adaptive": c(2.0)}
    a = acceptance(zero, base, "rapidkv-adaptive")
    assert a["met"] and a["ratio"] == math.inf
    zero["rapidkv-adaptive"] = c(0.0)
    assert not acceptance(zero, base, "rapidkv-adaptive")["met"]


def test_the_summary_and_the_plot_are_written(tmp_path: Path) -> None:
    import io

    from rapidkv.bench.goodput.plot import plot

    sweep, opts = _sweep(adaptive_fast=False)
    report = json.loads(to_json(build_report(sweep, opts, Path("/logs"), 1.0, None)))
    out = io.StringIO()
    print_report(report, out)
    text = out.getvalue()
    assert "== prefill-heavy" in text and "result: OK" in text
    assert "WARNING: processes not ours" in text and "prefill-heavy rapidkv 4" in text
    assert "rapidkv-adaptive" in text and "met False" in text
    path = plot(report, tmp_path / "goodput.png")
    assert path.stat().st_size > 0


def test_an_slo_given_in_ms_is_reported_as_given() -> None:
    import dataclasses
    import io

    sweep, opts = _sweep()
    opts = dataclasses.replace(opts, tpot_slo_ms=10.0)
    report = json.loads(to_json(build_report(sweep, opts, Path("/logs"), 1.0, None)))
    slo = report["workloads"]["prefill-heavy"]["slo"]
    assert (slo["ttft_factor"], slo["tpot_factor"]) == (4.0, None)
    assert (report["meta"]["ttft_slo_ms"], report["meta"]["tpot_slo_ms"]) == (None, 10.0)
    out = io.StringIO()
    print_report(report, out)
    assert "TTFT 100.0 ms (4 x single c1 p50 25.00), TPOT 10.00 ms (given)" in out.getvalue()


# ---------------------------------------------------------------- the client, the router


def _fake_vllm():
    """Streams as many tokens as asked (ids 0, 1, ...) and remembers each request."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    seen: list[tuple[float, int, int]] = []

    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        seen.append((time.monotonic(), body["prompt"][0], body["max_tokens"]))

        async def events():
            for t in range(body["max_tokens"]):
                yield f"data: {json.dumps({'choices': [{'token_ids': [t]}]})}\n\n"
                await asyncio.sleep(0)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    return app, seen


def test_a_load_takes_one_max_tokens_per_prompt_and_the_arrivals_given() -> None:
    from rapidkv.bench.common.loads import Load, run_load
    from rapidkv.router.server import ThreadedServer

    app, seen = _fake_vllm()
    arrivals = [0.0, 0.3, 0.6]
    with ThreadedServer(app) as server:
        results, wall = run_load(
            server.url, [[1], [2], [3]], [2, 5, 3], Load("poisson5", rate=5.0), arrivals=arrivals
        )
        with pytest.raises(ValueError):
            run_load(server.url, [[1], [2]], [2], Load("c1", concurrency=1))
        with pytest.raises(ValueError):
            run_load(server.url, [[1]], 2, Load("c1", concurrency=1), arrivals=[0.0])
    assert [len(r.token_ids) for r in results] == [2, 5, 3]
    assert [m for _, _, m in sorted(seen, key=lambda s: s[1])] == [2, 5, 3]
    sent = sorted(t for t, _, _ in seen)
    assert sent[1] - sent[0] == pytest.approx(0.3, abs=0.1)
    assert sent[2] - sent[0] == pytest.approx(0.6, abs=0.1)
    assert wall >= 0.6


def test_the_adaptive_router_gets_both_instances_and_the_slos_appended() -> None:
    from rapidkv.bench.common.groups import CONFIGS, RunningGroup, _group_plan

    assert (
        CONFIGS["rapidkv-adaptive"].group == "rapidkv" and not CONFIGS["rapidkv-adaptive"].default
    )
    keyed, plan = _group_plan("rapidkv", Path("/model"), Path("/logs"), ())
    assert [k for k, _ in keyed] == ["prefill", "decode"]
    controls = {
        k: spec.kv_transfer_config["kv_connector_extra_config"]["control_port"] for k, spec in keyed
    }
    assert all(spec.kv_transfer_config["kv_role"] == "kv_both" for _, spec in keyed)
    servers = {
        "prefill": SimpleNamespace(base_url="http://p"),
        "decode": SimpleNamespace(base_url="http://d"),
    }
    fronts = dict(plan(RunningGroup("rapidkv", servers)))
    argv = fronts["router-adaptive"]
    pairs = [argv[i + 1] for i, a in enumerate(argv) if a == "--instance"]
    assert pairs == [
        f"http://p=127.0.0.1:{controls['prefill']}",
        f"http://d=127.0.0.1:{controls['decode']}",
    ]
    assert "--prefill" not in argv and "--decode" not in argv
    assert argv[argv.index("--placement") + 1] == "adaptive"
    assert argv[argv.index("--dispatch") + 1] == "dual"
    assert "--placement" not in fronts["router-dual"]  # today's router: fixed
    local = fronts["router-local"]  # rapidkv-local: the same instances as two replicas
    assert CONFIGS["rapidkv-local"].front == "router-local" and not CONFIGS["rapidkv-local"].default
    assert local[local.index("--dispatch") + 1] == "local"
    assert [local[i + 1] for i, a in enumerate(local) if a == "--decode"] == [
        "http://p",
        "http://d",
    ]
    assert "--prefill" not in local and "--instance" not in local


def test_a_front_restarted_with_options_replaces_the_running_one(tmp_path: Path) -> None:
    """`RunningGroup.start_front`: the plan's argv plus the options given, the
    old process stopped first."""
    import sys

    from rapidkv.bench.common.groups import RunningGroup
    from rapidkv.harness import free_port

    script = (
        "import sys, http.server\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers()\n"
        "        self.wfile.write(repr(sys.argv).encode())\n"
        "    def log_message(self, *a): pass\n"
        "port = int(sys.argv[sys.argv.index('--port') + 1])\n"
        "http.server.HTTPServer(('127.0.0.1', port), H).serve_forever()\n"
    )

    def plan(g: RunningGroup) -> list[tuple[str, list[str]]]:
        return [("echo", [sys.executable, "-c", script, "--port", str(free_port())])]

    group = RunningGroup("g", {}, plan=plan, log_dir=tmp_path)
    try:
        first = group.start_front("echo", ["--slo", "1"], label="echo.a")
        second = group.start_front("echo", ["--slo", "2"], label="echo.b")
        assert first.process.returncode() is not None  # stopped
        import httpx

        assert "'--slo', '2'" in httpx.get(f"{second.url}/health").text
        assert group.fronts == {"echo": second}
        assert (tmp_path / "g.echo.a.log").exists() and (tmp_path / "g.echo.b.log").exists()
    finally:
        group.stop()
    assert group.fronts["echo"].process.returncode() is not None
