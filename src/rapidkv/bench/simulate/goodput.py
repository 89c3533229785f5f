"""Goodput: the highest swept rate at which enough requests meet both SLOs.

As `bench goodput` defines it: a request meets the SLOs when its TTFT is
within `SLO.ttft_ms` and its TPOT within `SLO.tpot_ms` (a one-token output has
no TPOT: TTFT alone); a rate's attainment is the share of its requests that
do (an unfinished one does not); goodput is the highest swept rate whose
attainment is at least `TARGET` (0 when none is).

SLOs (`reference_slo`): `TTFT_FACTOR` x and `TPOT_FACTOR` x the TTFT and TPOT
p50 of one instance, sent directly, at concurrency 1, on the workload's
requests: here simulated with the fit, on `REFERENCE_REQUESTS` requests whose
prompts are evenly spread over the workload's range (`workload.spread`), so
that the SLOs do not move with a sample's median. On the workloads of shared
prefixes, as `bench goodput` takes them: its default `PREFIX_REFERENCE_REQUESTS`
requests of the workload (whole conversations, in order), with prefix
caching, from an empty cache: a p50 mostly of hits (a group's later
requests, a conversation's later turns).

Rates (`sweep`): per instance, doubling from `START_PER_INSTANCE` req/s (or
`start`: `bench simulate --start`, fewer rates on a large fleet) until
a rate fails (halving instead when the first fails, down to
`LOWEST_PER_INSTANCE`), then `refine` bisections between the highest rate
that passed and the lowest that failed above it; each rate is ``n`` times the
per-instance rate, so the sweep scales with the fleet. Each rate runs the same
requests with the same arrival pattern, scaled (`workload.arrival_times`),
from empty prefix caches (`bench goodput` empties them before every rate).
`run_point`'s `warm_up`: that many requests before the measured ones, served
the same way but not counted (their outcomes, their prefix figures included,
are left out): caches that have served the workload a while, where the real
runs start every rate cold.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rapidkv.bench.simulate.engine import Outcome, Simulation, simulate
from rapidkv.bench.simulate.fit import Fit
from rapidkv.bench.simulate.routers import make_router
from rapidkv.bench.simulate.workload import Spec, arrival_times, requests, spread
from rapidkv.router.placement import SLO

TARGET = 0.9
TTFT_FACTOR = 4.0
TPOT_FACTOR = 1.5
START_PER_INSTANCE = 1.0
LOWEST_PER_INSTANCE = 0.125
HIGHEST_PER_INSTANCE = 256.0
REFERENCE_REQUESTS = 1000
PREFIX_REFERENCE_REQUESTS = 40  # bench goodput's --requests default


def meets(o: Outcome, slo: SLO) -> bool:
    if o.ttft_ms is None or o.ttft_ms > slo.ttft_ms:
        return False
    if o.output > 1 and (o.tpot_ms is None or o.tpot_ms > slo.tpot_ms):
        return False
    return o.e2e_ms is not None


def attainment(outcomes: Sequence[Outcome], slo: SLO) -> float:
    """The share of `outcomes` meeting both SLOs (0 for none)."""
    if not outcomes:
        return 0.0
    return sum(meets(o, slo) for o in outcomes) / len(outcomes)


def goodput_of(attained: dict[float, float], target: float = TARGET) -> float:
    """The highest rate whose attainment is at least `target` (0 for none)."""
    return max((r for r, a in attained.items() if a >= target), default=0.0)


def quantile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated quantile `q` of `values` (None for none)."""
    from rapidkv.bench.common.stats import percentile

    xs = sorted(v for v in values if v is not None)
    return percentile(xs, q * 100) if xs else None


def reference_slo(
    fit: Fit, workload: Any, seed: int = 0, tokenizer: str = "auto"
) -> tuple[SLO, dict[str, float]]:
    """The SLOs of the module docstring, and the single-instance c1 p50s they come from."""
    caching = bool(getattr(workload, "prefix_caching", False))
    if caching:
        specs = requests(workload, PREFIX_REFERENCE_REQUESTS, seed, tokenizer)
    else:
        specs = spread(workload, REFERENCE_REQUESTS, seed)
    ttft, tpot = single_c1_p50s(fit, specs, caching)
    slo = SLO(TTFT_FACTOR * ttft, TPOT_FACTOR * tpot)
    return slo, {"single_c1_ttft_p50_ms": ttft, "single_c1_tpot_p50_ms": tpot}


def single_c1_p50s(fit: Fit, specs: Sequence[Spec], caching: bool) -> tuple[float, float]:
    """The TTFT and TPOT p50 of `specs` served one at a time by one instance,
    sent directly (with `caching`: its prefix cache empty at the start).
    ValueError when no request finishes."""
    router = make_router("dp", 1, fit, SLO())
    out = simulate(fit, 1, router, specs, concurrency=1, routed=False, prefix_caching=caching)
    ttft = quantile([o.ttft_ms for o in out if o.ttft_ms is not None], 0.5)
    tpot = quantile([o.tpot_ms for o in out if o.tpot_ms is not None], 0.5)
    if ttft is None or tpot is None:
        raise ValueError("the simulated single c1 finished no request")
    return ttft, tpot


