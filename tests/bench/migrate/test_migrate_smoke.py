"""`rapidkv bench migrate`: a smoke run of the command (its pure parts are
tested in test_migrate_report.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_cli import run_bench


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_migrate_quick_moves_requests_there_and_back_in_both_modes_and_matches(
    tmp_path: Path,
) -> None:
    """`--quick`: one length (128), one round after one warm-up round: every
    migration succeeds in both modes, every output equals its unmigrated
    reference, the KV loaded is what the destinations' vLLM counted, and the
    JSON has the documented keys."""
    out = tmp_path / "migrate.json"
    proc, elapsed = run_bench(
        "migrate",
        "--quick",
        "--json",
        str(out),
        "--plot",
        str(tmp_path / "migrate.png"),
        "--log-dir",
        str(tmp_path / "logs"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["errors"] == []
    assert report["meta"]["cpu"] and report["meta"]["cores"] and report["meta"]["git"]
    assert report["hard_mismatches"] == 0 and report["incomplete_runs"] == 0
    assert report["migrations"] == {"ok": 4, "failed": 0, "warmup_ok": 4, "warmup_failed": 0}
    assert [r["outcome"] for r in report["runs"] if not r["warmup"]].count("match") == 2
    e = report["lengths"]["128"]
    for key in ("downtime_ms", "stop_and_copy_downtime_ms", "router_downtime_ms"):
        assert e[key]["n"] == 2 and e[key]["p50"] > 0 and e[key]["p99"] >= e[key]["p50"], key
    assert 0 < e["bytes_at_cutover"] < e["stop_and_copy_bytes_at_cutover"]
    assert e["bytes_before_cutover"] > 0
    assert report["decode_step_ms"]["p50"] > 0
    assert report["kv_check"] == {"checked": 8, "mismatches": 0}
    assert set(report["acceptance"]) >= {"per_length", "flat", "beats_stop_and_copy", "met"}
    # each migration's delta transfer came from the destination's connector timeline
    assert all(s["delta_transfer_ms"] is not None for s in report["samples"])
    assert (tmp_path / "migrate.png").stat().st_size > 0
    assert "result: OK" in proc.stdout
    print(f"bench migrate smoke: {elapsed:.0f}s")
