"""`rapidkv bench NAME`: each benchmark module registers its own options.

Benchmark modules keep their top level light (heavy imports inside functions),
since all of them are imported to build the parser.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

# name -> (help, module with a `register(parser) -> run` function)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "kvt": ("kvt data-plane throughput and layer/substep send latency", "rapidkv.bench.kvt"),
    "serve": (
        "rapidkv vs single vLLM, vLLM's NIXL connectors and dp2, served",
        "rapidkv.bench.serve",
    ),
    "transfer-kv": (
        "TransferKV on a busy P: step vs bypass vs substep, per request state",
        "rapidkv.bench.transfer_kv",
    ),
    "chaos": (
        "a soak through the router: client aborts, injected transfer faults, P and D killed",
        "rapidkv.bench.chaos",
    ),
    "goodput": (
        "goodput (req/s within TTFT/TPOT SLOs) of dp2, vllm-nixl, rapidkv fixed and adaptive",
        "rapidkv.bench.goodput",
    ),
    "migrate": (
        "live migration's client-side downtime per sequence length: pre-copy vs stop-and-copy",
        "rapidkv.bench.migrate",
    ),
    "simulate": (
        "the placement policies on simulated fleets of 2-64 instances fitted from this machine",
        "rapidkv.bench.simulate",
    ),
}


def register(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    runners = {
        name: importlib.import_module(module).register(sub.add_parser(name, help=help_text))
        for name, (help_text, module) in BENCHMARKS.items()
    }
    return lambda args: runners[args.benchmark](args)
