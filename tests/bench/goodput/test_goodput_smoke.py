"""`rapidkv bench goodput`: a smoke run of the command (its pure parts are
tested in test_goodput_slo.py and test_goodput_report.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_cli import run_bench


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_goodput_sweeps_single_and_rapidkv_adaptive_and_matches(tmp_path: Path) -> None:
    """`--quick` on one workload, `single` and `rapidkv-adaptive` only: the
    SLOs come from `single`'s c1, the adaptive router runs with them, every
    rate of both configurations is measured, every output equals the
    reference, and the JSON has the documented keys."""
    out = tmp_path / "goodput.json"
    proc, elapsed = run_bench(
        "goodput",
        "--quick",
        "--workloads",
        "prefill-heavy",
        "--configs",
        "single,rapidkv-adaptive",
        "--json",
        str(out),
        "--plot",
        str(tmp_path / "goodput.png"),
        "--log-dir",
        str(tmp_path / "logs"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["meta"]["cpu"]
    assert report["acceptance"]["hard_mismatches_all_configs"] == 0
    w = report["workloads"]["prefill-heavy"]
    assert w["error"] is None and w["rates"] == [2.0, 8.0]
    slo, c1 = w["slo"], w["single_c1"]
    assert slo["ttft_ms"] == pytest.approx(4 * c1["ttft_ms"]["p50"])
    assert slo["tpot_ms"] == pytest.approx(1.5 * c1["tpot_ms"]["p50"])
    assert c1["requests"] == 8 and c1["errors"] == 0 and c1["hard_mismatches"] == 0
    assert set(w["configs"]) == {"single", "rapidkv-adaptive"}
    for name, c in w["configs"].items():
        assert c["error"] is None and c["errors"] == 0 and c["hard_mismatches"] == 0, name
        assert set(c["attainment"]) == {"2", "8"} and set(c["rates"]) == {"2", "8"}, name
        assert all(0.0 <= a <= 1.0 for a in c["attainment"].values()), name
        assert c["goodput_req_s"] in (0.0, 2.0, 8.0), name
        for s in c["rates"].values():
            assert s["requests"] == 8 and s["errors"] == 0 and s["hard_mismatches"] == 0
            assert s["ttft_ms"]["p50"] > 0 and s["tpot_ms"]["p90"] > 0
            assert s["server_cpu_s"] and s["other_cpu_cores"] is not None
    adaptive = w["configs"]["rapidkv-adaptive"]
    assert adaptive["router_args"] == [
        "--ttft-slo-ms",
        f"{slo['ttft_ms']:.3f}",
        "--tpot-slo-ms",
        f"{slo['tpot_ms']:.3f}",
    ]
    for s in adaptive["rates"].values():  # the router placed every request, for a reason
        assert sum(s["placements"].values()) == 8
        assert sum(s["reasons"].values()) == 8 and "fixed" not in s["reasons"]
        # what it learned (or its priors), per instance; a transfer once it saw one
        assert set(s["learned"]) - {"transfer_ms"} == {"prefill_ms", "step_ms"}
        assert all(len(s["learned"][m]) == 2 for m in ("prefill_ms", "step_ms"))
    assert w["configs"]["single"]["rates"]["2"]["placements"] is None
    # P and the router on core 0, D alone on core 1
    assert adaptive["affinity"] == {"prefill": ["0"], "decode": ["1"], "router-adaptive": ["0"]}
    fronts = sorted(p.name for p in (tmp_path / "logs").rglob("rapidkv.router*.log"))
    assert fronts == ["rapidkv.router-adaptive.prefill-heavy.log"]
    assert (tmp_path / "goodput.png").stat().st_size > 0
    assert "result: OK" in proc.stdout
    print(f"bench goodput smoke: {elapsed:.0f}s")


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_goodput_on_shared_prefixes_serves_from_emptied_caches_with_kv_events(
    tmp_path: Path,
) -> None:
    """`--quick` on `shared-prefix` and `multiturn` (5 requests, i.e. 2
    conversations of 4 turns), `rapidkv-adaptive` only:
    prefix caching on (every cache emptied before every rate), the rapidkv
    pair publishing KV events, a conversation's prompts made by `single`'s
    answers, every request answered as the reference, and the servers'
    prompt tokens and the router's counters in the JSON."""
    out = tmp_path / "goodput.json"
    proc, elapsed = run_bench(
        "goodput",
        "--quick",
        "--workloads",
        "shared-prefix,multiturn",
        "--configs",
        "rapidkv-adaptive",
        "--requests",
        "5",
        "--rates",
        "shared-prefix=2,4",
        "--rates",
        "multiturn=1,2",
        "--json",
        str(out),
        "--plot",
        str(tmp_path / "goodput.png"),
        "--log-dir",
        str(tmp_path / "logs"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["meta"]["prefix_caching"] is True
    assert report["meta"]["kv_events"] is True
    assert report["acceptance"]["hard_mismatches_all_configs"] == 0
    for name, requests in (("shared-prefix", 5), ("multiturn", 8)):  # 2 conversations of 4
        w = report["workloads"][name]
        assert w["error"] is None and w["requests"] == requests, name
        assert w["single_c1"]["requests"] == requests and w["single_c1"]["errors"] == 0
        c = w["configs"]["rapidkv-adaptive"]
        assert c["error"] is None and c["errors"] == 0 and len(c["rates"]) == 2, name
        for s in c["rates"].values():
            assert s["requests"] == requests and s["hard_mismatches"] == 0, name
            assert s["reset_errors"] == [] and sum(s["placements"].values()) == requests
            assert set(s["router_prefix_tokens"]) == {"hit", "fetched", "computed"}
            assert set(s["prompt_tokens"]) == {"prefill", "decode"}
            # every prompt token was computed, received or found in a cache somewhere
            counted = sum(s["prompt_tokens_by_source"].values())
            assert counted >= s["prompt_tokens_sent"] > 0
            assert 0.0 <= s["prefix_cache_hit_fraction"] <= 1.0
    assert report["workloads"]["multiturn"]["prompt_len_sent"]["max"] <= 1024 + 64
    logs = {p.name: p.read_text() for p in (tmp_path / "logs").rglob("rapidkv-*.log")}
    assert sorted(logs) == ["rapidkv-decode.log", "rapidkv-prefill.log"]
    assert all("--kv-events-config" in text for text in logs.values())
    assert "--no-enable-prefix-caching" not in logs["rapidkv-prefill.log"]
    assert (tmp_path / "goodput.png").stat().st_size > 0
    print(f"bench goodput prefix smoke: {elapsed:.0f}s")
