"""How far one run's goodput ratio can be trusted: a paired block bootstrap.

A goodput comes from a few dozen requests per rate, so a handful of them
decides it: at 60 requests, 90 % attainment is 6 misses or fewer, and a
seventh moves the goodput down a whole sweep step. The interval says how much
of the acceptance ratio is that luck of the sample.

Every configuration serves the same requests at every rate (the same prompts,
the same arrival pattern scaled), so the requests are paired across
configurations and rates by their index. They are cut into consecutive blocks
of `block` requests (a burst of arrivals hurts its neighbours, so one request
is not an independent draw, a block nearly is), and each resample draws blocks
with replacement, the same blocks for every configuration and rate; each
configuration's attainment per rate, its goodput (`slo.goodput`, the same
rule) and the ratio of adaptive's to the best baseline's are computed from the
drawn requests. The interval is the central `level` of those ratios;
`p_met` is the share of resamples in which the ratio reaches the acceptance's.

Invariant: the same attainment lists and seed give the same interval. What it
cannot show is the machine's drift between runs (docs/benchmarks/goodput.md: the same
`dp2` measured 4 to 12 req/s in runs hours apart): it is a lower bound on the
uncertainty of a ratio, not the whole of it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

from rapidkv.bench.common.stats import outer_quantile
from rapidkv.bench.goodput.slo import TARGET, goodput

BLOCK = 6
"""Requests per block: 10 blocks at the 60 requests a rate of the documented runs."""

RESAMPLES = 2000

Attained = Mapping[float, Sequence[bool] | None]
"""One configuration: per swept rate, whether each request (in request order)
attained both SLOs; None for a rate not measured (a miss, as for goodput)."""


def ratio_interval(
    attained: Mapping[str, Attained],
    adaptive: str,
    baselines: Sequence[str],
    threshold: float,
    *,
    block: int = BLOCK,
    level: float = 0.95,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> dict[str, object] | None:
    """The bootstrap interval of goodput(adaptive) / max(goodput(baselines)).

    None when a configuration is missing or no rate lists its requests. A
    resample whose best baseline has goodput 0 gives ratio inf if adaptive's
    is positive, else it is left out: `resamples_used` says how many counted.
    Also each configuration's goodput interval over the same resamples,
    `goodput_interval`."""
    names = [adaptive, *baselines]
    if any(n not in attained for n in names):
        return None
    draws = _draws([attained[n] for n in names], block, resamples, seed)
    if draws is None:
        return None
    ratios: list[float] = []
    goodputs: dict[str, list[float]] = {c: [] for c in names}
    for drawn in draws:
        got = {c: _goodput(attained[c], drawn) for c in names}
        for c, g in got.items():
            goodputs[c].append(g)
        best = max(got[b] for b in baselines)
        mine = got[adaptive]
        if best > 0:
            ratios.append(mine / best)
        elif mine > 0:
            ratios.append(math.inf)
    tail = (1 - level) / 2
    return {
        "level": level,
        "block": max(1, block),
        "resamples": resamples,
        "resamples_used": len(ratios),
        "ratio_low": outer_quantile(ratios, tail),
        "ratio_high": outer_quantile(ratios, 1 - tail),
        "p_met": sum(r >= threshold for r in ratios) / len(ratios) if ratios else None,
        "goodput_interval": {
            c: [outer_quantile(g, tail), outer_quantile(g, 1 - tail)] for c, g in goodputs.items()
        },
    }


def goodput_interval(
    attained: Attained,
    *,
    block: int = BLOCK,
    level: float = 0.95,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> list[float | None] | None:
    """One configuration's goodput, `[low, high]` of the central `level` over
    the same resamples as `ratio_interval` (same seed: the same draws); None
    when no rate lists its requests."""
    draws = _draws([attained], block, resamples, seed)
    if draws is None:
        return None
    got = [_goodput(attained, drawn) for drawn in draws]
    tail = (1 - level) / 2
    return [outer_quantile(got, tail), outer_quantile(got, 1 - tail)]


def _draws(
    configs: Sequence[Attained], block: int, resamples: int, seed: int
) -> list[list[int]] | None:
    """`resamples` lists of request indices, each drawn as whole blocks with
    replacement (seeded); None with no requests listed; ValueError when the
    configurations' rates list different numbers of requests."""
    lengths = {len(v) for c in configs for v in c.values() if v is not None}
    if not lengths or lengths == {0}:
        return None
    if len(lengths) != 1:
        raise ValueError(f"requests per rate differ between rates or configurations: {lengths}")
    n = lengths.pop()
    block = max(1, block)
    starts = list(range(0, n, block))
    rng = random.Random(seed)
    out = []
    for _ in range(resamples):
        picks = [starts[rng.randrange(len(starts))] for _ in starts]
        out.append([i for s in picks for i in range(s, min(s + block, n))])
    return out


def _goodput(by_rate: Attained, drawn: Sequence[int]) -> float:
    att: dict[float, float | None] = {}
    for rate, hits in by_rate.items():
        att[rate] = None if hits is None else sum(hits[i] for i in drawn) / len(drawn)
    return goodput(att, TARGET).req_s or 0.0
