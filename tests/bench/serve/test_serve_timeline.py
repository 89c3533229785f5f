"""The TTFT breakdown of `rapidkv bench serve --trace` rows."""

from __future__ import annotations

import pytest

from rapidkv.bench.serve.timeline import stages, summarize, table


def row(config: str = "rapidkv", **extra) -> dict:
    base = {
        "config": config,
        "load": "c1",
        "error": None,
        "token_ms": [40.0, 45.0],
        "prefill_ms": {"admitted": 3.0, "last_chunk_end": 30.0},
        "decode_ms": {"d_admitted": 4.0, "d_kv_received": 33.0},
    }
    base.update(extra)
    return base


def test_stages_follow_the_request_to_its_first_token() -> None:
    s = stages(row())
    assert s == {
        "ttft": 40.0,
        "to_p": 3.0,
        "p_prefill": 27.0,
        "handoff": 3.0,
        "d_first": 7.0,
        "to_d": 4.0,
    }
    assert s["to_p"] + s["p_prefill"] + s["handoff"] + s["d_first"] == s["ttft"]


def test_a_single_instance_row_has_only_its_ttft() -> None:
    assert stages(row("single", prefill_ms=None, decode_ms=None)) == {"ttft": 40.0}


def test_summary_takes_medians_and_skips_failed_requests() -> None:
    rows = [
        row(token_ms=[30.0]),
        row(token_ms=[40.0]),
        row(token_ms=[90.0]),
        row(error="timeout", token_ms=[1000.0]),
    ]
    summary = summarize(rows)["rapidkv/c1"]
    assert summary["n"] == 3 and summary["ttft"] == pytest.approx(40.0)
    assert "rapidkv/c1" in table(summarize(rows))


def test_single_blocks_paired_with_a_configuration_are_kept_apart() -> None:
    rows = [
        row("single", prefill_ms=None, decode_ms=None),
        row(
            "single", prefill_ms=None, decode_ms=None, token_ms=[60.0, 65.0], paired_with="rapidkv"
        ),
    ]
    s = summarize(rows)
    assert s["single/c1"] == {"n": 1.0, "ttft": 40.0}
    assert s["single~rapidkv/c1"] == {"n": 1.0, "ttft": 60.0}
