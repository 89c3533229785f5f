"""`rapidkv bench serve`: what a run measured, per model, configuration and load
(`serve.run` fills them in, `serve.report` reads them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rapidkv.bench.common.reference import NEAR_TIE_MARGIN


@dataclass
class LoadRun:
    round: int
    results: list[Any] = field(default_factory=list)  # stats.RequestResult
    wall_s: float = 0.0  # the configuration's blocks only
    cpu_s: dict[str, float] = field(default_factory=dict)
    prompt_tokens: dict[str, dict[str, float]] = field(default_factory=dict)  # server ->
    # {"external", "local"} counted
    engine_ttft: dict[str, Any] = field(default_factory=dict)  # server -> stats.Histogram
    # of its engine's TTFT, counted over the configuration's blocks
    client_cpu_s: float = 0.0  # this process: the load generator
    other_cpu_s: float = 0.0  # everything else on the machine (noise: should be ~0)
    paired_single: list[Any] | None = None  # `single` on the same blocks (paired only)
    paired_single_wall_s: float = 0.0
    # with --trace, rapidkv: per role, the engine steps of the configuration's blocks
    steps: dict[str, list[Any]] = field(default_factory=dict)


@dataclass
class ConfigRun:
    """Everything measured for one configuration of one model."""

    name: str
    startup_s: list[float] = field(default_factory=list)
    server_startup_s: list[dict[str, float]] = field(default_factory=list)
    first_request_ms: list[float] = field(default_factory=list)
    affinity: dict[str, list[str]] = field(default_factory=dict)
    error: str | None = None
    loads: dict[str, list[LoadRun]] = field(default_factory=dict)


@dataclass
class ModelResult:
    """Everything measured on one model: its prompts, their references, each configuration."""

    model: str
    model_dir: Path
    prompts: list[Any]  # token ids per prompt
    max_tokens: list[int]  # one per prompt
    configs: dict[str, ConfigRun]
    references: list[Any] | None = None  # reference.Reference per prompt
    reference_error: str | None = None
    tie: float = NEAR_TIE_MARGIN  # the model's dtype's (reference.near_tie_margin)

    def samples(self) -> dict[str, dict[str, dict[str, list[float]]]]:
        """Per config and load, the pooled TTFT and TPOT samples (for the plot)."""
        out: dict[str, dict[str, dict[str, list[float]]]] = {}
        for name, c in self.configs.items():
            for load, runs in c.loads.items():
                ok = [r for run in runs for r in run.results if r.error is None]
                out.setdefault(name, {})[load] = {
                    "ttft_ms": [r.ttft_ms for r in ok],
                    "tpot_ms": [r.tpot_ms for r in ok],
                }
        return out
