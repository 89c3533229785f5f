"""`rapidkv bench migrate`: its pure parts: what a migration loads, the rows
built from the client's token times and the router's answers, the report's
keys and acceptance, the options (the command itself:
test_migrate_smoke.py)."""

from __future__ import annotations

import argparse
import io

import pytest

from rapidkv.bench.migrate.report import (
    acceptance,
    build_report,
    expected_loads,
    migration_rows,
    print_report,
    summarize,
    wire_blocks,
)
from rapidkv.bench.migrate.run import Options

BLOCK = 128


@pytest.mark.unit
def test_a_precopy_loads_all_but_its_last_token_and_the_cutover_what_its_full_blocks_miss() -> None:
    # prompt 128, ordered at 16 tokens (pre-copy of 144), cut over at 18
    assert expected_loads(128, 18, 144, BLOCK) == (143, 145 - 128)
    assert wire_blocks(128, 18, 144, BLOCK) == (2, 1)
    # stop-and-copy: everything at the cut-over
    assert expected_loads(128, 18, None, BLOCK) == (0, 145)
    assert wire_blocks(128, 18, None, BLOCK) == (0, 2)
    # long: 1920 + 20, cut over at 25: the cut-over loads a block and the delta
    before, at = expected_loads(1920, 25, 1940, BLOCK)
    assert before == 1939 and at == 1944 - 15 * BLOCK
    assert wire_blocks(1920, 25, 1940, BLOCK) == (16, 16 - 15)


def _times(n: int, cut: dict[int, float], step: float = 0.010) -> list[float]:
    """n token arrivals every `step` s, the gap before token i stretched to cut[i]."""
    out, t = [], 100.0
    for i in range(n):
        t += cut.get(i, step)
        out.append(t)
    return out


def _order(k: int, src: int, dest: int, at: int, t: float, g: int, pre: int | None) -> dict:
    # the relay numbers its attempts from 1: the k-th order's ids end -m<k+1>
    answer = {
        "cutover_xfer_id": f"x-m{k + 1}c",
        "tokens_at_cutover": g,
        "precopy": pre is not None,
        "downtime_ms": 28.0,
        "cutover_ms": 25.0,
        "total_ms": 60.0,
        **(
            {"precopy_xfer_id": f"x-m{k + 1}p", "precopy_tokens": pre, "precopy_ms": 30.0}
            if pre is not None
            else {}
        ),
    }
    return {
        "k": k,
        "from": "AB"[src],
        "to": "AB"[dest],
        "dest": dest,
        "ordered_at": at,
        "t_order": t,
        "status": 200,
        "answer": answer,
        "error": None,
        "reset_ms": None if k == 0 else 1.5,
    }


@pytest.mark.unit
def test_rows_take_the_downtime_and_decode_steps_from_the_clients_token_times() -> None:
    times = _times(128, {20: 0.030, 70: 0.040})  # cut-overs before tokens 20 and 70
    orders = [
        _order(0, 0, 1, 16, times[15] + 0.001, 20, 144),
        _order(1, 1, 0, 52, times[51] + 0.001, 70, 180),
    ]
    t_last = times[19]
    timelines = {
        "x-m1c": {
            "d_admitted": t_last + 0.005,
            "d_transfer_kv_sent": t_last + 0.006,
            "d_kv_received": t_last + 0.010,
            "transfer_kv": t_last + 0.007,
            "bypass_sent": t_last + 0.0075,
        },
        "x-m1p": {"d_transfer_kv_sent": 1.0, "d_kv_received": 1.002},
    }
    loaded = [(179 + (198 - 1 - 128)), (143 + (148 - 1 - 128))]  # A was the second's dest
    rows = migration_rows(
        times,
        orders,
        prompt_len=128,
        block=BLOCK,
        bytes_per_token=4096,
        loaded_by_instance=loaded,
        timelines=timelines,
        gap_tokens=32,
    )
    first, second = rows
    assert first["ok"] and second["ok"]
    assert first["client_downtime_ms"] == pytest.approx(30.0)
    assert second["client_downtime_ms"] == pytest.approx(40.0)
    # the destination's gaps: tokens 22..51 (up to the next order), then 72..101
    assert len(first["dest_gaps_ms"]) == 52 - 22 and first["dest_step_ms"] == pytest.approx(10.0)
    assert len(second["dest_gaps_ms"]) == 102 - 72
    assert first["source_gaps_ms"] == pytest.approx([10.0] * 3)  # tokens 17..19
    assert first["bytes_before_cutover"] == 143 * 4096
    assert first["bytes_at_cutover"] == (148 - 1 - 128) * 4096
    assert first["kv_check"] is True and second["kv_check"] is True
    b = first["breakdown_ms"]
    assert b["until_admitted_ms"] == pytest.approx(5.0)
    assert b["transfer_ms"] == pytest.approx(4.0) == first["delta_transfer_ms"]
    assert sum(b.values()) == pytest.approx(first["client_downtime_ms"])
    assert first["precopy_transfer_ms"] == pytest.approx(2.0)
    d = first["transfer_detail_ms"]
    assert d["to_source_ms"] == pytest.approx(1.0) and d["source_to_send_ms"] == pytest.approx(0.5)
    assert sum(d.values()) == pytest.approx(b["transfer_ms"])
    assert second["breakdown_ms"]["transfer_ms"] is None  # no timeline: not made up


