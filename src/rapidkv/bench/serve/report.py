"""`rapidkv bench serve`: the report, as JSON and as the terminal's summary table.

`build_report` turns what `serve.ModelResult` measured into the JSON document
(`docs/benchmarks/serve.md` lists its keys); `print_report` prints the table, the
noise warnings, start-up times and the issue's acceptance ratios.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from rapidkv.bench.common.output import fmt
from rapidkv.bench.common.provenance import machine_info

if TYPE_CHECKING:
    from rapidkv.bench.serve.options import Options
    from rapidkv.bench.serve.results import ConfigRun, LoadRun, ModelResult

NOISY_CORES = 0.2  # CPU used by processes not ours during a load, in cores, worth a warning
OWN_GROUPS = ("single", "rapidkv")
"""Groups whose failure fails the command; a baseline (dp2, vLLM's NIXL connectors)
that fails is reported in `failed_baselines`. A hard mismatch anywhere fails it."""


def build_report(runs: list[ModelResult], opts: Options, log_dir: Path) -> dict[str, Any]:
    from rapidkv.bench.common.groups import CONFIGS

    several = len(runs) > 1
    configs: dict[str, Any] = {}
    acceptance: dict[str, Any] = {}
    stalls: dict[str, Any] = {}
    ok = True
    failed_baselines = []
    for mr in runs:
        entries = {name: config_report(mr, c) for name, c in mr.configs.items()}
        for name, entry in entries.items():
            key = f"{name}@{mr.model}" if several else name
            entry.update(description=CONFIGS[name].description, group=CONFIGS[name].group)
            entry["kv_transfer_params"] = CONFIGS[name].params
            configs[key] = entry
            failed = bool(entry["error"] or entry["errors"])
            if failed and CONFIGS[name].group not in OWN_GROUPS:
                failed_baselines.append(key)  # reported, not a failure of this command
            elif failed or entry["hard_mismatches"] or mr.reference_error is not None:
                ok = False
            elif entry["paired_single_hard_mismatches"]:
                ok = False  # `single` disagreed with its own reference
        acceptance[mr.model] = acceptance_report(entries)
        stalls[mr.model] = stall_report(entries)
    return {
        "meta": meta(runs, opts, log_dir),
        "reference": {mr.model: {"config": "single", "error": mr.reference_error} for mr in runs},
        "configs": configs,
        "acceptance": acceptance,
        "stalls": stalls,
        "failed_baselines": failed_baselines,
        "ok": ok,
    }


def config_report(mr: ModelResult, c: ConfigRun) -> dict[str, Any]:
    from rapidkv.bench.common.stats import load_summary, merge_histograms, summarize

    loads: dict[str, Any] = {}
    for load, runs in c.loads.items():
        servers = sorted({server for run in runs for server in run.engine_ttft})
        pooled = load_summary(
            [r for run in runs for r in run.results],
            mr.references,
            sum(run.wall_s for run in runs),
            _sum_dicts([run.cpu_s for run in runs]),
            {
                server: merge_histograms(
                    run.engine_ttft[server] for run in runs if server in run.engine_ttft
                )
                for server in servers
            },
            mr.tie,
        )
        pooled["prompt_tokens"] = {
            server: _sum_dicts([run.prompt_tokens[server] for run in runs])
            for server in runs[0].prompt_tokens
        }
        sent = sum(len(mr.prompts[r.prompt_index]) for run in runs for r in run.results)
        external = sum(v["external"] for v in pooled["prompt_tokens"].values())
        pooled["kv_transferred_fraction"] = external / sent if sent else math.nan
        counted = sum(sum(v.values()) for v in pooled["prompt_tokens"].values())
        cached = sum(v.get("cached", 0.0) for v in pooled["prompt_tokens"].values())
        pooled["prefix_cache_hit_fraction"] = cached / counted if counted else math.nan
        pooled["client_cpu_s"] = sum(run.client_cpu_s for run in runs)
        pooled["other_cpu_s"] = sum(run.other_cpu_s for run in runs)
        wall = pooled["duration_s"]
        pooled["other_cpu_cores"] = pooled["other_cpu_s"] / wall if wall > 0 else math.nan
        paired_runs = [run for run in runs if run.paired_single is not None]
        if paired_runs:
            pooled["paired_single"] = paired_summary(mr, paired_runs)
        if len(runs) > 1:
            per_round = []
            for run in runs:
                s = load_summary(
                    run.results, mr.references, run.wall_s, run.cpu_s, run.engine_ttft, mr.tie
                )
                row = {
                    "round": run.round,
                    "ttft_ms_p50": s["ttft_ms"]["p50"],
                    **_stall_figures(s),
                    "tpot_ms_p50": s["tpot_ms"]["p50"],
                    "throughput_req_s": s["throughput_req_s"],
                }
                if run.paired_single is not None:
                    ps = summarize([r.tpot_ms for r in run.paired_single if r.error is None])
                    row["paired_single_tpot_ms_p50"] = ps["p50"]
                per_round.append(row)
            pooled["rounds"] = per_round
        loads[load] = pooled
    counted = list(loads.values())
    startup = summarize(c.startup_s)
    return {
        "error": c.error,
        "startup_s": startup["mean"] if c.startup_s else None,
        "startup_s_rounds": c.startup_s,
        "server_startup_s": c.server_startup_s,
        "first_request_ms": c.first_request_ms,
        "affinity": c.affinity,
        "errors": sum(v["errors"] for v in counted),
        "hard_mismatches": sum(v["hard_mismatches"] or 0 for v in counted),
        "near_tie_mismatches": sum(v["near_tie_mismatches"] or 0 for v in counted),
        "paired_single_hard_mismatches": sum(
            v["paired_single"]["hard_mismatches"] or 0 for v in counted if "paired_single" in v
        ),
        "loads": loads,
    }


PAIRED_KEYS = ("requests", "errors", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
PAIRED_KEYS += ("ttft_over_1s", "hard_mismatches", "near_tie_mismatches")
PAIRED_KEYS += ("itl_max_ms", "gaps_over_250ms", "lumped_share")


def paired_summary(mr: ModelResult, runs: list[LoadRun]) -> dict[str, Any]:
    """`single` on the same blocks as the configuration, in the same rounds, and
    the configuration's TPOT p50 over it (from those rounds only), with a 95 %
    bootstrap interval over the blocks: how far this run's ratio can be trusted."""
    from rapidkv.bench.common.stats import load_summary, paired_ratio_interval, summarize

    single = [r for run in runs for r in run.paired_single or []]
    wall = sum(run.paired_single_wall_s for run in runs)
    s = load_summary(single, mr.references, wall, {}, tie=mr.tie)
    out = {k: s[k] for k in PAIRED_KEYS}
    own = summarize([r.tpot_ms for run in runs for r in run.results if r.error is None])
    out["tpot_p50_over_paired_single"] = own["p50"] / s["tpot_ms"]["p50"]
    blocks: dict[tuple[int, int], tuple[list[float], list[float]]] = {}
    for run in runs:  # a block: (round, prompt index // block size)
        for side, results in enumerate((run.results, run.paired_single or [])):
            for r in results:
                if r.error is None and not math.isnan(r.tpot_ms):
                    key = (run.round, r.prompt_index // mr.opts.pair_block)
                    blocks.setdefault(key, ([], []))[side].append(r.tpot_ms)
    out["tpot_p50_over_paired_single_ci95"] = list(paired_ratio_interval(list(blocks.values())))
    out["blocks"] = len(blocks)
    return out


TPOT_COMPARED = ("single", "single-noop-connector", "dp2", "rapidkv")

TTFT_OVER_SINGLE_C1 = 0.7
"""rapidkv's TTFT p50 at c1 at most this share of `single`'s: a split computes
about half of the prompt on each core."""
TTFT_OVER_VLLM_NIXL = 0.5
"""rapidkv's TTFT p50 at c1 and c4 at most this share of tuned `vllm-nixl`'s."""
TPOT_OVER_DP2 = 1.05
"""rapidkv's TPOT p50 at c1 and c4 at most this multiple of `dp2`'s: both use
both cores (`single`'s lone-core TPOT is no floor for a pair)."""
GAP_LIMIT_MS = 1000.0
"""No inter-token gap of a rapidkv request over this."""


def acceptance_report(configs: dict[str, Any]) -> dict[str, Any]:
    """The acceptance ratios of `rapidkv` (the router's defaults), where both
    sides were measured: TTFT p50 over `single`'s at c1 and over tuned
    `vllm-nixl`'s at c1 and c4, TPOT p50 over `dp2`'s at c1 and c4, output
    tokens/s over `dp2`'s at c4, its longest inter-token gap, and hard
    mismatches anywhere. Context, no targets: its TPOT over `single`'s (on the
    same blocks where paired, with their interval) and the no-op connector's
    floor. A target whose sides were not both measured is left out of `met`."""

    def stat(name: str, load: str, measure: str, key: str | None = None) -> float:
        try:
            value = configs[name]["loads"][load][measure]
            return float(value if key is None else value[key])
        except KeyError:
            return math.nan

    def paired(name: str, load: str) -> dict[str, Any] | None:
        """`name`'s comparison with `single` on the same blocks (None: not paired)."""
        return configs.get(name, {}).get("loads", {}).get(load, {}).get("paired_single")

    out: dict[str, Any] = {}
    at_most: dict[str, float] = {}
    ttft = "ttft_p50_rapidkv_over_single_c1"
    out[ttft] = stat("rapidkv", "c1", "ttft_ms", "p50") / stat("single", "c1", "ttft_ms", "p50")
    at_most[ttft] = TTFT_OVER_SINGLE_C1
    for load in ("c1", "c4"):
        key = f"ttft_p50_rapidkv_over_vllm_nixl_{load}"
        mine, theirs = (
            stat("rapidkv", load, "ttft_ms", "p50"),
            stat("vllm-nixl", load, "ttft_ms", "p50"),
        )
        out[key], at_most[key] = mine / theirs, TTFT_OVER_VLLM_NIXL
        key = f"tpot_p50_rapidkv_over_dp2_{load}"
        mine, theirs = stat("rapidkv", load, "tpot_ms", "p50"), stat("dp2", load, "tpot_ms", "p50")
        out[key], at_most[key] = mine / theirs, TPOT_OVER_DP2
    throughput = "output_tok_s_rapidkv_over_dp2_c4"
    out[throughput] = stat("rapidkv", "c4", "output_tok_s") / stat("dp2", "c4", "output_tok_s")
    gaps = [
        stat("rapidkv", load, "itl_max_ms") for load in configs.get("rapidkv", {}).get("loads", {})
    ]
    out["itl_max_ms_rapidkv"] = max(gaps, default=math.nan)
    at_most["itl_max_ms_rapidkv"] = GAP_LIMIT_MS
    out["hard_mismatches_all_configs"] = sum(
        c["hard_mismatches"] + c.get("paired_single_hard_mismatches", 0) for c in configs.values()
    )
    # context
    loads = sorted({load for c in configs.values() for load in c["loads"]})
    for load in loads:
        tpot = {name: stat(name, load, "tpot_ms", "p50") for name in TPOT_COMPARED}
        pair = paired("rapidkv", load)
        out[f"paired_{load}"] = pair is not None
        unpaired = tpot["rapidkv"] / tpot["single"]
        if pair is None:
            out[f"tpot_p50_rapidkv_over_single_{load}"] = unpaired
        else:
            out[f"tpot_p50_rapidkv_over_single_{load}"] = pair["tpot_p50_over_paired_single"]
            ci95 = pair["tpot_p50_over_paired_single_ci95"]
            out[f"ci95_tpot_p50_rapidkv_over_single_{load}"] = ci95
            out[f"unpaired_tpot_p50_rapidkv_over_single_{load}"] = unpaired
        noop = tpot["single-noop-connector"]
        noop_pair = paired("single-noop-connector", load)
        floor = (
            noop / tpot["single"] if noop_pair is None else noop_pair["tpot_p50_over_paired_single"]
        )
        out[f"floor_tpot_p50_noop_connector_over_single_{load}"] = floor
    checks = [out[k] <= limit for k, limit in at_most.items() if not math.isnan(out[k])]
    if not math.isnan(out[throughput]):
        checks.append(out[throughput] >= 1.0)
    out["targets"] = (
        f"rapidkv TTFT p50 <= {TTFT_OVER_SINGLE_C1}x single at c1 and <= "
        f"{TTFT_OVER_VLLM_NIXL}x vllm-nixl at c1, c4; TPOT p50 <= {TPOT_OVER_DP2}x dp2 at "
        f"c1, c4; c4 output tok/s >= dp2; no gap over {GAP_LIMIT_MS / 1000:.0f} s; "
        "0 hard mismatches"
    )
    out["met"] = bool(checks) and all(checks) and out["hard_mismatches_all_configs"] == 0
    return out


STALL_P99_OVER_P50 = 4.0
"""Context, no target: a TTFT p99 this far above the p50 was the first sign of
a stall, and is also what engine queueing gives at a deep load."""


DEEP_OVER_DP2 = 0.5
"""At c16 and c32 a rapidkv configuration serves at least this share of dp2's
rate: one P prefills every prompt, which two plain replicas share."""
THROUGHPUT_TARGETS: dict[str, dict[str, float]] = {
    "c4": {"vllm-nixl": 1.0},
    "c16": {"vllm-nixl": 1.0, "dp2": DEEP_OVER_DP2},
    "c32": {"vllm-nixl": 1.0, "dp2": DEEP_OVER_DP2},
}
"""Per load, the baselines whose throughput a rapidkv configuration's is held
against, and the least ratio (the stall report's targets)."""


def stall_report(configs: dict[str, Any]) -> dict[str, Any]:
    """Whether any rapidkv configuration stalled, over whole streams: per load,
    requests whose TTFT was over 1 s (target 0), the longest inter-token gap
    (target <= 1 s), the client's TTFT p90 against the engines' own (target <=
    1.5x + 50 ms: else requests waited outside the engines); at c4, c16 and c32
    its throughput over tuned vllm-nixl's (target >= 1) and at c16 and c32 over
    dp2's (target >= `DEEP_OVER_DP2`: one P prefills every prompt that two
    replicas share). Shown beside them: the longest TTFT, the gaps over 250 ms,
    the share of gaps under 1 ms (tokens that came in lumps) and TTFT p99 /
    p50. (Only c1 is ever paired, and it has no throughput target: every load
    held to one runs whole, as the baselines do.)"""
    from rapidkv.bench.common.stats import ENGINE_TTFT_FACTOR, ENGINE_TTFT_SLACK_MS, SLOW_GAP_MS

    out: dict[str, Any] = {}
    checks: list[bool] = []
    baselines = {base: configs.get(base, {}).get("loads", {}) for base in ("vllm-nixl", "dp2")}
    for name, c in configs.items():
        if not name.startswith("rapidkv"):
            continue
        for load, s in c["loads"].items():
            row = {
                **_stall_figures(s),
                "lumped_share": s["lumped_share"],
                "engine_ttft_ms_p90_by_server": s.get("engine_ttft_ms_p90_by_server", {}),
                "client_ttft_over_engine_p90": s["client_ttft_over_engine_p90"],
                "client_ttft_within_engine_bound": s["client_ttft_within_engine_bound"],
                "ttft_p99_over_p50": s["ttft_ms"]["p99"] / s["ttft_ms"]["p50"],
            }
            checks += [
                row["ttft_over_1s"] == 0,
                not row["itl_max_ms"] > SLOW_GAP_MS,  # nan: no gaps (one token each)
                row["client_ttft_within_engine_bound"] is True,  # None: engines' unknown
            ]
            for base, least in THROUGHPUT_TARGETS.get(load, {}).items():
                if load not in baselines[base]:
                    continue
                ratio = s["throughput_req_s"] / baselines[base][load]["throughput_req_s"]
                row[f"throughput_over_{base.replace('-', '_')}"] = ratio
                checks.append(ratio >= least)
            out[f"{name} {load}"] = row
    out["targets"] = (
        "every rapidkv configuration, every load: no TTFT over 1 s, no inter-token gap "
        f"over {SLOW_GAP_MS / 1000:g} s, client TTFT p90 <= {ENGINE_TTFT_FACTOR:g}x the "
        f"engines' TTFT p90 + {ENGINE_TTFT_SLACK_MS:g} ms; at c4, c16 and c32 throughput >= "
        f"tuned vllm-nixl's, at c16 and c32 >= {DEEP_OVER_DP2:g}x dp2's"
    )
    out["met"] = bool(checks) and all(checks)
    return out


def meta(runs: list[ModelResult], opts: Options, log_dir: Path) -> dict[str, Any]:
    from rapidkv.bench.common.dataset import TURNS
    from rapidkv.bench.common.groups import PAIR_PAUSE_S
    from rapidkv.bench.common.reference import near_tie_margin
    from rapidkv.bench.serve.options import MULTITURN
    from rapidkv.connector.config import ConnectorConfig

    lengths = [len(p) for p in runs[0].prompts] or [0]  # multiturn: none without a reference
    return {
        **machine_info(),
        "models": {mr.model: str(mr.model_dir) for mr in runs},
        "dtype": {mr.model: opts.dtype_of(mr.model) for mr in runs},
        "requests": opts.requests,
        "prompt_len": {
            "min": min(lengths),
            "max": max(lengths),
            "mean": sum(lengths) / len(lengths),
        },
        "dataset": opts.dataset,
        "turns": TURNS if opts.dataset == MULTITURN else 1,  # per conversation
        "max_tokens": opts.max_tokens,  # sharegpt: the cap on each answer's length
        "output_len": {
            "min": min(runs[0].max_tokens),
            "max": max(runs[0].max_tokens),
            "mean": sum(runs[0].max_tokens) / len(runs[0].max_tokens),
        },
        "loads": [load.name for load in opts.loads],
        "include_usage": opts.include_usage,
        "rounds": opts.rounds,
        "warmup_requests": opts.warmup,
        "pair_block": opts.pair_block,
        "pair_pause_s": PAIR_PAUSE_S,
        "seed": opts.seed,
        "prefix_caching": opts.prefix_caching,
        "server_args": [
            *(() if opts.prefix_caching else ("--no-enable-prefix-caching",)),
            *opts.server_args,
        ],
        "base_url": opts.base_url,
        "reference_url": opts.reference_url,
        "rapidkv_default_transfer_kv_mode": ConnectorConfig().transfer_kv_mode,
        "near_tie_margin": {mr.model: near_tie_margin(opts.dtype_of(mr.model)) for mr in runs},
        "log_dir": str(log_dir),
    }


def _stall_figures(s: dict[str, Any]) -> dict[str, Any]:
    """A load summary's figures that show a stall: TTFT's tail against the
    engines' own, requests over 1 s, and the longest inter-token gaps."""
    return {
        "ttft_ms_p90": s["ttft_ms"]["p90"],
        "engine_ttft_ms_p90": s["engine_ttft_ms_p90"],
        "ttft_ms_max": s["ttft_ms"]["max"],
        "ttft_over_1s": s["ttft_over_1s"],
        "itl_max_ms": s["itl_max_ms"],
        "gaps_over_250ms": s["gaps_over_250ms"],
    }


def _sum_dicts(dicts: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out


def print_report(report: dict[str, Any], out: IO[str]) -> None:
    """The summary table, noise warnings, start-up times and acceptance ratios, to `out`."""
    cols = (
        ("TTFT p50", "ttft_ms", "p50"),
        ("mean", "ttft_ms", "mean"),
        ("p99", "ttft_ms", "p99"),
        ("max", "ttft_ms", "max"),
        ("TPOT p50", "tpot_ms", "p50"),
        ("mean", "tpot_ms", "mean"),
        ("ITL p99", "itl_ms", "p99"),
        ("E2E p50", "e2e_ms", "p50"),
    )

    def stream(s: dict[str, Any]) -> str:  # whole streams: largest gap, gaps > 250 ms, lumps
        return (
            f"{fmt(s['itl_max_ms']):>9}{s['gaps_over_250ms']:>6}"
            f"{fmt(s['lumped_share'] * 100, 0):>6}"
        )

    head = f"{'config':<22}{'load':<11}" + "".join(f"{h:>9}" for h, _, _ in cols)
    head += f"{'gap max':>9}{'>250':>6}{'lump%':>6}"
    head += f"{'>1s':>4}{'req/s':>7}{'tok/s':>7}{'cpu s/rq':>9}{'xfer':>6}{'hit':>5}"
    head += f"{'hard':>5}{'tie':>4}"
    head += f"{'err':>4}"
    m = report["meta"]
    served = ", ".join(f"{model} ({m['dtype'][model]})" for model in m["models"])
    what = f"{served}, {m['dataset']} prompts"
    if m.get("base_url"):
        what += f", endpoint {m['base_url']}"
    print(f"\nrapidkv bench serve: {what}; CPU {m['cpu']} ({m['cpus']} cpus)", file=out)
    print(f"{head}\n{'-' * len(head)}", file=out)
    for key, c in report["configs"].items():
        if c["error"]:
            print(f"{key:<22}{'ERROR':<11}{c['error'].splitlines()[0][:110]}", file=out)
        for load, s in c["loads"].items():
            line = f"{key:<22}{load:<11}" + "".join(f"{fmt(s[m][k]):>9}" for _, m, k in cols)
            line += stream(s)
            line += f"{s['ttft_over_1s']:>4}{fmt(s['throughput_req_s']):>7}"
            line += f"{fmt(s['output_tok_s'], 0):>7}"
            line += f"{fmt(s['server_cpu_s_per_req'], 3):>9}"
            line += f"{fmt(s['kv_transferred_fraction'] * 100, 0):>5}%"
            line += f"{fmt(s['prefix_cache_hit_fraction'] * 100, 0):>4}%"
            line += f"{fmt(s['hard_mismatches'], 0):>5}{fmt(s['near_tie_mismatches'], 0):>4}"
            line += f"{s['errors']:>4}"
            print(line, file=out)
            if "paired_single" in s:  # `single` on the same blocks, and the TPOT ratio
                ps = s["paired_single"]
                line = f"{'  ~ single, paired':<22}{load:<11}"
                line += "".join(f"{fmt(ps[m][k]):>9}" for _, m, k in cols)
                line += stream(ps)
                lo, hi = ps["tpot_p50_over_paired_single_ci95"]
                line += f"  TPOT p50 ratio {fmt(ps['tpot_p50_over_paired_single'], 3)}"
                line += f" [{fmt(lo, 3)}, {fmt(hi, 3)}]"
                line += f"  hard {fmt(ps['hard_mismatches'], 0)} err {ps['errors']}"
                print(line, file=out)
    noisy = [
        f"{key} {load} ({s['other_cpu_cores']:.2f} cores)"
        for key, c in report["configs"].items()
        for load, s in c["loads"].items()
        if s["other_cpu_cores"] > NOISY_CORES
    ]
    if noisy:
        print(f"\nWARNING: other processes were busy during: {', '.join(noisy)}", file=out)
    print("\nstart-up (s, launch -> all healthy), first request (ms), CPUs of threads:", file=out)
    for key, c in report["configs"].items():
        if c["startup_s"] is not None:
            first = ", ".join(f"{v:.0f}" for v in c["first_request_ms"])
            line = f"  {key:<22}{fmt(c['startup_s']):>8}  first: {first or '-':<14}"
            print(f"{line} {c['affinity']}", file=out)
    for model, a in report["acceptance"].items():
        print(f"\nacceptance ({model}): {a['targets']}", file=out)
        for k, v in a.items():
            if k not in ("targets", "met"):
                shown = ", ".join(fmt(x, 3) for x in v) if isinstance(v, list) else fmt(v, 3)
                print(f"  {k:<52} {shown}", file=out)
        print(f"  met: {a['met']}", file=out)
    stall_cols = (  # (heading, key, digits)
        (">1s", "ttft_over_1s", 0),
        ("TTFT max", "ttft_ms_max", 1),
        ("gap max", "itl_max_ms", 1),
        (">250ms", "gaps_over_250ms", 0),
        ("lumped", "lumped_share", 3),
        ("TTFT p90", "ttft_ms_p90", 1),
        ("engine", "engine_ttft_ms_p90", 1),
        ("ratio", "client_ttft_over_engine_p90", 2),
        ("within", "client_ttft_within_engine_bound", 0),
        ("p99/p50", "ttft_p99_over_p50", 2),
        ("rate/nixl", "throughput_over_vllm_nixl", 2),
        ("rate/dp2", "throughput_over_dp2", 2),
    )
    for model, st in report.get("stalls", {}).items():
        print(f"\nstalls ({model}): {st['targets']}", file=out)
        head = f"  {'config load':<30}" + "".join(f"{h:>10}" for h, _, _ in stall_cols)
        print(head, file=out)
        for k, row in st.items():
            if k not in ("targets", "met"):
                shown = "".join(f"{_cell(row.get(m), d):>10}" for _, m, d in stall_cols)
                print(f"  {k:<30}{shown}{'  paired' if row.get('paired') else ''}", file=out)
        print(f"  met: {st['met']}", file=out)
    for model, ref in report["reference"].items():
        if ref["error"]:
            why = ref["error"].splitlines()[0][:200]
            print(f"\n{model}: no reference, mismatches not checked: {why}", file=out)
    if report["failed_baselines"]:
        print(f"\nbaselines that failed: {', '.join(report['failed_baselines'])}", file=out)
    print(f"\nresult: {'OK' if report['ok'] else 'FAILED'}", file=out)


def _cell(v: Any, digits: int) -> str:
    """A stall table's cell: a target's yes/NO, else a number."""
    return ("yes" if v else "NO") if isinstance(v, bool) else fmt(v, digits)
