"""`rapidkv bench serve`: the run's options, as parsed and checked from the command line."""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from typing import Any

from rapidkv.bench.common.dataset import SHAREGPT_MAX_TOKENS, TURNS
from rapidkv.bench.common.options import DTYPES, MODELS, check_known, check_model

__all__ = ["MODELS", "Options"]

DEFAULT_MODELS = ("tiny", "smollm2-135m")
"""tiny: what the CI smokes serve; SmolLM2: a real model, whose prefill is real
compute (the acceptance block reads it)."""
DEFAULT_LOADS = "c1,c4,poisson8"
QUICK_LOADS = "c1,c4"
NETNS_DEFAULT_CONFIGS = ("single", "rapidkv")
MULTITURN = "sharegpt-multiturn"
ENDPOINT = "endpoint"
"""The configuration `--base-url` measures unless `--configs` names it."""
NETNS_GROUPS = ("single", "single-noop-connector", "dp2", "rapidkv")
"""The groups `--netns-link` runs: rapidkv across the link, the others on one host."""


@dataclass(frozen=True)
class Options:
    models: tuple[str, ...]
    dtype: str | None  # `--dtype` as given (vLLM's spelling); None: each model's own
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
    prefix_caching: bool = True  # vLLM's default; each load starts with empty caches
    base_url: str | None = None  # measure this running endpoint; start nothing
    reference_url: str | None = None  # with base_url: the reference instance

    def dtype_of(self, model: str) -> str:
        """The dtype `model` is served in (vLLM's spelling): `--dtype`, else the
        model's own (`options.MODEL_DTYPES`)."""
        from rapidkv.bench.common.options import model_dtype

        return self.dtype or model_dtype(model, None)

    def paired(self, name: str, load: Any | None = None) -> bool:
        """Whether configuration `name` is measured in blocks paired with
        `single` at `load` (at any of the run's loads when None): a
        configuration marked paired, at concurrency 1 only (a deeper load's
        blocks would each start empty and drain, which no unpaired baseline
        does: their TTFT and throughput would not compare), never an
        endpoint's (`single` is not started)."""
        from rapidkv.bench.common.groups import CONFIGS

        if self.pair_block <= 0 or self.base_url or not CONFIGS[name].paired:
            return False
        return any(x.concurrency == 1 for x in (self.loads if load is None else [load]))

    @property
    def pairing(self) -> bool:
        """Whether `single` stays up through each round for paired blocks."""
        return any(self.paired(c) for c in self.configs)

    def load_units(self, name: str, load: Any) -> int:
        """Progress units (requests) of `load` on `name`, its `single` blocks included."""
        return self.requests * (2 if self.paired(name, load) else 1)

    def units(self, name: str) -> int:
        """Progress units of one configuration in one round."""
        return self.warmup + sum(self.load_units(name, load) for load in self.loads)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Options:
        from rapidkv.bench.common.groups import CONFIGS
        from rapidkv.bench.common.loads import Load

        models = tuple(m for m in args.models.split(",") if m)
        netns = getattr(args, "netns_link", None)
        base_url = getattr(args, "base_url", None)
        reference_url = getattr(args, "reference_url", None)
        if args.configs is not None:
            configs = tuple(c for c in args.configs.split(",") if c)
        elif base_url:
            configs = (ENDPOINT,)
        elif netns:
            configs = NETNS_DEFAULT_CONFIGS
        else:
            configs = tuple(name for name, c in CONFIGS.items() if c.default)
        for m in models:
            check_model(m)
        check_known(configs, CONFIGS, "configuration")
        if not models or not configs:
            raise ValueError("give at least one model and one configuration")
        if base_url:
            if len(configs) != 1 or len(models) != 1 or netns:
                raise ValueError(
                    "--base-url measures one endpoint: one --models (what it serves, for its "
                    "tokenizer and prompts), at most one --configs (the name its rows get, and "
                    "its per-request parameters), no --netns-link"
                )
            for flag, url in (("--base-url", base_url), ("--reference-url", reference_url)):
                if url is not None and not url.startswith(("http://", "https://")):
                    raise ValueError(f"{flag} {url!r}: give an http:// or https:// URL")
        elif reference_url:
            raise ValueError(
                "--reference-url goes with --base-url (else `single` is the reference)"
            )
        elif ENDPOINT in configs:
            raise ValueError(f"configuration {ENDPOINT!r} is --base-url's")
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
            max_tokens = 16 if dataset == "random" else SHAREGPT_MAX_TOKENS
        pair_block = args.pair_block
        if dataset == MULTITURN:  # whole conversations: in requests and in paired blocks
            if requests < TURNS:
                raise ValueError(f"{MULTITURN}: --requests counts turns, {TURNS} a conversation")
            requests -= requests % TURNS
            pair_block = -(-pair_block // TURNS) * TURNS
            if base_url and not reference_url:
                raise ValueError(
                    f"{MULTITURN} with --base-url needs --reference-url: a conversation's "
                    "later prompts are made from the reference's answers"
                )
        if requests < 1 or args.rounds < 1 or max_tokens < 1:
            raise ValueError("--requests, --rounds and --max-tokens must be >= 1")
        if warmup < 0 or args.pair_block < 0:
            raise ValueError("--warmup and --pair-block must be >= 0")
        if not 1 <= args.min_len <= args.max_len:
            raise ValueError("need 1 <= --min-len <= --max-len")
        return cls(
            models=models,
            dtype=DTYPES[args.dtype] if args.dtype else None,
            configs=configs,
            loads=tuple(Load.parse(t) for t in loads.split(",") if t),
            requests=requests,
            min_len=args.min_len,
            max_len=args.max_len,
            max_tokens=max_tokens,
            rounds=args.rounds,
            warmup=warmup,
            pair_block=pair_block,
            seed=args.seed,
            timeout=args.timeout,
            server_args=tuple(shlex.split(args.server_args)),
            netns_link=netns,
            include_usage=getattr(args, "include_usage", True),
            dataset=dataset,
            prefix_caching=getattr(args, "prefix_caching", True),
            base_url=base_url.rstrip("/") if base_url else None,
            reference_url=reference_url.rstrip("/") if reference_url else None,
        )


PAIR_SEED_STRIDE = 7919  # block b of a load draws its Poisson arrivals from seed + b * this