@pytest.mark.unit
def test_a_refused_migration_is_a_failed_row_and_stop_and_copy_has_no_precopy() -> None:
    times = _times(64, {20: 0.05})
    refused = dict(_order(1, 1, 0, 52, 0.0, 0, None), status=409, answer=None, error="HTTP 409")
    rows = migration_rows(
        times,
        [_order(0, 0, 1, 16, times[15], 20, None), refused],
        prompt_len=128,
        block=BLOCK,
        bytes_per_token=4096,
        loaded_by_instance=[0, 999],
        timelines={},
        gap_tokens=32,
    )
    sac, failed = rows
    assert sac["ok"] and sac["tokens_before_cutover"] == 0 and sac["source_gaps_ms"] == []
    assert sac["bytes_at_cutover"] == (148 - 1) * 4096 and sac["kv_check"] is False
    assert not failed["ok"] and failed["error"] == "HTTP 409"


def _length(down: float, step: float, delta: float, sac: float | None) -> dict:
    def s(v: float | None) -> dict:
        return summarize([] if v is None else [v])

    return {
        "downtime_ms": s(down),
        "decode_step_ms": s(step),
        "delta_transfer_ms": s(delta),
        "stop_and_copy_downtime_ms": s(sac),
    }


@pytest.mark.unit
def test_acceptance_bounds_flatness_and_the_stop_and_copy_comparison() -> None:
    met = acceptance({"128": _length(20, 6, 3, 22), "1920": _length(25, 7, 4, 40)})
    assert met["per_length"]["128"]["bound_ms"] == pytest.approx(21.0)
    assert met["within_decode_steps"] is True
    assert met["flat"]["ratio"] == pytest.approx(1.25) and met["flat"]["met"] is True
    assert met["beats_stop_and_copy"]["met"] is True and met["met"] is True
    grew = acceptance({"128": _length(20, 6, 3, 22), "1920": _length(31, 9, 4, 40)})
    assert grew["within_decode_steps"] is True and grew["flat"]["met"] is False
    assert grew["met"] is False
    one = acceptance({"128": _length(20, 6, 3, None)})
    assert one["flat"]["met"] is None and one["beats_stop_and_copy"]["met"] is None
    assert one["met"] is None


def _result() -> dict:
    times = _times(128, {20: 0.030, 70: 0.040})
    rows, runs = [], []
    for mode, pre in (("precopy", (144, 180)), ("stop_and_copy", (None, None))):
        orders = [
            _order(0, 0, 1, 16, times[15], 20, pre[0]),
            _order(1, 1, 0, 52, times[51], 70, pre[1]),
        ]
        for row in migration_rows(
            times,
            orders,
            prompt_len=128,
            block=BLOCK,
            bytes_per_token=4096,
            loaded_by_instance=[0, 0],
            timelines={},
            gap_tokens=32,
        ):
            rows.append(dict(row, length=128, round=0, mode=mode, xfer_id="x"))
        runs.append({"length": 128, "round": 0, "warmup": False, "mode": mode, "outcome": "match"})
    runs.append(
        {"length": 128, "round": 0, "warmup": False, "mode": "reference", "outcome": "reference"}
        | {"gaps_ms": [10.0] * 100}
    )
    return {
        "runs": runs,
        "rows": rows,
        "warmup": [],
        "bytes_sent": {"A": 1.0},
        "bytes_per_token": 4096,
        "block": BLOCK,
    }


