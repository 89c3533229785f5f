"""`rapidkv bench goodput --plot`: SLO attainment against the request rate.

One PNG from the report: a panel per workload, a line per configuration (the
share of requests meeting both SLOs at each swept rate), the 90 % target as
a dashed line, and each configuration's goodput in the legend. With prefix
caching on (a workload of shared prefixes), a second row: per workload, the
share of the prompt tokens the servers counted that their prefix caches
served, at each rate. Matplotlib with the Agg backend (no display needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rapidkv.bench.common.output import save_figure
    from rapidkv.bench.goodput.slo import TARGET

    workloads = report["workloads"]
    caching = any(w.get("prefix_caching") for w in workloads.values())
    rows, cols = (2 if caching else 1), max(1, len(workloads))
    fig, grid = plt.subplots(rows, cols, figsize=(6.0 * cols, 4.2 * rows), squeeze=False)
    axes = list(grid[0])
    for ax, (name, w) in zip(axes, workloads.items(), strict=False):
        for config, c in w["configs"].items():
            points = [(float(rate), a) for rate, a in c["attainment"].items() if a is not None]
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            gp = c["goodput_req_s"]
            label = f"{config} (goodput {'-' if gp is None else f'{gp:g}'})"
            ax.plot(xs, [y * 100 for y in ys], marker="o", label=label)
        ax.axhline(TARGET * 100, color="grey", linestyle="--", linewidth=1)
        slo = w["slo"]
        sub = (
            ""
            if slo is None
            else (f"\nTTFT <= {slo['ttft_ms']:.0f} ms, TPOT <= {slo['tpot_ms']:.1f} ms")
        )
        ax.set_title(f"{name}{sub}", fontsize=9)
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel("requests meeting both SLOs (%)")
        ax.set_ylim(-3, 103)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    if caching:
        for ax, (name, w) in zip(grid[1], workloads.items(), strict=False):
            _hits(ax, name, w)
    meta = report["meta"]
    title = (
        f"rapidkv bench goodput: {meta['requests_per_rate']} requests per rate, "
        f"{meta['cpu'] or 'unknown CPU'}"
    )
    return save_figure(fig, path, title)


def _hits(ax: Any, name: str, w: dict[str, Any]) -> None:
    """Per configuration, the servers' prefix-cache hit share at each rate."""
    import math

    for config, c in w["configs"].items():
        points = [
            (float(rate), s["prefix_cache_hit_fraction"] * 100)
            for rate, s in c["rates"].items()
            if s.get("prefix_cache_hit_fraction") is not None
            and math.isfinite(s["prefix_cache_hit_fraction"])
        ]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", label=config)
    ax.set_title(f"{name}: prefix-cache hits", fontsize=9)
    ax.set_xlabel("request rate (req/s, Poisson)")
    ax.set_ylabel("prompt tokens served from cache (%)")
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    if ax.get_lines():
        ax.legend(fontsize=7, loc="lower left")
