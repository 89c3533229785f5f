"""`rapidkv bench goodput`: a smoke run of the command (its pure parts are
tested in test_goodput_slo.py and test_goodput_report.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from bench_cli import run_bench

from rapidkv.harness.server import EXECUTOR_ENV


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_bench_goodput_sweeps_every_workload_and_matches(tmp_path: Path) -> None:
    """One `--quick` run, `single` and `rapidkv-adaptive`, on a length workload
    and on both of shared prefixes (5 requests; multiturn: 2 conversations of
    4 turns, at two rates), so that the servers start once:

    - the SLOs come from `single`'s c1, the adaptive router runs with them,
      every rate of both configurations is measured, every output equals the
      reference, and the JSON has the documented keys;
    - prefix caching is on (every cache emptied before every rate), the rapidkv
      pair publishes KV events, a conversation's prompts are made by
      `single`'s answers, and the servers' prompt tokens and the router's
      counters are in the JSON."""
    out = tmp_path / "goodput.json"
    proc, elapsed = run_bench(
        "goodput",
        "--quick",
        "--workloads",
        "prefill-heavy,shared-prefix,multiturn",
        "--configs",
        "single,rapidkv-adaptive",
        "--requests",
        "5",
        # one rate each but multiturn's: a sweep of several is multiturn's
        "--rates",
        "prefill-heavy=4",
        "--rates",
        "shared-prefix=4",
        "--rates",
        "multiturn=2,4",
        "--json",
        str(out),
        "--plot",
        str(tmp_path / "goodput.png"),
        "--log-dir",
        str(tmp_path / "logs"),
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["meta"]["cpu"]
    assert report["meta"]["vllm_executor"] == os.environ[EXECUTOR_ENV]  # tests/conftest.py's
    assert report["meta"]["prefix_caching"] is True and report["meta"]["kv_events"] is True
    assert report["acceptance"]["hard_mismatches_all_configs"] == 0
    rates = {"prefill-heavy": ("4",), "shared-prefix": ("4",), "multiturn": ("2", "4")}
    for name, requests in (("prefill-heavy", 5), ("shared-prefix", 5), ("multiturn", 8)):
        w = report["workloads"][name]
        assert w["error"] is None and w["requests"] == requests, name
        assert w["rates"] == [float(r) for r in rates[name]], name
        slo, c1 = w["slo"], w["single_c1"]
        assert slo["ttft_ms"] == pytest.approx(4 * c1["ttft_ms"]["p50"])
        assert slo["tpot_ms"] == pytest.approx(1.5 * c1["tpot_ms"]["p50"])
        assert c1["requests"] == requests and c1["errors"] == 0 and c1["hard_mismatches"] == 0
        assert set(w["configs"]) == {"single", "rapidkv-adaptive"}, name
        for config, c in w["configs"].items():
            assert c["error"] is None and c["errors"] == 0 and c["hard_mismatches"] == 0, config
            assert set(c["attainment"]) == set(rates[name]) == set(c["rates"]), config
            assert all(0.0 <= a <= 1.0 for a in c["attainment"].values()), config
            assert c["goodput_req_s"] in (0.0, *map(float, rates[name])), config
            for s in c["rates"].values():
                assert s["requests"] == requests and s["errors"] == 0, config
                assert s["hard_mismatches"] == 0 and s["reset_errors"] == [], config
                assert s["ttft_ms"]["p50"] > 0 and s["tpot_ms"]["p90"] > 0
                assert s["server_cpu_s"] and s["other_cpu_cores"] is not None
                # every prompt token was computed, received or found in a cache somewhere
                counted = sum(s["prompt_tokens_by_source"].values())
                assert counted >= s["prompt_tokens_sent"] > 0
                assert 0.0 <= s["prefix_cache_hit_fraction"] <= 1.0
        adaptive = w["configs"]["rapidkv-adaptive"]
        assert adaptive["router_args"] == [
            "--ttft-slo-ms",
            f"{slo['ttft_ms']:.3f}",
            "--tpot-slo-ms",
            f"{slo['tpot_ms']:.3f}",
        ]
        for s in adaptive["rates"].values():  # the router placed every request, for a reason
            assert sum(s["placements"].values()) == requests
            assert sum(s["reasons"].values()) == requests and "fixed" not in s["reasons"]
            assert set(s["router_prefix_tokens"]) == {"hit", "fetched", "computed"}
            assert set(s["prompt_tokens"]) == {"prefill", "decode"}
            # what it learned (or its priors), per instance; a transfer once it saw one
            assert set(s["learned"]) - {"transfer_ms"} == {"prefill_ms", "step_ms"}
            assert all(len(s["learned"][m]) == 2 for m in ("prefill_ms", "step_ms"))
        assert w["configs"]["single"]["rates"][rates[name][-1]]["placements"] is None
        # P and the router on core 0, D alone on core 1
        assert adaptive["affinity"] == {
            "prefill": ["0"],
            "decode": ["1"],
            "router-adaptive": ["0"],
        }
    assert report["workloads"]["multiturn"]["prompt_len_sent"]["max"] <= 1024 + 64
    fronts = sorted(p.name for p in (tmp_path / "logs").rglob("rapidkv.router*.log"))
    assert fronts == [f"rapidkv.router-adaptive.{w}.log" for w in sorted(rates)]
    logs = {p.name: p.read_text() for p in (tmp_path / "logs").rglob("rapidkv-*.log")}
    assert sorted(logs) == ["rapidkv-decode.log", "rapidkv-prefill.log"]
    assert all("--kv-events-config" in text for text in logs.values())
    assert "--no-enable-prefix-caching" not in logs["rapidkv-prefill.log"]
    assert (tmp_path / "goodput.png").stat().st_size > 0
    assert "result: OK" in proc.stdout
    print(f"bench goodput smoke: {elapsed:.0f}s")
