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
from rapidkv.bench.simulate.goodput import reference_slo, run_point, sweep
from rapidkv.bench.simulate.routers import POLICIES
from rapidkv.bench.simulate.workload import WORKLOADS, requests
from rapidkv.router.placement import SLO

DEFAULT_SIZES = (2, 4, 8, 16, 32, 64)
DEFAULT_POLICIES = ("dp", "fixed-pd", "adaptive")
QUICK_SIZES = (2, 4, 8)
REQUESTS = 50  # per instance and run
MIN_REQUESTS = 400  # per run, whatever the fleet size
QUICK_REQUESTS = 10
QUICK_MIN_REQUESTS = 100


@dataclass(frozen=True)
class Options:
    sizes: tuple[int, ...]
    policies: tuple[str, ...]
    workloads: tuple[str, ...]
    requests: int  # per instance and run
    min_requests: int
    refine: int
    seed: int
    ttft_slo_ms: float | None
    tpot_slo_ms: float | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "sizes": list(self.sizes),
            "policies": list(self.policies),
            "workloads": list(self.workloads),
            "requests_per_instance": self.requests,
            "min_requests": self.min_requests,
            "refine": self.refine,
            "seed": self.seed,
            "ttft_slo_ms": self.ttft_slo_ms,
            "tpot_slo_ms": self.tpot_slo_ms,
        }


def options(args: argparse.Namespace) -> Options:
    sizes = _ints(args.sizes) if args.sizes else (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    policies = tuple(_names(args.policies)) if args.policies else DEFAULT_POLICIES
    workloads = tuple(_names(args.workloads)) if args.workloads else tuple(WORKLOADS)
    try:
        check_known(policies, POLICIES, "policy (--policies)")
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
    for name in ("ttft_slo_ms", "tpot_slo_ms"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be > 0")
    return Options(
        sizes=tuple(sorted(set(sizes))),
        policies=policies,
        workloads=workloads,
        requests=per_instance,
        min_requests=QUICK_MIN_REQUESTS if args.quick else MIN_REQUESTS,
        refine=2 if args.quick else args.refine,
        seed=args.seed,
        ttft_slo_ms=args.ttft_slo_ms,
        tpot_slo_ms=args.tpot_slo_ms,
    )


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
    ref_slo, ref = reference_slo(fit, workload, opts.seed)
    slo = SLO(opts.ttft_slo_ms or ref_slo.ttft_ms, opts.tpot_slo_ms or ref_slo.tpot_ms)
    given = [k for k, v in (("TTFT", opts.ttft_slo_ms), ("TPOT", opts.tpot_slo_ms)) if v]
    source = (
        f"{', '.join(given)} from the options, else " if given else ""
    ) + "4x / 1.5x single's c1 p50s, simulated"
    sizes: dict[str, Any] = {}
    for n in opts.sizes:
        count = max(opts.min_requests, opts.requests * n)
        specs = requests(workload, count, opts.seed)
        policies: dict[str, Any] = {}
        for policy in opts.policies:
            if policy in ("fixed-pd", "nixl") and n < 2:
                continue

            def evaluate(rate: float, n: int = n, policy: str = policy, specs: Any = specs) -> Any:
                say(f"{name}: {n} instances, {policy}, {rate:g} req/s")
                return run_point(fit, n, policy, specs, rate, opts.seed, slo)

            policies[policy] = sweep(evaluate, n, opts.refine).as_dict()
        sizes[str(n)] = {"requests": count, "policies": policies}
    return {
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "source": source, **ref},
        "sizes": sizes,
    }


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
