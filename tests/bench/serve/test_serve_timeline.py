"""The TTFT breakdown of `rapidkv bench serve --trace` rows."""

from __future__ import annotations

import pytest

from rapidkv.bench.serve.timeline import (
    STEP_COLUMNS,
    STEP_FIELDS,
    stages,
    step_breakdown,
    summarize,
    table,
)


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


def steps_row(role: str, steps: list[dict]) -> dict:
    return {
        "kind": "steps",
        "config": "rapidkv",
        "load": "c1",
        "role": role,
        "fields": list(STEP_FIELDS),
        "steps": [[step[f] for f in STEP_FIELDS] for step in steps],
    }


def step(begin: float, ms: float, tokens: int, requests: int, **worker: float) -> dict:
    return {
        "step_id": 1,
        "begin": begin,
        "end": begin + ms / 1000,
        "scheduled_tokens": tokens,
        "requests": requests,
        "forward": worker.get("forward", 0.0),
        "layer_wait": worker.get("layer_wait", 0.0),
        "hooks": worker.get("hooks", 0.0),
    }


def test_engine_steps_split_into_decode_and_prompt_with_their_parts() -> None:
    decode = [
        step(1.0, 40.0, 1, 1, forward=0.030, hooks=0.002),
        step(2.0, 50.0, 2, 2, forward=0.040, hooks=0.004),
        step(3.0, 45.0, 1, 1, forward=0.035, hooks=0.003),
    ]
    prompt = [step(4.0, 300.0, 257, 2, forward=0.280, layer_wait=0.1, hooks=0.005)]
    empty = [step(5.0, 1.0, 0, 0)]
    rows = [
        row(token_ms=[40.0, 90.0, 140.0]),  # gaps 50, 50
        row(token_ms=[40.0, 100.0]),  # gap 60
        row(error="timeout", token_ms=[0.0, 1000.0]),  # not counted
        steps_row("decode", decode + prompt + empty),
    ]
    out = step_breakdown(rows)
    assert set(out) == {"rapidkv/c1/decode/decode", "rapidkv/c1/decode/prompt"}
    d = out["rapidkv/c1/decode/decode"]
    assert d["n"] == 3 and d["wall"] == pytest.approx(45.0)
    assert d["forward"] == pytest.approx(35.0) and d["hooks"] == pytest.approx(3.0)
    assert d["rest"] == pytest.approx(7.0) and d["wait"] == 0.0
    assert d["itl"] == pytest.approx(50.0)  # the client's gaps, beside the steps'
    p = out["rapidkv/c1/decode/prompt"]
    assert p["n"] == 1 and p["tokens"] == 257 and p["wait"] == pytest.approx(100.0)
    assert "itl" not in p
    assert "rapidkv/c1/decode/decode" in table(out, STEP_COLUMNS)
