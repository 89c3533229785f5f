"""`rapidkv bench serve`: a smoke run of the command (its pure parts are
tested in test_serve_options.py, test_serve_report.py and tests/bench/common).
The run is `started_serve`'s, shared with test_serve_endpoint, which
compares its endpoints with it."""

from __future__ import annotations

import json

import pytest
from started_serve import StartedRun

from rapidkv.bench.serve.timeline import step_breakdown


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_serve_runs_single_and_rapidkv_and_matches(started_run: StartedRun) -> None:
    """Four requests at c1 and at c4 (one warm-up) through `single` and
    `rapidkv` (rapidkv's c1 one block paired with `single`; the no-op
    connector's configuration is the endpoint of test_serve_endpoint): every
    output equals the reference, the JSON has the documented keys and positive
    figures, the rapidkv decode instance received the prompts' KV, only the
    router that rapidkv uses was started, and it runs on P's core; the trace
    has each request and each rapidkv engine's steps per load."""
    proc, elapsed = started_run.proc, started_run.elapsed
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = json.loads(started_run.json.read_text())
    assert report["ok"] is True and report["reference"]["tiny"]["error"] is None
    assert report["meta"]["include_usage"] is True
    assert set(report["configs"]) == {"single", "rapidkv"}
    for name, config in report["configs"].items():
        assert config["error"] is None and config["startup_s"] > 0, name
        assert set(config["loads"]) == {"c1", "c4"}, name
        for load, s in config["loads"].items():
            assert s["requests"] == 4 and s["errors"] == 0 and s["hard_mismatches"] == 0, load
        c1 = config["loads"]["c1"]
        assert (c1["matches"], c1["hard_mismatches"], c1["near_tie_mismatches"]) == (4, 0, 0)
        for measure in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            for key in ("mean", "p50", "p90", "p99"):
                assert c1[measure][key] > 0, (name, measure, key)
        assert c1["throughput_req_s"] > 0 and c1["output_tok_s"] > 0
        assert c1["server_cpu_s_per_req"] > 0
        # whole streams, and the engines' own TTFT read from their /metrics
        assert c1["itl_max_ms"] > 0 and c1["gaps_over_250ms"] >= 0
        assert 0 <= c1["lumped_share"] <= 1
        assert c1["engine_ttft_requests"] >= 4 and c1["engine_ttft_ms_p90"] > 0
        assert c1["client_ttft_over_engine_p90"] > 0
    # one request at a time: the router splits each prompt, and the head (about
    # 55 % of it, in whole blocks) reaches D through the connector
    assert report["configs"]["rapidkv"]["loads"]["c1"]["kv_transferred_fraction"] > 0.3
    # paired: `single` served the same four prompts beside it, in one block
    pair = report["configs"]["rapidkv"]["loads"]["c1"]["paired_single"]
    assert pair["requests"] == 4 and pair["errors"] == 0 and pair["hard_mismatches"] == 0
    assert pair["tpot_ms"]["p50"] > 0 and pair["tpot_p50_over_paired_single"] > 0
    lo, hi = pair["tpot_p50_over_paired_single_ci95"]  # one block: the ratio itself
    assert pair["blocks"] == 1 and lo == hi == pytest.approx(pair["tpot_p50_over_paired_single"])
    assert "paired_single" not in report["configs"]["rapidkv"]["loads"]["c4"]  # c1 only
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
    assert started_run.plot.stat().st_size > 0
    fronts = sorted(p.name for p in started_run.logs.rglob("rapidkv.router*.log"))
    assert fronts == ["rapidkv.router-dual.log"]
    # P and the router share core 0; D's core runs D alone
    affinity = report["configs"]["rapidkv"]["affinity"]
    assert affinity == {"prefill": ["0"], "decode": ["1"], "router-dual": ["0"]}
    assert "result: OK" in proc.stdout
    # the trace: each request, and each rapidkv engine's steps during each load,
    # where D's prompt steps waited for the split heads and its forwards are timed
    rows = [json.loads(line) for line in started_run.trace.read_text().splitlines()]
    requests = [r for r in rows if r.get("kind") is None]
    for load in ("c1", "c4"):
        assert sum(r["config"] == "rapidkv" and r["load"] == load for r in requests) == 4
    paired = [r for r in requests if r.get("paired_with") == "rapidkv"]
    assert len(paired) == 4 and {(r["config"], r["load"]) for r in paired} == {("single", "c1")}
    steps = {(r["load"], r["role"]): r for r in rows if r.get("kind") == "steps"}
    assert set(steps) == {(load, role) for load in ("c1", "c4") for role in ("prefill", "decode")}
    assert {r["config"] for r in steps.values()} == {"rapidkv"}
    breakdown = step_breakdown(rows)
    d_prompt, d_decode = (breakdown[f"rapidkv/c1/decode/{k}"] for k in ("prompt", "decode"))
    assert d_prompt["n"] == 4 and d_prompt["wait"] > 0 and d_prompt["forward"] > 0
    assert d_decode["n"] >= 4 * 14 and d_decode["wait"] == 0 and d_decode["itl"] > 0
    assert 0 < d_decode["forward"] < d_decode["wall"] and d_decode["hooks"] > 0
    print(f"bench serve smoke: {elapsed:.0f}s")
