"""`rapidkv bench serve`: whole streams and the engines' own TTFT in a load's
summary (`stats`): the gaps between tokens, vLLM's TTFT histogram read from
`/metrics` before and after a load, its counts over the load, merged over
servers and rounds, and percentiles estimated from its buckets."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rapidkv.bench.common.stats import (
    TTFT_METRIC,
    Histogram,
    RequestResult,
    engine_ttft_summary,
    histogram,
    histogram_delta,
    histogram_percentile,
    load_summary,
    merge_histograms,
)

pytestmark = pytest.mark.unit

BOUNDS = ("0.01", "0.05", "0.1", "0.5", "1.0", "+Inf")


def exposition(counts: list[int], total: float, engine: str = "0") -> str:
    """vLLM's `/metrics` text for the TTFT histogram: cumulative `counts` per bound."""
    labels = f'engine="{engine}",model_name="tiny"'
    lines = [
        f"# HELP {TTFT_METRIC} Histogram of time to first token in seconds.",
        f"# TYPE {TTFT_METRIC} histogram",
    ]
    for le, c in zip(BOUNDS, counts, strict=True):
        lines.append(f'{TTFT_METRIC}_bucket{{{labels},le="{le}"}} {float(c)}')
    lines.append(f"{TTFT_METRIC}_count{{{labels}}} {float(counts[-1])}")
    lines.append(f"{TTFT_METRIC}_sum{{{labels}}} {total}")
    lines.append("# TYPE vllm:num_requests_running gauge")
    lines.append(f"vllm:num_requests_running{{{labels}}} 0.0")
    return "\n".join(lines) + "\n"


