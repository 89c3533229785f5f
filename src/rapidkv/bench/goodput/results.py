"""`rapidkv bench goodput`: what a sweep measured (`goodput.run` fills it in,
`goodput.report` reads it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RateRun:
    """One configuration at one rate of one workload."""

    rate: float
    arrivals: list[float]
    results: list[Any]  # serve.stats.RequestResult, in prompt order
    wall_s: float
    placements: dict[str, float] | None = None  # a rapidkv router's, by kind
    reasons: dict[str, float] | None = None  # ... and by the policy's reason (or "fixed")
    learned: dict[str, Any] | None = None  # an adaptive router's models after the rate
    prefix_tokens: dict[str, float] | None = None  # a rapidkv router's: hit, fetched, computed
    prompt_tokens: dict[str, dict[str, float]] = field(default_factory=dict)  # per server
    reset_errors: list[str] = field(default_factory=list)  # caches not emptied before it
    server_cpu_s: dict[str, float] = field(default_factory=dict)  # per process tree
    client_cpu_s: float = 0.0  # this process: the load generator
    other_cpu_s: float = 0.0  # everything else on the machine (noise: should be ~0)


@dataclass
class ConfigRun:
    name: str
    error: str | None = None
    startup_s: float | None = None
    affinity: dict[str, list[str]] = field(default_factory=dict)
    warmup_errors: list[str] = field(default_factory=list)
    router_args: dict[str, list[str]] = field(default_factory=dict)  # workload -> appended
    rates: dict[str, dict[float, RateRun]] = field(default_factory=dict)  # workload -> rate ->


@dataclass
class WorkloadRun:
    """One workload: its requests, `single`'s reference outputs and c1, its SLOs."""

    name: str
    max_tokens: tuple[int, ...]  # one per request
    prompts: list[list[int]]  # multiturn: empty until the reference pass makes them
    arrival_seed: int
    references: list[Any] | None = None  # serve.stats.Reference per prompt
    error: str | None = None  # why there is no reference or no SLO
    single_c1: list[Any] | None = None  # RequestResult
    single_c1_wall_s: float = 0.0
    single_c1_other_cpu_s: float = 0.0  # noise while the SLOs' base was measured
    slo: Any = None  # slo.SLO
    conversations: Any = None  # multiturn: dataset.Conversations, the prompts' makings
    follows: list[bool] | None = None  # per request: sent after the one before is answered
    think_s: tuple[float, ...] | None = None  # per request: after the answer it follows
    warm_prompts: list[list[int]] = field(default_factory=list)  # sent first at each rate
    warm_max_tokens: tuple[int, ...] = ()  # one per warm-up prompt

    @property
    def requests(self) -> int:
        return len(self.max_tokens)


@dataclass
class SweepResult:
    """Every workload (its requests, references and SLOs) and every configuration's runs."""

    workloads: dict[str, WorkloadRun] = field(default_factory=dict)
    configs: dict[str, ConfigRun] = field(default_factory=dict)
