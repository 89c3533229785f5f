"""`rapidkv bench goodput`: the run's options, as parsed and checked from the command line."""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass

from rapidkv.bench.common.options import (
    check_known,
    check_model,
    from_namespace,
    served_fields,
)

DEFAULT_CONFIGS = ("single", "dp2", "vllm-nixl", "rapidkv", "rapidkv-adaptive")
"""`--configs`' default for the request length workloads."""
BASELINES = ("dp2", "vllm-nixl", "rapidkv")
"""What `rapidkv-adaptive`'s goodput is compared with on them (the issue's acceptance)."""
PREFIX_CONFIGS = (
    "dp2",
    "rapidkv-adaptive-blind",
    "rapidkv-kv-aware-nofetch",
    "rapidkv-adaptive",
)
"""`--configs`' default for the workloads of shared prefixes (`single` runs
anyway): least outstanding requests, and the adaptive placement blind to
what the instances hold, aware of it without fetching, and with fetching."""
PREFIX_BASELINES = ("dp2", "rapidkv-adaptive-blind")
"""What `rapidkv-adaptive` (prefix index and fetch) is compared with on them."""
ADAPTIVE = "rapidkv-adaptive"
ADAPTIVE_FRONT = "router-adaptive"
"""The prefix of the adaptive router's fronts (`serve.configs`): started again
for each workload, with its SLOs."""
ARRIVAL_SALT = 7919  # a workload's arrivals are drawn from its seed + this


@dataclass(frozen=True)
class Options:
    workloads: tuple[str, ...]
    configs: tuple[str, ...]
    rates: dict[str, tuple[float, ...]]  # workload -> ascending req/s
    requests: int
    warmup: int
    seed: int
    ttft_slo_factor: float
    tpot_slo_factor: float
    ttft_slo_ms: float | None  # given: used instead of the factor's
    tpot_slo_ms: float | None
    timeout: float
    dtype: str
    server_args: tuple[str, ...]  # --max-model-len first, then --server-args
    router_args: tuple[str, ...] = ()  # the adaptive router's, after its SLOs
    together: bool = True  # every group up at once, rates interleaved across them
    include_usage: bool = True  # stream_options: {"include_usage": true} on every request
    model: str = "tiny"  # options.MODELS, or a checkpoint's directory
    dataset: str = "random"  # the prompts of the workloads' lengths
    prefix_caching: bool = False  # a workload shares prefixes: on, emptied before each rate
    rate_warm_up: int | None = None  # shared-prefix's warm-up at each rate (None: its own)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Options:
        from rapidkv.bench.common.groups import CONFIGS
        from rapidkv.bench.common.workloads import MAX_MODEL_LEN
        from rapidkv.bench.goodput.workloads import WORKLOADS

        workloads = tuple(w for w in args.workloads.split(",") if w)
        check_known(workloads, WORKLOADS, "workload")
        if args.configs is None:
            configs = default_configs(workloads)
        else:
            configs = tuple(c for c in args.configs.split(",") if c)
        check_known(configs, CONFIGS, "configuration")
        check_model(getattr(args, "model", "tiny"))
        if not workloads or not configs:
            raise ValueError("give at least one workload and one configuration")
        if len(set(configs)) != len(configs) or len(set(workloads)) != len(workloads):
            raise ValueError("a configuration or workload is named twice")
        pick = "quick_rates" if args.quick else "default_rates"
        rates = {w: tuple(sorted(getattr(WORKLOADS[w], pick))) for w in workloads}
        given = [parse_rates(text) for text in args.rates or ()]
        for name, values in sorted(given, key=lambda g: g[0] is not None):  # named ones win
            if name is not None and name not in workloads:
                raise ValueError(f"--rates {name}=...: {name!r} is not in --workloads")
            for w in [name] if name is not None else workloads:
                rates[w] = values
        requests = args.requests if args.requests is not None else (8 if args.quick else 40)
        warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
        if requests < 2:
            raise ValueError("--requests must be >= 2")
        if warmup < 0:
            raise ValueError("--warmup must be >= 0")
        rate_warm_up = getattr(args, "rate_warm_up", None)
        if rate_warm_up is None and args.quick:
            rate_warm_up = 4
        if rate_warm_up is not None and rate_warm_up < 0:
            raise ValueError("--rate-warm-up must be >= 0")
        if args.ttft_slo_factor <= 0 or args.tpot_slo_factor <= 0:
            raise ValueError("the SLO factors must be > 0")
        for flag, v in (("--ttft-slo-ms", args.ttft_slo_ms), ("--tpot-slo-ms", args.tpot_slo_ms)):
            if v is not None and not v > 0:
                raise ValueError(f"{flag} must be > 0")
        served = served_fields(args)
        max_len = ("--max-model-len", str(MAX_MODEL_LEN))
        return from_namespace(
            cls,
            args,
            workloads=workloads,
            configs=configs,
            rates=rates,
            requests=requests,
            warmup=warmup,
            rate_warm_up=rate_warm_up,
            router_args=tuple(shlex.split(args.router_args)),
            together=not args.one_group_at_a_time,
            prefix_caching=any(WORKLOADS[w].prefix_caching for w in workloads),
            **{**served, "server_args": (*max_len, *served["server_args"])},
        )

    def count(self, workload: str) -> int:
        """Requests per rate of `workload` (`multiturn`: whole conversations)."""
        from rapidkv.bench.goodput.workloads import WORKLOADS

        return int(WORKLOADS[workload].requests(self.requests))

    def units(self) -> int:
        """Progress units: one per request (references, `single`'s warm-up and
        c1, every configuration's warm-ups and sweeps)."""
        total = 0
        for w in self.workloads:
            total += 2 * self.count(w) + self.warmup  # reference, c1; warm-up
            for c in self.configs:
                total += (0 if c == "single" else self.warmup) + self.count(w) * len(self.rates[w])
        return total


