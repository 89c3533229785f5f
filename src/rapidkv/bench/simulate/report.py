"""`rapidkv bench simulate`'s output: the JSON, the table, the plot.

JSON (`build`), every figure simulated:

    {"bench": "simulate", "date", "git", "options": {...},
     "fit": {<Fit's fields>, "measurements": {...}, "source", "warnings": [...]},
     "fit_check": [{"config", "load", "ttft_p50_ms", "measured_ttft_p50_ms",
                    "tpot_p50_ms", "measured_tpot_p50_ms", "in_fit"}, ...],
     "workloads": {"<workload>": {
         "slo": {"ttft_ms", "tpot_ms", "source", "single_c1_ttft_p50_ms", "single_c1_tpot_p50_ms"},
         "prefix_caching": bool, "cache_blocks": N,       # the latter with prefix caching
         "sizes": {"<n>": {"requests": N, "policies": {"<policy>": {
             "goodput_req_s", "goodput_per_instance_req_s",
             "attainment": {"<rate>": fraction},
             "points": [{"rate", "attainment", "ttft_ms": {"p50", "p90"}, "tpot_ms": {...},
                         "throughput_req_s", "placements": {kind: count},
                         "misses": {"ttft"|"tpot"|"both": count},
                         "router": {...},
                         "prefix_tokens": {                # with prefix caching
                             "instances": {"cached", "external", "computed"},
                             "hit_fraction", "placed": {"hit", "fetched", "computed"},
                             "evictions", "cache_blocks"}}]}}}}}},
     "summary": [{"workload", "instances", "policy", "goodput_req_s",
                  "goodput_per_instance_req_s",
                  "hit_fraction", "fetched_fraction"}],  # the last two: prefix caching
     "compare": {...}}                                   # with --compare only

With prefix caching, a policy's ``hit_fraction`` and ``fetched_fraction``
in the summary and the table are those of the rate of its goodput (the
highest passing rate; its lowest rate when none passes): of the prompt
tokens the instances counted, the share their caches served; of the prompt
tokens the router placed, the share it fetched from another instance's cache.

``points[].router`` is the only part that is not a function of the options:
the adaptive router's mean wall time per `decide` on this machine
(``decide_ms_mean``), its reasons and what its models learned.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rapidkv.bench.common.provenance import git_describe


def build(
    *,
    options: dict[str, Any],
    fit: dict[str, Any],
    fit_check: list[dict[str, Any]] | None,
    workloads: dict[str, Any],
    compare: dict[str, Any] | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "bench": "simulate",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "git": git_describe(),
        "options": options,
        "fit": fit,
        "fit_check": fit_check,
        "workloads": workloads,
        "summary": summary(workloads),
    }
    if compare is not None:
        out["compare"] = compare
    return out


def summary(workloads: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for wname, w in workloads.items():
        for n, size in sorted(w["sizes"].items(), key=lambda kv: int(kv[0])):
            for policy, s in size["policies"].items():
                row = {
                    "workload": wname,
                    "instances": int(n),
                    "policy": policy,
                    "goodput_req_s": s["goodput_req_s"],
                    "goodput_per_instance_req_s": s["goodput_per_instance_req_s"],
                }
                if w.get("prefix_caching"):
                    row.update(prefix_at_goodput(s))
                rows.append(row)
    return rows


def prefix_at_goodput(s: dict[str, Any]) -> dict[str, float | None]:
    """The hit and fetched shares at the rate of a sweep's goodput (its lowest
    rate when none passes); None where the point has no prefix figures."""
    points = s.get("points") or []
    if not points:
        return {"hit_fraction": None, "fetched_fraction": None}
    at = [p for p in points if p["rate"] <= s["goodput_req_s"]] or points[:1]
    t = max(at, key=lambda p: p["rate"]).get("prefix_tokens")
    if not t:
        return {"hit_fraction": None, "fetched_fraction": None}
    placed = sum(t["placed"].values())
    return {
        "hit_fraction": t["hit_fraction"],
        "fetched_fraction": t["placed"]["fetched"] / placed if placed else 0.0,
    }


def table(report: dict[str, Any]) -> str:
    """Goodput per fleet size, a column per policy: total (per instance), req/s;
    the first adaptive policy's mean wall time per `decide` on this machine."""
    lines: list[str] = []
    for wname, w in report["workloads"].items():
        slo = w["slo"]
        lines.append(
            f"{wname}: SLO TTFT {slo['ttft_ms']:.1f} ms, TPOT {slo['tpot_ms']:.2f} ms "
            f"({slo['source']}); goodput req/s, total (per instance), simulated"
        )
        policies: list[str] = []
        for size in w["sizes"].values():
            policies += [p for p in size["policies"] if p not in policies]
        head = f"{'instances':>9s}  {'requests':>8s}" + "".join(f"  {p:>18s}" for p in policies)
        adaptive = next((p for p in policies if p.startswith("adaptive")), None)
        if adaptive:
            head += "  decide ms"
        lines.append(head)
        for n, size in sorted(w["sizes"].items(), key=lambda kv: int(kv[0])):
            row = f"{n:>9s}  {size['requests']:>8d}"
            for p in policies:
                s = size["policies"].get(p)
                cell = (
                    "-"
                    if s is None
                    else (f"{s['goodput_req_s']:.1f} ({s['goodput_per_instance_req_s']:.2f})")
                )
                row += f"  {cell:>18s}"
            if adaptive:
                row += f"  {_decide_ms(size['policies'].get(adaptive)):>9s}"
            lines.append(row)
        if w.get("prefix_caching"):
            lines.append(
                f"prefix caches ({w.get('cache_blocks', '?')} blocks an instance) at each "
                "goodput: the instances' prompt tokens their caches served / the router's "
                "prompt tokens fetched"
            )
            for n, size in sorted(w["sizes"].items(), key=lambda kv: int(kv[0])):
                row = f"{n:>9s}  {'':>8s}"
                for p in policies:
                    s = size["policies"].get(p)
                    f = prefix_at_goodput(s) if s else {}
                    hit, fetched = f.get("hit_fraction"), f.get("fetched_fraction")
                    cell = "-" if hit is None else f"{100 * hit:.0f} % / {100 * fetched:.0f} %"
                    row += f"  {cell:>18s}"
                lines.append(row)
        lines.append("")
    return "\n".join(lines).rstrip()


def _decide_ms(s: dict[str, Any] | None) -> str:
    if not s:
        return "-"
    values = [
        p["router"]["decide_ms_mean"]
        for p in s["points"]
        if p.get("router", {}).get("decide_ms_mean") is not None
    ]
    return f"{sum(values) / len(values):.2f}" if values else "-"


def plot(report: dict[str, Any], path: str | Path) -> None:
    """Goodput per instance against fleet size: a panel per workload, a line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = report["workloads"]
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4), squeeze=False)
    for ax, (wname, w) in zip(axes[0], workloads.items(), strict=True):
        by_policy: dict[str, list[tuple[int, float]]] = {}
        for n, size in w["sizes"].items():
            for p, s in size["policies"].items():
                by_policy.setdefault(p, []).append((int(n), s["goodput_per_instance_req_s"]))
        for p, pts in by_policy.items():
            pts.sort()
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p)
        ax.set_xscale("log", base=2)
        sizes = sorted(int(n) for n in w["sizes"])
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.minorticks_off()
        ax.set_xlabel("instances")
        ax.set_ylabel("goodput per instance (req/s)")
        ax.set_title(f"{wname} (simulated)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
