"""`rapidkv bench chaos`: a short run of the command (P and D each killed and
restarted, injected transfer failures); its pure parts are tested in
test_chaos_workload.py, test_chaos_driver.py and test_chaos_report.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_cli import run_bench

from rapidkv.harness import VLLMServer


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_chaos_survives_restarts_aborts_and_injected_failures(
    tmp_path: Path, single_server: VLLMServer
) -> None:
    """40 requests at concurrency 4 with client aborts, 30 % of the transfers
    failed on purpose, P and then D killed and restarted: nothing hangs, leaks,
    mismatches or fails unclearly, both recoveries are measured, and the
    injected failures were recomputed by D. The references are the session's
    single instance's (`--reference-url`: the run starts none). (Which
    transfers fail is a hash of their random ids: of the ~28 a run settles on
    P, none failing has a chance of 0.7^28, 5e-5; at a fifth it would be
    0.8^28, 0.2 %.)"""
    out = tmp_path / "chaos.json"
    proc, elapsed = run_bench(
        "chaos",
        "--requests",
        "40",
        "--concurrency",
        "4",
        "--fail-rate",
        "0.3",
        "--reference-url",
        single_server.base_url,
        "--json",
        str(out),
        "--log-dir",
        str(tmp_path / "logs"),
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["ok"] is True and r["problems"] == []
    assert (r["hung"], r["mismatches"], r["failed_unclear"]) == (0, 0, 0)
    assert r["leaked_blocks"] == {"prefill": 0, "decode": 0}
    assert r["requests"] == 40 and r["completed"] > 0
    assert r["completed"] + r["aborted"] + r["failed_clear"] == 40
    assert set(r["recovery_s"]) == {"prefill", "decode"}
    assert all(s is not None and s > 0 for s in r["recovery_s"].values())
    p, d = r["counters"]["prefill"], r["counters"]["decode"]
    assert p["processes"] == d["processes"] == 2
    injected = p.get("debug_injected_failures", 0)  # a counter appears once incremented
    assert injected > 0 and p["transfers_failed"] >= injected, (p, proc.stdout[-3000:])
    assert r["recompute_fallbacks"] > 0
    assert r["cpu"] and "result: OK" in proc.stdout
    assert f"reference: {single_server.base_url}" in proc.stderr
    print(f"bench chaos smoke: {elapsed:.0f}s")
