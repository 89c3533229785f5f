"""`bench/common/stats.py`: percentiles, summaries, a request's timing, a
load's summary and the paired ratio's interval."""

from __future__ import annotations

import math

import pytest

from rapidkv.bench.common.reference import Reference
from rapidkv.bench.common.stats import RequestResult, load_summary, percentile, summarize

REF = Reference(token_ids=(5, 6, 7, 8), margins=(2.0, 0.03, 0.5, math.nan))


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
