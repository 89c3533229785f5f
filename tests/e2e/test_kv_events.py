"""vLLM's KV events feed the router's prefix-cache index (`router.kvindex`).

One real vLLM (the session's chunked-prefill instance: tiny float32 model,
prefix caching on, `--kv-events-config` with a ZMQ publisher and a replay
socket on free ports) and a
`KVIndexService` subscribed to it: completions sharing a long prefix show up
as the right number of leading cached blocks, computed with the index's own
hash from the token ids; a prompt never sent has none; a subscriber that
missed batches catches up by replay; `POST /reset_prefix_cache` ends in
`AllBlocksCleared` and an empty index.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from pd_harness import listening

from rapidkv.harness import (
    VLLMServer,
    complete,
    get_metrics,
    random_prompts,
)
from rapidkv.router.kvindex import KVIndexService, Member

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture
def member(chunked_kv_events: tuple[int, int, str]) -> Member:
    """The member that follows the session's chunked-prefill server, which
    publishes its KV events (`chunked_spec` in tests/conftest.py)."""
    pub, replay, topic = chunked_kv_events
    return Member("kv", f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", topic)


def block_size(server: VLLMServer) -> int:
    """The engine's KV block size, from `vllm:cache_config_info`."""
    for (name, labels), _ in get_metrics(server.base_url).items():
        if name == "vllm:cache_config_info":
            return int(dict(labels)["block_size"])
    raise AssertionError("no vllm:cache_config_info in /metrics")


async def until(what: str, check: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def test_the_publisher_listens_on_loopback_only(
    single_server_chunked: VLLMServer, chunked_kv_events: tuple[int, int, str]
) -> None:
    """The harness binds vLLM's publisher to 127.0.0.1 (`harness.kv_events`),
    where vLLM's documented ``tcp://*:PORT`` would listen on every interface."""
    pub, replay, _ = chunked_kv_events
    tcp, _ = listening(single_server_chunked.process.live_pids())
    assert {(host, port) for host, port in tcp if port in (pub, replay)} == {
        ("127.0.0.1", pub),
        ("127.0.0.1", replay),
    }, tcp


def test_the_index_follows_the_prefix_cache_of_a_real_instance(
    single_server_chunked: VLLMServer, member: Member, tiny_model: Path
) -> None:
    kv_server = single_server_chunked
    n = block_size(kv_server)
    length = 5 * n + n // 3  # five full blocks and a partial one (max-model-len 1024)
    assert length + 2 <= 1024
    a, fresh, fresh2, never = random_prompts(tiny_model, [length] * 4, seed=2024)
    b = a[: 3 * n + 10] + fresh[3 * n + 10 :]  # shares a's first three blocks
    c = a[: 4 * n] + never[4 * n :]  # a's four blocks, then tokens never sent
    e = a[: 2 * n] + fresh2[2 * n :]  # sent while the subscriber is away

    async def send(prompt: list[int]) -> None:
        await asyncio.to_thread(complete, kv_server.base_url, prompt, 2)

    async def run() -> None:
        service = KVIndexService(n)
        index = service.index
        try:
            await service.add(member)
            await until("the first catch-up", lambda: index.synced("kv"))
            await send(a)
            await send(b)
            await until("both prompts", lambda: index.match(b) == {"kv": 5})
            assert index.match(a) == {"kv": 5}
            assert index.match(c) == {"kv": 4}
            assert index.match(never) == {"kv": 0}

            await service.remove("kv")  # away: e's blocks are published to nobody
            await send(e)
            await service.add(member)  # back: the catch-up replay from seq 0 brings them
            await until("the replayed batches", lambda: index.match(e) == {"kv": 5})
            assert index.match(a) == {"kv": 5}
            assert index.member_counts("kv")["replays"] >= 1

            r = await asyncio.to_thread(httpx.post, f"{kv_server.base_url}/reset_prefix_cache")
            assert r.status_code == 200, r.text
            await send(a[:3])  # the clear is published with the engine's next step
            await until("AllBlocksCleared", lambda: index.match(a) == {"kv": 0})
            counts = index.member_counts("kv")
            assert counts["cleared"] >= 1 and index.match(e) == {"kv": 0}
            assert counts.get("refused", 0) == 0 and counts.get("skipped_orphan", 0) == 0
        finally:
            await service.close()

    asyncio.run(run())
