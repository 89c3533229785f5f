"""`RpcServer` and `RpcClient` over real sockets on loopback: replies, concurrency
on one connection, limits, reconnects, and what bad or unauthenticated peers get
(nothing, and no handler call)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from rapidkv.control.address import parse_address
from rapidkv.control.client import RpcClient, RpcError
from rapidkv.control.codes import Code
from rapidkv.control.framing import LENGTH, ClientSession
from rapidkv.control.messages import (
    Abort,
    AbortReason,
    AbortReply,
    ErrorReply,
    Handshake,
    HandshakeReply,
    KVSpec,
    RankEndpoint,
    Reply,
    Request,
    Stats,
    StatsRequest,
    TransferKV,
    TransferKVReply,
    answer_handshake,
    decode_reply,
    encode,
    prompt_hash,
)
from rapidkv.control.server import RpcServer

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

SECRET = b"s3cret"
DEADLINE = 5.0  # seconds any single wait may take before the test fails

SPEC = KVSpec(
    block_size=16,
    kernel_blocks_per_block=1,
    dtype="float32",
    num_layers=1,
    layer_block_bytes=(4096,),
    layer_runs_per_block=(1,),
    tp_size=1,
    model_fingerprint="fp",
)
ENDPOINTS = [
    RankEndpoint(rank=0, transport="tcp", transport_metadata=b"m", layout=b"l", num_blocks=8)
]


def transfer(xfer_id: str = "x1") -> TransferKV:
    return TransferKV(
        xfer_id=xfer_id,
        dst_instance="D",
        dst_blocks=[1, 2],
        first_block=0,
        num_tokens=20,
        prompt_hash=prompt_hash(range(21)),
    )


class Peer:
    """The handler under test: answers every request, records each call, and holds
    TransferKVs until `release()` when `hold` is set."""

    def __init__(self, hold: bool = False) -> None:
        self.calls: list[Request] = []
        self.hold = hold
        self.gate: concurrent.futures.Future[None] = concurrent.futures.Future()

    def release(self) -> None:
        self.gate.set_result(None)

    async def __call__(self, msg: Request) -> Reply:
        self.calls.append(msg)
        match msg:
            case TransferKV():
                if self.hold:
                    await asyncio.wrap_future(self.gate)
                return TransferKVReply(xfer_id=msg.xfer_id, code=Code.OK, tokens_sent=20)
            case Abort():
                return AbortReply(xfer_id=msg.xfer_id, code=Code.OK)
            case Handshake():
                return answer_handshake(msg, instance_id="P", spec=SPEC, endpoints=ENDPOINTS)
            case StatsRequest():
                return Stats({"calls": float(len(self.calls))})
        raise AssertionError(msg)


def wait_for(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


@pytest.fixture
def peer() -> Peer:
    return Peer()


@pytest.fixture(params=[None, SECRET], ids=["plain", "hmac"])
def secret(request: pytest.FixtureRequest) -> bytes | None:
    return request.param


@pytest.fixture
def server(peer: Peer, secret: bytes | None) -> Iterator[RpcServer]:
    with RpcServer(peer, secret=secret) as srv:
        yield srv


@pytest.fixture
def client(secret: bytes | None) -> Iterator[RpcClient]:
    with RpcClient(secret=secret) as cl:
        yield cl


class RawPeer:
    """A hand-driven client connection (blocking socket + `ClientSession`)."""

    def __init__(self, address: str, secret: bytes | None, *, hello: bool = True) -> None:
        self.sock = socket.create_connection(parse_address(address), timeout=DEADLINE)
        self.session = ClientSession(secret)
        head = self._recv_exactly(LENGTH.size)
        self.session.receive(head + self._recv_exactly(LENGTH.unpack(head)[0]))
        self.hello = self.session.outgoing()
        if hello:
            self.sock.sendall(self.hello)

    def _recv_exactly(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            assert chunk, "connection closed"
            buf += chunk
        return buf

    def request(self, request_id: int, payload: bytes) -> bytes:
        frame = self.session.seal(request_id, payload)
        self.sock.sendall(frame)
        return frame

    def reply(self) -> tuple[int, Reply]:
        while True:
            got = self.session.receive(self.sock.recv(65536))
            if got:
                assert len(got) == 1
                return got[0][0], decode_reply(got[0][1])

    def rest_until_closed(self) -> bytes:
        """Everything the server sends until it closes the connection."""
        data = b""
        try:
            while chunk := self.sock.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
        return data

    def close(self) -> None:
        self.sock.close()


# ---------------------------------------------------------------------------- replies


def test_every_request_gets_its_reply(server: RpcServer, client: RpcClient, peer: Peer) -> None:
    hs = Handshake(instance_id="D", control_address="127.0.0.1:1", spec=SPEC, endpoints=ENDPOINTS)
    assert client.call(server.address, hs, DEADLINE) == HandshakeReply(
        code=Code.OK, instance_id="P", spec=SPEC, endpoints=ENDPOINTS
    )
    assert client.call(server.address, transfer(), DEADLINE) == TransferKVReply(
        xfer_id="x1", code=Code.OK, tokens_sent=20
    )
    abort = Abort(xfer_id="x1", reason=AbortReason.CLIENT_ABORT)
    assert client.call(server.address, abort, DEADLINE).code == Code.OK  # type: ignore[union-attr]
    assert client.call(server.address, StatsRequest(), DEADLINE) == Stats({"calls": 4.0})
    assert peer.calls == [hs, transfer(), abort, StatsRequest()]
    assert server.counters()["connections_accepted"] == 1


def test_a_slow_transfer_kv_does_not_hold_up_stats_on_the_same_connection(
    server: RpcServer, client: RpcClient, peer: Peer
) -> None:
    peer.hold = True
    slow = client.submit(server.address, transfer(), DEADLINE)
    assert client.call(server.address, StatsRequest(), DEADLINE) == Stats({"calls": 2.0})
    assert not slow.done()
    peer.release()
    assert slow.result(DEADLINE).code == Code.OK  # type: ignore[union-attr]
    assert server.counters()["connections_accepted"] == 1


def test_many_threads_share_one_connection_per_address(
    server: RpcServer, client: RpcClient
) -> None:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [
            pool.submit(client.call, server.address, transfer(f"x{i}"), DEADLINE) for i in range(64)
        ]
        replies = [f.result() for f in futures]
    assert [r.xfer_id for r in replies] == [f"x{i}" for i in range(64)]  # type: ignore[union-attr]
    assert server.counters()["connections_accepted"] == 1


def test_submit_returns_before_the_reply_and_the_future_resolves_later(
    server: RpcServer, client: RpcClient, peer: Peer
) -> None:
    peer.hold = True
    fut = client.submit(server.address, transfer(), DEADLINE)
    wait_for(lambda: len(peer.calls) == 1, "the handler to start")
    assert not fut.done()
    done = threading.Event()
    fut.add_done_callback(lambda _: done.set())
    peer.release()
    assert done.wait(DEADLINE)
    assert fut.result().code == Code.OK  # type: ignore[union-attr]


def test_handler_failures_and_wrong_reply_types_become_rpc_errors(
    client: RpcClient, secret: bytes | None
) -> None:
    async def broken(msg: Request) -> Reply:
        if isinstance(msg, Abort):
            raise KeyError("no such xfer")
        return Stats()  # the wrong type for every other request

    with RpcServer(broken, secret=secret) as server:
        with pytest.raises(RpcError, match="handler failed on Abort: KeyError") as e:
            client.call(server.address, Abort(xfer_id="x", reason=AbortReason.TIMEOUT), DEADLINE)
        assert e.value.code == Code.ERROR
        with pytest.raises(RpcError, match="handler returned Stats for TransferKV"):
            client.call(server.address, transfer(), DEADLINE)
        assert client.call(server.address, StatsRequest(), DEADLINE) == Stats()
        assert server.counters()["handler_errors"] == 2


def test_requests_over_the_in_flight_limit_are_answered_busy(
    peer: Peer, client: RpcClient, secret: bytes | None
) -> None:
    peer.hold = True
    with RpcServer(peer, secret=secret, max_in_flight=2) as server:
        held = [client.submit(server.address, transfer(f"x{i}"), DEADLINE) for i in range(2)]
        with pytest.raises(RpcError) as e:
            client.call(server.address, StatsRequest(), DEADLINE)
        assert e.value.code == Code.BUSY
        peer.release()
        assert [f.result(DEADLINE).code for f in held] == [Code.OK, Code.OK]  # type: ignore[union-attr]
        assert client.call(server.address, StatsRequest(), DEADLINE) == Stats({"calls": 3.0})


def test_a_timeout_raises_timeout_error_and_the_connection_stays_usable(
    server: RpcServer, client: RpcClient, peer: Peer
) -> None:
    peer.hold = True
    with pytest.raises(TimeoutError, match="no reply from"):
        client.call(server.address, transfer(), 0.2)
    peer.release()  # the late reply is dropped
    assert client.call(server.address, StatsRequest(), DEADLINE) == Stats({"calls": 2.0})
    assert server.counters()["connections_accepted"] == 1


# ---------------------------------------------------------------------------- connections


def test_the_client_reconnects_after_the_server_restarts(
    peer: Peer, client: RpcClient, secret: bytes | None
) -> None:
    first = RpcServer(peer, secret=secret)
    first.start()
    address = first.address
    assert client.call(address, StatsRequest(), DEADLINE) == Stats({"calls": 1.0})
    first.stop()
    wait_for(lambda: not client.connected(address), "the client to see the connection close")
    with pytest.raises(ConnectionError):
        client.call(address, StatsRequest(), DEADLINE)  # nobody listens
    with RpcServer(peer, port=parse_address(address)[1], secret=secret) as second:
        assert client.call(address, StatsRequest(), DEADLINE) == Stats({"calls": 2.0})
        assert second.counters()["connections_accepted"] == 1


def test_requests_pending_when_the_server_stops_fail_with_connection_error(
    peer: Peer, client: RpcClient, secret: bytes | None
) -> None:
    peer.hold = True
    server = RpcServer(peer, secret=secret)
    server.start()
    fut = client.submit(server.address, transfer(), DEADLINE)
    wait_for(lambda: len(peer.calls) == 1, "the handler to start")
    server.stop()
    with pytest.raises(ConnectionError):
        fut.result(DEADLINE)


def test_close_fails_pending_requests_and_refuses_new_ones(
    server: RpcServer, peer: Peer, secret: bytes | None
) -> None:
    peer.hold = True
    client = RpcClient(secret=secret)
    fut = client.submit(server.address, transfer(), DEADLINE)
    wait_for(lambda: len(peer.calls) == 1, "the handler to start")
    client.close()
    with pytest.raises(ConnectionError, match="closed"):
        fut.result(DEADLINE)
    with pytest.raises(RuntimeError, match="closed"):
        client.submit(server.address, StatsRequest(), DEADLINE)


def test_submit_refuses_caller_bugs_at_once(server: RpcServer, secret: bytes | None) -> None:
    with RpcClient(secret=secret, max_frame=1024) as client:
        with pytest.raises(TypeError, match="not a control-plane request"):
            client.submit(server.address, Stats(), DEADLINE)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="control address"):
            client.submit("localhost", StatsRequest(), DEADLINE)
        big = TransferKV(
            xfer_id="x",
            dst_instance="D",
            dst_blocks=list(range(1000)),
            first_block=0,
            num_tokens=1,
            prompt_hash="0" * 32,
        )
        with pytest.raises(ValueError, match="exceeds the frame limit 1024"):
            client.submit(server.address, big, DEADLINE)


def test_a_reply_over_the_clients_frame_limit_fails_the_connection(
    secret: bytes | None,
) -> None:
    async def chatty(msg: Request) -> Reply:
        return Stats({f"counter_{i}": float(i) for i in range(200)})

    with (
        RpcServer(chatty, secret=secret) as server,
        RpcClient(secret=secret, max_frame=1024) as client,
        pytest.raises(ConnectionError, match="exceeds the limit of 1024"),
    ):
        client.call(server.address, StatsRequest(), DEADLINE)


def test_the_server_listens_only_on_the_configured_host(peer: Peer) -> None:
    with RpcServer(peer, host="127.0.0.1") as on_one, RpcServer(peer, host="127.0.0.2") as on_two:
        for server, other in ((on_one, "127.0.0.2"), (on_two, "127.0.0.1")):
            host, port = parse_address(server.address)
            socket.create_connection((host, port), timeout=DEADLINE).close()
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((other, port), timeout=DEADLINE)
    with pytest.raises(ValueError, match="explicitly"):
        RpcServer(peer, host="")


# ---------------------------------------------------------------------------- bad peers


def test_a_wrong_secret_gets_nothing_and_never_reaches_the_handler(
    peer: Peer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="rapidkv.control.server")
    with RpcServer(peer, secret=SECRET) as server:
        raw = RawPeer(server.address, b"wrong")
        raw.request(1, encode(StatsRequest()))
        assert raw.rest_until_closed() == b""
        local = f"127.0.0.1:{raw.sock.getsockname()[1]}"
        raw.close()
        with RpcClient(secret=b"wrong") as client, pytest.raises(ConnectionError):
            client.call(server.address, StatsRequest(), DEADLINE)
        assert server.counters()["auth_failures"] == 2
    assert peer.calls == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(local in w and "bad tag" in w for w in warnings), warnings


@pytest.mark.parametrize(
    ("server_secret", "client_secret", "why"),
    [(SECRET, None, "requires a shared secret"), (None, SECRET, "does not authenticate")],
)
def test_a_secret_on_one_side_only_fails_to_connect(
    peer: Peer, server_secret: bytes | None, client_secret: bytes | None, why: str
) -> None:
    with (
        RpcServer(peer, secret=server_secret) as server,
        RpcClient(secret=client_secret) as client,
        pytest.raises(ConnectionError, match=why),
    ):
        client.call(server.address, StatsRequest(), DEADLINE)
    assert peer.calls == []


def test_a_tampered_frame_closes_the_connection(peer: Peer) -> None:
    with RpcServer(peer, secret=SECRET) as server:
        raw = RawPeer(server.address, SECRET)
        raw.request(1, encode(StatsRequest()))
        assert raw.reply() == (1, Stats({"calls": 1.0}))
        frame = bytearray(raw.session.seal(2, encode(transfer())))
        frame[-40] ^= 0x01  # a byte of the message body
        raw.sock.sendall(frame)
        assert raw.rest_until_closed() == b""
        raw.close()
        assert server.counters()["auth_failures"] == 1
    assert peer.calls == [StatsRequest()]


def test_frames_replayed_on_a_new_connection_are_refused(peer: Peer) -> None:
    with RpcServer(peer, secret=SECRET) as server:
        raw = RawPeer(server.address, SECRET)
        recorded = raw.hello + raw.request(1, encode(transfer()))
        assert raw.reply()[0] == 1
        raw.close()
        replay = RawPeer(server.address, b"unknown", hello=False)  # only reads the preamble
        replay.sock.sendall(recorded)
        assert replay.rest_until_closed() == b""
        replay.close()
    assert peer.calls == [transfer()]


def test_a_frame_over_the_limit_is_refused_before_its_body_is_read(peer: Peer) -> None:
    with RpcServer(peer, max_frame=4096) as server:
        raw = RawPeer(server.address, None)
        raw.sock.sendall(LENGTH.pack(4097))  # and no body
        assert raw.rest_until_closed() == b""  # closed without waiting for 4097 bytes
        raw.close()
        assert server.counters()["frame_errors"] == 1
        assert server.counters()["oversized_frames"] == 1
    assert peer.calls == []


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"\x00\x00\x00\x05hello",
        bytes(range(255, -1, -1)) * 4,
        b"\xff\xff\xff\xff",
        b"\x00\x00\x00\x00",
    ],
    ids=["http", "short-frame", "bytes", "huge-length", "empty-frame"],
)
def test_garbage_bytes_close_that_connection_and_the_server_goes_on(
    peer: Peer, garbage: bytes, secret: bytes | None
) -> None:
    with RpcServer(peer, secret=secret) as server, RpcClient(secret=secret) as client:
        raw = RawPeer(server.address, secret, hello=False)
        raw.sock.sendall(garbage)
        assert raw.rest_until_closed() == b""
        raw.close()
        after_hello = RawPeer(server.address, secret)
        after_hello.sock.sendall(garbage)
        assert after_hello.rest_until_closed() == b""
        after_hello.close()
        assert client.call(server.address, StatsRequest(), DEADLINE) == Stats({"calls": 1.0})
        assert server.counters()["frame_errors"] + server.counters()["auth_failures"] == 2


@pytest.mark.parametrize(
    ("payload", "named"),
    [
        (b"\xc1", "invalid request"),
        (encode(TransferKVReply(xfer_id="x", code=Code.OK)), "Invalid value 'transfer_kv_reply'"),
        (
            encode(transfer()).replace(b"\xabfirst_block\x00", b"\xabfirst_block\x09"),
            "first_block 9 beyond 2",
        ),
    ],
    ids=["not-msgpack", "a-reply", "invalid-field"],
)
def test_an_invalid_message_in_a_sound_frame_gets_an_error_reply_naming_it(
    peer: Peer, payload: bytes, named: str, secret: bytes | None
) -> None:
    with RpcServer(peer, secret=secret) as server:
        raw = RawPeer(server.address, secret)
        raw.request(7, payload)
        request_id, reply = raw.reply()
        assert request_id == 7
        assert isinstance(reply, ErrorReply) and reply.code == Code.ERROR
        assert named in reply.message
        raw.request(8, encode(StatsRequest()))  # the connection goes on
        assert raw.reply() == (8, Stats({"calls": 1.0}))
        raw.close()
        assert server.counters()["bad_requests"] == 1


def test_a_request_id_reused_while_in_flight_closes_the_connection(peer: Peer) -> None:
    peer.hold = True
    with RpcServer(peer) as server:
        raw = RawPeer(server.address, None)
        raw.request(1, encode(transfer()))
        raw.request(1, encode(StatsRequest()))
        assert raw.rest_until_closed() == b""
        raw.close()
        peer.release()


def test_a_peer_that_never_says_hello_is_dropped(
    peer: Peer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="rapidkv.control.server")
    with RpcServer(peer, secret=SECRET, hello_timeout=0.2) as server:
        raw = RawPeer(server.address, SECRET, hello=False)
        assert raw.rest_until_closed() == b""
        raw.close()
        assert server.counters()["hello_timeouts"] == 1
        assert server.counters()["oversized_frames"] == 0
    assert any("no valid HELLO in time" in r.getMessage() for r in caplog.records)
