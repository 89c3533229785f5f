"""`kvindex.service` and `kvindex.subscriber` against vLLM's own publisher
(`ZmqEventPublisher`, run in this process on IPC endpoints): live batches,
catch-up by replay, a publisher restart, leaving, unreadable messages and a
replay endpoint that never answers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import zmq

from rapidkv.router.kvindex import KVIndexService, Member

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

kv_events = pytest.importorskip("vllm.distributed.kv_events")

B = 4
_encode = msgspec.msgpack.Encoder().encode  # as vLLM's publisher encodes
PROMPT = list(range(1, 13))  # three blocks
OTHER = list(range(100, 112))


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> object:
    return kv_events.BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=B,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=0,
    )


def batch(*events) -> object:
    return kv_events.KVEventBatch(ts=time.time(), events=list(events))


class Publisher:
    """vLLM's ZmqEventPublisher on `dir`'s IPC endpoints."""

    def __init__(self, dir: Path, topic: str = "kv") -> None:
        self.endpoint, self.replay = f"ipc://{dir}/pub", f"ipc://{dir}/replay"
        self.pub = kv_events.ZmqEventPublisher(
            data_parallel_rank=0, endpoint=self.endpoint, replay_endpoint=self.replay, topic=topic
        )

    def member(self, key: str = "m", **kw) -> Member:
        return Member(key, self.endpoint, self.replay, "kv", **kw)


async def until(what: str, check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def test_live_batches_and_history_both_reach_the_index(tmp_path: Path) -> None:
    async def run() -> None:
        pub = Publisher(tmp_path)
        pub.pub.publish(batch(stored([11], None, PROMPT[:4])))  # before anyone listens
        service = KVIndexService(B, replay_timeout_s=2.0)
        try:
            await service.add(pub.member())
            await until("the history", lambda: service.index.match(PROMPT) == {"m": 1})
            pub.pub.publish(batch(stored([12, 13], 11, PROMPT[4:12])))
            await until("the live batch", lambda: service.index.match(PROMPT) == {"m": 3})
            assert service.index.match(OTHER) == {"m": 0}
            pub.pub.publish(batch(kv_events.BlockRemoved(block_hashes=[12], medium="GPU")))
            await until("the eviction", lambda: service.index.match(PROMPT) == {"m": 1})
            counts = service.index.member_counts("m")
            assert counts["applied"] == 3 and counts["replays"] >= 1
            await service.remove("m")
            assert service.index.members() == ()
        finally:
            await service.close()
            pub.pub.shutdown()

    asyncio.run(run())


def test_a_restarted_publisher_replaces_what_the_old_one_held(tmp_path: Path) -> None:
    async def run() -> None:
        pub = Publisher(tmp_path)
        links: list[tuple[str, bool]] = []
        service = KVIndexService(B, replay_timeout_s=2.0, on_link=lambda *a: links.append(a))
        try:
            await service.add(pub.member())
            await until("connected", lambda: service.index.synced("m"))
            pub.pub.publish(batch(stored([11, 12, 13], None, PROMPT)))
            await until("the old store", lambda: service.index.match(PROMPT) == {"m": 3})
            pub.pub.shutdown()
            await until("the drop", lambda: not service.index.synced("m"))
            pub = Publisher(tmp_path)  # seqs from 0 again, same endpoints
            pub.pub.publish(batch(stored([21, 22, 23], None, OTHER)))
            await until("the new store", lambda: service.index.match(OTHER) == {"m": 3})
            assert service.index.match(PROMPT) == {"m": 0}
            assert service.index.member_counts("m")["publishers"] >= 1
            assert links == [("m", True), ("m", False), ("m", True)]
        finally:
            await service.close()
            pub.pub.shutdown()

    asyncio.run(run())


def test_a_new_identity_drops_the_old_entries_at_once(tmp_path: Path) -> None:
    async def run() -> None:
        pub = Publisher(tmp_path)
        service = KVIndexService(B, replay_timeout_s=2.0)
        try:
            await service.add(pub.member(identity="one"))
            pub.pub.publish(batch(stored([11, 12, 13], None, PROMPT)))
            await until("the store", lambda: service.index.match(PROMPT) == {"m": 3})
            await service.add(pub.member(identity="two"))
            assert service.index.match(PROMPT) == {"m": 0}
            # the same process, in fact: the catch-up replay from 0 brings its batch back
            await until("the catch-up", lambda: service.index.match(PROMPT) == {"m": 3})
        finally:
            await service.close()
            pub.pub.shutdown()

    asyncio.run(run())


def test_unreadable_messages_are_counted_and_a_silent_replay_times_out(tmp_path: Path) -> None:
    """A publisher of our own: garbage frames, and a replay endpoint nobody serves."""

    async def run() -> None:
        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        pub.bind(f"ipc://{tmp_path}/pub")
        member = Member("m", f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/nobody", "kv")
        service = KVIndexService(B, replay_timeout_s=0.3)
        try:
            await service.add(member)
            await until("the replay to time out", lambda: service.index.synced("m"))
            for frames in (
                [b"kv", (0).to_bytes(8, "big"), b"\xc1 not msgpack"],
                [b"kv", b"two frames"],
                [b"kv", (1).to_bytes(8, "big"), b""],
                [b"kv", (2).to_bytes(8, "big"), _encode(batch(stored([11], None, PROMPT[:4])))],
            ):
                pub.send_multipart(frames)
            await until("the good batch", lambda: service.index.match(PROMPT) == {"m": 1})
            counts = service.index.member_counts("m")
            assert counts["refused_frames"] == 1 and counts["refused"] == 2
            assert counts["applied"] == 3  # unreadable batches are applied as "unknown"
        finally:
            await service.close()
            pub.close(linger=0)
            ctx.term()

    asyncio.run(run())


def test_a_member_made_to_leave_the_index_is_joined_again_when_added(tmp_path: Path) -> None:
    async def run() -> None:
        pub = Publisher(tmp_path)
        service = KVIndexService(B, replay_timeout_s=2.0)
        try:
            await service.add(pub.member())
            pub.pub.publish(batch(stored([11], None, PROMPT[:4])))
            await until("the store", lambda: service.index.match(PROMPT) == {"m": 1})
            service.index.leave("m")  # a caller that must stop placement reading it at once
            await service.add(pub.member())
            await until("the catch-up", lambda: service.index.match(PROMPT) == {"m": 1})
        finally:
            await service.close()
            pub.pub.shutdown()

    asyncio.run(run())