def default_configs(workloads: tuple[str, ...]) -> tuple[str, ...]:
    """`--configs`' default: each workload's (`DEFAULT_CONFIGS`, `PREFIX_CONFIGS`), in turn."""
    from rapidkv.bench.goodput.workloads import WORKLOADS

    out: list[str] = []
    for w in workloads:
        for c in PREFIX_CONFIGS if WORKLOADS[w].prefix_caching else DEFAULT_CONFIGS:
            if c not in out:
                out.append(c)
    return tuple(out)


def baselines(workload: str) -> tuple[str, ...]:
    """What `ADAPTIVE` is compared with on `workload` (`BASELINES`, `PREFIX_BASELINES`)."""
    from rapidkv.bench.goodput.workloads import WORKLOADS

    return PREFIX_BASELINES if WORKLOADS[workload].prefix_caching else BASELINES


def fixed_fronts(members: list[str]) -> set[str]:
    """The fronts of `members` started with their group (the adaptive router's
    wait for a workload's SLOs)."""
    from rapidkv.bench.common.groups import CONFIGS

    return {CONFIGS[m].front for m in members if not is_adaptive(CONFIGS[m].front)}


def is_adaptive(front: str | None) -> bool:
    """Whether `front` is one of the adaptive router's (None: no front, served directly)."""
    return front is not None and front.startswith(ADAPTIVE_FRONT)


def parse_rates(text: str) -> tuple[str | None, tuple[float, ...]]:
    """`2,4,8` (every workload) or `chat=1,2,3` (one): the workload named, if
    any, and the rates, ascending."""
    name, sep, values = text.rpartition("=")
    try:
        rates = tuple(float(t) for t in values.split(",") if t.strip())
    except ValueError:
        raise ValueError(f"--rates {text!r}: give req/s, comma-separated") from None
    if not rates or any(r <= 0 for r in rates) or len(set(rates)) != len(rates):
        raise ValueError(f"--rates {text!r}: distinct positive req/s, comma-separated")
    return (name.strip() if sep else None), tuple(sorted(rates))
