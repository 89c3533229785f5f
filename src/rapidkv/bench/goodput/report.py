"""`rapidkv bench goodput`: the report, as JSON and as the terminal's summary.

`build_report` turns what `run.Sweep` measured into the JSON document
(docs/benchmarks/goodput.md lists its keys): per workload its SLOs and `single`'s c1,
per configuration its goodput (`slo.goodput`), `attainment` per rate and, per
rate, what the attainment was made of (with prefix caching: the servers'
prefix-cache hits and a rapidkv router's prompt tokens hit, fetched and
computed); then the issue's acceptance (adaptive's goodput over the best
baseline's, per workload: `options.baselines`). `print_report` prints it as
tables.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from rapidkv.bench.common.output import fmt
from rapidkv.bench.common.reference import NEAR_TIE_MARGIN, near_tie_margin

if TYPE_CHECKING:
    from rapidkv.bench.goodput.options import Options
    from rapidkv.bench.goodput.results import ConfigRun, SweepResult, WorkloadRun

OWN_GROUPS = ("single", "rapidkv")
"""Groups whose failure, or any failed request of theirs, fails the command; a
baseline (dp2, vLLM's NIXL connectors) that fails is reported in
`failed_baselines`. A hard mismatch anywhere fails it."""

NOISY_CORES = 0.2
"""CPU used by processes not ours during a rate, in cores, that makes it `noisy`
(`serve.report.NOISY_CORES`): a shared machine's other work lands on some
configurations and not on others."""

ACCEPTANCE_RATIO = 1.1
"""rapidkv-adaptive's goodput over the best baseline's, on every workload."""

CACHE_SOURCES = ("external", "local", "cached")
"""vLLM's prompt tokens by source (`groups.PROMPT_TOKEN_SOURCES`): received
through a connector, computed, found in the prefix cache."""

SUMMARY_KEYS = ("p50", "p90", "p99", "mean", "max")


def build_report(
    sweep: SweepResult, opts: Options, log_dir: Path, wall_s: float, command: str | None
) -> dict[str, Any]:
    from rapidkv.bench.common.groups import CONFIGS
    from rapidkv.bench.goodput.options import ADAPTIVE, baselines
    from rapidkv.bench.goodput.workloads import WORKLOADS

    workloads: dict[str, Any] = {}
    ok = True
    failed_baselines: set[str] = set()
    hard = 0
    for name, w in sweep.workloads.items():
        configs = {c: config_report(sweep.configs[c], w, opts) for c in opts.configs}
        for c, entry in configs.items():
            hard += entry["hard_mismatches"]
            failed = bool(entry["error"] or entry["errors"])
            if failed and CONFIGS[c].group not in OWN_GROUPS:
                failed_baselines.add(c)
            elif failed:
                ok = False
        c1 = single_c1_report(w, near_tie_margin(opts.dtype))
        hard += (c1 or {}).get("hard_mismatches") or 0
        if w.error is not None or w.slo is None:
            ok = False
        summary = WORKLOADS[name].summary()
        if "warm_up" in summary:  # the warm-up sent at each rate (--rate-warm-up)
            summary["warm_up"] = len(w.warm_prompts)
        workloads[name] = {
            **summary,
            "requests": w.requests,
            "prompt_len_sent": _lengths(w.prompts),
            "prefix_caching": opts.prefix_caching,
            "rates": list(opts.rates[name]),
            "error": w.error,
            "slo": None
            if w.slo is None
            else {
                "ttft_ms": w.slo.ttft_ms,
                "tpot_ms": w.slo.tpot_ms,
                # None: given in ms (--ttft-slo-ms / --tpot-slo-ms)
                "ttft_factor": None if opts.ttft_slo_ms is not None else opts.ttft_slo_factor,
                "tpot_factor": None if opts.tpot_slo_ms is not None else opts.tpot_slo_factor,
                "attainment_target": _target(),
            },
            "single_c1": c1,
            "configs": configs,
            "acceptance": acceptance(configs, baselines(name), ADAPTIVE, opts.rates[name]),
        }
    if hard:
        ok = False
    met = [w["acceptance"]["met"] for w in workloads.values()]
    noisy = [
        f"{w} single c1"
        for w, entry in workloads.items()
        if (entry["single_c1"] or {}).get("other_cpu_cores", 0.0) > NOISY_CORES
    ]
    noisy += [
        f"{w} {c} {rate}"
        for w, entry in workloads.items()
        for c, ce in entry["configs"].items()
        for rate, s in ce["rates"].items()
        if s["other_cpu_cores"] > NOISY_CORES
    ]
    return {
        "meta": meta(opts, log_dir, wall_s, command),
        "noisy": noisy,
        "workloads": workloads,
        "acceptance": {
            "target": f"on every workload, {ADAPTIVE}'s goodput >= {ACCEPTANCE_RATIO:g}x the "
            "best of its baselines ("
            + "; ".join(f"{w}: {', '.join(baselines(w))}" for w in workloads)
            + "); 0 hard mismatches",
            "hard_mismatches_all_configs": hard,
            "met": bool(met) and all(met) and hard == 0,
        },
        "failed_baselines": sorted(failed_baselines),
        "ok": ok,
    }


def _target() -> float:
    from rapidkv.bench.goodput.slo import TARGET

    return TARGET


def _brief(summary: dict[str, float]) -> dict[str, float]:
    return {k: summary[k] for k in SUMMARY_KEYS}


def _lengths(prompts: list[list[int]]) -> dict[str, float] | None:
    """The prompts' lengths in tokens: min, max, mean (None without prompts)."""
    if not prompts:
        return None
    lens = [len(p) for p in prompts]
    return {"min": min(lens), "max": max(lens), "mean": sum(lens) / len(lens)}


def pooled_sources(per_server: list[dict[str, float]]) -> dict[str, float]:
    """Prompt tokens by source (`CACHE_SOURCES`), summed over servers (or rates)."""
    return {k: sum(v.get(k, 0.0) for v in per_server) for k in CACHE_SOURCES}


def cache_figures(
    pooled: dict[str, float], sent: int, router: dict[str, float] | None
) -> dict[str, Any]:
    """What the prefix caches did: the servers' prompt tokens by source
    (`pooled`, `CACHE_SOURCES`), `prefix_cache_hit_fraction` (of the prompt
    tokens the servers counted, the share their caches served, as `bench
    serve`'s `hit`: a prompt handed from P to D counts on both),
    `cached_over_sent` (the same hits over `sent`, the prompt tokens of the
    requests answered), and a rapidkv router's prompt tokens by where its
    placement found them (`router_prefix_tokens`: hit, fetched, computed;
    None for another front) with `fetched_fraction` (fetched over their sum)."""
    counted = sum(pooled.values())
    out: dict[str, Any] = {
        "prompt_tokens_sent": sent,
        "prompt_tokens_by_source": pooled,
        "prefix_cache_hit_fraction": pooled["cached"] / counted if counted else math.nan,
        "cached_over_sent": pooled["cached"] / sent if sent else math.nan,
        "router_prefix_tokens": router,
        "fetched_fraction": None,
    }
    if router is not None:
        total = sum(router.values())
        out["fetched_fraction"] = router.get("fetched", 0.0) / total if total else math.nan
    return out


def single_c1_report(w: WorkloadRun, tie: float = NEAR_TIE_MARGIN) -> dict[str, Any] | None:
    """`single`'s c1 on the workload: what the SLOs were derived from."""
    from rapidkv.bench.common.stats import load_summary

    if w.single_c1 is None:
        return None
    s = load_summary(w.single_c1, w.references, w.single_c1_wall_s, {}, tie=tie)
    return {
        "requests": s["requests"],
        "errors": s["errors"],
        "ttft_ms": _brief(s["ttft_ms"]),
        "tpot_ms": _brief(s["tpot_ms"]),
        "hard_mismatches": s["hard_mismatches"],
        "near_tie_mismatches": s["near_tie_mismatches"],
        "other_cpu_cores": w.single_c1_other_cpu_s / w.single_c1_wall_s
        if w.single_c1_wall_s > 0
        else math.nan,
    }


def rate_report(run: Any, w: WorkloadRun, tie: float = NEAR_TIE_MARGIN) -> dict[str, Any]:
    """One configuration at one rate: attainment and what it was made of."""
    from rapidkv.bench.common.arrivals import offered_rate
    from rapidkv.bench.common.reference import classify
    from rapidkv.bench.common.stats import load_summary
    from rapidkv.bench.goodput.by_placement import by_placement
    from rapidkv.bench.goodput.slo import Outcome, attainment, attains

    refs = w.references
    s = load_summary(run.results, refs, run.wall_s, {}, tie=tie)
    outcomes = [
        Outcome(
            r.ttft_ms,
            r.tpot_ms,
            error=r.error is not None,
            hard_mismatch=refs is not None
            and r.error is None
            and classify(refs[r.prompt_index], r.token_ids, tie) == "hard",
        )
        for r in run.results
    ]
    row: dict[str, Any] = {"rate_req_s": run.rate, "offered_req_s": offered_rate(run.arrivals)}
    if w.slo is not None:
        row.update(attainment(outcomes, w.slo))
        # per request, in request order (paired across configurations: interval.py)
        row["attained"] = [False] * len(w.prompts)
        for r, o in zip(run.results, outcomes, strict=True):
            row["attained"][r.prompt_index] = attains(o, w.slo)
    else:  # no SLO: nothing to judge
        row.update(attainment=None, ttft_attainment=None, tpot_attainment=None, attained=None)
        row["requests"] = s["requests"]
    row.update(
        errors=s["errors"],
        error_examples=s["error_examples"],
        ttft_ms=_brief(s["ttft_ms"]),
        tpot_ms=_brief(s["tpot_ms"]),
        throughput_req_s=s["throughput_req_s"],
        duration_s=s["duration_s"],
        matches=s["matches"],
        hard_mismatches=s["hard_mismatches"],
        near_tie_mismatches=s["near_tie_mismatches"],
        placements=run.placements,
        reasons=run.reasons,
        prompt_tokens=run.prompt_tokens,
        **cache_figures(
            pooled_sources(list(run.prompt_tokens.values())),
            sum(len(w.prompts[r.prompt_index]) for r in run.results if r.error is None),
            run.prefix_tokens,
        ),
        reset_errors=run.reset_errors,
        by_placement=by_placement([r.placement for r in run.results], outcomes, w.slo)
        if run.placements is not None
        else None,
        learned=run.learned,
        server_cpu_s=run.server_cpu_s,
        client_cpu_s=run.client_cpu_s,
        other_cpu_cores=run.other_cpu_s / run.wall_s if run.wall_s > 0 else math.nan,
    )
    return row


def config_report(c: ConfigRun, w: WorkloadRun, opts: Options) -> dict[str, Any]:
    from rapidkv.bench.common.groups import CONFIGS
    from rapidkv.bench.goodput.interval import goodput_interval
    from rapidkv.bench.goodput.slo import goodput, rate_key

    runs = c.rates.get(w.name, {})
    rates: dict[str, Any] = {}
    for rate in opts.rates[w.name]:
        if rate in runs:
            rates[rate_key(rate)] = rate_report(runs[rate], w, near_tie_margin(opts.dtype))
    by_rate = {
        rate: (rates[rate_key(rate)]["attainment"] if rate_key(rate) in rates else None)
        for rate in opts.rates[w.name]
    }
    gp = goodput(by_rate) if w.slo is not None else goodput({})
    interval = goodput_interval(_attained(rates, opts.rates[w.name]))
    counted = list(rates.values())
    routed = [v["router_prefix_tokens"] for v in counted if v["router_prefix_tokens"] is not None]
    return {
        "description": CONFIGS[c.name].description,
        "group": CONFIGS[c.name].group,
        "error": c.error,
        "startup_s": c.startup_s,
        "affinity": c.affinity,
        "router_args": c.router_args.get(w.name),
        "warmup_errors": c.warmup_errors,
        **gp.as_dict(),
        # 95 %, paired block bootstrap over the requests (interval.py)
        "goodput_interval_req_s": interval,
        "attainment": {rate_key(r): a for r, a in by_rate.items()},
        "requests": sum(v["requests"] for v in counted),
        "errors": sum(v["errors"] for v in counted),
        "hard_mismatches": sum(v["hard_mismatches"] or 0 for v in counted),
        "near_tie_mismatches": sum(v["near_tie_mismatches"] or 0 for v in counted),
        # over every rate: see cache_figures
        **cache_figures(
            pooled_sources([v["prompt_tokens_by_source"] for v in counted]),
            sum(v["prompt_tokens_sent"] for v in counted),
            {k: sum(r.get(k, 0.0) for r in routed) for k in routed[0]} if routed else None,
        ),
        "rates": rates,
    }


def acceptance(
    configs: dict[str, Any],
    baselines: tuple[str, ...],
    adaptive: str,
    rates: tuple[float, ...] | list[float] = (),
) -> dict[str, Any]:
    """`adaptive`'s goodput over the best of `baselines` on one workload. Met
    only with every baseline and `adaptive` measured, none of the baselines
    above the sweep (its goodput would be a lower bound: the ratio an upper
    one), and a positive goodput for `adaptive`. `interval`: the ratio's
    paired block bootstrap over the swept `rates` (interval.py), None
    without per-request attainment."""
    got = {b: configs[b]["goodput_req_s"] for b in baselines if b in configs}
    known = {b: g for b, g in got.items() if g is not None}
    best = max(known, key=lambda b: known[b], default=None)
    mine = configs.get(adaptive, {}).get("goodput_req_s")
    out: dict[str, Any] = {
        "adaptive": adaptive,
        "adaptive_goodput_req_s": mine,
        "baselines_goodput_req_s": got,
        "best_baseline": best,
        "best_baseline_goodput_req_s": known.get(best) if best else None,
        "ratio": None,
        "interval": _interval(configs, baselines, adaptive, rates),
        "met": False,
        "why_not": None,
    }
    missing = [b for b in baselines if b not in known]
    if mine is None or missing:
        absent = missing + ([adaptive] if mine is None else [])
        out["why_not"] = f"not measured: {', '.join(absent)}"
        return out
    assert best is not None
    b = known[best]
    out["ratio"] = mine / b if b > 0 else (math.inf if mine > 0 else math.nan)
    above = [x for x in baselines if configs[x]["goodput_bound"] == "above_sweep"]
    if above:
        out["why_not"] = f"{', '.join(above)} met the target at every rate: raise --rates"
    elif mine <= 0 or mine < ACCEPTANCE_RATIO * b:
        out["why_not"] = f"{mine:g} < {ACCEPTANCE_RATIO:g} x {b:g} req/s"
    else:
        out["met"] = True
    return out


def _interval(
    configs: dict[str, Any],
    baselines: tuple[str, ...],
    adaptive: str,
    rates: tuple[float, ...] | list[float],
) -> dict[str, Any] | None:
    from rapidkv.bench.goodput.interval import ratio_interval

    attained = {
        c: _attained(configs[c].get("rates", {}), rates)
        for c in (adaptive, *baselines)
        if c in configs
    }
    return ratio_interval(attained, adaptive, baselines, ACCEPTANCE_RATIO)


def _attained(
    rates: dict[str, Any], swept: tuple[float, ...] | list[float]
) -> dict[float, list[bool] | None]:
    """One configuration's per-request attainment at each swept rate (None: not run)."""
    from rapidkv.bench.goodput.slo import rate_key

    return {r: (rates.get(rate_key(r)) or {}).get("attained") for r in swept}


def meta(opts: Options, log_dir: Path, wall_s: float, command: str | None) -> dict[str, Any]:
    from rapidkv.bench.common.groups import COMMON_ARGS, CONFIGS
    from rapidkv.bench.common.provenance import machine_info
    from rapidkv.bench.goodput.options import ARRIVAL_SALT, is_adaptive
    from rapidkv.harness.procs import cpu_model

    return {
        **machine_info(),
        "cpu": cpu_model(),
        "command": command,
        "model": opts.model,
        "dataset": opts.dataset,
        "dtype": opts.dtype,
        "configs": list(opts.configs),
        "workloads": list(opts.workloads),
        "requests_per_rate": opts.requests,
        "warmup_requests": opts.warmup,
        "seed": opts.seed,
        "arrival_seed": f"each workload's seed + {ARRIVAL_SALT}, the same gaps at every rate",
        "ttft_slo_factor": opts.ttft_slo_factor,
        "tpot_slo_factor": opts.tpot_slo_factor,
        "ttft_slo_ms": opts.ttft_slo_ms,
        "tpot_slo_ms": opts.tpot_slo_ms,
        "attainment_target": _target(),
        "timeout_s": opts.timeout,
        "include_usage": opts.include_usage,
        "server_args": [*(() if opts.prefix_caching else COMMON_ARGS), *opts.server_args],
        # every server's cache emptied before every rate (and single's c1)
        "prefix_caching": opts.prefix_caching,
        # the rapidkv group's servers publish --kv-events-config (ZMQ, loopback)
        "kv_events": opts.prefix_caching
        and any(is_adaptive(CONFIGS[c].front) for c in opts.configs),
        "near_tie_margin": near_tie_margin(opts.dtype),
        "wall_s": wall_s,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "log_dir": str(log_dir),
    }


# ------------------------------------------------------------------ printing


def print_report(report: dict[str, Any], out: IO[str]) -> None:
    cols = (
        ("TTFT p50", "ttft_ms", "p50"),
        ("p90", "ttft_ms", "p90"),
        ("TPOT p50", "tpot_ms", "p50"),
        ("p90", "tpot_ms", "p90"),
    )
    for name, w in report["workloads"].items():
        print(f"\n== {name}: {w['description']}", file=out)
        slo, c1 = w["slo"], w["single_c1"]
        if slo is None:
            print(f"no SLOs: {w['error']}", file=out)
        else:
            base = c1 or {"ttft_ms": {"p50": math.nan}, "tpot_ms": {"p50": math.nan}}
            noise = base.get("other_cpu_cores")
            if noise is not None and noise > NOISY_CORES:
                print(f"WARNING: others used {noise:.2f} cores during single's c1", file=out)
            ttft, tpot = (
                "given"
                if slo[f"{k}_factor"] is None
                else f"{slo[f'{k}_factor']:g} x single c1 p50 {fmt(base[f'{k}_ms']['p50'], 2)}"
                for k in ("ttft", "tpot")
            )
            print(
                f"SLOs: TTFT {fmt(slo['ttft_ms'])} ms ({ttft}), TPOT {fmt(slo['tpot_ms'], 2)} "
                f"ms ({tpot}); goodput: the highest rate before the first with < "
                f"{slo['attainment_target']:.0%} attaining both",
                file=out,
            )
        caching = w.get("prefix_caching", False)
        if caching:
            print(
                "prefix caching on, every server's cache emptied before every rate; hit: the "
                "share of the prompt tokens the servers counted that their caches served; "
                "tokens: a rapidkv router's prompt tokens hit / fetched / computed",
                file=out,
            )
        width = max([18, *(len(k) + 1 for k in w["configs"])])
        head = f"{'config':<{width}}{'rate':>6}{'offer':>7}{'attain':>8}{'ttft':>6}{'tpot':>6}"
        head += "".join(f"{h:>9}" for h, _, _ in cols)
        head += f"{'req/s':>7}{'n':>4}{'err':>4}{'hard':>5}{'tie':>4}{'other':>6}"
        head += f"{'hit':>5}  placements" if caching else "  placements"
        print(f"{head}\n{'-' * len(head)}", file=out)
        for key, c in w["configs"].items():
            if c["error"]:
                print(f"{key:<{width}}ERROR {c['error'].splitlines()[0][:110]}", file=out)
            for rk, s in c["rates"].items():
                line = f"{key:<{width}}{rk:>6}{fmt(s['offered_req_s']):>7}"
                line += f"{_pct(s['attainment']):>8}{_pct(s.get('ttft_attainment')):>6}"
                line += f"{_pct(s.get('tpot_attainment')):>6}"
                line += "".join(f"{fmt(s[m][k]):>9}" for _, m, k in cols)
                line += f"{fmt(s['throughput_req_s']):>7}{s['requests']:>4}{s['errors']:>4}"
                line += f"{fmt(s['hard_mismatches'], 0):>5}{fmt(s['near_tie_mismatches'], 0):>4}"
                line += f"{fmt(s['other_cpu_cores'], 2):>6}"
                if caching:
                    line += f"{_pct(s.get('prefix_cache_hit_fraction')):>5}"
                if s["placements"]:
                    line += "  " + " ".join(f"{k} {v:.0f}" for k, v in s["placements"].items() if v)
                tokens = s.get("router_prefix_tokens")
                if caching and tokens and any(tokens.values()):  # a router with an index
                    line += "; tokens " + "/".join(
                        f"{tokens.get(k, 0.0):.0f}" for k in ("hit", "fetched", "computed")
                    )
                print(line, file=out)
        print("goodput (req/s):", file=out)
        for key, c in w["configs"].items():
            if caching:
                tokens = c.get("router_prefix_tokens") or {}
                pulled = f", fetched {tokens['fetched']:.0f} tokens" if any(tokens.values()) else ""
                hit = f" (hit {_pct(c.get('prefix_cache_hit_fraction'))}{pulled})"
            else:
                hit = ""
            extra = "" if c["goodput_bound"] == "within" else f" ({c['goodput_bound']})"
            if not c["attainment_monotonic"]:
                extra += f" (not monotonic: DistServe's max rule {fmt(c['goodput_max_req_s'])})"
            interp = c["goodput_interpolated_req_s"]
            if interp is not None:
                extra += f", crossing ~{fmt(interp)}"
            iv = c.get("goodput_interval_req_s")
            if iv:
                extra += f", 95 % [{fmt(iv[0])}, {fmt(iv[1])}]"
            print(f"  {key:<{width}}{fmt(c['goodput_req_s']):>7}{extra}{hit}", file=out)
        a = w["acceptance"]
        why = f" ({a['why_not']})" if a["why_not"] else ""
        iv = a.get("interval")
        ci = (
            f" [{fmt(iv['ratio_low'], 2)}, {fmt(iv['ratio_high'], 2)}], "
            f">= {ACCEPTANCE_RATIO:g} in {_pct(iv['p_met'])} of resamples"
            if iv and iv["ratio_low"] is not None
            else ""
        )
        print(
            f"acceptance: {a['adaptive']} {fmt(a['adaptive_goodput_req_s'])} vs best baseline "
            f"{a['best_baseline']} {fmt(a['best_baseline_goodput_req_s'])}: ratio "
            f"{fmt(a['ratio'], 2)}{ci}, met {a['met']}{why}",
            file=out,
        )
    if report["noisy"]:
        print(
            f"\nWARNING: processes not ours used > {NOISY_CORES:g} cores (column `other`) "
            f"during {len(report['noisy'])} rates: {', '.join(report['noisy'][:12])}"
            + (" ..." if len(report["noisy"]) > 12 else ""),
            file=out,
        )
    acc = report["acceptance"]
    print(f"\nacceptance: {acc['target']}", file=out)
    print(f"  hard mismatches: {acc['hard_mismatches_all_configs']}, met: {acc['met']}", file=out)
    m = report["meta"]
    print(f"cpu: {m['cpu']} ({m['cpus']} cpus), wall {m['wall_s']:.0f} s", file=out)
    if report["failed_baselines"]:
        print(f"baselines that failed: {', '.join(report['failed_baselines'])}", file=out)
    print(f"\nresult: {'OK' if report['ok'] else 'FAILED'}", file=out)


def _pct(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v * 100:.0f}%"