@pytest.mark.unit
def test_the_report_has_the_documented_keys_and_prints_its_table_and_acceptance() -> None:
    meta = {
        "cpu": "x",
        "cores": 2,
        "git": "g",
        "rounds": 1,
        "max_tokens": 128,
        "kv_bytes_per_token": 4096,
        "lengths_requested": {"128": 128, "2048": 1920},
        "max_model_len": 2048,
    }
    report = build_report(_result(), meta)
    e = report["lengths"]["128"]
    assert e["downtime_ms"]["p50"] == pytest.approx(35.0)  # the two migrations' 30 and 40
    assert e["downtime_ms"]["p99"] > 0 and e["stop_and_copy_downtime_ms"]["p50"] > 0
    assert e["bytes_at_cutover"] > 0 and e["stop_and_copy_bytes_at_cutover"] > e["bytes_at_cutover"]
    assert e["unmigrated_decode_step_ms"]["p50"] == pytest.approx(10.0)
    assert report["decode_step_ms"]["p50"] == pytest.approx(10.0)
    assert report["migrations"] == {"ok": 4, "failed": 0, "warmup_ok": 0, "warmup_failed": 0}
    assert report["ok"] is True and report["hard_mismatches"] == 0
    out = io.StringIO()
    print_report(report, out)
    text = out.getvalue()
    assert "2048 -> 1920" in text and "| 128 | precopy |" in text and "result: OK" in text


def _args(**kw: object) -> argparse.Namespace:
    base = dict(
        lengths=None,
        modes="precopy,stop-and-copy",
        rounds=None,
        warmup_rounds=1,
        max_tokens=128,
        migrate_after=16,
        gap_tokens=32,
        seed=0,
        timeout=120.0,
        dtype="float32",
        server_args="",
        quick=False,
    )
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.unit
def test_options_cut_a_length_to_the_longest_that_fits_and_refuse_what_cannot_run() -> None:
    opts = Options.from_args(_args(), max_model_len=2048)
    assert opts.lengths == (128, 512, 1920) and opts.requested[2048] == 1920
    assert opts.modes == ("precopy", "stop_and_copy") and opts.rounds == 12
    quick = Options.from_args(_args(quick=True), max_model_len=2048)
    assert quick.lengths == (128,) and quick.rounds == 1
    for bad in (
        _args(modes="live"),
        _args(lengths="1"),
        _args(max_tokens=64),  # no room for two migrations and their gaps
        _args(rounds=0),
        _args(netns_link="fast"),  # not a tc rate
    ):
        with pytest.raises(ValueError):
            Options.from_args(bad, max_model_len=2048)
    assert opts.netns_link is None
    assert Options.from_args(_args(netns_link="1gbit"), 2048).netns_link == "1gbit"


@pytest.mark.unit
def test_the_paired_ratio_takes_rounds_as_blocks_and_needs_both_modes_in_one() -> None:
    from rapidkv.bench.migrate.report import paired_downtime_ratio

    def row(r: int, mode: str, ms: float) -> dict:
        return {"round": r, "mode": mode, "client_downtime_ms": ms}

    rows = [row(r, "precopy", 10.0 + r) for r in range(4)] + [
        row(r, "stop_and_copy", 20.0 + 2 * r) for r in range(4)
    ]
    out = paired_downtime_ratio([*rows, row(9, "precopy", 99.0)])  # round 9: no pair
    assert out["rounds"] == 4
    assert out["ratio"] == pytest.approx(11.5 / 23.0)
    lo, hi = out["ci95"]
    assert 0.4 < lo <= out["ratio"] <= hi < 0.6
    assert paired_downtime_ratio(rows[:4]) == {"ratio": None, "ci95": None, "rounds": 0}
