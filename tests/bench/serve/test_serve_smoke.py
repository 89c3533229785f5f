"""`rapidkv bench serve`: its pure parts (stats, mismatch classification, loads,
the NIXL tuning and proxy rewrite), and a smoke run of the command itself."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import types
from pathlib import Path

import pytest
from bench_cli import run_bench

from rapidkv.bench.common.loads import Load
from rapidkv.bench.common.nixl_tuning import guarded_setaffinity, parse_cpus, patch_nixl_api
from rapidkv.bench.common.output import to_json
from rapidkv.bench.common.proxy import prefill_body
from rapidkv.bench.common.reference import Reference, classify, margins_from_logprobs
from rapidkv.bench.common.stats import Histogram, RequestResult, load_summary, percentile, summarize
from rapidkv.bench.serve.options import Options
from rapidkv.bench.serve.report import acceptance_report, stall_report

REF = Reference(token_ids=(5, 6, 7, 8), margins=(2.0, 0.03, 0.5, math.nan))


# ---------------------------------------------------------------- classification


@pytest.mark.unit
def test_identical_output_is_a_match() -> None:
    assert classify(REF, [5, 6, 7, 8]) == "match"


@pytest.mark.unit
def test_divergence_where_the_reference_had_a_near_tie_is_a_near_tie() -> None:
    assert classify(REF, [5, 9, 1, 1]) == "near_tie"  # margin 0.03 at position 1


@pytest.mark.unit
def test_divergence_at_a_clear_margin_is_hard_even_after_a_near_tie_position() -> None:
    assert classify(REF, [9, 6, 7, 8]) == "hard"  # margin 2.0 at position 0
    assert classify(REF, [5, 6, 9, 8]) == "hard"  # margin 0.5 at position 2


@pytest.mark.unit
def test_the_margin_bound_is_inclusive_and_configurable() -> None:
    ref = Reference((1, 2), (0.05, 0.05))
    assert classify(ref, [3, 2]) == "near_tie"
    assert classify(ref, [3, 2], tie=0.01) == "hard"


@pytest.mark.unit
def test_unknown_margin_or_a_length_difference_is_hard() -> None:
    assert classify(REF, [5, 6, 7, 9]) == "hard"  # margin nan at position 3
    assert classify(REF, [5, 6, 7]) == "hard"
    assert classify(REF, [5, 6, 7, 8, 9]) == "hard"
    assert classify(REF, []) == "hard"


@pytest.mark.unit
def test_margins_are_top1_minus_top2_from_openai_top_logprobs() -> None:
    top = [{"token_id:3": -0.1, "token_id:9": -2.1}, {"token_id:4": -0.5}, None]
    m = margins_from_logprobs(top)
    assert m[0] == pytest.approx(2.0)
    assert math.isnan(m[1]) and math.isnan(m[2])
    # order of the dict does not matter
    assert margins_from_logprobs([{"a": -3.0, "b": -1.0}])[0] == pytest.approx(2.0)


# ---------------------------------------------------------------- statistics


@pytest.mark.unit
def test_percentiles_interpolate_linearly_like_numpy() -> None:
    values = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 5.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


@pytest.mark.unit
def test_summaries_ignore_nan_and_report_every_statistic() -> None:
    s = summarize([3.0, math.nan, 1.0, 2.0])
    assert s == {
        "mean": 2.0,
        "p50": 2.0,
        "p90": 2.8,
        "p99": pytest.approx(2.98),
        "min": 1.0,
        "max": 3.0,
        "n": 3,
    }
    empty = summarize([math.nan])
    assert empty["n"] == 0 and math.isnan(empty["p50"])


@pytest.mark.unit
def test_request_timing_derives_ttft_tpot_and_itl_from_token_arrivals() -> None:
    r = RequestResult(0, (1, 2, 3), (10.0, 14.0, 20.0), 21.0, 0.0)
    assert r.ttft_ms == 10.0 and r.tpot_ms == 5.0 and r.itl_ms == [4.0, 6.0]
    one = RequestResult(0, (1,), (10.0,), 11.0, 0.0)
    assert math.isnan(one.tpot_ms) and one.itl_ms == []


@pytest.mark.unit
def test_a_load_summary_counts_verdicts_errors_throughput_and_cpu() -> None:
    refs = [REF, Reference((1, 2), (1.0, 1.0))]
    results = [
        RequestResult(0, (5, 6, 7, 8), (10.0, 12.0, 14.0, 16.0), 17.0, 0.0),
        RequestResult(0, (5, 9, 7, 8), (20.0, 22.0, 24.0, 26.0), 27.0, 0.0),
        RequestResult(1, (1, 3), (30.0, 40.0), 41.0, 0.0),
        RequestResult(1, (), (), math.nan, 0.0, error="boom"),
    ]
    s = load_summary(results, refs, wall_s=2.0, cpu_s={"prefill": 1.0, "router": 0.6})
    assert (s["matches"], s["near_tie_mismatches"], s["hard_mismatches"]) == (1, 1, 1)
    assert s["requests"] == 4 and s["errors"] == 1 and s["error_examples"] == ["boom"]
    assert s["ttft_ms"]["p50"] == 20.0 and s["ttft_ms"]["n"] == 3
    assert s["throughput_req_s"] == 1.5 and s["output_tok_s"] == 5.0
    assert s["server_cpu_s_per_req"] == pytest.approx(0.4)
    assert s["ttft_over_1s"] == 0 and s["ttft_ms"]["max"] == 30.0
    unchecked = load_summary(results, None, 2.0, {})
    assert unchecked["hard_mismatches"] is None
    slow = [RequestResult(0, (5,), (t,), t + 1, 0.0) for t in (999.0, 1000.0, 1000.5, 3100.0)]
    s = load_summary(slow, None, 1.0, {})
    assert s["ttft_over_1s"] == 2 and s["ttft_ms"]["max"] == 3100.0


@pytest.mark.unit
def test_at_deep_loads_throughput_is_held_against_vllm_nixl_and_half_of_dp2() -> None:
    def config(rate: float) -> dict:
        load = {"ttft_ms": {"p50": 100.0, "p90": 120.0, "p99": 150.0, "max": 160.0}}
        load.update(ttft_over_1s=0, throughput_req_s=rate, itl_max_ms=20.0)
        load.update(gaps_over_250ms=0, lumped_share=0.0, engine_ttft_ms_p90=110.0)
        load.update(client_ttft_over_engine_p90=120 / 110, client_ttft_within_engine_bound=True)
        return {"loads": {"c16": load, "c32": dict(load)}}

    configs = {"vllm-nixl": config(20.0), "dp2": config(50.0), "rapidkv": config(26.0)}
    st = stall_report(configs)
    assert st["met"] is True
    assert st["rapidkv c32"]["throughput_over_vllm_nixl"] == pytest.approx(1.3)
    assert st["rapidkv c32"]["throughput_over_dp2"] == pytest.approx(0.52)
    configs["rapidkv"] = config(24.0)  # above vllm-nixl, under half of dp2
    assert stall_report(configs)["met"] is False
    configs["dp2"] = config(40.0)
    configs["rapidkv"] = config(19.0)  # half of dp2, under vllm-nixl
    assert stall_report(configs)["met"] is False


def test_a_stall_shows_in_the_stall_report_whatever_the_p50() -> None:
    def config(
        p50: float,
        p99: float,
        over: int,
        rate: float,
        gap: float = 12.0,
        p90: float = 300.0,
        engine: float = 250.0,
    ) -> dict:
        ttft = {"p50": p50, "p90": p90, "p99": p99, "max": p99}
        load = {"ttft_ms": ttft, "ttft_over_1s": over, "throughput_req_s": rate}
        load.update(itl_max_ms=gap, gaps_over_250ms=int(gap > 250), lumped_share=0.1)
        load.update(engine_ttft_ms_p90=engine, client_ttft_over_engine_p90=p90 / engine)
        load["client_ttft_within_engine_bound"] = (
            p90 <= 1.5 * engine + 50 if not math.isnan(engine) else None
        )
        return {"loads": {"c1": load, "c4": load}}

    configs = {
        "vllm-nixl": config(200.0, 2900.0, 3, 10.0, gap=3000.0),  # a baseline's are not ours
        "rapidkv": config(160.0, 600.0, 0, 12.0),
        "rapidkv-whole": config(170.0, 650.0, 0, 11.0),
    }
    st = stall_report(configs)
    assert st["met"] is True
    assert st["rapidkv c4"]["throughput_over_vllm_nixl"] == pytest.approx(1.2)
    assert "throughput_over_vllm_nixl" not in st["rapidkv c1"]
    assert st["rapidkv c1"]["itl_max_ms"] == 12.0 and st["rapidkv c1"]["lumped_share"] == 0.1
    assert st["rapidkv c1"]["client_ttft_over_engine_p90"] == pytest.approx(1.2)
    configs["rapidkv-whole"] = config(161.0, 2885.0, 4, 11.0)  # the p50 looks fine
    st = stall_report(configs)
    assert st["met"] is False and st["rapidkv-whole c1"]["ttft_over_1s"] == 4
    assert st["rapidkv-whole c1"]["ttft_p99_over_p50"] == pytest.approx(2885 / 161)
    configs["rapidkv-whole"] = config(161.0, 900.0, 0, 11.0)  # p99 / p50 5.6: context only
    assert stall_report(configs)["met"] is True
    configs["rapidkv-whole"] = config(161.0, 600.0, 0, 9.0)  # slower than vllm-nixl at c4
    assert stall_report(configs)["met"] is False
    configs["rapidkv-whole"]["loads"]["c4"]["paired_single"] = {}  # blocks: no rate target
    st = stall_report(configs)
    assert st["met"] is True and st["rapidkv-whole c4"]["paired"] is True
    # whole streams: a gap over 1 s fails, gaps over 250 ms are shown, not a target
    configs["rapidkv-whole"] = config(170.0, 650.0, 0, 11.0, gap=1000.5)
    st = stall_report(configs)
    assert st["met"] is False and st["rapidkv-whole c1"]["gaps_over_250ms"] == 1
    configs["rapidkv-whole"] = config(170.0, 650.0, 0, 11.0, gap=1000.0)
    assert stall_report(configs)["met"] is True
    configs["rapidkv-whole"] = config(170.0, 650.0, 0, 11.0, gap=math.nan)  # one token each
    assert stall_report(configs)["met"] is True
    # the client's TTFT against the engines' own: waits outside the engines fail
    configs["rapidkv-whole"] = config(170.0, 650.0, 0, 11.0, p90=425.0, engine=250.0)
    assert stall_report(configs)["met"] is True  # 425 <= 1.5 x 250 + 50
    configs["rapidkv-whole"] = config(170.0, 650.0, 0, 11.0, p90=426.0, engine=250.0)
    st = stall_report(configs)
    assert st["met"] is False and st["rapidkv-whole c1"]["client_ttft_within_engine_bound"] is False
    configs["rapidkv-whole"] = config(170.0, 650.0, 0, 11.0, engine=math.nan)  # not read
    assert stall_report(configs)["met"] is False
    assert "engines' TTFT p90" in st["targets"] and "gap over 1 s" in st["targets"]


@pytest.mark.unit
def test_acceptance_ratios_and_the_connector_floor_which_is_no_target() -> None:
    def config(ttft: float, tpot: float) -> dict:
        load = {"ttft_ms": {"p50": ttft, "mean": ttft}, "tpot_ms": {"p50": tpot}}
        return {"hard_mismatches": 0, "loads": {"c1": load, "c4": load}}

    configs = {
        "single": config(50.0, 5.0),
        "single-noop-connector": config(50.0, 6.0),  # 1.2x: above 1.05, yet no target
        "vllm-nixl": config(80.0, 5.5),
        "rapidkv": config(40.0, 5.1),
    }
    a = acceptance_report(configs)
    assert a["ttft_p50_rapidkv_over_vllm_nixl_c1"] == pytest.approx(0.5)
    assert a["tpot_p50_rapidkv_over_single_c4"] == pytest.approx(1.02)
    assert a["floor_tpot_p50_noop_connector_over_single_c1"] == pytest.approx(1.2)
    assert a["floor_tpot_p50_rapidkv_over_noop_connector_c1"] == pytest.approx(0.85)
    assert a["met"] is True
    configs["rapidkv"] = config(40.0, 5.3)  # 1.06x single
    assert acceptance_report(configs)["met"] is False
    del configs["single-noop-connector"]
    assert math.isnan(acceptance_report(configs)["floor_tpot_p50_noop_connector_over_single_c1"])


@pytest.mark.unit
def test_paired_tpot_ratios_replace_the_unpaired_ones_as_targets() -> None:
    """Where a configuration was measured in blocks beside `single`, the TPOT
    target is its ratio to those blocks; the unpaired ratio stays as context."""

    def config(tpot: float, paired_ratio: float | None = None) -> dict:
        load: dict = {"ttft_ms": {"p50": 40.0, "mean": 40.0}, "tpot_ms": {"p50": tpot}}
        if paired_ratio is not None:
            load["paired_single"] = {
                "tpot_p50_over_paired_single": paired_ratio,
                "tpot_p50_over_paired_single_ci95": [paired_ratio - 0.1, paired_ratio + 0.1],
            }
        return {"hard_mismatches": 0, "paired_single_hard_mismatches": 0, "loads": {"c1": load}}

    configs = {
        "single": config(5.0),
        "single-noop-connector": config(5.5, paired_ratio=1.01),
        "rapidkv": config(6.0, paired_ratio=1.02),  # 1.2x the unpaired `single`
    }
    a = acceptance_report(configs)
    assert a["tpot_p50_rapidkv_over_single_c1"] == pytest.approx(1.02)
    assert a["unpaired_tpot_p50_rapidkv_over_single_c1"] == pytest.approx(1.2)
    assert a["paired_c1"] is True and a["met"] is True
    assert a["ci95_tpot_p50_rapidkv_over_single_c1"] == pytest.approx([0.92, 1.12])
    assert a["floor_tpot_p50_noop_connector_over_single_c1"] == pytest.approx(1.01)
    configs["rapidkv"] = config(5.1, paired_ratio=1.06)  # unpaired 1.02: the pair decides
    assert acceptance_report(configs)["met"] is False
    configs["rapidkv"]["paired_single_hard_mismatches"] = 1
    assert acceptance_report(configs)["hard_mismatches_all_configs"] == 1


@pytest.mark.unit
def test_progress_counts_the_paired_single_blocks_and_its_warm_up() -> None:
    from rapidkv.bench.serve import register
    from rapidkv.bench.serve.run import total_units

    parser = argparse.ArgumentParser()
    register(parser)

    def units(*argv: str) -> int:
        return total_units(Options.from_args(parser.parse_args(list(argv))))

    base = ["--requests", "10", "--loads", "c1,c4", "--warmup", "2", "--rounds", "3"]
    # the reference (10), then per round: warm-up + 2 loads x 10 per configuration,
    # the same again for each paired configuration's `single` blocks, and the
    # warm-up of `single` when it is no configuration of its own
    assert units(*base, "--configs", "single,dp2") == 10 + 3 * 2 * 22
    assert units(*base, "--configs", "single,rapidkv") == 10 + 3 * (2 * 22 + 20)
    assert units(*base, "--configs", "rapidkv") == 10 + 3 * (22 + 20 + 2)
    assert units(*base, "--configs", "rapidkv", "--pair-block", "0") == 10 + 3 * 22
    with pytest.raises(ValueError, match="pair-block"):
        Options.from_args(parser.parse_args([*base, "--pair-block", "-1"]))


@pytest.mark.unit
def test_a_model_is_a_test_model_by_name_or_a_checkpoints_directory(tmp_path: Path) -> None:
    from rapidkv.bench.serve import register

    parser = argparse.ArgumentParser()
    register(parser)
    (tmp_path / "config.json").write_text("{}")
    opts = Options.from_args(parser.parse_args(["--models", f"tiny,{tmp_path}"]))
    assert opts.models == ("tiny", str(tmp_path))
    for bad in ("huge", str(tmp_path / "nothing-here")):
        with pytest.raises(ValueError, match="unknown model"):
            Options.from_args(parser.parse_args(["--models", bad]))


def test_the_json_output_is_strict_json_with_null_for_missing_figures() -> None:
    text = to_json({"p50": math.nan, "n": 3, "ids": (1, 2), "inf": math.inf, "dir": Path("/x")})
    assert json.loads(text) == {"p50": None, "n": 3, "ids": [1, 2], "inf": None, "dir": "/x"}


# ---------------------------------------------------------------- loads, tuning, proxy


@pytest.mark.unit
def test_load_names_parse_into_closed_and_open_loops() -> None:
    assert Load.parse("c4") == Load("c4", concurrency=4)
    assert Load.parse("poisson8") == Load("poisson8", rate=8.0)
    assert Load.parse("poisson2.5").rate == 2.5
    for bad in ("c0", "poisson0", "x3", "c", ""):
        with pytest.raises(ValueError):
            Load.parse(bad)


def _entry(loads: dict[str, list[RequestResult]]) -> dict:
    """A configuration's JSON entry as `report.config_report` builds it, from
    each load's results (one round, no references, 1 s per load)."""
    entry: dict = {"error": None, "startup_s": 1.0, "first_request_ms": [], "affinity": {}}
    entry.update(errors=0, hard_mismatches=0, near_tie_mismatches=0, loads={})
    entry["paired_single_hard_mismatches"] = 0
    engine = Histogram(((0.01, 0.0), (0.05, 4.0), (math.inf, 4.0)), 4.0)  # p90 46 ms
    for load, results in loads.items():
        s = load_summary(results, None, 1.0, {"decode": 0.5}, {"decode": engine})
        s.update(prompt_tokens={}, kv_transferred_fraction=1.0, client_cpu_s=0.1)
        s.update(other_cpu_s=0.0, other_cpu_cores=0.0)
        entry["loads"][load] = s
    return entry


