"""Summaries of measured samples: percentiles, paired intervals, histograms,
one load's summary.

Pure functions, no I/O: they turn what one load produced (per-request token
ids and arrival times, and the engines' TTFT histograms read before and after
it) into the numbers the benchmarks report; each output's verdict against its
reference is `reference.classify`'s.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rapidkv.bench.common.reference import NEAR_TIE_MARGIN, Reference, classify

SLOW_TTFT_MS = 1000.0
"""A request whose first token took longer than this is counted (`ttft_over_1s`):
a stall of the whole pipeline shows there even when the p50 hides it."""

SLOW_GAP_MS = 1000.0
"""The largest inter-token gap a stall-free stream has (`itl_max_ms`, a target)."""
LONG_GAP_MS = 250.0
"""Inter-token gaps longer than this are counted (`gaps_over_250ms`): decode steps
take a few ms here, so a gap this long is a stream held up somewhere."""
LUMP_GAP_MS = 1.0
"""Inter-token gaps shorter than this are tokens that arrived in a lump
(`lumped_share`): held back, then relayed together."""

TTFT_METRIC = "vllm:time_to_first_token_seconds"
"""vLLM's histogram of each engine's own time to first token (arrival at the
instance -> first token out), in seconds."""
ENGINE_TTFT_FACTOR = 1.5
ENGINE_TTFT_SLACK_MS = 50.0
"""The client's TTFT p90 is within the engines' when <= FACTOR x theirs + SLACK:
the rest is time a request spent outside the engines (client, router, relays)."""


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0..100) of ascending values, linearly interpolated
    between closest ranks (numpy's default); nan for no values."""
    n = len(sorted_values)
    if n == 0:
        return math.nan
    pos = (n - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def tail_summary(
    values: Iterable[float], digits: int = 3, with_max: bool = False
) -> dict[str, float | int]:
    """p50 and p99 (`percentile`, rounded to `digits`), the max when asked, and
    n, of the values that are not nan; nan figures and n 0 for none."""
    xs = sorted(v for v in values if not math.isnan(v))
    if not xs:
        return {"p50": math.nan, "p99": math.nan, "n": 0}
    out: dict[str, float | int] = {
        "p50": round(percentile(xs, 50), digits),
        "p99": round(percentile(xs, 99), digits),
    }
    if with_max:
        out["max"] = round(xs[-1], digits)
    out["n"] = len(xs)
    return out


def outer_quantile(values: Sequence[float], q: float) -> float | None:
    """The `q` quantile (0..1) by the outer rank (below the median the lower,
    above it the higher): the values are sweep steps, so an interval of them,
    not between them, and an infinite ratio stays inf."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    return ordered[math.floor(pos) if q < 0.5 else math.ceil(pos)]


def paired_ratio_interval(
    blocks: Sequence[tuple[Sequence[float], Sequence[float]]],
    level: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float]:
    """A bootstrap interval of p50(a) / p50(b) over paired blocks `(a, b)`: the
    blocks are drawn with replacement, each keeping its pair, `resamples` times
    (seeded: the same blocks give the same interval); nan, nan without blocks."""
    import random
    import statistics

    blocks = [(a, b) for a, b in blocks if a and b]
    if not blocks:
        return math.nan, math.nan
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        drawn = [blocks[rng.randrange(len(blocks))] for _ in blocks]
        a = [v for pair in drawn for v in pair[0]]
        b = [v for pair in drawn for v in pair[1]]
        ratios.append(statistics.median(a) / statistics.median(b))
    ratios.sort()
    tail = (1 - level) / 2 * 100
    return percentile(ratios, tail), percentile(ratios, 100 - tail)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """mean, p50, p90, p99, min, max and n of the finite values (nan when none)."""
    finite = sorted(v for v in values if math.isfinite(v))
    if not finite:
        nan = math.nan
        return {"mean": nan, "p50": nan, "p90": nan, "p99": nan, "min": nan, "max": nan, "n": 0}
    return {
        "mean": sum(finite) / len(finite),
        "p50": percentile(finite, 50),
        "p90": percentile(finite, 90),
        "p99": percentile(finite, 99),
        "min": finite[0],
        "max": finite[-1],
        "n": len(finite),
    }


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram as scraped: cumulative counts by upper bound
    (`le`, ascending; the last one +Inf), and the observations' count and sum."""

    buckets: tuple[tuple[float, float], ...] = ()
    count: float = 0.0
    total: float = 0.0  # the `_sum` sample

    def as_json(self) -> dict[str, float]:
        """{le: cumulative count}, `le` written as Prometheus writes it (`+Inf`)."""
        return {("+Inf" if math.isinf(le) else f"{le:g}"): c for le, c in self.buckets}


def histogram(
    metrics: Mapping[tuple[str, frozenset[tuple[str, str]]], float], name: str
) -> Histogram:
    """Histogram `name` out of one scrape (`harness.get_metrics`: {(sample name,
    labels): value}), summed over every label set but `le` (engines, models);
    empty when the scrape has no such histogram."""
    buckets: dict[float, float] = {}
    count = total = 0.0
    for (sample, labels), value in metrics.items():
        if sample == f"{name}_bucket":
            le = float(dict(labels)["le"])  # "+Inf" -> inf
            buckets[le] = buckets.get(le, 0.0) + value
        elif sample == f"{name}_count":
            count += value
        elif sample == f"{name}_sum":
            total += value
    return Histogram(tuple(sorted(buckets.items())), count, total)


def histogram_delta(before: Histogram, after: Histogram) -> Histogram:
    """What `after` counted since `before` (the same series read twice); `after`
    itself when a count went back (the server started afresh in between)."""
    old = dict(before.buckets)
    if after.count < before.count or any(c < old.get(le, 0.0) for le, c in after.buckets):
        return after
    return Histogram(
        tuple((le, c - old.get(le, 0.0)) for le, c in after.buckets),
        after.count - before.count,
        after.total - before.total,
    )


def merge_histograms(histograms: Iterable[Histogram]) -> Histogram:
    """The sum of histograms (several servers, several rounds). Over the union
    of their bounds: where one has no bucket at a bound, it counts there what
    its next lower bound counts (vLLM's instances share their bounds: exact)."""
    hs = list(histograms)
    bounds = sorted({le for h in hs for le, _ in h.buckets})

    def at(h: Histogram, bound: float) -> float:
        below = [c for le, c in h.buckets if le <= bound]
        return below[-1] if below else 0.0

    return Histogram(
        tuple((b, sum(at(h, b) for h in hs)) for b in bounds),
        sum(h.count for h in hs),
        sum(h.total for h in hs),
    )


def histogram_percentile(h: Histogram, q: float) -> float:
    """The `q`-th percentile (0..100) estimated from cumulative bucket counts,
    as Prometheus's `histogram_quantile`: the rank's bucket is found and the
    value interpolated linearly between its lower bound (the bucket below's
    upper bound; 0 below the first) and its upper bound; a rank in the +Inf
    bucket gives the highest finite bound; q = 0 the lower bound of the first
    bucket that holds any. nan without observations."""
    if not h.buckets or h.buckets[-1][1] <= 0:
        return math.nan
    rank = q / 100.0 * h.buckets[-1][1]
    lo_le, lo_c = 0.0, 0.0
    for le, c in h.buckets:
        if c >= rank and c > lo_c:  # the first bucket that holds the rank (q = 0: any)
            if math.isinf(le):
                return lo_le
            return lo_le + (le - lo_le) * (rank - lo_c) / (c - lo_c)
        lo_le, lo_c = le, c
    return lo_le


def engine_ttft_summary(
    client_ttft_p90_ms: float, engines: Mapping[str, Histogram]
) -> dict[str, Any]:
    """The engines' own TTFT over a load (`engines`: per server, its TTFT
    histogram's counts over the load) next to the client's TTFT p90: each
    server's p90 and the p90 of all servers merged, in ms, the client's p90
    over the merged one, and whether the client's is within
    `ENGINE_TTFT_FACTOR` x it + `ENGINE_TTFT_SLACK_MS` (None when either is unknown)."""
    merged = merge_histograms(engines.values())
    engine_p90 = histogram_percentile(merged, 90) * 1000
    known = math.isfinite(engine_p90) and math.isfinite(client_ttft_p90_ms)
    bound = ENGINE_TTFT_FACTOR * engine_p90 + ENGINE_TTFT_SLACK_MS
    return {
        "engine_ttft_ms_p90": engine_p90,
        "engine_ttft_ms_p90_by_server": {
            k: histogram_percentile(h, 90) * 1000 for k, h in engines.items()
        },
        "engine_ttft_requests": merged.buckets[-1][1] if merged.buckets else 0.0,
        "engine_ttft_buckets": {k: h.as_json() for k, h in engines.items()},
        "client_ttft_over_engine_p90": (
            client_ttft_p90_ms / engine_p90 if known and engine_p90 > 0 else math.nan
        ),
        "client_ttft_within_engine_bound": client_ttft_p90_ms <= bound if known else None,
    }


@dataclass(frozen=True)
class RequestResult:
    """One measured request: which prompt, what came back, when (ms after it was sent)."""

    prompt_index: int
    token_ids: tuple[int, ...]
    token_ms: tuple[float, ...]  # arrival of each token
    e2e_ms: float  # sent -> response complete
    sent_s: float  # wall-clock time (time.time()) it was sent
    xfer_id: str | None = None  # the rapidkv router's id for it, when routed by one
    error: str | None = None
    sent_mono: float = math.nan  # time.monotonic() it was sent (the connectors' clock)
    placement: str | None = None  # a rapidkv router's x-rapidkv-placement header

    @property
    def ttft_ms(self) -> float:
        return self.token_ms[0] if self.token_ms else math.nan

    @property
    def tpot_ms(self) -> float:
        """Mean time per output token after the first (nan with fewer than 2)."""
        t = self.token_ms
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else math.nan

    @property
    def itl_ms(self) -> list[float]:
        """Gaps between consecutive tokens (0 for tokens that arrived together)."""
        t = self.token_ms
        return [b - a for a, b in itertools.pairwise(t)]


def load_summary(
    results: Sequence[RequestResult],
    references: Sequence[Reference] | None,
    wall_s: float,
    cpu_s: Mapping[str, float],
    engine_ttft: Mapping[str, Histogram] | None = None,
    tie: float = NEAR_TIE_MARGIN,
) -> dict[str, Any]:
    """The report of one load on one configuration (mismatches classified with
    near-tie margin `tie`).

    `wall_s` is first request sent -> last response complete; `cpu_s` the CPU
    seconds each server-side process tree ("prefill", "router", ...) used over
    the load; `engine_ttft` each server's TTFT histogram counted over the load
    (`engine_ttft_summary`; none given: its figures are nan). Mismatches are
    counted against `references` (by prompt index) when given; failed requests
    count as errors, not as mismatches.

    Whole streams, not only their first token: `itl_max_ms` is the longest gap
    between two tokens of any request, `gaps_over_250ms` counts the gaps over
    `LONG_GAP_MS`, `lumped_share` is the share of gaps under `LUMP_GAP_MS`
    (tokens that arrived together).
    """
    ok = [r for r in results if r.error is None]
    gaps = [g for r in ok for g in r.itl_ms]
    ttft = summarize([r.ttft_ms for r in ok])
    verdicts = {"match": 0, "near_tie": 0, "hard": 0}
    for r in ok if references is not None else ():
        verdicts[classify(references[r.prompt_index], r.token_ids, tie)] += 1
    out_tokens = sum(len(r.token_ids) for r in ok)
    n = len(results)
    cpu_total = sum(cpu_s.values())
    return {
        "requests": n,
        "errors": n - len(ok),
        "error_examples": sorted({r.error for r in results if r.error})[:3],
        "ttft_ms": ttft,
        "ttft_over_1s": sum(r.ttft_ms > SLOW_TTFT_MS for r in ok),
        **engine_ttft_summary(ttft["p90"], engine_ttft or {}),
        "tpot_ms": summarize([r.tpot_ms for r in ok]),
        "itl_ms": summarize(gaps),
        "itl_max_ms": max(gaps) if gaps else math.nan,
        "gaps_over_250ms": sum(g > LONG_GAP_MS for g in gaps),
        "lumped_share": sum(g < LUMP_GAP_MS for g in gaps) / len(gaps) if gaps else math.nan,
        "e2e_ms": summarize([r.e2e_ms for r in ok]),
        "duration_s": wall_s,
        "throughput_req_s": len(ok) / wall_s if wall_s > 0 else math.nan,
        "output_tok_s": out_tokens / wall_s if wall_s > 0 else math.nan,
        "server_cpu_s": dict(cpu_s),
        "server_cpu_s_per_req": cpu_total / n if n and cpu_s else math.nan,  # none known: nan
        "matches": verdicts["match"] if references is not None else None,
        "near_tie_mismatches": verdicts["near_tie"] if references is not None else None,
        "hard_mismatches": verdicts["hard"] if references is not None else None,
    }
