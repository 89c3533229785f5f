"""A fit calibrated on a real run's own single instance, before comparing with that run.

A `bench goodput` run measures, per workload, `single` at concurrency 1:
every measured request once, one at a time, on one instance sent directly,
from an empty prefix cache (``workloads.<w>.single_c1``: the p50s its SLOs
come from). The same machine's speed drifts between runs (by 15-20 % within
hours: docs/benchmarks/simulate.md, "Calibrated on the run's own single
instance"), so a fit taken from another run is off by as much, and a
comparison against the SLOs of the run (4x and 1.5x those p50s) then
measures that drift, not the model.

`calibrate(fit, workload, ttft_p50, tpot_p50, ...)` scales `fit` so that
the simulated single c1 of the same requests (`single_c1`) has the measured
p50s:

- the decode step (`Fit.step_ms`, `Fit.step_ms_per_seq`) by the measured
  TPOT p50 over the simulated one;
- then the prompt's cost (`Fit.prefill_ms_per_token`, `Fit.prefill_ms`) by
  the factor that puts the simulated TTFT p50 on the measured one
  (bisection between `SCALE_RANGE`'s ends: the TTFT p50 rises with it);
  where even an end misses it, that end, and `Calibration.exact` is False.

Nothing else changes: transfers, the router and the shared core keep the
fit's figures. Only single's own c1 is read, never an outcome of a
configuration that `compare` predicts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rapidkv.bench.simulate.fit import Fit
from rapidkv.bench.simulate.goodput import single_c1_p50s
from rapidkv.bench.simulate.workload import requests, spread

CONTEXT_MS_PER_TOKEN_MAX = 0.5  # the context cost's bisection range above the fit's
BISECTIONS = 24
TTFT_TOLERANCE_MS = 0.5  # close enough: a bisection stops there


@dataclass(frozen=True)
class Calibration:
    """`fit` scaled (see the module docstring), and what it was scaled on."""

    fit: Fit
    measured: tuple[float, float]  # single c1 TTFT p50, TPOT p50 (ms): the run's
    before: tuple[float, float]  # the same, simulated with the fit as given
    after: tuple[float, float]  # and with `fit`
    speed: float  # every compute cost's factor
    context_ms_per_token: float  # the calibrated fit's
    exact: bool  # the TTFT p50 met within TTFT_TOLERANCE_MS

    def as_dict(self) -> dict[str, Any]:
        return {
            "single_c1_measured_ms": {"ttft_p50": self.measured[0], "tpot_p50": self.measured[1]},
            "single_c1_simulated_ms": {"ttft_p50": self.before[0], "tpot_p50": self.before[1]},
            "single_c1_calibrated_ms": {"ttft_p50": self.after[0], "tpot_p50": self.after[1]},
            "speed": self.speed,
            "context_ms_per_token": self.context_ms_per_token,
            "exact": self.exact,
        }


def single_c1(
    fit: Fit, workload: Any, count: int, seed: int = 0, tokenizer: str = "auto", warm: int = 0
) -> tuple[float, float]:
    """The simulated TTFT and TPOT p50 of one instance, sent directly, at
    concurrency 1, on the workload's measured requests as `bench goodput`'s
    single c1 sends them: with prefix caching, the `count` requests after
    the `warm` ones of the plan, from an empty cache; else `count` requests
    spread over the prompt range."""
    caching = bool(getattr(workload, "prefix_caching", False))
    if caching:
        specs = requests(workload, warm + count, seed, tokenizer)[warm:]
    else:
        specs = spread(workload, count, seed)
    return single_c1_p50s(fit, specs, caching)


def calibrate(
    fit: Fit,
    workload: Any,
    ttft_p50: float,
    tpot_p50: float,
    *,
    count: int,
    seed: int = 0,
    tokenizer: str = "auto",
    warm: int = 0,
) -> Calibration:
    """`fit` scaled to the measured single c1 p50s (see the module docstring).
    ValueError for p50s that are not positive."""
    if not (ttft_p50 > 0 and tpot_p50 > 0):
        raise ValueError(f"single c1 p50s must be > 0: TTFT {ttft_p50}, TPOT {tpot_p50}")

    def measure(f: Fit) -> tuple[float, float]:
        return single_c1(f, workload, count, seed, tokenizer, warm)

    before = measure(fit)
    speed = tpot_p50 / before[1] if before[1] > 0 else 1.0
    scaled = dataclasses.replace(
        fit,
        step_ms=fit.step_ms * speed,
        step_ms_per_seq=fit.step_ms_per_seq * speed,
        prefill_ms_per_token=fit.prefill_ms_per_token * speed,
        prefill_ms=fit.prefill_ms * speed,
        context_ms_per_token=fit.context_ms_per_token * speed,
    )

    def with_context(c: float) -> Fit:
        return dataclasses.replace(scaled, context_ms_per_token=c)

    after = measure(scaled)
    context = scaled.context_ms_per_token
    if after[0] < ttft_p50 - TTFT_TOLERANCE_MS:
        low, high = context, context + CONTEXT_MS_PER_TOKEN_MAX
        for _ in range(BISECTIONS):
            context = (low + high) / 2
            after = measure(with_context(context))
            if abs(after[0] - ttft_p50) <= TTFT_TOLERANCE_MS:
                break
            if after[0] < ttft_p50:
                low = context
            else:
                high = context
    exact = abs(after[0] - ttft_p50) <= TTFT_TOLERANCE_MS
    return Calibration(
        with_context(context), (ttft_p50, tpot_p50), before, after, speed, context, exact
    )
