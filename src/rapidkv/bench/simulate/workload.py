"""The simulated requests: `bench goodput`'s workloads and seeded Poisson arrivals.

- ``prefill-heavy``: prompts uniform in [128, 900] tokens, 16 output tokens;
- ``chat``: prompts uniform in [100, 900], outputs uniform in [32, 256].

`requests(workload, count, seed)` draws the prompts and outputs once
(`spread`: prompts evenly spread instead, for the SLOs' reference and the fit
check);
`poisson_arrivals(count, rate, seed)` scales one seeded pattern of unit-rate
gaps by the rate, so every rate of a sweep sees the same requests in the same
order, only closer together (as `bench goodput` sends them).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    name: str
    min_prompt: int
    max_prompt: int
    min_output: int
    max_output: int

    def __post_init__(self) -> None:
        prompts = 1 <= self.min_prompt <= self.max_prompt
        if not (prompts and 1 <= self.min_output <= self.max_output):
            raise ValueError(f"need 1 <= min <= max for prompts and outputs: {self}")


@dataclass(frozen=True)
class Spec:
    """One request: its prompt and output lengths, in tokens."""

    prompt: int
    output: int


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("prefill-heavy", 128, 900, 16, 16),
        Workload("chat", 100, 900, 32, 256),
    )
}


def requests(workload: Workload, count: int, seed: int) -> list[Spec]:
    """`count` requests of `workload`, seeded."""
    rng = random.Random(f"{workload.name}:{seed}")
    return [
        Spec(
            rng.randint(workload.min_prompt, workload.max_prompt),
            rng.randint(workload.min_output, workload.max_output),
        )
        for _ in range(count)
    ]


def spread(workload: Workload, count: int, seed: int) -> list[Spec]:
    """`count` requests whose prompts are evenly spread over the workload's
    range (the k-th at quantile (k + 1/2) / count) and outputs drawn, in a
    seeded order: a sample without a sample's noise in its median."""
    rng = random.Random(f"{workload.name}:spread:{seed}")
    width = workload.max_prompt - workload.min_prompt
    specs = [
        Spec(
            workload.min_prompt + round(width * (k + 0.5) / count),
            rng.randint(workload.min_output, workload.max_output),
        )
        for k in range(count)
    ]
    rng.shuffle(specs)
    return specs


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """`count` arrival times (ms from 0, the first at 0) of a Poisson process
    of `rate` requests per second, seeded; the same gaps for every rate."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, not {rate}")
    rng = random.Random(f"arrivals:{seed}")
    out, t = [], 0.0
    for _ in range(count):
        out.append(t * 1000.0 / rate)
        t += rng.expovariate(1.0)
    return out
