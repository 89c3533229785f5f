"""`rapidkv bench serve --plot`: TTFT and TPOT distributions per configuration.

One PNG: a row per (model, measure), a column per load, a box per configuration
(whiskers at p1/p99, the mean as a dot), log-scaled TTFT so that the stock
NIXL baseline does not flatten everything else. Matplotlib with the Agg
backend (no display needed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from rapidkv.bench.common.output import save_figure

# samples[model][config][load] = {"ttft_ms": [...], "tpot_ms": [...]}
Samples = Mapping[str, Mapping[str, Mapping[str, Mapping[str, Sequence[float]]]]]

MEASURES = (("ttft_ms", "TTFT (ms)", True), ("tpot_ms", "TPOT (ms)", False))


def plot(samples: Samples, loads: Sequence[str], path: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(model, m) for model in samples for m in MEASURES]
    n_configs = max((len(c) for c in samples.values()), default=1)
    fig, axes = plt.subplots(
        len(rows),
        len(loads),
        figsize=(max(4.0, 0.55 * n_configs + 1.5) * len(loads), 3.6 * len(rows)),
        squeeze=False,
    )
    for r, (model, (key, label, log)) in enumerate(rows):
        configs = list(samples[model])
        for c, load in enumerate(loads):
            ax = axes[r][c]
            data = [
                [v for v in samples[model][cfg].get(load, {}).get(key, ()) if v == v]
                for cfg in configs
            ]
            shown = [(cfg, d) for cfg, d in zip(configs, data, strict=True) if d]
            if shown:
                ax.boxplot(
                    [d for _, d in shown],
                    whis=(1, 99),
                    showfliers=False,
                    showmeans=True,
                    meanprops={
                        "marker": ".",
                        "markerfacecolor": "black",
                        "markeredgecolor": "black",
                    },
                )
                ax.set_xticks(
                    range(1, len(shown) + 1), [cfg for cfg, _ in shown], rotation=60, ha="right"
                )
            if log:
                ax.set_yscale("log")
            ax.grid(axis="y", alpha=0.3)
            ax.set_title(f"{model} · {load} · {label}", fontsize=9)
    return save_figure(fig, path, title)