@pytest.mark.unit
def test_deep_closed_loops_are_accepted_and_reported() -> None:
    """`--loads c1,c4,c16,c32,poisson8`: parsed, counted, reported and printed
    like any other; paired blocks of 8 cannot hold 16 in flight, which is said."""
    import io

    from rapidkv.bench.serve import register
    from rapidkv.bench.serve.report import print_report
    from rapidkv.bench.serve.run import total_units

    parser = argparse.ArgumentParser()
    register(parser)
    names = ["c1", "c4", "c16", "c32", "poisson8"]
    opts = Options.from_args(parser.parse_args(["--loads", ",".join(names)]))
    assert [load.name for load in opts.loads] == names
    assert [load.concurrency for load in opts.loads] == [1, 4, 16, 32, None]
    assert opts.capped_loads() == ["c16", "c32"]  # rapidkv is paired, in blocks of 8
    assert opts.units("single") == 2 + 5 * 64 and total_units(opts) > 0
    deep = ["--loads", "c16,c32", "--pair-block", "32"]
    assert Options.from_args(parser.parse_args(deep)).capped_loads() == []
    unpaired = ["--loads", "c32", "--pair-block", "0"]
    assert Options.from_args(parser.parse_args(unpaired)).capped_loads() == []

    ok = [RequestResult(i, (1, 2), (40.0, 45.0), 46.0, 0.0) for i in range(4)]
    entries = {name: _entry(dict.fromkeys(names, ok)) for name in ("single", "rapidkv")}
    a = acceptance_report(entries)
    assert a["tpot_p50_rapidkv_over_single_c32"] == pytest.approx(1.0)
    st = stall_report(entries)
    assert set(st) >= {f"rapidkv {n}" for n in names} and st["met"] is True
    report = {
        "configs": entries,
        "acceptance": {"tiny": a},
        "stalls": {"tiny": st},
        "reference": {"tiny": {"error": None}},
        "failed_baselines": [],
        "ok": True,
    }
    out = io.StringIO()
    print_report(report, out)
    rows = [line.split()[:2] for line in out.getvalue().splitlines()]
    assert ["rapidkv", "c16"] in rows and ["rapidkv", "c32"] in rows
    assert "rapidkv c32" in out.getvalue()


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


