"""P's control-plane handlers on a real `SchedulerSide` (no engine: its RPC
server on loopback, driven by a real `RpcClient`): who P knows as a
destination, how a restarted one replaces its old process, and what a
duplicate TransferKV gets."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from rapidkv.connector.config import ConnectorConfig
from rapidkv.connector.metadata import RankInfo, WorkerMeta
from rapidkv.connector.scheduler_side import SchedulerSide
from rapidkv.control.client import RpcClient
from rapidkv.control.codes import Code
from rapidkv.control.messages import (
    Handshake,
    RankEndpoint,
    StatsRequest,
    TransferKV,
    prompt_hash,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

PARK_TTL_S = 0.5


@pytest.fixture
def p_side() -> Iterator[tuple[SchedulerSide, RpcClient]]:
    side = SchedulerSide(
        ConnectorConfig(park_ttl_s=PARK_TTL_S, transport="tcp"), "P", 16, 1, "fingerprint"
    )
    info = RankInfo(
        rank=0,
        bypass_address="tcp://127.0.0.1:9",
        transport="tcp",
        transport_metadata=b"p-rank-0",
        layout=b"layout",
        num_blocks=64,
        block_bytes=(4096,),
        runs_per_block=(1,),
        dtype="float32",
        kernel_blocks_per_block=1,
    )
    side.set_ranks({0: info})
    client = RpcClient()
    try:
        yield side, client
    finally:
        client.close()
        side.close()


def handshake(side: SchedulerSide, instance: str, incarnation: str, control: str) -> Handshake:
    assert side.spec is not None
    endpoint = RankEndpoint(
        rank=0,
        transport="tcp",
        transport_metadata=f"{instance}/{incarnation}".encode(),
        layout=b"layout",
        num_blocks=64,
    )
    return Handshake(
        instance_id=instance,
        control_address=control,
        spec=side.spec,
        endpoints=[endpoint],
        incarnation=incarnation,
    )


def transfer(xfer_id: str, dst: str = "D") -> TransferKV:
    return TransferKV(
        xfer_id=xfer_id,
        dst_instance=dst,
        dst_blocks=[1, 2],
        first_block=0,
        num_tokens=20,
        prompt_hash=prompt_hash(range(21)),
    )


def stats(side: SchedulerSide, client: RpcClient) -> dict[str, float]:
    return client.call(side.server.address, StatsRequest(), 5).counters


def test_a_transfer_kv_from_an_instance_p_has_no_handshake_from_is_unknown_peer(
    p_side: tuple[SchedulerSide, RpcClient],
) -> None:
    side, client = p_side
    reply = client.call(side.server.address, transfer("x1", dst="stranger"), 5)
    assert reply.code == Code.UNKNOWN_PEER
    assert "no handshake from stranger" in reply.message
    assert stats(side, client)["parked_now"] == 0


def test_a_restarted_destination_replaces_its_old_process(
    p_side: tuple[SchedulerSide, RpcClient],
) -> None:
    """Same id with a new incarnation, or another id from the same control
    address: the old one is forgotten and what was parked for it answered GONE;
    the same process handshaking again changes nothing."""
    side, client = p_side
    address = side.server.address
    assert client.call(address, handshake(side, "D", "a", "127.0.0.1:7001"), 5).code == Code.OK
    assert client.call(address, handshake(side, "D", "a", "127.0.0.1:7001"), 5).code == Code.OK
    assert stats(side, client).get("peers_forgotten", 0) == 0

    parked = client.submit(address, transfer("parked-for-old-d"), 5)
    deadline = time.monotonic() + 5
    while stats(side, client)["parked_now"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert client.call(address, handshake(side, "D", "b", "127.0.0.1:7001"), 5).code == Code.OK
    assert parked.result(5).code == Code.GONE
    s = stats(side, client)
    assert s["peers_forgotten"] == 1 and s["peers_decode"] == 1 and s["parked_now"] == 0

    # another instance where D was: D is gone
    assert client.call(address, handshake(side, "D2", "c", "127.0.0.1:7001"), 5).code == Code.OK
    s = stats(side, client)
    assert s["peers_forgotten"] == 2 and s["peers_decode"] == 1
    assert client.call(address, transfer("x2", dst="D"), 5).code == Code.UNKNOWN_PEER

    # a wildcard control address names no host: nobody is evicted by it
    for name in ("W1", "W2"):
        assert client.call(address, handshake(side, name, "w", "0.0.0.0:7002"), 5).code == Code.OK
    assert stats(side, client)["peers_decode"] == 3


def test_a_duplicate_transfer_kv_gets_the_first_ones_answer_and_changes_nothing(
    p_side: tuple[SchedulerSide, RpcClient],
) -> None:
    side, client = p_side
    address = side.server.address
    assert client.call(address, handshake(side, "D", "a", "127.0.0.1:7001"), 5).code == Code.OK
    first = client.submit(address, transfer("x1"), 5)
    deadline = time.monotonic() + 5
    while stats(side, client)["parked_now"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    second = client.submit(address, transfer("x1"), 5)
    replies = [first.result(5), second.result(5)]  # both answered once the park TTL passed
    assert [r.code for r in replies] == [Code.NOT_FOUND, Code.NOT_FOUND]
    s = stats(side, client)
    assert s["duplicate_transfer_kv"] == 1
    assert s["park_expired"] == 1 and s["parked"] == 1 and s["parked_now"] == 0


def test_a_destination_whose_writes_failed_is_forgotten_and_handshakes_anew(
    p_side: tuple[SchedulerSide, RpcClient],
) -> None:
    """A worker reports the transport failed writes to D: P forgets D (unless a
    newer handshake of it came since) and D's next TransferKV is UNKNOWN_PEER,
    so D handshakes again and P connects to it anew."""
    side, client = p_side
    address = side.server.address
    assert client.call(address, handshake(side, "D", "a", "127.0.0.1:7001"), 5).code == Code.OK
    generation = int(stats(side, client)["peers_added"])
    side.update_output(WorkerMeta(broken_peers=[("D", generation - 1)]), None)  # stale
    assert stats(side, client).get("peers_forgotten", 0) == 0
    side.update_output(WorkerMeta(broken_peers=[("D", generation)]), None)
    assert stats(side, client)["peers_forgotten"] == 1
    assert client.call(address, transfer("x1"), 5).code == Code.UNKNOWN_PEER
    assert client.call(address, handshake(side, "D", "a", "127.0.0.1:7001"), 5).code == Code.OK
    s = stats(side, client)
    assert s["peers_decode"] == 1 and s["peers_added"] == generation + 1
