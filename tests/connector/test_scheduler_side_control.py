"""P's control-plane handlers on a real `SchedulerSide` (no engine: its RPC
server on loopback, driven by a real `RpcClient`): who P knows as a
destination, how a restarted one replaces its old process, and what a
duplicate TransferKV gets."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from vllm_stand_ins import Request as StandInRequest
from vllm_stand_ins import SchedulerOutput as StandInOutput
from vllm_stand_ins import handshake, rank_info, stats, wait_counter

from rapidkv.connector.config import ConnectorConfig
from rapidkv.connector.consumer_side import Consumed
from rapidkv.connector.metadata import WorkerMeta
from rapidkv.connector.scheduler_side import SchedulerSide
from rapidkv.control.client import RpcClient, RpcError
from rapidkv.control.codes import Code
from rapidkv.control.messages import (
    Abort,
    AbortReason,
    AbortReply,
    ErrorReply,
    Request,
    StatsRequest,
    TransferKV,
    prompt_hash,
)
from rapidkv.control.server import RpcServer
from rapidkv.harness import free_port

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

PARK_TTL_S = 0.5


RANK_INFO = rank_info(b"p-rank-0")


@pytest.fixture
def p_side() -> Iterator[tuple[SchedulerSide, RpcClient]]:
    side = SchedulerSide(
        ConnectorConfig(park_ttl_s=PARK_TTL_S, transport="tcp"), "P", 16, 1, "fingerprint"
    )
    side.set_ranks({0: RANK_INFO})
    client = RpcClient()
    try:
        yield side, client
    finally:
        client.close()
        side.close()


def transfer(xfer_id: str, dst: str = "D") -> TransferKV:
    return TransferKV(
        xfer_id=xfer_id,
        dst_instance=dst,
        dst_blocks=[1, 2],
        first_block=0,
        num_tokens=20,
        prompt_hash=prompt_hash(range(21)),
    )


def wait_parked(side: SchedulerSide, client: RpcClient) -> None:
    """Wait until P holds a parked TransferKV."""
    wait_counter(side, client, "parked_now")


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
    wait_parked(side, client)
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
    wait_parked(side, client)
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


def test_an_idle_destination_is_forgotten_after_peer_idle_ttl_s_but_not_one_in_use(
    p_side: tuple[SchedulerSide, RpcClient],
) -> None:
    """D restarted elsewhere with a new id never writes to P again: its entry
    goes once idle for `peer_idle_ttl_s`; one with a transfer parked stays."""
    side, client = p_side
    address = side.server.address
    for d, port in (("D", 7001), ("E", 7002)):
        hs = handshake(side, d, "a", f"127.0.0.1:{port}")
        assert client.call(address, hs, 5).code == Code.OK
    parked = client.submit(address, transfer("x1", dst="E"), 5)  # E has one parked
    wait_parked(side, client)
    ttl = side.config.peer_idle_ttl_s
    with side.shared.lock:
        side.control.forget_idle(time.monotonic() + ttl / 2)
    assert stats(side, client)["peers_decode"] == 2  # not idle long enough
    with side.shared.lock:
        side.control.forget_idle(time.monotonic() + ttl + 1)
    s = stats(side, client)
    assert s["peers_decode"] == 1 and s["peers_forgotten"] == 1
    assert client.call(address, transfer("x2", dst="D"), 5).code == Code.UNKNOWN_PEER
    assert parked.result(5).code == Code.NOT_FOUND  # E's transfer ran its course


class AbortAnswerer:
    """Stands in for P's control plane: answers Aborts with the given codes in
    turn (then OK)."""

    def __init__(self, codes: list[Code]) -> None:
        self.codes = list(codes)
        self.asked = 0
        self.server = RpcServer(self.handle)
        self.server.start()

    async def handle(self, request: Request) -> AbortReply | ErrorReply:
        if not isinstance(request, Abort):
            return ErrorReply(Code.ERROR, "unexpected")
        self.asked += 1
        code = self.codes.pop(0) if self.codes else Code.OK
        return AbortReply(xfer_id=request.xfer_id, code=code, message="as scripted")


def d_side(**config: float) -> SchedulerSide:
    return SchedulerSide(ConnectorConfig(transport="tcp", **config), "D", 16, 1, "fingerprint")


def reported(side: SchedulerSide, req_id: str) -> bool:
    return req_id in side.shared.pending.recv_failed


@pytest.mark.parametrize("codes", [[], [Code.BUSY, Code.ERROR], [Code.GONE], [Code.NOT_FOUND]])
def test_d_gives_up_blocks_p_may_write_only_once_p_confirms_the_abort(codes: list[Code]) -> None:
    """The write fence on D: the request is reported failed (its blocks freed
    or recomputed) only after an OK / GONE / NOT_FOUND; BUSY and ERROR are
    asked again while the blocks stay held."""
    p = AbortAnswerer(codes)
    side = d_side()
    try:
        c = Consumed("x1", "req-1", p.server.address, None)
        side.consumer.abort_p(c, AbortReason.TIMEOUT, report=True)
        deadline = time.monotonic() + 10
        while not reported(side, "req-1"):
            assert time.monotonic() < deadline, "never reported"
            time.sleep(0.01)
        unconfirmed = sum(code in (Code.BUSY, Code.ERROR) for code in codes)
        assert p.asked == unconfirmed + 1
        assert side.counters["abort_retries"] == unconfirmed
    finally:
        side.close()
        p.server.stop()


def test_a_p_that_never_confirms_holds_the_blocks_until_the_fence_timeout() -> None:
    p = AbortAnswerer([Code.BUSY] * 1000)
    side = d_side(fence_timeout_s=1.0)
    try:
        c = Consumed("x1", "req-1", p.server.address, None)
        t0 = time.monotonic()
        side.consumer.abort_p(c, AbortReason.TIMEOUT, report=True)
        time.sleep(0.5)
        assert not reported(side, "req-1")  # still held
        deadline = t0 + 5
        while not reported(side, "req-1"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert 1.0 <= time.monotonic() - t0 < 2.0  # held the whole fence timeout, then given up
        assert side.stats()["abort_fence_gave_up"] == 1
        assert p.asked >= 3
    finally:
        side.close()
        p.server.stop()


def test_a_refused_connection_confirms_the_abort() -> None:
    """Nothing listens at P's control address any more: P's process is gone."""
    side = d_side()
    try:
        c = Consumed("x1", "req-1", f"127.0.0.1:{free_port()}", None)
        side.consumer.abort_p(c, AbortReason.TIMEOUT, report=True)
        deadline = time.monotonic() + 5
        while not reported(side, "req-1"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert side.counters.get("abort_retries", 0) == 0
    finally:
        side.close()


def test_with_a_secret_a_peer_without_it_can_do_nothing(
    p_side: tuple[SchedulerSide, RpcClient],
) -> None:
    """P's control plane with a shared secret: a peer with no secret, or a wrong
    one, gets no handshake (so never the endpoints that reach P's or D's KV
    memory), triggers no transfer, aborts nothing and reads no stats; P's state
    is as before. The same messages with the secret work."""
    side, _ = p_side
    side.close()
    secret = "the shared secret"
    side = SchedulerSide(
        ConnectorConfig(park_ttl_s=PARK_TTL_S, transport="tcp", secret=secret),
        "P",
        16,
        1,
        "fingerprint",
    )
    side.set_ranks({0: RANK_INFO})
    good = RpcClient(secret=secret.encode())
    strangers = [RpcClient(), RpcClient(secret=b"a guess")]
    try:
        address = side.server.address
        before = stats(side, good)
        attempts = [
            handshake(side, "D", "a", "127.0.0.1:7001"),
            transfer("x1"),
            Abort(xfer_id="x1", reason=AbortReason.CLIENT_ABORT),
            StatsRequest(),
        ]
        for client in strangers:
            for request in attempts:
                with pytest.raises((ConnectionError, RpcError)):
                    client.call(address, request, 5)
        after = stats(side, good)
        for name in ("peers_decode", "parked_now", "tombstones", "transfers_live"):
            assert after[name] == before[name] == 0, name
        assert not any(k.startswith("aborts_") for k in after)
        # the wrong secret fails authentication each time; without one the client
        # stops at the server's preamble, which asks for one
        assert after["rpc_auth_failures"] == len(attempts)
        reply = good.call(address, handshake(side, "D", "a", "127.0.0.1:7001"), 5)
        assert reply.code == Code.OK and reply.endpoints  # the secret opens it
    finally:
        good.close()
        for client in strangers:
            client.close()
        side.close()


def test_a_wildcard_bind_advertises_the_configured_host() -> None:
    """Bound to every interface, the control plane tells routers (the discovery
    answer, every P answer) and P (D's handshakes) the advertised host, at the
    port it bound; the wildcard itself is never given out."""
    config = ConnectorConfig(
        transport="tcp", control_host="0.0.0.0", control_advertise_host="127.0.0.1"
    )
    side = SchedulerSide(config, "P", 16, 1, "fingerprint")
    try:
        bound = side.server.address
        port = int(bound.rpartition(":")[2])
        assert bound.startswith("0.0.0.0:")
        assert side.identity()["rapidkv"]["control"] == f"127.0.0.1:{port}"
        assert side.shared.control_address == f"127.0.0.1:{port}"
        with RpcClient() as client:  # reached at the advertised address
            assert client.call(f"127.0.0.1:{port}", StatsRequest(), 5).counters is not None
    finally:
        side.close()


def test_the_identity_a_router_learns_carries_block_size_and_max_num_seqs() -> None:
    config = ConnectorConfig(transport="tcp")
    sides = [
        SchedulerSide(config, "P", 16, 1, "fingerprint", max_num_seqs=8),
        SchedulerSide(config, "Q", 32, 1, "fingerprint"),
    ]
    try:
        known, unknown = (s.identity()["rapidkv"] for s in sides)
        assert (known["block_size"], known["max_num_seqs"]) == (16, 8)
        assert unknown["block_size"] == 32 and "max_num_seqs" not in unknown
        assert known["instance_id"] == "P" and known["control"] == sides[0].shared.control_address
    finally:
        for s in sides:
            s.close()


@pytest.mark.parametrize("reason", [AbortReason.NOTHING_TO_LOAD, AbortReason.CLIENT_ABORT])
def test_an_abort_that_overtakes_its_request_frees_it_when_it_finishes(
    p_side: tuple[SchedulerSide, RpcClient], reason: AbortReason
) -> None:
    """D's Abort reaches P before P's engine admitted the request (D found the
    prompt in its prefix cache; 32 streams at once through the router did it):
    the request is released as it finishes, not held for `finished_ttl_s`."""
    side, client = p_side
    reply = client.call(side.server.address, Abort(xfer_id="early", reason=reason), 5)
    assert isinstance(reply, AbortReply) and reply.code == Code.OK
    ids = list(range(21))
    req = StandInRequest("req-early", {"rapidkv": {"xfer_id": "early", "role": "prefill"}}, 21, ids)
    side.on_new_request(req)
    held, _ = side.request_finished(req, [3, 4])
    assert held  # vLLM must wait for finished_sending, which comes with the next step
    assert "req-early" in side.build_meta(StandInOutput({}, set(), 0)).release
    assert stats(side, client)["aborted_before_admission"] == 1


def test_once_the_engine_shuts_down_nothing_waits_for_a_transfer_kv(
    p_side: tuple[SchedulerSide, RpcClient],
) -> None:
    """vLLM's engine was asked to shut down (`closing`, set by the chained
    SIGTERM handler): at its next step a parked TransferKV is answered GONE and
    a finished request no TransferKV came for is released with that step; a
    TransferKV arriving later is answered GONE at once (never parked), and so
    is one for a released request; a request finishing later without one is
    released at once. A transfer already accepted runs to its end."""
    side, client = p_side
    address = side.server.address
    assert client.call(address, handshake(side, "D", "a", "127.0.0.1:7001"), 5).code == Code.OK

    def prefill(xfer_id: str) -> StandInRequest:
        req = StandInRequest(
            f"req-{xfer_id}",
            {"rapidkv": {"xfer_id": xfer_id, "role": "prefill"}},
            21,
            list(range(21)),
        )
        side.on_new_request(req)
        return req

    held = prefill("held")  # prefilled, finished, D has not asked yet
    assert side.request_finished(held, [3, 4])[0]
    accepted = prefill("accepted")  # D asked while it runs
    running = prefill("running")  # still computing at the shutdown
    parked = client.submit(address, transfer("parked"), 5)
    wait_parked(side, client)
    deadline = time.monotonic() + 5
    taken = client.submit(address, transfer("accepted"), 5)
    while stats(side, client)["transfers_live"] < 3 or "accepted" not in side.producer._produced:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert side.build_meta(StandInOutput({}, set(), 0)).release == []  # not shutting down

    side.shared.closing = True
    meta = side.build_meta(StandInOutput({}, set(), 0))
    assert meta.release == ["req-held"]
    assert parked.result(5).code == Code.GONE
    assert not taken.done()  # its transfer runs on
    reply = client.call(address, transfer("never-admitted"), 5)
    assert reply.code == Code.GONE and "shutting down" in reply.message
    assert client.call(address, transfer("held"), 5).code == Code.GONE
    assert side.request_finished(running, [5])[0]
    assert side.build_meta(StandInOutput({}, set(), 0)).release == ["req-running"]
    s = stats(side, client)
    assert s["parked_now"] == 0 and s["shutdown_refused"] == 2 and s["shutdown_released"] == 2
    assert s["transfers_live"] == 1  # the accepted one
    assert accepted.request_id not in meta.release
