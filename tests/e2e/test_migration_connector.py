"""Live migration on a real pair of vLLM instances running RapidKVConnector
(`kv_both`: either may be source or destination), driven here as the router
will drive it (docs/protocol.md#live-migration): A decodes a request of role
`local`; B is sent a pre-copy (A's prompt and the tokens generated so far,
`max_tokens=1`, `migrate_from`), then the cut-over (the same with every token
so far, the remaining `max_tokens`), and A's stream is closed once B's first
token arrived. The concatenation equals a single instance's greedy output, the
KV crossed (B computed only the last prompt token of each request), the
cut-over loaded only what the pre-copy had not left in B's prefix cache, and
both instances are back at their baseline. A migration whose source is gone is
recomputed."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import httpx
import pytest
from pd_harness import (
    BLOCK,
    MAX_TOKENS,
    SOURCE_MIGRATION_PROMPT,
    SOURCE_MIGRATION_TOKENS,
    Pair,
    assert_back_to_baseline,
    block_bytes,
    wait_for,
)

from rapidkv.control.messages import TimelineRequest
from rapidkv.harness.client import acomplete_full, completion_body, get_metrics, metric_sum

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

PRE_COPY_AFTER = 4  # tokens A generated before the pre-copy goes to B
CUT_OVER_AFTER = 6  # more tokens A generated (past the pre-copy) before the cut-over


def destination_params(pair: Pair, xfer_id: str, source: str) -> dict[str, Any]:
    """A migration destination's `kv_transfer_params` on B (the source on A)."""
    return {
        "do_remote_prefill": True,
        "rapidkv": {
            "xfer_id": xfer_id,
            "role": "decode",
            "prefill_control": pair.p_control,
            "migrate_from": source,
        },
    }


