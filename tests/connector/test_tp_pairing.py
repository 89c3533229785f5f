"""Instances of different TP sizes in the connector: the handshake pairs them
where their KV heads map (and refuses with the reason where not), P counts a
transfer settled once every (source rank, destination rank) pair's SendDone
came, and a worker rank connects to, and sends each task to, every rank of the
destination that needs its heads."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from rapidkv.bench.kvt.tp import rank_kvs
from rapidkv.connector.bypass import Peer
from rapidkv.connector.config import ConnectorConfig
from rapidkv.connector.metadata import RankInfo
from rapidkv.connector.producer import Produced
from rapidkv.connector.rank_pairs import rank_pairs
from rapidkv.connector.scheduler_side import SchedulerSide
from rapidkv.connector.worker_side import WorkerSide
from rapidkv.control.client import RpcClient
from rapidkv.control.codes import Code
from rapidkv.control.messages import Handshake, KVSpec, RankEndpoint
from rapidkv.kvt.head_map import MappingError
from rapidkv.kvt.layout import Layout
from rapidkv.kvt.messages import SendDone
from rapidkv.kvt.task import Task

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

BLOCKS, LAYERS, BLOCK = 4, 2, 16


def layouts(tp: int) -> list[Layout]:
    return [layout for _, layout in rank_kvs("cpu", tp, False, layers=LAYERS, blocks=BLOCKS)]


def endpoints(tp: int, change: Any = None) -> list[RankEndpoint]:
    out = []
    for rank, layout in enumerate(layouts(tp)):
        if change is not None:
            layout = change(layout)
        out.append(
            RankEndpoint(
                rank=rank,
                transport="tcp",
                transport_metadata=b"m",
                layout=msgspec.msgpack.encode(layout),
                num_blocks=BLOCKS,
            )
        )
    return out


def other_head_size(layout: Layout) -> Layout:
    layers = tuple(
        msgspec.structs.replace(
            x, heads=msgspec.structs.replace(x.heads, head_size=x.heads.head_size // 2)
        )
        for x in layout.layers
    )
    return msgspec.structs.replace(layout, layers=layers)


def no_heads(layout: Layout) -> Layout:
    layers = tuple(msgspec.structs.replace(x, heads=None) for x in layout.layers)
    return msgspec.structs.replace(layout, layers=layers)


def test_rank_pairs_count_the_routes_or_refuse_with_the_reason() -> None:
    assert rank_pairs(endpoints(2), endpoints(1)) == 2  # both P ranks to D's one
    assert rank_pairs(endpoints(1), endpoints(2)) == 2  # P's one rank to both
    assert rank_pairs(endpoints(4), endpoints(2)) == 4
    assert rank_pairs(endpoints(2), endpoints(2)) == 2
    with pytest.raises(MappingError, match="head size 128 vs 64"):
        rank_pairs(endpoints(2), endpoints(1, other_head_size))
    with pytest.raises(MappingError, match="does not describe its KV heads"):
        rank_pairs(endpoints(2, no_heads), endpoints(1))
    bad = [msgspec.structs.replace(e, layout=b"\x01") for e in endpoints(1)]
    with pytest.raises(MappingError, match="does not decode"):
        rank_pairs(endpoints(2), bad)


def rank_infos(tp: int) -> dict[int, RankInfo]:
    out = {}
    for rank, layout in enumerate(layouts(tp)):
        per_layer = tuple(x.run_bytes for x in layout.layers)
        out[rank] = RankInfo(
            rank=rank,
            bypass_address="tcp://127.0.0.1:9",
            transport="tcp",
            transport_metadata=b"p",
            layout=msgspec.msgpack.encode(layout),
            num_blocks=BLOCKS,
            block_bytes=per_layer,
            runs_per_block=(1,) * LAYERS,
            dtype="int16",
            kernel_blocks_per_block=1,
        )
    return out


@pytest.fixture
def p_tp1() -> Iterator[tuple[SchedulerSide, RpcClient]]:
    side = SchedulerSide(ConnectorConfig(transport="tcp"), "P", BLOCK, 1, "fingerprint")
    side.set_ranks(rank_infos(1))
    client = RpcClient()
    try:
        yield side, client
    finally:
        client.close()
        side.close()


def d_handshake(side: SchedulerSide, name: str, tp: int, change: Any = None) -> Handshake:
    assert side.spec is not None
    spec: KVSpec = msgspec.structs.replace(
        side.spec,
        tp_size=tp,
        layer_block_bytes=tuple(b // tp for b in side.spec.layer_block_bytes),
    )
    return Handshake(
        instance_id=name,
        control_address="127.0.0.1:7001",
        spec=spec,
        endpoints=endpoints(tp, change),
        incarnation="a",
    )


def test_a_p_at_tp_1_pairs_with_a_d_at_tp_2_and_refuses_heads_that_cannot_map(p_tp1) -> None:
    side, client = p_tp1
    reply = client.call(side.server.address, d_handshake(side, "D2", 2), 5)
    assert reply.code == Code.OK, reply.reasons
    assert side.shared.peer_pairs["D2"] == 2
    refused = client.call(side.server.address, d_handshake(side, "Dx", 2, other_head_size), 5)
    assert refused.code == Code.ERROR
    assert "KV heads do not map onto Dx" in refused.reasons[0]
    assert "head size 128 vs 64" in refused.reasons[0]
    assert "Dx" not in side.shared.peer_pairs


def test_p_settles_a_transfer_once_every_pair_settled(p_tp1) -> None:
    side, _ = p_tp1
    producer = side.producer
    p = Produced("x", "req", 33, "h", issued=True, settles=2)
    producer._produced["x"] = p
    producer.take_settled([SendDone("x", 0, 32, True, "", 0, 1)])
    assert "x" in producer._produced and not p.all_settled  # D's rank 1 still owed
    producer.take_settled([SendDone("x", 0, 32, True, "", 0, 1)])  # the same again
    assert not p.all_settled
    producer.take_settled([SendDone("x", 0, 16, False, "write failed", 1, 1)])
    assert p.all_settled
    assert side.shared.counters["transfers_failed"] == 1  # one pair failed: all failed


class StubKvt:
    """What `WorkerSide._add_peer`/`_drop_peer` ask of kvt."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.peers: list[tuple[int, str]] = []  # (dst rank, "add" | "remove")

    def add_peer(self, metadata: bytes, layout: Layout, rank: int | None = None) -> str:
        self.peers.append((rank if rank is not None else -1, "add"))
        return f"peer{rank}"

    def remove_peer(self, peer: str) -> None:
        self.peers.append((int(peer.rpartition(".r")[2]), "remove"))