@dataclass(frozen=True)
class Point:
    """One rate of a sweep."""

    rate: float
    attainment: float
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    tpot_p50_ms: float | None
    tpot_p90_ms: float | None
    throughput_req_s: float
    placements: dict[str, int]
    misses: dict[str, int]  # requests missing only TTFT, only TPOT, both
    router: dict[str, Any] = field(default_factory=dict, compare=False)  # not deterministic
    prefix: dict[str, Any] = field(default_factory=dict)  # `Simulation.prefix_tokens`

    def as_dict(self) -> dict[str, Any]:
        return {
            "rate": self.rate,
            "attainment": self.attainment,
            "ttft_ms": {"p50": self.ttft_p50_ms, "p90": self.ttft_p90_ms},
            "tpot_ms": {"p50": self.tpot_p50_ms, "p90": self.tpot_p90_ms},
            "throughput_req_s": self.throughput_req_s,
            "placements": self.placements,
            "misses": self.misses,
            "router": self.router,
            **({"prefix_tokens": self.prefix} if self.prefix else {}),
        }


def run_point(
    fit: Fit,
    n: int,
    policy: str,
    specs: Sequence[Spec],
    rate: float,
    seed: int,
    slo: SLO,
    *,
    routed: bool = True,
    shared_core: bool = False,
    workload: Any = None,
    warm_up: int = 0,
) -> Point:
    """`specs` at `rate` req/s (Poisson, seeded; `workload`'s arrivals and
    prefix caching when given, `workload.arrival_times`) on `n` instances
    under `policy` (`routed`: through a router; `shared_core`: as on the
    2-core testbed, `engine`); the first `warm_up` of them not counted."""
    router = make_router(policy, n, fit, slo)
    arrivals = arrival_times(workload, specs, rate, seed)
    sim = Simulation(
        fit,
        n,
        router,
        routed=routed,
        shared_core=shared_core,
        prefix_caching=bool(getattr(workload, "prefix_caching", False)),
    )
    if warm_up:
        sim.count_from = warm_up
    out = sim.run(specs, arrivals=arrivals)[warm_up:]
    ttfts = [o.ttft_ms for o in out if o.ttft_ms is not None]
    tpots = [o.tpot_ms for o in out if o.tpot_ms is not None]
    latency = fit.http_ms + (fit.router_ms if routed else 0.0)
    ends = [o.arrival_ms + o.e2e_ms - latency for o in out if o.e2e_ms is not None]
    sent = [o.arrival_ms for o in out if not math.isnan(o.arrival_ms)]
    span_s = (max(ends) - min(sent)) / 1000 if ends else 0.0
    misses: Counter[str] = Counter()
    for o in out:
        ttft_ok = o.ttft_ms is not None and o.ttft_ms <= slo.ttft_ms
        tpot_ok = o.output <= 1 or (o.tpot_ms is not None and o.tpot_ms <= slo.tpot_ms)
        if not (ttft_ok and tpot_ok):
            misses["both" if not (ttft_ok or tpot_ok) else "ttft" if tpot_ok else "tpot"] += 1
    return Point(
        rate=rate,
        attainment=attainment(out, slo),
        ttft_p50_ms=quantile(ttfts, 0.5),
        ttft_p90_ms=quantile(ttfts, 0.9),
        tpot_p50_ms=quantile(tpots, 0.5),
        tpot_p90_ms=quantile(tpots, 0.9),
        throughput_req_s=len(ends) / span_s if span_s > 0 else 0.0,
        placements=dict(sorted(sim.kinds.items())),
        misses=dict(sorted(misses.items())),
        router=router.diagnostics(),
        prefix=sim.prefix_tokens(),
    )


@dataclass
class Sweep:
    """The rates a sweep ran and its goodput."""

    n: int
    points: dict[float, Point] = field(default_factory=dict)

    @property
    def attainment(self) -> dict[float, float]:
        return {r: p.attainment for r, p in sorted(self.points.items())}

    @property
    def goodput(self) -> float:
        return goodput_of(self.attainment)

    def as_dict(self) -> dict[str, Any]:
        g = self.goodput
        return {
            "goodput_req_s": g,
            "goodput_per_instance_req_s": g / self.n,
            "attainment": {_key(r): a for r, a in self.attainment.items()},
            "points": [p.as_dict() for _, p in sorted(self.points.items())],
        }


def sweep(
    evaluate: Callable[[float], Point], n: int, refine: int = 3, start: float = START_PER_INSTANCE
) -> Sweep:
    """The rates of the module docstring, each evaluated once (`evaluate(rate)`)."""
    s = Sweep(n)

    def ok(per_instance: float) -> bool:
        rate = _round(per_instance * n)
        if rate not in s.points:
            s.points[rate] = evaluate(rate)
        return s.points[rate].attainment >= TARGET

    r = start
    lo: float | None = None
    hi: float | None = None
    if ok(r):
        lo = r
        while hi is None and r < HIGHEST_PER_INSTANCE:
            r *= 2
            if ok(r):
                lo = r
            else:
                hi = r
    else:
        hi = r
        while lo is None and r > LOWEST_PER_INSTANCE:
            r /= 2
            if ok(r):
                lo = r
            else:
                hi = r
    if lo is None or hi is None:
        return s
    for _ in range(refine):
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return s


def _round(rate: float) -> float:
    """A rate to 4 significant digits (stable JSON keys)."""
    return float(f"{rate:.4g}")


def _key(rate: float) -> str:
    return f"{rate:g}"
