"""`rapidkv demo`: P + D + router on this machine, a small mixed workload, a table.

Builds the tiny float32 model if needed, starts a prefill and a decode vLLM
server with RapidKVConnector (pinned to cores 0 and 1, chunked prefill) and the
rapidkv router (dual dispatch), streams a mixed workload through the router at
concurrency 4 with a progress line, then serves the same prompts by the decode
instance alone (no transfer: the single-instance reference; prefix caching is
off on both so the reference is not a cache hit) and checks every output token
for token. Prints TTFT, TPOT, KV bytes moved and transfer time.
Everything it started is stopped on exit, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rapidkv.harness.client import Streamed


def register(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--log-dir", type=Path, default=None, help="server logs (default: tmp)")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    return run


def run_workload(
    url: str,
    prompts: list[list[int]],
    max_tokens: int,
    concurrency: int,
    label: str,
    params: Any = None,
) -> list[dict]:
    import httpx

    from rapidkv.harness.client import acomplete_stream

    done = [0]

    async def main() -> list[Streamed]:
        sem = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient() as client:

            async def one(ids: list[int]) -> Streamed:
                async with sem:
                    r = await acomplete_stream(
                        client, url, ids, max_tokens, kv_transfer_params=params
                    )
                done[0] += 1
                end = "\n" if done[0] == len(prompts) or not sys.stderr.isatty() else ""
                if end or sys.stderr.isatty():
                    print(
                        f"\r  {label}: {done[0]}/{len(prompts)} requests", end=end, file=sys.stderr
                    )
                return r

            out = await asyncio.gather(*(one(p) for p in prompts))
        return list(out)

    return asyncio.run(main())


def run(args: argparse.Namespace) -> int:
    from rapidkv.connector.config import kv_transfer_config
    from rapidkv.control.client import RpcClient
    from rapidkv.control.messages import StatsRequest
    from rapidkv.harness import free_port, random_prompts, running
    from rapidkv.harness.server import pd_specs
    from rapidkv.models import ensure_model
    from rapidkv.router.config import Instance, RouterConfig
    from rapidkv.router.server import start_router

    say = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    say("building / finding the tiny test model ...")
    model = ensure_model("tiny", dtype="float32")
    lengths = [20, 127, 128, 300, 513, 900]
    prompts = random_prompts(
        model, [lengths[i % len(lengths)] for i in range(args.requests)], seed=2026
    )
    pc, dc = free_port(), free_port()
    # Prefix caching off: the reference run serves the same prompts on D after
    # the P + D run, and cached blocks would make its TTFT look like a cache hit.
    chunked = ("--max-num-batched-tokens", "256", "--no-enable-prefix-caching")
    specs = pd_specs(model, kv_transfer_config(pc), kv_transfer_config(dc), chunked)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="rapidkv-demo-"))
    say(f"starting P (core 0) and D (core 1), logs in {log_dir} ...")
    with running(specs, log_dir) as (p, d), RpcClient() as rpc:
        p_control = f"127.0.0.1:{pc}"
        config = RouterConfig(
            prefill=(Instance(p.base_url, p_control),),
            decode=(Instance(d.base_url, f"127.0.0.1:{dc}"),),
            port=0,
        )
        before = rpc.call(p_control, StatsRequest(), 10).counters
        with start_router(config) as router:
            say(f"router on {router.url} (dual dispatch); sending {len(prompts)} requests")
            pd = run_workload(router.url, prompts, args.max_tokens, args.concurrency, "P+D")
        after = rpc.call(p_control, StatsRequest(), 10).counters
        fallbacks = rpc.call(f"127.0.0.1:{dc}", StatsRequest(), 10).counters.get(
            "recompute_fallbacks", 0
        )
        say("reference: the same prompts on one instance alone (no transfer) ...")
        ref = run_workload(d.base_url, prompts, args.max_tokens, args.concurrency, "single")

    def delta(key: str) -> float:
        return after.get(key, 0) - before.get(key, 0)

    transfers = delta("transfers_ok")
    mismatches = sum(a.token_ids != b.token_ids for a, b in zip(pd, ref, strict=True))
    result = {
        "requests": len(prompts),
        "ttft_ms": {
            "p50": statistics.median(r.ttft_ms for r in pd),
            "single_p50": statistics.median(r.ttft_ms for r in ref),
        },
        "tpot_ms": {
            "p50": statistics.median(r.tpot_ms for r in pd),
            "single_p50": statistics.median(r.tpot_ms for r in ref),
        },
        "kv_transfers": transfers,
        "kv_bytes_moved": delta("bytes_sent"),
        "transfer_ms_mean": delta("transfer_ms_sum") / transfers if transfers else None,
        "recompute_fallbacks": fallbacks,
        "mismatches": mismatches,
    }
    print()
    print(f"{'':28}{'P + D (rapidkv)':>18}{'single instance':>18}")
    print(
        f"{'TTFT p50 (ms)':28}{result['ttft_ms']['p50']:>18.1f}"
        f"{result['ttft_ms']['single_p50']:>18.1f}"
    )
    print(
        f"{'TPOT p50 (ms)':28}{result['tpot_ms']['p50']:>18.2f}"
        f"{result['tpot_ms']['single_p50']:>18.2f}"
    )
    print(f"{'KV transfers':28}{transfers:>18.0f}")
    print(f"{'KV bytes moved':28}{result['kv_bytes_moved'] / 2**20:>15.1f} MiB")
    if transfers:
        print(f"{'TransferKV -> done, mean':28}{result['transfer_ms_mean']:>15.1f} ms")
    print(f"{'local recompute fallbacks':28}{fallbacks:>18.0f}")
    ok = mismatches == 0 and transfers == len(prompts)
    print(
        f"\noutputs equal to the single instance: {len(prompts) - mismatches}/{len(prompts)}"
        f"  -> {'PASS' if ok else 'FAIL'}"
    )
    if args.json:
        print(json.dumps(result))
    return 0 if ok else 1
