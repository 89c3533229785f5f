"""`rapidkv bench migrate --plot`: downtime and KV moved against the sequence length.

Left: the client-side downtime per length, pre-copy and stop-and-copy (p50
line, p99 as the bar's top), the router's own measure dashed, the
destinations' decode step p50 and the acceptance's bound (3 steps + the
delta's transfer) as reference lines. Right: KiB of KV loaded before and at
the cut-over. Matplotlib with the Agg backend (no display needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLORS = {"precopy": "tab:blue", "stop_and_copy": "tab:red"}
LABELS = {"precopy": "pre-copy", "stop_and_copy": "stop-and-copy"}


def plot(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rapidkv.bench.common.output import save_figure

    lengths = report["lengths"]
    xs = [int(n) for n in lengths]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11.0, 4.4))

    def series(mode: str, key: str, stat: str) -> list[float | None]:
        out = []
        for e in lengths.values():
            m = e["modes"].get(mode)
            s = m[key] if m else None
            out.append(s[stat] if s and s.get("n") else None)
        return out

    for mode in ("precopy", "stop_and_copy"):
        p50 = series(mode, "client_downtime_ms", "p50")
        if all(v is None for v in p50):
            continue
        p99 = series(mode, "client_downtime_ms", "p99")
        pts = [(x, a, b) for x, a, b in zip(xs, p50, p99, strict=True) if a is not None]
        px, py, pz = zip(*pts, strict=True)
        err = [[0] * len(py), [max(z - y, 0) for y, z in zip(py, pz, strict=True)]]
        ax.errorbar(
            px, py, yerr=err, marker="o", capsize=4, color=COLORS[mode],
            label=f"{LABELS[mode]}, client (p50, bar to p99)",
        )  # fmt: skip
        router = series(mode, "router_downtime_ms", "p50")
        rpts = [(x, y) for x, y in zip(xs, router, strict=True) if y is not None]
        if rpts:
            rx, ry = zip(*rpts, strict=True)
            ax.plot(rx, ry, linestyle="--", marker=".", color=COLORS[mode], alpha=0.6,
                    label=f"{LABELS[mode]}, router p50")  # fmt: skip
    steps = [
        (int(n), e["decode_step_ms"]["p50"]) for n, e in lengths.items() if e["decode_step_ms"]["n"]
    ]
    if steps:
        sx, sy = zip(*steps, strict=True)
        ax.plot(
            sx, sy, color="grey", marker="s", markersize=3, label="decode step p50 (destination)"
        )
    bounds = [
        (int(n), a["bound_ms"])
        for n, a in report["acceptance"]["per_length"].items()
        if a["bound_ms"]
    ]
    if bounds:
        bx_, by_ = zip(*bounds, strict=True)
        ax.plot(bx_, by_, color="grey", linestyle=":", label="3 decode steps + delta's transfer")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("sequence length at the order (prompt tokens)")
    ax.set_ylabel("downtime (ms)")
    top = max((y for line in ax.get_lines() for y in line.get_ydata()), default=1.0)
    ax.set_ylim(0, top * 1.6)  # room for the legend above the data
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title("client-side downtime per migration", fontsize=9)

    width = 0.27
    idx = list(range(len(xs)))
    bars = [
        ("precopy", "bytes_before_cutover", "pre-copy: before the cut-over", "tab:cyan"),
        ("precopy", "bytes_at_cutover", "pre-copy: at the cut-over", "tab:blue"),
        ("stop_and_copy", "bytes_at_cutover", "stop-and-copy: at the cut-over", "tab:red"),
    ]
    for j, (mode, key, label, color) in enumerate(bars):
        vals = [(v or 0) / 1024 for v in series(mode, key, "p50")]
        bx.bar([i + (j - 1) * width for i in idx], vals, width, label=label, color=color)
    bx.set_xticks(idx, [str(x) for x in xs])
    bx.set_xlabel("sequence length at the order (prompt tokens)")
    bx.set_ylabel("KV loaded by the destination (KiB, p50)")
    bx.set_yscale("log")
    bx.set_ylim(bottom=16)  # KiB: a tenth of a block of the tiny model and more
    bx.grid(alpha=0.3, axis="y")
    bx.legend(fontsize=7, loc="upper left")
    bx.set_title("KV moved per migration", fontsize=9)
    meta = report["meta"]
    title = (
        f"rapidkv bench migrate: {meta['rounds']} rounds, {meta.get('cpu') or 'unknown CPU'}, "
        f"git {meta.get('git')}"
    )
    return save_figure(fig, path, title)