class Stream:
    """A streaming completion whose token ids are read as they come (`token_ids`
    of each chunk, with `return_token_ids`), by a task of its own."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self._grew = asyncio.Event()
        self.task: asyncio.Task | None = None

    async def read(self, resp: httpx.Response) -> None:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            self.tokens.extend(json.loads(line[6:])["choices"][0].get("token_ids") or [])
            self._grew.set()
        self._grew.set()

    async def until(self, n: int, timeout: float = 60.0) -> None:
        async def wait() -> None:
            while len(self.tokens) < n:
                assert self.task is None or not self.task.done(), "the stream ended early"
                self._grew.clear()
                await self._grew.wait()

        await asyncio.wait_for(wait(), timeout)


def test_a_decoding_request_migrates_with_a_pre_copy_and_a_cut_over(
    pd_pair: Pair, workloads: dict
) -> None:
    (prompt,), (expected,) = workloads["migration"]
    assert len(prompt) == SOURCE_MIGRATION_PROMPT and len(expected) == SOURCE_MIGRATION_TOKENS
    a, b = pd_pair.p, pd_pair.d  # A: the source, B: the destination
    before = {w: pd_pair.stats(w) for w in ("p", "d")}
    b_metrics = get_metrics(b.base_url)
    source, pre_id, cut_id = "mig-src", "mig-pre", "mig-cut"

    async def main() -> tuple[list[int], int, int, list[int], list[int]]:
        async with httpx.AsyncClient() as client:
            on_a, on_b = Stream(), Stream()
            body = completion_body(
                prompt,
                SOURCE_MIGRATION_TOKENS,
                stream=True,
                kv_transfer_params={"rapidkv": {"xfer_id": source, "role": "local"}},
            )
            async with client.stream(
                "POST", f"{a.base_url}/v1/completions", json=body, timeout=120
            ) as resp:
                on_a.task = asyncio.create_task(on_a.read(resp))
                await on_a.until(PRE_COPY_AFTER)
                k = len(on_a.tokens)
                pre = await acomplete_full(
                    client,
                    b.base_url,
                    prompt + on_a.tokens[:k],
                    1,
                    kv_transfer_params=destination_params(pd_pair, pre_id, source),
                )
                await on_a.until(k + CUT_OVER_AFTER)
                cut = len(on_a.tokens)
                assert cut < SOURCE_MIGRATION_TOKENS - 50, "A decoded too fast to migrate mid-way"
                body_b = completion_body(
                    prompt + on_a.tokens[:cut],
                    SOURCE_MIGRATION_TOKENS - cut,
                    stream=True,
                    kv_transfer_params=destination_params(pd_pair, cut_id, source),
                )

                async def stream_b() -> None:
                    async with client.stream(
                        "POST", f"{b.base_url}/v1/completions", json=body_b, timeout=120
                    ) as resp_b:
                        await on_b.read(resp_b)

                on_b.task = asyncio.create_task(stream_b())
                await on_b.until(1)
                # B's first token is out: the router closes A's stream (A aborts it)
                on_a.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await on_a.task
            await on_b.task
            return on_a.tokens, k, cut, pre.token_ids, on_b.tokens

    from_a, k, cut, pre_tokens, from_b = asyncio.run(main())

    # token for token the single instance's output
    assert pre_tokens == expected[k : k + 1]  # the pre-copy's one token, computed on B
    assert from_a[:cut] + from_b == expected
    assert len(from_a) < SOURCE_MIGRATION_TOKENS  # A was stopped mid-way

    # the KV crossed twice (pre-copy, cut-over) and nothing was recomputed
    assert wait_for(lambda: pd_pair.since(before, "p", "migration_transfers_ok") == 2, 2.0), (
        pd_pair.stats("p")
    )
    a_after, b_after = pd_pair.stats("p"), pd_pair.stats("d")

    def a_delta(name: str) -> float:
        return a_after.get(name, 0) - before["p"].get(name, 0)

    def b_delta(name: str) -> float:
        return b_after.get(name, 0) - before["d"].get(name, 0)

    assert a_delta("migration_transfers") == 2 and a_delta("migration_transfers_failed") == 0
    assert b_delta("transfer_kv_ok") == 2 and b_delta("migration_transfer_kv_sent") == 2
    assert b_delta("recompute_fallbacks") == 0
    # the cut-over started at the pre-copy's blocks, cached on B: B computed the
    # pre-copy's whole prompt, so its full blocks are prefix hits of the cut-over
    pre_len, cut_len = len(prompt) + k, len(prompt) + cut
    first_block = min(pre_len // BLOCK, (cut_len - 1) // BLOCK)
    assert first_block > 0
    assert a_delta("migration_blocks_skipped") == first_block
    m = get_metrics(b.base_url)

    def by_source(source_: str) -> float:
        name = "vllm:prompt_tokens_by_source_total"
        return metric_sum(m, name, source=source_) - metric_sum(b_metrics, name, source=source_)

    assert by_source("external_kv_transfer") == (pre_len - 1) + (cut_len - 1 - first_block * BLOCK)
    assert by_source("local_cache_hit") == first_block * BLOCK
    assert by_source("local_compute") == 2  # each request's last prompt token
    # and the bytes: every block of the pre-copy, the cut-over's from first_block on
    blocks = -(-(pre_len - 1) // BLOCK) + -(-(cut_len - 1) // BLOCK) - first_block
    assert a_delta("bytes_sent") == blocks * block_bytes(pd_pair.model)
    timeline = pd_pair.rpc.call(pd_pair.p_control, TimelineRequest([pre_id, cut_id]), 10).xfers
    for xfer_id in (pre_id, cut_id):
        tl = timeline[xfer_id]
        assert tl.mode == "migration", tl
        assert {"transfer_kv", "accepted", "bypass_sent", "settled"} <= set(tl.events), tl
    # everything A held for the migrations and B loaded is given back
    assert_back_to_baseline(pd_pair)
    assert pd_pair.stats("p")["migration_sources"] == pd_pair.stats("d")["migration_sources"] == 0


def test_a_migration_whose_source_is_gone_is_recomputed(pd_pair: Pair, workloads: dict) -> None:
    """B is sent a migration of a request A already finished: A answers GONE
    at once, B does not ask again and computes the prompt itself."""
    (prompt,), (expected,) = workloads["migration-gone"]
    before = {w: pd_pair.stats(w) for w in ("p", "d")}

    async def main() -> list[int]:
        async with httpx.AsyncClient() as client:
            done = await acomplete_full(
                client,
                pd_pair.p.base_url,
                prompt[:100],
                2,
                kv_transfer_params={"rapidkv": {"xfer_id": "mig-finished", "role": "local"}},
            )
            assert len(done.token_ids) == 2  # a source no more: vLLM finished it
            out = await acomplete_full(
                client,
                pd_pair.d.base_url,
                prompt,
                MAX_TOKENS,
                kv_transfer_params=destination_params(pd_pair, "mig-gone", "mig-finished"),
            )
            return out.token_ids

    assert asyncio.run(main()) == expected
    assert pd_pair.since(before, "p", "migration_unknown_source") == 1
    assert pd_pair.since(before, "p", "migration_transfers") == 0
    assert pd_pair.since(before, "d", "recompute_fallbacks") == 1
    assert pd_pair.since(before, "d", "transfer_kv_retries_not_found") == 0
    assert_back_to_baseline(pd_pair)