def scraped(text: str) -> dict:
    """What `harness.get_metrics` makes of a `/metrics` answer."""
    return {
        (sample.name, frozenset(sample.labels.items())): float(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def hist(*counts: float) -> Histogram:
    """A histogram over BOUNDS with these cumulative counts."""
    bounds = [float(b) for b in BOUNDS]
    return Histogram(tuple(zip(bounds, map(float, counts), strict=True)), float(counts[-1]))


def test_the_histogram_is_read_from_metrics_summed_over_engines() -> None:
    h = histogram(scraped(exposition([1, 3, 4, 4, 5, 5], 0.9)), TTFT_METRIC)
    assert h.buckets == ((0.01, 1.0), (0.05, 3.0), (0.1, 4.0), (0.5, 4.0), (1.0, 5.0),
                         (math.inf, 5.0))  # fmt: skip
    assert (h.count, h.total) == (5.0, 0.9)
    two = scraped(exposition([1, 3, 4, 4, 5, 5], 0.9) + exposition([0, 1, 1, 2, 2, 2], 0.3, "1"))
    both = histogram(two, TTFT_METRIC)
    assert both.buckets[1] == (0.05, 4.0) and both.count == 7.0
    assert both.total == pytest.approx(1.2)
    assert histogram(scraped(exposition([0] * 6, 0.0)), "vllm:other").buckets == ()
    assert histogram(two, TTFT_METRIC).as_json() == {
        "0.01": 1.0, "0.05": 4.0, "0.1": 5.0, "0.5": 6.0, "1": 7.0, "+Inf": 7.0
    }  # fmt: skip


def test_a_load_counts_what_the_histogram_gained_over_it() -> None:
    before, after = hist(1, 3, 4, 4, 5, 5), hist(1, 5, 9, 10, 11, 12)
    d = histogram_delta(before, after)
    assert [c for _, c in d.buckets] == [0.0, 2.0, 5.0, 6.0, 6.0, 7.0] and d.count == 7.0
    restarted = hist(0, 1, 1, 1, 1, 1)  # the server came back: its counts start afresh
    assert histogram_delta(before, restarted) == restarted
    assert histogram_delta(Histogram(), after) == after  # nothing before: all of it


def test_servers_and_rounds_merge_bucket_by_bucket() -> None:
    m = merge_histograms([hist(0, 2, 5, 6, 6, 7), hist(1, 1, 1, 3, 3, 3)])
    assert [c for _, c in m.buckets] == [1.0, 3.0, 6.0, 9.0, 9.0, 10.0] and m.count == 10.0
    coarse = Histogram(((0.1, 2.0), (math.inf, 4.0)), 4.0)  # bounds another set lacks
    m = merge_histograms([hist(0, 2, 5, 6, 6, 7), coarse])
    assert dict(m.buckets)[0.05] == 2.0 and dict(m.buckets)[0.1] == 7.0
    assert dict(m.buckets)[math.inf] == 11.0
    assert merge_histograms([]).buckets == ()


def test_percentiles_interpolate_inside_the_bucket_like_prometheus() -> None:
    h = hist(0, 2, 6, 8, 10, 10)  # 10 observations
    # p50: rank 5, in (0.05, 0.1] holding ranks 3..6: 0.05 + 0.05 * (5 - 2) / 4
    assert histogram_percentile(h, 50) == pytest.approx(0.0875)
    # p90: rank 9, in (0.5, 1.0] holding 9..10: halfway
    assert histogram_percentile(h, 90) == pytest.approx(0.75)
    assert histogram_percentile(h, 100) == pytest.approx(1.0)
    # the first bucket starts at 0
    assert histogram_percentile(hist(4, 4, 4, 4, 4, 4), 50) == pytest.approx(0.005)
    # a rank in the +Inf bucket: the highest finite bound
    assert histogram_percentile(hist(0, 0, 0, 0, 1, 10), 90) == 1.0
    assert histogram_percentile(hist(0, 0, 5, 5, 5, 5), 0) == 0.05  # the smallest bucket used
    assert math.isnan(histogram_percentile(hist(0, 0, 0, 0, 0, 0), 90))
    assert math.isnan(histogram_percentile(Histogram(), 90))


def test_the_clients_ttft_is_held_against_the_engines() -> None:
    engines = {"prefill": hist(0, 2, 6, 8, 10, 10), "decode": hist(0, 0, 0, 10, 10, 10)}
    s = engine_ttft_summary(400.0, engines)
    # merged: cumulative 0, 2, 6, 18, 20, 20; p90 rank 18 -> the 0.5 s bound
    assert s["engine_ttft_ms_p90"] == pytest.approx(500.0)
    assert s["engine_ttft_ms_p90_by_server"]["prefill"] == pytest.approx(750.0)
    assert s["engine_ttft_ms_p90_by_server"]["decode"] == pytest.approx(460.0)
    assert s["engine_ttft_requests"] == 20.0
    assert s["engine_ttft_buckets"]["decode"]["0.5"] == 10.0
    assert s["client_ttft_over_engine_p90"] == pytest.approx(0.8)
    assert s["client_ttft_within_engine_bound"] is True
    assert engine_ttft_summary(800.0, engines)["client_ttft_within_engine_bound"] is True
    late = engine_ttft_summary(800.1, engines)  # 1.5 x 500 + 50 = 800
    assert late["client_ttft_within_engine_bound"] is False
    assert late["client_ttft_over_engine_p90"] == pytest.approx(1.6002)
    unknown = engine_ttft_summary(400.0, {})
    assert math.isnan(unknown["engine_ttft_ms_p90"]) and unknown["engine_ttft_requests"] == 0
    assert unknown["client_ttft_within_engine_bound"] is None
    assert math.isnan(unknown["client_ttft_over_engine_p90"])


def test_a_load_summary_covers_whole_streams_and_the_engines_ttft() -> None:
    results = [
        RequestResult(0, (1, 2, 3, 4), (100.0, 105.0, 1405.0, 1405.2), 1406.0, 0.0),
        RequestResult(1, (1, 2, 3), (200.0, 200.0, 500.0), 501.0, 0.0),  # two in one chunk
        RequestResult(2, (1,), (50.0,), 51.0, 0.0),  # one token: no gap
        RequestResult(3, (), (), math.nan, 0.0, error="boom"),  # not counted
    ]
    s = load_summary(results, None, 2.0, {}, {"single": hist(0, 0, 1, 3, 3, 3)})
    assert s["itl_max_ms"] == pytest.approx(1300.0)
    assert s["gaps_over_250ms"] == 2  # 1300 and 300
    assert s["lumped_share"] == pytest.approx(2 / 5)  # 0.2 and 0 of 5 gaps
    assert s["ttft_ms"]["p90"] == pytest.approx(180.0)
    # rank 2.7 in (0.1, 0.5], which holds ranks 2 and 3: 0.1 + 0.4 * 1.7 / 2
    assert s["engine_ttft_ms_p90"] == pytest.approx(440.0)
    assert s["client_ttft_over_engine_p90"] == pytest.approx(180 / 440)
    assert s["client_ttft_within_engine_bound"] is True
    bare = load_summary(results[2:3], None, 1.0, {})
    assert math.isnan(bare["itl_max_ms"]) and math.isnan(bare["lumped_share"])
    assert bare["gaps_over_250ms"] == 0 and bare["client_ttft_within_engine_bound"] is None
