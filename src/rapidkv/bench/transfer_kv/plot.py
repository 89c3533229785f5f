"""`rapidkv bench transfer-kv`: the terminal table and the PNG plot.

The plot: one row per phase, one column per metric (arrival -> first byte,
arrival -> last byte confirmed, exposed transfer time), a box per (mode, state)
with whiskers at p1/p99 and the median step length as a dashed line; log
scale (bypass is ~100x faster than a step), symlog for exposed time (often
0). Matplotlib with the Agg backend.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rapidkv.bench.common.output import save_figure
from rapidkv.bench.transfer_kv.stats import METRICS, MODES, STATES

LABELS = {
    "first_byte_ms": "arrival -> first byte (ms)",
    "last_byte_ms": "arrival -> last byte confirmed (ms)",
    "exposed_ms": "exposed transfer time (ms)",
}
SHORT = {"finished": "fin", "last_chunk": "last", "earlier_chunk": "earlier"}


def _fmt(x: Any) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.2f}" if x < 100 else f"{x:.0f}"


def table(report: Mapping[str, Any], phases: Sequence[str]) -> str:
    """p50 / p99 per phase, mode and state, then the acceptance points."""
    lines = []
    for phase in phases:
        r = report[phase]
        cap = r.get("bandwidth_cap_gbps") or 0
        head = f"{phase}: step p50 {_fmt(r['step_ms']['p50'])} ms"
        if cap:
            head += f", cap {cap:.3f} GB/s (full transfer {_fmt(r.get('wire_ms'))} ms)"
        lines.append(head)
        lines.append(
            f"  {'mode':8} {'state':13} {'n':>4}  {'first p50/p99':>15}  {'last p50/p99':>15}  "
            f"{'exposed p50/p99':>15}"
        )
        for mode in MODES:
            for state in STATES:
                c = r["modes"][mode][state]
                cols = "  ".join(f"{_fmt(c[m]['p50']):>7}/{_fmt(c[m]['p99']):<7}" for m in METRICS)
                lines.append(f"  {mode:8} {state:13} {c['first_byte_ms']['n']:>4}  {cols}")
        late = r["last_chunk_first_byte_after_ready_ms"]["substep"]["last_block_after_step_end"]
        counters = r.get("p_counters", {})
        n = r["modes"]["substep"]["last_chunk"]["exposed_ms"]["n"]
        lines.append(
            f"  substep, last chunk: {late} of {n} samples got the last chunk's block only "
            "after that step ended; P's counters: "
            + ", ".join(
                f"{k} {v:.0f}"
                for k, v in counters.items()
                if k.startswith(("substeps_", "bypass_full_sends"))
            )
        )
        lines.append(
            f"  {r['samples']} samples, {r['noisy_samples']} set aside (other processes on "
            f"our cores: {r.get('other_cpu_cores')}), {r['checks']['failed']} failed"
        )
    for p in report.get("acceptance", []):
        verdict = {True: "ok  ", False: "MISS", None: "n/a "}[p["ok"]]
        lines.append(f"[{verdict}] {p['point']}: {_fmt(p['value'])} ({p['limit']})")
    return "\n".join(lines)


def plot(
    values: Mapping[str, Mapping[tuple[str, str], Mapping[str, Sequence[float]]]],
    step_ms: Mapping[str, float],
    path: Path,
    title: str = "",
) -> Path:
    """`values[phase][(mode, state)][metric]` -> list of ms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = list(values)
    cells = [(m, s) for m in MODES for s in STATES]
    fig, axes = plt.subplots(
        len(phases), len(METRICS), figsize=(5.2 * len(METRICS), 3.8 * len(phases)), squeeze=False
    )
    colors = {"step": "tab:gray", "bypass": "tab:blue", "substep": "tab:orange"}
    for r, phase in enumerate(phases):
        for c, metric in enumerate(METRICS):
            ax = axes[r][c]
            data = [list(values[phase].get(cell, {}).get(metric, ())) for cell in cells]
            shown = [(i, cell, d) for i, (cell, d) in enumerate(zip(cells, data, strict=True)) if d]
            if shown:
                boxes = ax.boxplot(
                    [d for _, _, d in shown],
                    positions=[i + 1 for i, _, _ in shown],
                    whis=(1, 99),
                    showfliers=False,
                    patch_artist=True,
                )
                for patch, (_, cell, _) in zip(boxes["boxes"], shown, strict=True):
                    patch.set_facecolor(colors[cell[0]])
                    patch.set_alpha(0.6)
            ax.set_xticks(
                range(1, len(cells) + 1),
                [f"{m}\n{SHORT[s]} ({len(d)})" for (m, s), d in zip(cells, data, strict=True)],
                fontsize=7,
            )
            ax.set_xlim(0.5, len(cells) + 0.5)
            if step_ms.get(phase) and not math.isnan(step_ms[phase]):
                ax.axhline(step_ms[phase], color="k", ls="--", lw=0.8, label="step p50")
                ax.legend(fontsize=7, loc="upper left")
            if metric == "exposed_ms":  # 0 (fully hidden) is common: linear below 1 ms
                ax.set_yscale("symlog", linthresh=1.0)
                ax.set_ylim(bottom=0)
            else:
                ax.set_yscale("log")
            ax.grid(axis="y", alpha=0.3)
            ax.set_title(f"{phase} · {LABELS[metric]}", fontsize=9)
    return save_figure(fig, path, title)