def worker(tp: int, rank: int) -> tuple[WorkerSide, StubKvt]:
    w = WorkerSide(ConnectorConfig(transport="tcp"), "P", rank, BLOCK)
    kvt = StubKvt(layouts(tp)[rank])
    w.kvt = kvt  # type: ignore[assignment]
    return w, kvt


def d_peers(tp: int, generation: int) -> list[Peer]:
    return [
        Peer("D", d, b"m", msgspec.msgpack.encode(layout), generation)
        for d, layout in enumerate(layouts(tp))
    ]


def task() -> Task:
    return Task("x", "D", (0,), (1,), 0, BLOCK, True)


def test_a_rank_at_tp_1_sends_each_task_to_both_ranks_of_a_d_at_tp_2() -> None:
    w, kvt = worker(1, 0)
    assert [t.peer for t in w._mine([task()])] == ["D.r0"]  # not connected yet: own rank
    for peer in d_peers(2, 1):
        w._add_peer(peer)
    assert kvt.peers == [(0, "add"), (1, "add")]
    assert [t.peer for t in w._mine([task()])] == ["D.r0", "D.r1"]
    for peer in d_peers(2, 1):  # the same entries again (step metadata and bypass)
        w._add_peer(peer)
    assert len(kvt.peers) == 2
    for peer in d_peers(2, 2):  # D restarted: the old connections go
        w._add_peer(peer)
    assert kvt.peers[2:] == [(0, "remove"), (1, "remove"), (0, "add"), (1, "add")]
    w._drop_peer("D", 2)
    assert kvt.peers[6:] == [(0, "remove"), (1, "remove")]


@pytest.mark.parametrize("rank", [0, 1])
def test_both_ranks_at_tp_2_send_to_the_one_rank_of_a_d_at_tp_1(rank: int) -> None:
    w, kvt = worker(2, rank)
    for peer in d_peers(1, 1):
        w._add_peer(peer)
    assert kvt.peers == [(0, "add")]
    assert [t.peer for t in w._mine([task()])] == ["D.r0"]


def test_at_equal_tp_a_rank_sends_to_its_own_rank_only() -> None:
    w, kvt = worker(2, 1)
    for peer in d_peers(2, 1):
        w._add_peer(peer)
    assert kvt.peers == [(1, "add")]
    assert [t.peer for t in w._mine([task()])] == ["D.r1"]
