"""`rapidkv bench goodput`: Poisson open-loop arrivals at a rate, seeded.

The client sends request i at `arrivals[i]` seconds after the start, whatever
is still in flight (an open loop: a slow server does not slow the arrivals
down, it queues them). Gaps between arrivals are independent and exponential
with mean 1 / rate; the first request is sent at once (as in `bench serve`'s
`poissonR` loads).

Common random numbers: the gaps are drawn once at rate 1 from the seed and
divided by the rate, so every rate of a sweep replays the *same* pattern of
bursts and lulls, only faster. Attainment then differs between two rates by
the rate, not by the luck of two draws (a burst that one rate happened to get
and the next did not), and every configuration gets the same arrivals at a
given rate.

Exact rate: the unit gaps are scaled so that their mean is exactly 1 (the
process conditioned on its last arrival falling at (n - 1) / rate): with a
few dozen requests a plain draw offers 10-20 % more or less than its nominal
rate, the same error at every rate, which would shift every goodput by it.
"""

from __future__ import annotations

import random


def unit_gaps(n: int, seed: int) -> list[float]:
    """`n - 1` gaps (s) of a Poisson process of rate 1, from `seed`, scaled to a
    mean of exactly 1."""
    rng = random.Random(seed)
    gaps = [rng.expovariate(1.0) for _ in range(max(0, n - 1))]
    mean = sum(gaps) / len(gaps) if gaps else 1.0
    return [g / mean for g in gaps]


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """When (s after the start) to send each of `n` requests at `rate` req/s:
    0 for the first, then the seed's unit-rate gaps over `rate`, summed."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    if n <= 0:
        return []
    out, t = [0.0], 0.0
    for gap in unit_gaps(n, seed):
        t += gap / rate
        out.append(t)
    return out


def offered_rate(arrivals: list[float]) -> float:
    """The rate the arrivals offer: requests after the first over the span
    (nan with fewer than two requests)."""
    if len(arrivals) < 2 or arrivals[-1] <= arrivals[0]:
        return float("nan")
    return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])
