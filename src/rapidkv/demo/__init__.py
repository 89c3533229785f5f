"""`rapidkv demo`: P + D + router on this machine, real questions, a fair table.

By default on SmolLM2-135M-Instruct (float32, converted from its package on
first use): a prefill and a decode vLLM server with RapidKVConnector (pinned to
cores 0 and 1, chunked prefill) and the rapidkv router (its defaults: dual
dispatch, split prefill), and one instance alone (the decode server, asked
directly: no transfer) as the reference. It sends ShareGPT questions and a
few conversations of several turns (each turn's prompt is the history with
the answers the model gave, through the chat template) to both, checks every
output token for token, prints a few questions with their answers, and a table
of TTFT and TPOT. ``--model tiny`` runs the same on the random-weight test
model with random token-id prompts.

Fair comparison: both sides are warmed up first, then served the same prompts
in blocks of --concurrency, alternating which goes first; prefix caching is
off on both (each prompt is sent twice: the second would be a cache hit).
Everything it started is stopped on exit, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODELS = ("smollm2-135m", "tiny")


def register(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    parser.add_argument("--model", choices=MODELS, default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=12, help="single questions")
    parser.add_argument(
        "--conversations", type=int, default=2, help="of 3 turns each (SmolLM2 only)"
    )
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="per answer (SmolLM2: 48; tiny: 16)"
    )
    parser.add_argument("--log-dir", type=Path, default=None, help="server logs (default: tmp)")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    return run


def run(args: argparse.Namespace) -> int:
    from rapidkv.connector.config import kv_transfer_config
    from rapidkv.control.client import RpcClient
    from rapidkv.control.messages import StatsRequest
    from rapidkv.demo.serving import Side, served_in_blocks
    from rapidkv.demo.workload import (
        Chat,
        Turn,
        random_turns,
        sharegpt_conversations,
        sharegpt_turns,
    )
    from rapidkv.harness import free_port, running
    from rapidkv.harness.server import pd_specs
    from rapidkv.router.config import Instance, RouterConfig
    from rapidkv.router.server import start_router

    say = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    real = args.model == "smollm2-135m"
    max_tokens = args.max_tokens or (48 if real else 16)
    chat: Chat | None = None
    conversations: list[list[str]] = []
    if real:
        from rapidkv.models.smollm2 import MissingPackage, ensure_smollm2

        say("building / finding SmolLM2-135M-Instruct (float32) ...")
        try:
            model = ensure_smollm2("float32")
        except MissingPackage as e:
            say(f"rapidkv demo: {e}")
            return 2
        chat = Chat(model)
        turns = sharegpt_turns(chat, args.requests, seed=2026, max_prompt=600)
        conversations = sharegpt_conversations(args.conversations, 2026, 3, max_chars=300)
    else:
        from rapidkv.models import ensure_model

        say("building / finding the tiny test model ...")
        model = ensure_model("tiny", dtype="float32")
        turns = random_turns(model, args.requests, seed=2026)
    pc, dc = free_port(), free_port()
    chunked = ("--max-num-batched-tokens", "256", "--no-enable-prefix-caching")
    specs = pd_specs(model, kv_transfer_config(pc), kv_transfer_config(dc), chunked)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="rapidkv-demo-"))
    say(f"starting P (core 0) and D (core 1), logs in {log_dir} ...")
    with running(specs, log_dir) as (p, d), RpcClient() as rpc:
        p_control, d_control = f"127.0.0.1:{pc}", f"127.0.0.1:{dc}"
        config = RouterConfig(
            prefill=(Instance(p.base_url, p_control),),
            decode=(Instance(d.base_url, d_control),),
            port=0,
        )
        before = rpc.call(p_control, StatsRequest(), 10).counters
        with start_router(config) as router:
            pd, single = Side("P + D", router.url), Side("single", d.base_url)
            say(f"router on {router.url}; {len(turns)} questions, both sides, alternating")
            ignore_eos = not real
            served_in_blocks(turns, [pd, single], max_tokens, args.concurrency, ignore_eos)
            for k, conversation in enumerate(conversations):
                assert chat is not None
                say(f"conversation {k + 1}: {len(conversation)} turns")
                history: list[dict[str, str]] = []
                for question in conversation:
                    history.append({"role": "user", "content": question})
                    turn = Turn(chat.prompt(history), question)
                    served_in_blocks([turn], [pd, single], max_tokens, 1, ignore_eos)
                    history.append({"role": "assistant", "content": chat.text(pd.answers[-1])})
        after = rpc.call(p_control, StatsRequest(), 10).counters
        fallbacks = rpc.call(d_control, StatsRequest(), 10).counters.get("recompute_fallbacks", 0)

    def delta(key: str) -> float:
        return after.get(key, 0) - before.get(key, 0)

    transfers = delta("transfers_ok")
    n = len(pd.answers)
    mismatches = sum(a != b for a, b in zip(pd.answers, single.answers, strict=True))
    result: dict[str, Any] = {
        "model": args.model,
        "requests": n,
        "ttft_ms": {"p50": pd.p50("ttft_ms"), "single_p50": single.p50("ttft_ms")},
        "tpot_ms": {"p50": pd.p50("tpot_ms"), "single_p50": single.p50("tpot_ms")},
        "kv_transfers": transfers - pd.warmups,
        "kv_bytes_moved": delta("bytes_sent"),
        "transfer_ms_mean": (
            delta("transfer_seconds_sum") * 1000 / delta("transfer_seconds_count")
            if delta("transfer_seconds_count")
            else None
        ),
        "recompute_fallbacks": fallbacks,
        "mismatches": mismatches,
    }
    if chat is not None:
        shown = [0, 1, len(pd.questions) - 1][: min(3, n)]
        result["answers"] = [
            {"question": pd.questions[i], "answer": chat.text(pd.answers[i])} for i in shown
        ]
        print()
        for qa in result["answers"]:
            print(f"Q: {_short(qa['question'], 160)}")
            print(f"A: {_short(qa['answer'], 300)}\n")
    _table(result)
    ok = mismatches == 0 and result["kv_transfers"] == n
    verdict = "PASS" if ok else "FAIL"
    print(f"\noutputs equal to the single instance: {n - mismatches}/{n}  -> {verdict}")
    if args.json:
        print(json.dumps(result))
    return 0 if ok else 1


def _table(result: dict[str, Any]) -> None:
    ttft, tpot = result["ttft_ms"], result["tpot_ms"]
    print(f"{'':28}{'P + D (rapidkv)':>18}{'single instance':>18}")
    print(f"{'TTFT p50 (ms)':28}{ttft['p50']:>18.1f}{ttft['single_p50']:>18.1f}")
    print(f"{'TPOT p50 (ms)':28}{tpot['p50']:>18.2f}{tpot['single_p50']:>18.2f}")
    print(f"{'KV transfers':28}{result['kv_transfers']:>18.0f}")
    print(f"{'KV bytes moved':28}{result['kv_bytes_moved'] / 2**20:>15.1f} MiB")
    if result["transfer_ms_mean"] is not None:
        print(f"{'TransferKV -> done, mean':28}{result['transfer_ms_mean']:>15.1f} ms")
    print(f"{'local recompute fallbacks':28}{result['recompute_fallbacks']:>18.0f}")
    print(
        "\nTPOT: D decodes with no prefill in its steps; one instance interleaves the\n"
        "      prefills of new requests with its decodes, which slows every stream.\n"
        "TTFT: P + D adds the hop of the prompt's KV from P to D (with split prefill D\n"
        "      computes the prompt's tail meanwhile); one idle instance has no hop."
    )


def _short(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."