@pytest.mark.unit
def test_the_nixl_proxy_asks_p_for_one_token_and_a_remote_decode() -> None:
    body = {
        "prompt": [1, 2],
        "max_tokens": 16,
        "stream": True,
        "min_tokens": 16,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    p = prefill_body(body)
    assert p["max_tokens"] == 1 and p["stream"] is False
    assert "min_tokens" not in p and "stream_options" not in p
    assert p["kv_transfer_params"]["do_remote_decode"] is True
    assert p["prompt"] == [1, 2] and body["max_tokens"] == 16  # the client's body is untouched


def _fake_vllm(stall_on: int, seen: list[dict] | None = None):
    """An ASGI app streaming two tokens per completion (then a usage event when
    asked for, as vLLM does); it never answers a prompt starting with
    `stall_on`; each request's body is appended to `seen`."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        if seen is not None:
            seen.append(body)

        async def events():
            if body["prompt"][0] == stall_on:
                await asyncio.sleep(30)
            for t in (7, 8):
                yield f"data: {json.dumps({'choices': [{'token_ids': [t]}]})}\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


@pytest.mark.unit
def test_a_load_stops_sending_after_a_request_times_out() -> None:
    from rapidkv.bench.common.loads import SKIPPED, TIMEOUT, run_load
    from rapidkv.router.server import ThreadedServer

    prompts = [[1], [2], [3], [4]]
    with ThreadedServer(_fake_vllm(stall_on=2)) as server:
        results, wall = run_load(server.url, prompts, 2, Load.parse("c1"), timeout_s=0.5)
    assert [r.token_ids for r in results[:1]] == [(7, 8)] and results[0].error is None
    assert results[1].error.startswith(TIMEOUT)
    assert all(r.error.startswith(SKIPPED) for r in results[2:])
    assert 0.5 <= wall < 5


@pytest.mark.unit
def test_a_load_asks_for_usage_unless_told_not_to() -> None:
    """Every streamed request carries `stream_options: {"include_usage": true}`
    by default (`--no-include-usage` turns it off); the usage event adds no token."""
    from rapidkv.bench.common.loads import run_load
    from rapidkv.bench.serve import register
    from rapidkv.router.server import ThreadedServer

    seen: list[dict] = []
    with ThreadedServer(_fake_vllm(stall_on=9, seen=seen)) as server:
        with_usage, _ = run_load(server.url, [[1], [2]], 2, Load.parse("c1"))
        without, _ = run_load(server.url, [[3]], 2, Load.parse("c1"), include_usage=False)
    assert [b.get("stream_options") for b in seen] == [{"include_usage": True}] * 2 + [None]
    assert [r.token_ids for r in with_usage + without] == [(7, 8)] * 3
    assert all(len(r.token_ms) == 2 and r.error is None for r in with_usage + without)

    parser = argparse.ArgumentParser()
    register(parser)
    assert Options.from_args(parser.parse_args([])).include_usage is True
    assert Options.from_args(parser.parse_args(["--no-include-usage"])).include_usage is False


def test_a_load_runs_its_client_on_the_cpus_given_and_gives_them_back() -> None:
    import os

    from rapidkv.bench.common.loads import run_load
    from rapidkv.router.server import ThreadedServer

    before = os.sched_getaffinity(0)
    seen: list[set[int]] = []
    with ThreadedServer(_fake_vllm(stall_on=9)) as server:
        results, _ = run_load(
            server.url,
            [[1], [2]],
            2,
            Load.parse("c1"),
            on_done=lambda: seen.append(os.sched_getaffinity(0)),
            cpus={0},
        )
    assert [r.error for r in results] == [None, None]
    assert seen == [{0}, {0}]  # on_done runs in the client's event loop
    assert os.sched_getaffinity(0) == before


def test_the_client_and_fronts_share_core_0_except_with_the_stock_nixl_setup() -> None:
    from rapidkv.bench.common.groups import CONFIGS, helper_cpus

    for name in ("single", "dp2", "vllm-nixl", "rapidkv", "single-noop-connector"):
        assert helper_cpus(CONFIGS[name].group) == {0}, name
    for name in ("vllm-nixl-stock", "vllm-nixl-push-stock"):
        assert helper_cpus(CONFIGS[name].group) is None, name


# ---------------------------------------------------------------- smoke


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_bench_serve_runs_single_and_rapidkv_and_matches(tmp_path: Path) -> None:
    """Two requests through `rapidkv` and through one instance with the no-op KV
    connector (`single` only computes the reference):
    every output equals the reference, the JSON has the documented keys and
    positive figures, the rapidkv decode instance received the prompts' KV, only
    the router that configuration uses was started, and it runs on P's core."""
    out = tmp_path / "serve.json"
    proc, elapsed = run_bench(
        "serve",
        "--configs",
        "rapidkv,single-noop-connector",
        "--requests",
        "2",
        "--loads",
        "c1",
        "--warmup",
        "0",
        "--json",
        str(out),
        "--plot",
        str(tmp_path / "serve.png"),
        "--log-dir",
        str(tmp_path / "logs"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["reference"]["tiny"]["error"] is None
    assert report["meta"]["include_usage"] is True
    assert set(report["configs"]) == {"rapidkv", "single-noop-connector"}
    for name, config in report["configs"].items():
        assert config["error"] is None and config["startup_s"] > 0, name
        c1 = config["loads"]["c1"]
        assert c1["requests"] == 2 and c1["errors"] == 0, name
        assert (c1["matches"], c1["hard_mismatches"], c1["near_tie_mismatches"]) == (2, 0, 0)
        for measure in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            for key in ("mean", "p50", "p90", "p99"):
                assert c1[measure][key] > 0, (name, measure, key)
        assert c1["throughput_req_s"] > 0 and c1["output_tok_s"] > 0
        assert c1["server_cpu_s_per_req"] > 0
        # whole streams, and the engines' own TTFT read from their /metrics
        assert c1["itl_max_ms"] > 0 and c1["gaps_over_250ms"] >= 0
        assert 0 <= c1["lumped_share"] <= 1
        assert c1["engine_ttft_requests"] >= 2 and c1["engine_ttft_ms_p90"] > 0
        assert c1["client_ttft_over_engine_p90"] > 0
    # one request at a time: the router splits each prompt, and the head (about
    # 55 % of it, in whole blocks) reaches D through the connector
    assert report["configs"]["rapidkv"]["loads"]["c1"]["kv_transferred_fraction"] > 0.3
    # both are paired: `single` served the same two prompts beside each of them
    for name in ("rapidkv", "single-noop-connector"):
        pair = report["configs"][name]["loads"]["c1"]["paired_single"]
        assert pair["requests"] == 2 and pair["errors"] == 0 and pair["hard_mismatches"] == 0
        assert pair["tpot_ms"]["p50"] > 0 and pair["tpot_p50_over_paired_single"] > 0
        lo, hi = pair["tpot_p50_over_paired_single_ci95"]  # one block: the ratio itself
        assert pair["blocks"] == 1 and lo == hi == pytest.approx(
            pair["tpot_p50_over_paired_single"]
        )
    ratio = report["acceptance"]["tiny"]["tpot_p50_rapidkv_over_single_c1"]
    assert report["acceptance"]["tiny"]["paired_c1"] is True
    stalls = report["stalls"]["tiny"]["rapidkv c1"]
    assert set(stalls["engine_ttft_ms_p90_by_server"]) == {"prefill", "decode"}
    assert (
        ratio
        == report["configs"]["rapidkv"]["loads"]["c1"]["paired_single"][
            "tpot_p50_over_paired_single"
        ]
    )
    assert (tmp_path / "serve.png").stat().st_size > 0
    fronts = sorted(p.name for p in (tmp_path / "logs").rglob("rapidkv.router*.log"))
    assert fronts == ["rapidkv.router-dual.log"]
    # P and the router share core 0; D's core runs D alone
    affinity = report["configs"]["rapidkv"]["affinity"]
    assert affinity == {"prefill": ["0"], "decode": ["1"], "router-dual": ["0"]}
    # the no-op connector was loaded (vLLM logs the class it creates) and changed nothing
    noop_log = next((tmp_path / "logs").rglob("single-noop-connector.log")).read_text()
    assert "NoopConnector" in noop_log
    assert report["configs"]["single-noop-connector"]["affinity"] == {"single": ["1"]}
    assert "result: OK" in proc.stdout
    print(f"bench serve smoke: {elapsed:.0f}s")


@pytest.mark.unit
def test_the_paired_ratio_interval_is_seeded_and_brackets_what_the_blocks_show() -> None:
    from rapidkv.bench.common.stats import paired_ratio_interval

    same = [([5.0 + i % 3, 5.5, 6.0], [5.0 + (i + 1) % 3, 5.5, 6.0]) for i in range(12)]
    lo, hi = paired_ratio_interval(same)
    assert lo <= 1.0 <= hi and (lo, hi) == paired_ratio_interval(same)
    slower = [([x * 1.2 for x in b], b) for _, b in same]
    lo, hi = paired_ratio_interval(slower)
    assert lo == pytest.approx(1.2) and hi == pytest.approx(1.2)
    assert all(math.isnan(v) for v in paired_ratio_interval([]))
    assert all(math.isnan(v) for v in paired_ratio_interval([([], [5.0])]))


@pytest.mark.unit
def test_netns_link_places_rapidkv_and_refuses_the_nixl_baselines() -> None:
    """`--netns-link RATE`: by default `single` and `rapidkv`; configurations of
    vLLM's NIXL groups would run on one host and are refused; a bad rate too.
    rapidkv's P binds every interface in namespace A and advertises its link
    address, D binds its own; both data planes get their link address."""
    from types import SimpleNamespace

    from rapidkv.bench.common.groups import _group_plan, rapidkv_control
    from rapidkv.bench.serve import register
    from rapidkv.harness.netns import NetnsLink, Side

    parser = argparse.ArgumentParser()
    register(parser)
    opts = Options.from_args(parser.parse_args(["--quick", "--netns-link", "1gbit"]))
    assert opts.configs == ("single", "rapidkv") and opts.netns_link == "1gbit"
    assert "vllm-nixl" in Options.from_args(parser.parse_args(["--quick"])).configs
    with pytest.raises(ValueError, match="vllm-nixl"):
        Options.from_args(parser.parse_args(["--netns-link", "1gbit", "--configs", "vllm-nixl"]))
    with pytest.raises(ValueError, match="rate"):
        Options.from_args(parser.parse_args(["--netns-link", "1gb"]))

    link = NetnsLink(
        3, Side("ns-a", "10.77.3.1", "rkv3a"), Side("ns-b", "10.77.3.2", "rkv3b"), "1gbit", ()
    )
    keyed, fronts = _group_plan("rapidkv", Path("/m"), Path("/logs"), (), link)
    (_, p), (_, d) = keyed
    assert (p.netns, p.host, d.netns, d.host) == ("ns-a", "10.77.3.1", "ns-b", "10.77.3.2")
    p_extra = p.kv_transfer_config["kv_connector_extra_config"]
    d_extra = d.kv_transfer_config["kv_connector_extra_config"]
    assert p_extra["control_host"] == "0.0.0.0" and p_extra["kvt_host"] == "10.77.3.1"
    assert d_extra["control_host"] == "10.77.3.2" and d_extra["kvt_host"] == "10.77.3.2"
    p_control = rapidkv_control(p.kv_transfer_config)
    assert p_control == f"10.77.3.1:{p_extra['control_port']}"
    servers = {
        "prefill": SimpleNamespace(base_url="http://10.77.3.1:1"),
        "decode": SimpleNamespace(base_url="http://10.77.3.2:2"),
    }
    dual = dict(fronts(SimpleNamespace(servers=servers)))["router-dual"]
    assert dual[dual.index("--prefill") + 1] == f"http://10.77.3.1:1={p_control}"
    local, _ = _group_plan("rapidkv", Path("/m"), Path("/logs"), ())
    assert local[0][1].netns is None and rapidkv_control(local[0][1].kv_transfer_config)[:10] == (
        "127.0.0.1:"
    )
