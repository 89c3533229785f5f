"""The simulated requests: `bench goodput`'s workloads as `Spec`s, and their arrivals.

`requests(workload, count, seed)` draws the requests once, as `bench goodput`
draws them: the length workloads (`common.workloads`: `prefill-heavy`,
`chat`) from their `Workload.plan`; the workloads of shared prefixes
(`shared-prefix`, `multiturn`) from `prefix_workloads`, with their content
(the segments their prompts share) and, for conversations, which request
follows which after how long a think time. `spread` spreads a length
workload's prompts evenly instead, for the SLOs' reference and the fit check.

`arrival_times(workload, specs, rate, seed)` is when each request arrives,
in ms: for the length workloads `poisson_arrivals(count, rate, seed)`
(`common.arrivals`' in ms: every rate of a sweep sees the same requests in
the same order, only closer together); for the workloads of shared prefixes
`bench goodput`'s own (`arrivals.session_arrivals` from the workload's seed
and `goodput.options.ARRIVAL_SALT`, NaN for a turn that follows the one
before it: the engine sends it a think time after that one's answer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rapidkv.bench.common import arrivals
from rapidkv.bench.common.multiturn import MULTITURN, Multiturn
from rapidkv.bench.common.shared_prefix import SHARED_PREFIX, SharedPrefix
from rapidkv.bench.common.workloads import WORKLOADS as LENGTH_WORKLOADS
from rapidkv.bench.common.workloads import Plan, Workload
from rapidkv.bench.simulate.prefix_cache import Segment

__all__ = [
    "LENGTH_WORKLOADS",
    "PREFIX_WORKLOADS",
    "WORKLOADS",
    "Spec",
    "Workload",
    "arrival_times",
    "poisson_arrivals",
    "requests",
    "spread",
]

PREFIX_WORKLOADS: dict[str, Any] = {SHARED_PREFIX.name: SHARED_PREFIX, MULTITURN.name: MULTITURN}
WORKLOADS: dict[str, Any] = {**LENGTH_WORKLOADS, **PREFIX_WORKLOADS}
"""Every workload the simulator knows, by name (`bench goodput`'s four)."""


@dataclass(frozen=True)
class Spec:
    """One request: its prompt and output lengths, in tokens; with prefix
    caching, what its prompt is made of (`content`: segments, `prefix_cache`;
    empty: tokens of its own, shared with no other request) and the segment
    its answer is (`answer`: a conversation's next turn repeats it); whether
    it is sent only once the request before it is answered (`follows`), and
    `think_ms` after that."""

    prompt: int
    output: int
    content: tuple[Segment, ...] = ()
    answer: tuple[int, ...] | None = None
    follows: bool = False
    think_ms: float = 0.0


def _specs(plan: Plan) -> list[Spec]:
    return [Spec(p, o) for p, o in zip(plan.prompt_lens, plan.max_tokens, strict=True)]


def requests(workload: Any, count: int, seed: int, tokenizer: str = "auto") -> list[Spec]:
    """`count` requests of `workload`, seeded (`multiturn`: whole conversations,
    `count` rounded up; their tokens counted by `tokenizer`, `prefix_workloads.tokens_for`)."""
    from rapidkv.bench.simulate import prefix_workloads

    if isinstance(workload, SharedPrefix):
        return prefix_workloads.shared_prefix_specs(workload, count, seed)
    if isinstance(workload, Multiturn):
        return prefix_workloads.multiturn_specs(workload, count, seed, tokenizer)
    return _specs(workload.plan(count, seed))


def spread(workload: Workload, count: int, seed: int) -> list[Spec]:
    """`count` requests with evenly spread prompts (`Workload.spread`)."""
    return _specs(workload.spread(count, seed))


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """`count` arrival times, ms from 0 (the first at 0), of a Poisson process
    of `rate` requests per second, seeded (`common.arrivals.poisson_arrivals`)."""
    return [t * 1000.0 for t in arrivals.poisson_arrivals(count, rate, seed)]


def arrival_times(workload: Any, specs: Sequence[Spec], rate: float, seed: int) -> list[float]:
    """When each of `specs` arrives at `rate` req/s, ms (see the module docstring)."""
    if workload is None or not getattr(workload, "prefix_caching", False):
        return poisson_arrivals(len(specs), rate, seed)
    from rapidkv.bench.goodput.options import ARRIVAL_SALT

    follows = [s.follows for s in specs]
    times = arrivals.session_arrivals(follows, rate, workload.seed(seed) + ARRIVAL_SALT)
    return [t * 1000.0 for t in times]
