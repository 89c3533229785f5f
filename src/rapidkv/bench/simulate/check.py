"""The fit against what it came from: `bench serve`'s closed loops, simulated.

`fit_check(fit)` runs prompts like `bench serve`'s (64, evenly spread over
[128, 900] tokens, in a seeded order, 16 output tokens) at its loads ``c1``
and ``c4`` through the simulator for the configurations it can model
(`CONFIGS`) and returns their TTFT and TPOT p50s next to the measured ones
(`MEASURED`: docs/benchmarks/history.md, the tiny float32 bench serve run of 2026-12-01;
after ``--fit smollm2``, `MEASURED_SMOLLM2`; after ``--fit PATH``, the same
figures from that file when it has them).
Of these, `single`'s c1 TTFT and TPOT and c4 TPOT, `rapidkv-whole`'s and
`vllm-nixl`'s c1 TTFT are the fit's inputs (``in_fit``), and so is
`rapidkv-whole`'s c4 TTFT, which `Fit.shared_core_ms` was chosen to meet;
every other figure is a check the fit was not drawn from. The routed
configurations run as on the testbed (`engine`'s ``shared_core``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rapidkv.bench.simulate.engine import simulate
from rapidkv.bench.simulate.fit import Fit, find_figure
from rapidkv.bench.simulate.goodput import quantile
from rapidkv.bench.simulate.routers import FixedPdRouter, LocalRouter, Router
from rapidkv.bench.simulate.workload import Workload, spread

SERVE_PROMPTS = Workload("bench-serve", "bench serve's prompts", 128, 900, 16, 16)
LOADS = (1, 4)

# configuration -> (instances, routed, router factory)
CONFIGS: dict[str, tuple[int, bool, Callable[[Fit], Router]]] = {
    "single": (1, False, lambda fit: LocalRouter(1)),
    "dp2": (2, True, lambda fit: LocalRouter(2)),
    "vllm-nixl": (2, True, lambda fit: FixedPdRouter(2, fit, nixl=True)),
    "rapidkv": (2, True, lambda fit: FixedPdRouter(2, fit)),
    "rapidkv-whole": (2, True, lambda fit: FixedPdRouter(2, fit, split=False)),
}

# (config, load) -> (TTFT p50, TPOT p50), ms: docs/benchmarks/history.md, tiny float32, 2026-12-01
MEASURED: dict[tuple[str, str], tuple[float, float]] = {
    ("single", "c1"): (54.9, 5.4),
    ("single", "c4"): (184.6, 7.6),
    ("dp2", "c1"): (62.8, 4.6),
    ("dp2", "c4"): (96.0, 7.7),
    ("vllm-nixl", "c1"): (75.6, 4.4),
    ("vllm-nixl", "c4"): (259.8, 5.9),
    ("rapidkv", "c1"): (45.6, 5.1),
    ("rapidkv", "c4"): (168.9, 6.8),
    ("rapidkv-whole", "c1"): (59.2, 4.9),
    ("rapidkv-whole", "c4"): (157.3, 5.6),
}

# the same for SmolLM2-135M bf16: docs/benchmarks/serve.md, "SmolLM2-135M, random prompts"
MEASURED_SMOLLM2: dict[tuple[str, str], tuple[float, float]] = {
    ("single", "c1"): (274.3, 43.3),
    ("single", "c4"): (881.5, 50.2),
    ("dp2", "c1"): (266.7, 43.1),
    ("dp2", "c4"): (401.3, 49.6),
    ("vllm-nixl", "c1"): (344.9, 45.0),
    ("vllm-nixl", "c4"): (1225.4, 52.7),
    ("rapidkv", "c1"): (191.4, 46.0),
    ("rapidkv", "c4"): (686.1, 60.2),
    ("rapidkv-whole", "c1"): (313.1, 49.1),
    ("rapidkv-whole", "c4"): (586.5, 60.9),
}
MEASURED_BY_PRESET = {"smollm2": MEASURED_SMOLLM2}  # `fit.PRESETS`' figures

IN_FIT = {
    ("single", "c1", "ttft"),
    ("single", "c1", "tpot"),
    ("single", "c4", "tpot"),
    ("rapidkv-whole", "c1", "ttft"),
    ("vllm-nixl", "c1", "ttft"),
    ("rapidkv-whole", "c4", "ttft"),
}


Figures = dict[tuple[str, str], tuple[float | None, float | None]]


def measured_from(path: str | Path | None) -> Figures:
    """`MEASURED`, a preset's (`MEASURED_BY_PRESET`), or the same figures from a
    `bench serve --json` file (None where it has none)."""
    if path is None:
        return dict(MEASURED)
    if str(path) in MEASURED_BY_PRESET:
        return dict(MEASURED_BY_PRESET[str(path)])
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return {
        (config, load): (
            find_figure(data, (config,), load, "ttft_ms"),
            find_figure(data, (config,), load, "tpot_ms"),
        )
        for config, load in MEASURED
    }


def fit_check(fit: Fit, measured: Figures, seed: int = 0) -> list[dict[str, Any]]:
    """One row per configuration and load: simulated and measured p50s (ms)."""
    specs = spread(SERVE_PROMPTS, 64, seed)
    rows = []
    for config, (n, routed, factory) in CONFIGS.items():
        for c in LOADS:
            load = f"c{c}"
            out = simulate(
                fit, n, factory(fit), specs, concurrency=c, routed=routed, shared_core=routed
            )
            ttft = quantile([o.ttft_ms for o in out if o.ttft_ms is not None], 0.5)
            tpot = quantile([o.tpot_ms for o in out if o.tpot_ms is not None], 0.5)
            m_ttft, m_tpot = measured.get((config, load), (None, None))
            rows.append(
                {
                    "config": config,
                    "load": load,
                    "ttft_p50_ms": ttft,
                    "measured_ttft_p50_ms": m_ttft,
                    "tpot_p50_ms": tpot,
                    "measured_tpot_p50_ms": m_tpot,
                    "in_fit": sorted(k for cfg, ld, k in IN_FIT if (cfg, ld) == (config, load)),
                }
            )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    lines = ["config         load  TTFT p50 sim / measured   TPOT p50 sim / measured   in fit"]
    for r in rows:
        ttft = f"{f(r['ttft_p50_ms']):>8s} / {f(r['measured_ttft_p50_ms']):<8s}"
        tpot = f"{f(r['tpot_p50_ms']):>6s} / {f(r['measured_tpot_p50_ms']):<6s}"
        fitted = ",".join(r["in_fit"]) or "-"
        lines.append(f"{r['config']:14s} {r['load']:4s}  {ttft}         {tpot}          {fitted}")
    return "\n".join(lines)
