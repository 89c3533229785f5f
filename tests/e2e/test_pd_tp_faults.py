"""Faults at TP 2: one P rank's writes failed, and a D request aborted while
P's ranks write its KV.

P and D are the TP 2 pair (test_pd_tp's, pool key `pd_tp2`): its P injects
faults into the transfers whose xfer_id starts with `FAULTY` and no other
(`debug_fault_prefix`): its rank 1 alone fails those `kvt.faults` picks at
`FAIL_RATE` (`debug_fail_transfer_rate`, `debug_fail_ranks: [1]`: rank 0
writes its heads whole), and their layers are stretched
(`debug_layer_delay_s`) so that an abort lands while they are written. Each
request names its transfer, chosen by the same `SendFaults.plan` the workers
use: failing ones for the first test, one that does not fail for the second.
The references are the TP 2 instance's (`tp2_references`).

1. One rank failed: every transfer fails (P settles it failed once rank 1's
   SendDone says so), D recomputes every prompt (it keeps no half: rank 0's
   heads arrived whole), and the outputs are the TP 2 instance's; P counts the
   failures, D its recomputes; everything is freed on both.
2. Abort mid-transfer: X's D request is cancelled while P's ranks write X's
   layers; Y, computed on D alone right after (vLLM hands it X's blocks
   first), and Y again, are the TP 2 instance's answer: no write of X landed
   after the abort, on either rank (the write fence, per rank). P counts the
   client abort, nothing live or unconfirmed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from itertools import count, islice
from pathlib import Path

import httpx
import pytest
from pd_harness import MAX_TOKENS, Pair, assert_back_to_baseline, wait_for
from tp_harness import FAIL_RATE, FAULTY, PD_TP2, TP, tp2_pair

from rapidkv.harness import ServerPool, random_prompts
from rapidkv.harness.client import acomplete_full, complete_many
from rapidkv.kvt.faults import SendFaults

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def xfer_ids(name: str, failing: bool, n: int) -> list[str]:
    """`n` transfer ids that P's faults touch, that rank 1 fails (`failing`)
    or does not."""
    faults = SendFaults(FAIL_RATE, prefix=FAULTY)
    ids = (f"{FAULTY}{name}-{i}" for i in count())
    return list(islice((x for x in ids if (faults.plan(x, 4)[0] is not None) == failing), n))


@pytest.fixture(scope="module")
def pair(server_pool: ServerPool, tiny_model: Path, tp2_references: dict) -> Iterator[Pair]:
    """The TP 2 pair (`tp2_references` first: its TP 2 instance runs before
    the pair)."""
    tp2_specs, (p_control, d_control) = tp2_pair(tiny_model)
    p, d = server_pool.get(PD_TP2, tp2_specs, keep=["pd"])
    # a fresh TP 2 engine's first forwards take seconds (the first transfer
    # would outlast D's rpc_timeout_s): warmed, as test_pd_tp warms its pair
    complete_many(p.base_url, random_prompts(tiny_model, [100, 300], seed=3902), 2)
    pair = Pair(tiny_model, p, d, p_control, d_control)
    try:
        yield pair
    finally:
        pair.close()


def test_one_p_rank_failing_its_writes_fails_the_transfer_and_d_recomputes(
    pair: Pair, tp2_references: dict
) -> None:
    prompts, refs = tp2_references["tp-faults"]
    ids = xfer_ids("fail", failing=True, n=len(prompts))
    before = {"p": pair.stats("p"), "d": pair.stats("d")}

    async def main() -> list[list[int]]:
        outs = []
        async with httpx.AsyncClient(timeout=120) as client:
            for prompt, xfer_id in zip(prompts, ids, strict=True):
                pk, dk = pair.params(xfer_id)
                to_p = asyncio.create_task(
                    acomplete_full(client, pair.p.base_url, prompt, 1, kv_transfer_params=pk)
                )
                out = await acomplete_full(
                    client, pair.d.base_url, prompt, MAX_TOKENS, kv_transfer_params=dk
                )
                await to_p
                outs.append(out.token_ids)
        return outs

    assert asyncio.run(main()) == refs
    n = len(prompts)
    assert wait_for(lambda: pair.since(before, "p", "transfers_failed") == n, 5), pair.stats("p")
    assert pair.since(before, "p", "transfers_ok") == 0
    assert pair.since(before, "d", "recompute_fallbacks") == n
    # each failed as rank 1's error SendDone came, not by D giving up on P
    assert pair.since(before, "p", "aborts_timeout") == 0
    assert_back_to_baseline(pair)


def test_a_d_request_aborted_while_p_ranks_write_gets_no_write_after_the_abort(
    pair: Pair, tp2_references: dict
) -> None:
    (x_ids, y_ids), (y_ref,) = tp2_references["tp-abort"]
    (xfer_id,) = xfer_ids("abort", failing=False, n=1)
    before = {"p": pair.stats("p"), "d": pair.stats("d")}

    async def main() -> tuple[list[int], list[int]]:
        async with httpx.AsyncClient(timeout=120) as client:
            pk, dk = pair.params(xfer_id)
            to_p = asyncio.create_task(
                acomplete_full(client, pair.p.base_url, x_ids, 1, kv_transfer_params=pk)
            )
            to_d = asyncio.create_task(
                acomplete_full(client, pair.d.base_url, x_ids, MAX_TOKENS, kv_transfer_params=dk)
            )
            deadline = time.monotonic() + 20
            while "accepted" not in pair.timeline(xfer_id).events:  # P writes X now
                assert time.monotonic() < deadline, pair.timeline(xfer_id)
                await asyncio.sleep(0.005)
            assert "last_chunk_end" not in pair.timeline(xfer_id).events  # mid-step
            to_d.cancel()  # the client leaves: D aborts X, Aborts P, then frees
            await asyncio.gather(to_d, return_exceptions=True)
            # D freed X's blocks (P's ranks confirmed the Abort): Y gets them
            baseline = before["d"]["free_blocks"]
            while pair.stats("d")["free_blocks"] != baseline:
                assert time.monotonic() < deadline, pair.stats("d")
                await asyncio.sleep(0.005)
            y = await acomplete_full(client, pair.d.base_url, y_ids, MAX_TOKENS)
            await to_p
            again = await acomplete_full(client, pair.d.base_url, y_ids, MAX_TOKENS)
            return y.token_ids, again.token_ids

    y, again = asyncio.run(main())
    assert y == y_ref, f"a P rank wrote into blocks D had freed after the Abort (TP {TP})"
    assert again == y_ref, "D's prefix cache kept what P wrote into Y's blocks"
    assert pair.since(before, "p", "aborts_client_abort") >= 1
    assert pair.stats("p")["transfers_live"] == 0
    assert pair.since(before, "p", "aborts_unconfirmed") == 0
    assert_back_to_baseline(pair)
