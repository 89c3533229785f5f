"""`rapidkv bench simulate`'s run: options in, sweeps, report out."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import rapidkv.bench.simulate.check as check
import rapidkv.bench.simulate.compare as compare
import rapidkv.bench.simulate.report as report
from rapidkv.bench.common.options import check_known
from rapidkv.bench.simulate.fit import DEFAULT_FIT, Fit, load_fit
from rapidkv.bench.simulate.goodput import START_PER_INSTANCE, reference_slo, run_point, sweep
from rapidkv.bench.simulate.prefix_cache import parse_bytes
from rapidkv.bench.simulate.routers import POLICIES
from rapidkv.bench.simulate.workload import LENGTH_WORKLOADS, WORKLOADS, requests
from rapidkv.router.placement import SLO

DEFAULT_SIZES = (2, 4, 8, 16, 32, 64)
DEFAULT_POLICIES = ("dp", "fixed-pd", "adaptive")
PREFIX_POLICIES = ("dp", "adaptive-blind", "adaptive-nofetch", "adaptive")
"""The default policies on the workloads of shared prefixes: `bench goodput`'s
`dp2`, `rapidkv-adaptive-blind`, `rapidkv-kv-aware-nofetch`, `rapidkv-adaptive`."""
DEFAULT_WORKLOADS = tuple(LENGTH_WORKLOADS)
QUICK_SIZES = (2, 4, 8)
REQUESTS = 50  # per instance and run
MIN_REQUESTS = 400  # per run, whatever the fleet size
QUICK_REQUESTS = 10
QUICK_MIN_REQUESTS = 100


@dataclass(frozen=True)
class Options:
    sizes: tuple[int, ...]
    policies: tuple[str, ...] | None  # None: per workload, `policies_for`
    workloads: tuple[str, ...]
    requests: int  # per instance and run
    min_requests: int
    refine: int
    seed: int
    ttft_slo_ms: float | None
    tpot_slo_ms: float | None
    tokenizer: str = "auto"
    warm_up: int = 0  # per instance, before the measured requests (prefix caching)
    start: float = START_PER_INSTANCE

    def policies_for(self, workload: str) -> tuple[str, ...]:
        """The policies run on `workload`: `--policies`, else its defaults."""
        if self.policies is not None:
            return self.policies
        return PREFIX_POLICIES if workload not in LENGTH_WORKLOADS else DEFAULT_POLICIES

    def as_dict(self) -> dict[str, Any]:
        return {
            "sizes": list(self.sizes),
            "policies": {w: list(self.policies_for(w)) for w in self.workloads},
            "workloads": list(self.workloads),
            "requests_per_instance": self.requests,
            "min_requests": self.min_requests,
            "refine": self.refine,
            "seed": self.seed,
            "ttft_slo_ms": self.ttft_slo_ms,
            "tpot_slo_ms": self.tpot_slo_ms,
            "tokenizer": self.tokenizer,
            "warm_up_per_instance": self.warm_up,
            "start_per_instance": self.start,
        }


def options(args: argparse.Namespace) -> Options:
    sizes = _ints(args.sizes) if args.sizes else (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    policies = tuple(_names(args.policies)) if args.policies else None
    workloads = tuple(_names(args.workloads)) if args.workloads else DEFAULT_WORKLOADS
    try:
        check_known(policies or (), POLICIES, "policy (--policies)")
        check_known(workloads, WORKLOADS, "workload (--workloads)")
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if not sizes or min(sizes) < 1:
        raise SystemExit("--sizes: fleet sizes are >= 1")
    per_instance = args.requests or (QUICK_REQUESTS if args.quick else REQUESTS)
    if per_instance < 1:
        raise SystemExit("--requests must be >= 1")
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        raise SystemExit("--max-num-seqs must be >= 1")
    for name in ("cache_blocks", "kv_bytes_per_token"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.kv_cache_bytes is not None:
        try:
            if parse_bytes(args.kv_cache_bytes) < 1:
                raise ValueError("must be >= 1 byte")
        except ValueError as e:
            raise SystemExit(f"--kv-cache-bytes {args.kv_cache_bytes}: {e}") from None
    if args.min_requests is not None and args.min_requests < 1:
        raise SystemExit("--min-requests must be >= 1")
    if args.warm_up < 0 or not args.start > 0:
        raise SystemExit("--warm-up must be >= 0 and --start > 0")
    if args.tokenizer not in ("auto", "chars") and not Path(args.tokenizer).is_dir():
        raise SystemExit(
            f"--tokenizer: auto, chars or a checkpoint directory, not {args.tokenizer}"
        )
    for name in ("ttft_slo_ms", "tpot_slo_ms"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be > 0")
    return Options(
        sizes=tuple(sorted(set(sizes))),
        policies=policies,
        workloads=workloads,
        requests=per_instance,
        min_requests=args.min_requests
        if args.min_requests is not None
        else (QUICK_MIN_REQUESTS if args.quick else MIN_REQUESTS),
        refine=2 if args.quick else args.refine,
        seed=args.seed,
        ttft_slo_ms=args.ttft_slo_ms,
        tpot_slo_ms=args.tpot_slo_ms,
        tokenizer=args.tokenizer,
        warm_up=args.warm_up,
        start=args.start,
    )


def with_cache_options(fit: Fit, args: argparse.Namespace) -> Fit:
    """`fit` with the prefix cache's size from `--kv-cache-bytes`,
    `--kv-bytes-per-token` and `--cache-blocks` where given."""
    changes: dict[str, int] = {}
    if args.kv_cache_bytes is not None:
        changes["kv_cache_bytes"] = parse_bytes(args.kv_cache_bytes)
    if args.kv_bytes_per_token is not None:
        changes["kv_bytes_per_token"] = args.kv_bytes_per_token
    if args.cache_blocks is not None:
        changes["prefix_cache_blocks"] = args.cache_blocks
    return dataclasses.replace(fit, **changes) if changes else fit


def run(args: argparse.Namespace) -> int:
    opts = options(args)
    fit: Fit = DEFAULT_FIT
    warnings: list[str] = []
    if args.fit:
        fit, warnings = load_fit(args.fit)
    real = None
    if args.compare:
        try:
            real = json.loads(Path(args.compare).read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"--compare {args.compare}: {e}") from e
    slots = args.max_num_seqs
    if slots is None and real is not None:
        slots = compare.max_num_seqs_of(real)
    if slots is not None:
        fit = dataclasses.replace(fit, max_num_seqs=slots)
    fit = with_cache_options(fit, args)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    say = _progress()
    fit_dict = {**fit.as_dict(), "warnings": warnings}
    say("fit check: bench serve's loads, simulated")
    fit_rows = check.fit_check(fit, check.measured_from(args.fit), opts.seed)
    compared = None
    workloads: dict[str, Any] = {}
    if real is not None:
        compared = compare.compare(
            real,
            fit,
            seed=opts.seed,
            requests_per_instance=opts.requests,
            min_requests=opts.min_requests,
            slo_override=(opts.ttft_slo_ms, opts.tpot_slo_ms),
            progress=say,
            tokenizer=opts.tokenizer,
            calibrated=args.calibrate,
        )
    else:
        workloads = {w: simulate_workload(w, fit, opts, say) for w in opts.workloads}
    out = report.build(
        options=opts.as_dict(),
        fit=fit_dict,
        fit_check=fit_rows,
        workloads=workloads,
        compare=compared,
    )
    say("")
    text = "\n\n".join(
        part
        for part in (
            report.table(out) if workloads else "",
            compare.table(compared) if compared is not None else "",
            "fit check (bench serve's c1/c4, 64 prompts of 128-900 tokens, 16 tokens):\n"
            + check.table(fit_rows),
        )
        if part
    )
    if args.json and args.json != "-":
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    if args.plot and workloads:
        report.plot(out, args.plot)
    if args.json == "-":
        json.dump(out, sys.stdout, indent=1)
        print()
        print(text, file=sys.stderr)
    else:
        print(text)
    return 0


def simulate_workload(name: str, fit: Fit, opts: Options, say: Any) -> dict[str, Any]:
    """Every size and policy of one workload: the ``workloads.<name>`` of the JSON."""
    workload = WORKLOADS[name]
    ref_slo, ref = reference_slo(fit, workload, opts.seed, opts.tokenizer)
    slo = SLO(opts.ttft_slo_ms or ref_slo.ttft_ms, opts.tpot_slo_ms or ref_slo.tpot_ms)
    given = [k for k, v in (("TTFT", opts.ttft_slo_ms), ("TPOT", opts.tpot_slo_ms)) if v]
    source = (
        f"{', '.join(given)} from the options, else " if given else ""
    ) + "4x / 1.5x single's c1 p50s, simulated"
    caching = workload.prefix_caching
    sizes: dict[str, Any] = {}
    for n in opts.sizes:
        count = workload.requests(max(opts.min_requests, opts.requests * n))
        warm = workload.requests(opts.warm_up * n) if caching and opts.warm_up else 0
        specs = requests(workload, warm + count, opts.seed, opts.tokenizer)
        policies: dict[str, Any] = {}
        for policy in opts.policies_for(name):
            if policy in ("fixed-pd", "nixl") and n < 2:
                continue

            def evaluate(
                rate: float, n: int = n, policy: str = policy, specs: Any = specs, warm: int = warm
            ) -> Any:
                say(f"{name}: {n} instances, {policy}, {rate:g} req/s")
                return run_point(
                    fit,
                    n,
                    policy,
                    specs,
                    rate,
                    opts.seed,
                    slo,
                    workload=workload if caching else None,
                    warm_up=warm,
                )

            policies[policy] = sweep(evaluate, n, opts.refine, opts.start).as_dict()
        sizes[str(n)] = {"requests": count, "warm_up": warm, "policies": policies}
    out: dict[str, Any] = {
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "source": source, **ref},
        "prefix_caching": caching,
        "sizes": sizes,
    }
    if caching:
        out["cache_blocks"] = fit.cache_blocks
    return out


def _progress() -> Any:
    tty = sys.stderr.isatty()
    start = time.monotonic()

    def say(text: str) -> None:
        if not text:
            if tty:
                print(file=sys.stderr)
            return
        line = f"[{time.monotonic() - start:6.0f} s] {text}"
        if tty:
            print(f"\r\033[K{line}", end="", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)

    return say


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in _names(text))
    except ValueError as e:
        raise SystemExit(f"--sizes: {e}") from e


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]
