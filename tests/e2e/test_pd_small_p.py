"""A P with a small block pool (15 usable blocks) and one transfer per D at a
time: held blocks make P wait instead of preempting, transfers over the cap
are refused BUSY and retried, late substeps are rolled back, a migration to a
P without room is refused at once."""

from __future__ import annotations

import asyncio
import functools
import json
import time

import httpx
import pytest
from pd_harness import (
    BLOCK,
    MIGRATION_TOKENS,
    Pair,
    assert_back_to_baseline,
    block_bytes,
    wait_for,
)

from rapidkv.harness import VLLMServer, random_prompts
from rapidkv.harness.client import (
    acomplete_full,
    complete_full,
    completion_body,
    get_metrics,
    metric_sum,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def preemptions(server: VLLMServer) -> float:
    return metric_sum(get_metrics(server.base_url), "vllm:num_preemptions_total")


def test_blocks_held_for_transfers_make_p_wait_instead_of_preempting(
    small_p_pair: Pair, workloads: dict
) -> None:
    """P's pool is partly held by finished requests whose transfers are pending;
    two decodes grow into the rest. The one that finds no free block waits
    (has_pending_block_frees) instead of preempting the other, and goes on once
    the held blocks are freed: no preemption, exact outputs, nothing leaks."""
    from rapidkv.control.messages import Abort, AbortReason

    pair = small_p_pair
    decodes, expected = workloads["small_wait"]
    before = {"p": pair.stats("p"), "d": pair.stats("d")}
    preempted0 = preemptions(pair.p)
    fillers = random_prompts(pair.model, [500, 500], seed=4100)
    for i, filler in enumerate(fillers):  # 2 x 4 blocks held: no D ever asks for them
        pk = {"rapidkv": {"xfer_id": f"held-{i}", "role": "prefill"}}
        complete_full(pair.p.base_url, filler, 1, kv_transfer_params=pk)
    assert pair.stats("p")["free_blocks"] == 15 - 8

    async def main():
        async with httpx.AsyncClient() as client:
            # 2 x (130 + 300) tokens need 8 blocks; 7 are free
            tasks = [
                asyncio.create_task(acomplete_full(client, pair.p.base_url, ids, 300))
                for ids in decodes
            ]
            waits0 = before["p"].get("pending_block_frees_waits", 0)
            deadline = time.monotonic() + 30
            while pair.stats("p").get("pending_block_frees_waits", 0) == waits0:
                assert time.monotonic() < deadline, "P never waited for held blocks"
                assert not any(t.done() for t in tasks), "the decodes found enough blocks"
                await asyncio.sleep(0.02)
            for i in range(len(fillers)):  # their D gave up: the blocks come back
                abort = Abort(xfer_id=f"held-{i}", reason=AbortReason.TIMEOUT)
                assert pair.rpc.call(pair.p_control, abort, 10).code.name == "OK"
            return await asyncio.gather(*tasks)

    assert [c.token_ids for c in asyncio.run(main())] == expected
    assert preemptions(pair.p) == preempted0
    assert_back_to_baseline(pair)


def test_transfers_over_the_per_d_cap_are_refused_busy_and_retried(
    small_p_pair: Pair, workloads: dict
) -> None:
    """P takes one transfer per D at a time here: D's other TransferKVs get BUSY,
    are retried, and every prompt's KV still crosses."""
    pair = small_p_pair
    prompts, expected = workloads["small_busy"]
    before = {"p": pair.stats("p"), "d": pair.stats("d")}
    assert pair.run(prompts, "busy", serial=False, concurrency=3) == expected
    p1, d1 = pair.stats("p"), pair.stats("d")
    assert p1.get("busy_replies", 0) > before["p"].get("busy_replies", 0)
    assert d1.get("transfer_kv_retries_busy", 0) > before["d"].get("transfer_kv_retries_busy", 0)
    assert wait_for(
        lambda: (
            pair.stats("p").get("transfers_ok", 0) - before["p"].get("transfers_ok", 0)
            == len(prompts)
        ),
        2.0,
    )
    assert d1.get("recompute_fallbacks", 0) == before["d"].get("recompute_fallbacks", 0)
    assert_back_to_baseline(pair)


def test_substeps_that_arrive_after_their_step_are_rolled_back_and_sent_once(
    small_p_pair: Pair, workloads: dict
) -> None:
    """D's TransferKV reaches P while P computes the prompt's last chunk: P
    attaches a substep to that step, but the bypass channel holds it 300 ms, so
    the step freezes first and the worker rejects it. P rolls it back and the
    next step sends it: every block exactly once, exact output, nothing leaks."""
    pair = small_p_pair
    (ids,), (expected,) = workloads["small_late"]
    before = {"p": pair.stats("p"), "d": pair.stats("d")}
    pk, dk = pair.params("late-sub", mode="substep")

    assert pair.d_during_last_chunk("late-sub", ids, ids, pk, dk).token_ids == expected
    assert pair.timeline("late-sub").state_at_arrival == "last_chunk"

    delta = functools.partial(pair.since, before)

    assert wait_for(lambda: delta("p", "transfers_ok") == 1, 2.0)
    assert delta("p", "substeps_opened") == 1
    assert delta("p", "substeps_rejected") == 1  # the worker's verdict
    assert delta("p", "substeps_rolled_back") == 1  # the scheduler's follow-up
    assert delta("p", "substeps_accepted") == 0
    blocks = -(-(len(ids) - 1) // BLOCK)
    assert delta("p", "bytes_sent") == blocks * block_bytes(pair.model)  # each block once
    assert delta("d", "recompute_fallbacks") == 0
    assert_back_to_baseline(pair)


def test_a_migration_to_an_instance_without_room_is_refused_at_once_and_runs_on(
    small_p_pair: Pair, workloads: dict
) -> None:
    """P's pool is mostly held (3 blocks free) when a request decoding on D is
    ordered to move there: the router asks P's connector for room, gets too
    few free blocks for the tokens so far, and answers 409 busy at once,
    without sending P anything (a vLLM without room would queue the cut-over
    until the relay's 30 s timeout). The client's stream runs on on D to the
    single instance's output; both ends return to their baseline."""
    from rapidkv.control.messages import Abort, AbortReason
    from rapidkv.router.config import Instance, RouterConfig
    from rapidkv.router.server import start_router

    pair = small_p_pair
    (ids,), (expected,) = workloads["migrate-busy"]
    fillers = random_prompts(pair.model, [500, 500, 500], seed=4101)
    for i, filler in enumerate(fillers):  # 3 x 4 blocks held: no D ever asks for them
        pk = {"rapidkv": {"xfer_id": f"busy-held-{i}", "role": "prefill"}}
        complete_full(pair.p.base_url, filler, 1, kv_transfer_params=pk)
    assert pair.stats("p")["free_blocks"] == 3
    p_prompts0 = metric_sum(get_metrics(pair.p.base_url), "vllm:prompt_tokens_total")
    token = "busy-test-admin-token"
    auth = {"authorization": f"Bearer {token}"}
    config = RouterConfig(
        instances=(Instance(pair.p.base_url), Instance(pair.d.base_url)),
        dispatch="local",
        admin_token=token,
        port=0,
    )

    async def main(router: str) -> tuple[list[int], httpx.Response, float]:
        async with httpx.AsyncClient() as client:

            async def admin(path: str, **body: object) -> httpx.Response:
                return await client.post(f"{router}/admin/{path}", json=body, headers=auth)

            (await admin("drain", instance=pair.p.base_url, migrate=False)).raise_for_status()
            tokens: list[int] = []
            answer: list[tuple[httpx.Response, float]] = []
            body = completion_body(ids, MIGRATION_TOKENS, stream=True)
            async with client.stream("POST", f"{router}/v1/completions", json=body) as r:
                assert r.status_code == 200, await r.aread()
                xfer_id = r.headers["x-rapidkv-xfer-id"]
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    for choice in event["choices"]:
                        tokens.extend(choice.get("token_ids") or [])
                    if len(tokens) >= 20 and not answer:
                        (await admin("undrain", instance=pair.p.base_url)).raise_for_status()
                        t0 = time.monotonic()
                        move = {"xfer_id": xfer_id, "to": pair.p.base_url}
                        refused = await admin("migrate", **move)
                        answer.append((refused, time.monotonic() - t0))
            return tokens, *answer[0]

    try:
        with start_router(config) as router:
            tokens, refused, took = asyncio.run(main(router.url))
            metrics = httpx.get(f"{router.url}/metrics").text
    finally:
        for i in range(len(fillers)):
            abort = Abort(xfer_id=f"busy-held-{i}", reason=AbortReason.TIMEOUT)
            assert pair.rpc.call(pair.p_control, abort, 10).code.name == "OK"
    assert tokens == expected
    assert refused.status_code == 409, refused.text
    assert "is busy: no room" in refused.json()["error"]["message"], refused.text
    assert took < 5.0, f"refused after {took:.1f} s, not at once"
    assert 'rapidkv_router_migrations_total{outcome="refused"} 1.0' in metrics
    # P was sent nothing of the request (the router's discovery probes are 1 token each)
    p_prompts = metric_sum(get_metrics(pair.p.base_url), "vllm:prompt_tokens_total") - p_prompts0
    assert p_prompts < len(ids), p_prompts
    assert_back_to_baseline(pair)
