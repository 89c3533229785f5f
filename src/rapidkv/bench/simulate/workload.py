"""The simulated requests: `common.workloads`' plans as `Spec`s, and their arrivals.

`requests(workload, count, seed)` draws the prompts and outputs once, as
`bench goodput` draws them (`Workload.plan`); `spread` spreads the prompts
evenly instead, for the SLOs' reference and the fit check;
`poisson_arrivals(count, rate, seed)` is `common.arrivals`' in ms: every rate
of a sweep sees the same requests in the same order, only closer together.
"""

from __future__ import annotations

from dataclasses import dataclass

from rapidkv.bench.common import arrivals
from rapidkv.bench.common.workloads import WORKLOADS, Plan, Workload

__all__ = ["WORKLOADS", "Spec", "Workload", "poisson_arrivals", "requests", "spread"]


@dataclass(frozen=True)
class Spec:
    """One request: its prompt and output lengths, in tokens."""

    prompt: int
    output: int


def _specs(plan: Plan) -> list[Spec]:
    return [Spec(p, o) for p, o in zip(plan.prompt_lens, plan.max_tokens, strict=True)]


def requests(workload: Workload, count: int, seed: int) -> list[Spec]:
    """`count` requests of `workload`, seeded."""
    return _specs(workload.plan(count, seed))


def spread(workload: Workload, count: int, seed: int) -> list[Spec]:
    """`count` requests with evenly spread prompts (`Workload.spread`)."""
    return _specs(workload.spread(count, seed))


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """`count` arrival times, ms from 0 (the first at 0), of a Poisson process
    of `rate` requests per second, seeded (`common.arrivals.poisson_arrivals`)."""
    return [t * 1000.0 for t in arrivals.poisson_arrivals(count, rate, seed)]
