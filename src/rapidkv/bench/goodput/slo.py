"""`rapidkv bench goodput`: SLOs, attainment and goodput. Pure: no I/O.

SLOs are relative to `single` measured in the same run, per workload: TTFT
SLO = `ttft_factor` (4) x its c1 TTFT p50, TPOT SLO = `tpot_factor` (1.5) x
its c1 TPOT p50 (`derive`), unless one is given in ms (`given`): the same in
every run, where one c1 measurement of `single` moves between runs more than
the differences a run compares.

A request *attains* when it completed (no error), its output is not a hard
mismatch (a wrong answer is no good output, however fast; a near-tie is
fine: `serve.stats`), its TTFT is at most the TTFT SLO and its TPOT at most
the TPOT SLO (a request with fewer than two tokens has no TPOT and is judged
on its TTFT). The *attainment* of a rate is the share of the requests sent at
that rate that attained; every request sent counts, failed ones included.

Goodput (DistServe's definition): the highest request rate at which at least
`TARGET` (90 %) of requests attain, found by the sweep. What happens when
attainment is not monotonic in the rate (this machine is shared and noisy; a
sweep is a finite sample): DistServe takes the maximum rate that meets the
target. Here `goodput` is the highest swept rate such that it *and every swept
rate below it* meet the target, i.e. the last rate before the first miss: a
system that misses at 6 req/s has not shown it can hold 8, even if 8 happened
to pass. DistServe's literal maximum is reported beside it (`max_req_s`), and
`monotonic` says whether the two rules could differ (some miss is followed
by a pass). A rate with no attainment (not measured: its configuration failed
before it) is a miss.

Edge cases: no swept rate meets the target -> goodput 0 (`bound`
"below_sweep": lower the rates); every swept rate does -> goodput is the
highest rate and only a lower bound (`bound` "above_sweep": raise them); no
rate measured at all -> None ("no_data"). `interpolated_req_s` places the
crossing of the target linearly between the last passing rate and the first
miss (context for a coarse sweep, not the goodput).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

TARGET = 0.9
"""The share of requests that must meet both SLOs (DistServe's 90 %)."""

Bound = Literal["within", "below_sweep", "above_sweep", "no_data"]


@dataclass(frozen=True)
class SLO:
    ttft_ms: float
    tpot_ms: float


def derive(
    single_ttft_p50_ms: float, single_tpot_p50_ms: float, ttft_factor: float, tpot_factor: float
) -> SLO:
    """The SLOs from `single`'s c1 p50s; ValueError if either is not a positive number."""
    for what, v in (("TTFT", single_ttft_p50_ms), ("TPOT", single_tpot_p50_ms)):
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"single's c1 {what} p50 is {v}: no SLO can be derived")
    return SLO(ttft_factor * single_ttft_p50_ms, tpot_factor * single_tpot_p50_ms)


def given(derived: SLO, ttft_ms: float | None, tpot_ms: float | None) -> SLO:
    """`derived` with each SLO given in ms (not None) in its place."""
    for what, v in (("TTFT", ttft_ms), ("TPOT", tpot_ms)):
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ValueError(f"a {what} SLO is a positive number of ms, not {v}")
    return SLO(
        derived.ttft_ms if ttft_ms is None else ttft_ms,
        derived.tpot_ms if tpot_ms is None else tpot_ms,
    )


@dataclass(frozen=True)
class Outcome:
    """What attainment needs of one request."""

    ttft_ms: float
    tpot_ms: float  # nan: fewer than two tokens
    error: bool = False
    hard_mismatch: bool = False


def meets_ttft(o: Outcome, slo: SLO) -> bool:
    return not o.error and math.isfinite(o.ttft_ms) and o.ttft_ms <= slo.ttft_ms


def meets_tpot(o: Outcome, slo: SLO) -> bool:
    return not o.error and (math.isnan(o.tpot_ms) or o.tpot_ms <= slo.tpot_ms)


def attains(o: Outcome, slo: SLO) -> bool:
    """Completed, no hard mismatch, both SLOs met."""
    return not o.hard_mismatch and meets_ttft(o, slo) and meets_tpot(o, slo)


def attainment(outcomes: Iterable[Outcome], slo: SLO) -> dict[str, float | int]:
    """Over the requests of one rate: the share that attained, and the shares
    that met each SLO on its own (nan for no requests)."""
    rows = list(outcomes)
    n = len(rows)

    def share(pred: Callable[[Outcome, SLO], bool]) -> float:
        return sum(1 for o in rows if pred(o, slo)) / n if n else math.nan

    return {
        "attainment": share(attains),
        "ttft_attainment": share(meets_ttft),
        "tpot_attainment": share(meets_tpot),
        "requests": n,
    }


@dataclass(frozen=True)
class Goodput:
    req_s: float | None  # the last swept rate before the first miss (see module docstring)
    max_req_s: float | None  # DistServe's literal rule: the highest rate that meets it
    interpolated_req_s: float | None
    bound: Bound
    monotonic: bool  # no miss is followed by a pass

    def as_dict(self) -> dict[str, object]:
        return {
            "goodput_req_s": self.req_s,
            "goodput_max_req_s": self.max_req_s,
            "goodput_interpolated_req_s": self.interpolated_req_s,
            "goodput_bound": self.bound,
            "attainment_monotonic": self.monotonic,
        }


def goodput(by_rate: Mapping[float, float | None], target: float = TARGET) -> Goodput:
    """Goodput from the attainment at each swept rate (None or nan: not measured,
    a miss)."""
    rates = sorted(by_rate)
    att = [by_rate[r] for r in rates]
    ok = [a is not None and not math.isnan(a) and a >= target for a in att]
    if not rates or all(a is None or math.isnan(a) for a in att):
        return Goodput(None, None, None, "no_data", True)
    passing = [r for r, good in zip(rates, ok, strict=True) if good]
    first_miss = ok.index(False) if False in ok else len(rates)
    monotonic = all(not good for good in ok[first_miss:])
    if first_miss == 0:
        return Goodput(0.0, max(passing, default=0.0), None, "below_sweep", monotonic)
    last = rates[first_miss - 1]
    if first_miss == len(rates):
        return Goodput(last, last, None, "above_sweep", True)
    a_hi, a_lo = att[first_miss - 1], att[first_miss]
    assert a_hi is not None
    a_lo = 0.0 if a_lo is None or math.isnan(a_lo) else a_lo
    nxt = rates[first_miss]
    frac = (a_hi - target) / (a_hi - a_lo) if a_hi > a_lo else 0.0
    return Goodput(last, max(passing), last + frac * (nxt - last), "within", monotonic)


def rate_key(rate: float) -> str:
    """How a rate names its entry in the JSON: `2`, `2.5`."""
    return f"{rate:g}"
