"""`rapidkv bench serve`: the run's options, as parsed and checked from the command line."""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rapidkv.bench.common.dataset import SHAREGPT_MAX_TOKENS
from rapidkv.bench.common.options import DTYPES

MODELS = ("tiny", "small", "smollm2-135m")  # test models, and the real one (built on first use)
DEFAULT_LOADS = "c1,c4,poisson8"
QUICK_LOADS = "c1,c4"
NETNS_DEFAULT_CONFIGS = ("single", "rapidkv")
NETNS_GROUPS = ("single", "single-noop-connector", "dp2", "rapidkv")
"""The groups `--netns-link` runs: rapidkv across the link, the others on one host."""


@dataclass(frozen=True)
class Options:
    models: tuple[str, ...]
    dtype: str
    configs: tuple[str, ...]
    loads: tuple[Any, ...]  # loads.Load
    requests: int
    min_len: int
    max_len: int
    max_tokens: int
    rounds: int
    warmup: int
    pair_block: int  # 0: no pairing
    seed: int
    timeout: float
    server_args: tuple[str, ...]
    netns_link: str | None = None  # tc rate: rapidkv's P and D in two namespaces
    include_usage: bool = True  # stream_options: {"include_usage": true} on every request
    dataset: str = "random"  # dataset.DATASETS

    def paired(self, name: str) -> bool:
        """Whether configuration `name` is measured in blocks paired with `single`."""
        from rapidkv.bench.common.groups import CONFIGS

        return self.pair_block > 0 and CONFIGS[name].paired

    @property
    def pairing(self) -> bool:
        """Whether `single` stays up through each round for paired blocks."""
        return any(self.paired(c) for c in self.configs)

    def capped_loads(self) -> list[str]:
        """Closed loops whose concurrency a paired configuration's blocks cannot
        reach (a block holds `pair_block` prompts): measured at most that deep."""
        if not self.pairing:
            return []
        return [
            load.name
            for load in self.loads
            if load.concurrency is not None and load.concurrency > self.pair_block
        ]

    def load_units(self, name: str) -> int:
        """Progress units (requests) of one load of `name`, its `single` blocks included."""
        return self.requests * (2 if self.paired(name) else 1)

    def units(self, name: str) -> int:
        """Progress units of one configuration in one round."""
        return self.warmup + len(self.loads) * self.load_units(name)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Options:
        from rapidkv.bench.common.groups import CONFIGS
        from rapidkv.bench.common.loads import Load

        models = tuple(m for m in args.models.split(",") if m)
        netns = getattr(args, "netns_link", None)
        if args.configs is not None:
            configs = tuple(c for c in args.configs.split(",") if c)
        elif netns:
            configs = NETNS_DEFAULT_CONFIGS
        else:
            configs = tuple(name for name, c in CONFIGS.items() if c.default)
        for m in models:
            if m not in MODELS and not (Path(m) / "config.json").is_file():
                raise ValueError(
                    f"unknown model {m!r} (known: {', '.join(MODELS)}, or a checkpoint's "
                    "directory, holding its config.json)"
                )
        for c in configs:
            if c not in CONFIGS:
                raise ValueError(f"unknown configuration {c!r} (known: {', '.join(CONFIGS)})")
        if not models or not configs:
            raise ValueError("give at least one model and one configuration")
        if netns:
            from rapidkv.harness.netns import rate_bits

            rate_bits(netns)  # ValueError naming the rate
            refused = [c for c in configs if CONFIGS[c].group not in NETNS_GROUPS]
            if refused:
                raise ValueError(
                    f"--netns-link places rapidkv's P and D only; {', '.join(refused)} "
                    "would run on one host (leave them out)"
                )
        loads = args.loads or (QUICK_LOADS if args.quick else DEFAULT_LOADS)
        requests = args.requests if args.requests is not None else (8 if args.quick else 64)
        warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
        dataset = getattr(args, "dataset", "random")
        max_tokens = args.max_tokens
        if max_tokens is None:
            max_tokens = SHAREGPT_MAX_TOKENS if dataset == "sharegpt" else 16
        if requests < 1 or args.rounds < 1 or max_tokens < 1:
            raise ValueError("--requests, --rounds and --max-tokens must be >= 1")
        if warmup < 0 or args.pair_block < 0:
            raise ValueError("--warmup and --pair-block must be >= 0")
        if not 1 <= args.min_len <= args.max_len:
            raise ValueError("need 1 <= --min-len <= --max-len")
        return cls(
            models=models,
            dtype=DTYPES[args.dtype],
            configs=configs,
            loads=tuple(Load.parse(t) for t in loads.split(",") if t),
            requests=requests,
            min_len=args.min_len,
            max_len=args.max_len,
            max_tokens=max_tokens,
            rounds=args.rounds,
            warmup=warmup,
            pair_block=args.pair_block,
            seed=args.seed,
            timeout=args.timeout,
            server_args=tuple(shlex.split(args.server_args)),
            netns_link=netns,
            include_usage=getattr(args, "include_usage", True),
            dataset=dataset,
        )


PAIR_SEED_STRIDE = 7919  # block b of a load draws its Poisson arrivals from seed + b * this
