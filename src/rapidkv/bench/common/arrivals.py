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

Conversations (`session_arrivals`): where a request follows another (a
conversation's later turn, sent once the turn before it is answered), only
the others, the conversations' first turns, arrive at Poisson times, at
`rate` x starts / requests per second, so that the requests' rate stays
`rate`: a sweep's axis is requests per second whatever the workload.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence


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


def session_arrivals(follows: Sequence[bool], rate: float, seed: int) -> list[float]:
    """When to send each request at `rate` req/s where some follow the one
    before them (`follows`): nan for those (sent when the one before is
    answered), Poisson times for the others at `rate` x starts / requests
    (see the module). With none following: `poisson_arrivals`."""
    starts = list(follows).count(False)
    if starts == 0:
        return [math.nan] * len(follows)
    times = iter(poisson_arrivals(starts, rate * (starts / len(follows)), seed))
    return [math.nan if f else next(times) for f in follows]


def offered_rate(arrivals: Sequence[float]) -> float:
    """The rate the arrivals offer: requests after the first over the span
    (nan with fewer than two requests). Requests whose time is nan (they
    follow another: `session_arrivals`) count as the starts before them:
    the starts' rate x requests / starts."""
    starts = [t for t in arrivals if not math.isnan(t)]
    if len(starts) < 2 or starts[-1] <= starts[0]:
        return float("nan")
    return (len(starts) - 1) / (starts[-1] - starts[0]) * (len(arrivals) / len(starts))
