"""Conformance suite for kvt transports (`rapidkv.kvt.transport.base.Transport`).

Every generic test runs for every transport kind. The sender lives in the test
process; the receiver in a second process (`transport_peer`, multiprocessing
spawn) that owns ``guard | region | guard`` and registers only the region, so a
write escaping its bounds is visible. Waits poll with deadlines.

Where a kind promises more than the interface (NIXL: one request per post, rows
refused at post time, the reason of an ERROR), the generic test checks that too
under `kind == ...`. NIXL-only behaviour is in test_transport_nixl; TCP-specific
behaviour (authentication, the wire protocol's refusals) is at the end, marked by
`tcp` in the test names.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import logging
import socket
import threading
import time
import uuid
import zlib
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transport_peer import (
    FILL,
    Peer,
    Sender,
    assert_written,
    release_all,
    start_peer,
    wait_all,
)

from rapidkv.kvt.transport import Transport, TransportError, XferState, create_transport
from rapidkv.kvt.transport.tcp_inbound import Event, Inbound, Landed, Notif
from rapidkv.kvt.transport.tcp_memory import RegionTable
from rapidkv.kvt.transport.tcp_wire import (
    HEADER_SIZE,
    Hello,
    Kind,
    Metadata,
    ProtocolError,
    decode_metadata,
    encode_body,
    encode_metadata,
    pack_header,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

BLOCK = 4096
REGION = 1 << 20  # the shared peer's registered region
SRC = 16 << 20  # the sender's registered source buffer
DEADLINE = 10.0  # seconds any single wait may take before the test fails
PROMPT = 1.0  # seconds within which NIXL's calls on a dead peer must return

_NIXL_MISSING = importlib.util.find_spec("rapidkv.kvt.transport.nixl") is None
KINDS = [
    pytest.param("tcp"),
    pytest.param(
        "nixl",
        marks=pytest.mark.skipif(
            _NIXL_MISSING,
            reason="rapidkv/kvt/transport/nixl.py does not exist yet "
            "(being written against the same interface)",
        ),
    ),
]


def _uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


# --- fixtures --------------------------------------------------------------------------


@pytest.fixture(scope="module", params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def peer(kind: str) -> Iterator[Peer]:
    p = start_peer(kind, _uid(f"rx-{kind}"), REGION)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def sender(kind: str) -> Iterator[Sender]:
    src = np.random.default_rng(7).integers(0, 256, SRC, dtype=np.uint8)
    t = create_transport(kind, _uid(f"tx-{kind}"))
    t.register_memory([(src.ctypes.data, src.nbytes)])
    yield Sender(t, src)
    t.close()


@pytest.fixture
def link(sender: Sender, peer: Peer) -> Sender:
    """The sender freshly linked to a reset peer (clean memory, no notifications)."""
    peer.call("reset")
    assert sender.connect(peer) == peer.name
    return sender


# --- block maps --------------------------------------------------------------------------


def block_map(scenario: str, rng: np.random.Generator) -> np.ndarray:
    """`(src_offset, dst_offset, nbytes)` rows with disjoint destinations."""
    nb, ns = REGION // BLOCK, SRC // BLOCK
    if scenario == "contiguous":  # runs of consecutive blocks on both sides
        rows = []
        for dst0, length in ((0, 40), (64, 100), (200, 56)):
            src0 = int(rng.integers(0, ns - length))
            rows += [((src0 + i) * BLOCK, (dst0 + i) * BLOCK, BLOCK) for i in range(length)]
        return np.array(rows)
    if scenario == "scattered":  # random blocks to random blocks
        dst = rng.permutation(nb)[:180]
        src = rng.choice(ns, size=len(dst), replace=False)
        return np.stack([src * BLOCK, dst * BLOCK, np.full(len(dst), BLOCK)], axis=1)
    if scenario == "partial":  # part of a block: unaligned start, short length
        dst = rng.permutation(nb)[:120]
        off = rng.integers(0, BLOCK - 1, size=len(dst))
        n = rng.integers(1, BLOCK - off + 1)
        src = rng.integers(0, SRC - BLOCK, size=len(dst))
        return np.stack([src, dst * BLOCK + off, n], axis=1)
    if scenario == "many_small":  # thousands of 256-byte rows, scattered
        k = REGION // 256
        dst = rng.permutation(k)
        return np.stack([rng.integers(0, SRC - 256, size=k), dst * 256, np.full(k, 256)], axis=1)
    if scenario == "mixed_sizes":  # 1 byte .. 64 KiB, gaps of 0..3 bytes
        rows, pos = [], 0
        while True:
            n = int(rng.choice([1, 7, 256, 4096, 5000, 65536]))
            if pos + n > REGION:
                return np.array(rows)
            rows.append((int(rng.integers(0, SRC - n)), pos, n))
            pos += n + int(rng.integers(0, 4))
    raise ValueError(scenario)


def post_in_chunks(sender: Sender, peer: Peer, rows: np.ndarray, chunks: int) -> list[int]:
    return [sender.post(peer, part) for part in np.array_split(rows, chunks) if len(part)]


@contextlib.contextmanager
def nixl_requests(t: Transport) -> Iterator[list[tuple]]:
    """The NIXL transfer requests a NixlTransport creates inside the block."""
    agent = t._agent  # type: ignore[attr-defined]
    real, calls = agent.initialize_xfer, []

    def counting(*a: object, **k: object) -> object:
        calls.append(a)
        return real(*a, **k)

    agent.initialize_xfer = counting
    try:
        yield calls
    finally:
        del agent.initialize_xfer


# --- generic conformance -----------------------------------------------------------------


@pytest.mark.parametrize(
    "scenario", ["contiguous", "scattered", "partial", "many_small", "mixed_sizes"]
)
def test_destination_equals_source_for_block_maps(
    link: Sender, peer: Peer, kind: str, scenario: str
) -> None:
    rows = block_map(scenario, np.random.default_rng(zlib.crc32(scenario.encode())))
    with nixl_requests(link.t) if kind == "nixl" else contextlib.nullcontext([]) as requests:
        handles = post_in_chunks(link, peer, rows, chunks=3)
    if kind == "nixl":
        assert len(requests) == len(handles), "not one NIXL request per post"
    assert wait_all(link.t, handles) == [XferState.DONE] * len(handles)
    release_all(link.t, handles)
    assert_written(link, peer, rows)


@st.composite
def random_ranges(draw: st.DrawFn) -> np.ndarray:
    """Disjoint destination ranges of random sizes and gaps, random sources."""
    rows, pos = [], draw(st.integers(0, 3 * BLOCK))
    for _ in range(draw(st.integers(1, 24))):
        n = draw(st.integers(1, 5 * BLOCK))
        if pos + n > REGION:
            break
        rows.append((draw(st.integers(0, SRC - n)), pos, n))
        pos += n + draw(st.sampled_from([0, 0, 1, 7, BLOCK, 3 * BLOCK + 5]))
    return np.array(rows if rows else [(0, 0, 1)])


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(rows=random_ranges(), chunks=st.integers(1, 4))
def test_destination_equals_source_for_random_ranges(
    link: Sender, peer: Peer, rows: np.ndarray, chunks: int
) -> None:
    peer.call("reset")
    handles = post_in_chunks(link, peer, rows, chunks)
    assert wait_all(link.t, handles) == [XferState.DONE] * len(handles)
    release_all(link.t, handles)
    assert_written(link, peer, rows)


def test_notification_after_done_writes_arrives_after_their_data(link: Sender, peer: Peer) -> None:
    rounds, per = 8, 16
    rng = np.random.default_rng(3)
    dst_blocks = rng.permutation(REGION // BLOCK)[: rounds * per].reshape(rounds, per)
    peer.call("watch", BLOCK)  # the peer snapshots its blocks as each notification comes
    sent = []
    for k in range(rounds):
        src_blocks = rng.choice(SRC // BLOCK, size=per, replace=False)
        rows = np.stack([src_blocks * BLOCK, dst_blocks[k] * BLOCK, np.full(per, BLOCK)], axis=1)
        h = link.post(peer, rows)
        assert wait_all(link.t, [h]) == [XferState.DONE]
        link.t.release(h)
        link.t.send_notif(peer.name, f"round {k}".encode())
        sent.append(src_blocks)
    got = peer.call("notifs", rounds, DEADLINE)
    assert [(p, payload) for p, payload, _ in got] == [
        (link.t.name, f"round {k}".encode()) for k in range(rounds)
    ]
    for k, (_, _, crcs) in enumerate(got):
        for s, d in zip(sent[k], dst_blocks[k], strict=True):
            want = zlib.crc32(link.src[s * BLOCK : (s + 1) * BLOCK])
            assert crcs[d] == want, f"round {k}: block {d} not written when its notification came"


def test_many_writes_in_flight_all_complete(link: Sender, peer: Peer) -> None:
    n = 256
    rng = np.random.default_rng(5)
    dst = rng.permutation(REGION // BLOCK)[:n]
    src = rng.choice(SRC // BLOCK, size=n, replace=False)
    rows = np.stack([src * BLOCK, dst * BLOCK, np.full(n, BLOCK)], axis=1)
    handles = [link.post(peer, row) for row in rows]  # no poll until all are posted
    assert len(set(handles)) == n
    assert wait_all(link.t, handles) == [XferState.DONE] * n
    release_all(link.t, handles)
    link.t.send_notif(peer.name, b"all")
    assert [p for _, p, _ in peer.call("notifs", 1, DEADLINE)] == [b"all"]
    assert_written(link, peer, rows)


@pytest.mark.parametrize(
    "where",
    ["straddles_end", "before_start", "far_away", "bad_row_among_good", "source_past_end"],
)
def test_rows_outside_registered_memory_are_refused(
    link: Sender, peer: Peer, kind: str, where: str
) -> None:
    g = peer.guard
    rows = {
        "straddles_end": [(0, REGION - 100, 200)],
        "before_start": [(0, -g, 64)],
        "far_away": [(0, 1 << 40, BLOCK)],
        "bad_row_among_good": [(0, 0, BLOCK), (BLOCK, REGION, 64), (2 * BLOCK, BLOCK, BLOCK)],
        "source_past_end": [(SRC, 0, 64)],  # just past the sender's registered buffer
    }[where]
    try:
        h = link.post(peer, np.array(rows))
    except TransportError:
        pass  # refused at post time: as good as refused by the receiver
    else:
        assert kind != "nixl", "NIXL checks every row against the registrations at post time"
        assert wait_all(link.t, [h]) == [XferState.ERROR]
        link.t.release(h)
    mem = peer.memory()
    assert (mem[:g] == FILL).all() and (mem[g + REGION :] == FILL).all(), "bytes landed outside"
    # tcp: the receiver checks every row before reading any payload; nixl: refused at post
    if kind in ("tcp", "nixl"):
        assert (mem == FILL).all(), "part of a refused request landed"
    # the sender is still usable: write again (NIXL on the same link, others reconnect)
    if kind != "nixl":
        link.connect(peer)
    h = link.post(peer, np.array([(5 * BLOCK, 3 * BLOCK, BLOCK)]))
    assert wait_all(link.t, [h]) == [XferState.DONE]
    link.t.release(h)
    want = mem.copy()
    want[g + 3 * BLOCK : g + 4 * BLOCK] = link.src[5 * BLOCK : 6 * BLOCK]
    assert (peer.memory() == want).all(), "the good write did not land exactly"


def test_killed_destination_fails_pending_writes_and_sender_stays_usable(
    sender: Sender, peer: Peer, kind: str
) -> None:
    victim = start_peer(kind, _uid(f"victim-{kind}"), SRC)
    killer = threading.Thread(target=victim.kill)
    try:
        sender.connect(victim)
        handles = [sender.post(victim, [(0, 0, SRC)])]
        assert wait_all(sender.t, handles) == [XferState.DONE]
        killer.start()  # dies while the next 63 x 16 MiB are posted and in flight
        handles += [sender.post(victim, [(0, 0, SRC)]) for _ in range(63)]
        killer.join()
        killed = time.monotonic()
        states = wait_all(sender.t, handles, timeout=5.0)
        elapsed = time.monotonic() - killed
        assert states.count(XferState.DONE) < len(handles), "killed too late to test anything"
        # tcp: a reset or EOF, nixl: UCX's peer error handling fails every pending write
        if kind in ("tcp", "nixl"):
            assert XferState.PENDING not in states, f"still pending {elapsed:.1f}s after the kill"
            assert XferState.ERROR in states
        t0 = time.monotonic()
        if kind == "nixl":  # why; later writes fail at once, as states; notifications raise
            failed = [h for h, s in zip(handles, states, strict=True) if s is XferState.ERROR]
            reasons = {sender.t.error(h) for h in failed}  # type: ignore[attr-defined]
            assert all("Disconnect" in (r or "") for r in reasons), reasons
            handles.append(sender.post(victim, [(0, 0, BLOCK)]))
            assert wait_all(sender.t, handles[-1:], timeout=PROMPT) == [XferState.ERROR]
            with pytest.raises(TransportError):
                sender.t.send_notif(victim.name, b"anyone?")
        # whatever is left PENDING the caller gives up on; releasing must be clean
        release_all(sender.t, handles)
        sender.t.remove_peer(victim.name)
        sender.peers.discard(victim.name)
        limit = PROMPT if kind == "nixl" else 2.0
        assert time.monotonic() - t0 < limit, "calls on a dead peer hung"
    finally:
        victim.stop()
    # a new peer works
    peer.call("reset")
    sender.connect(peer)
    rows = np.array([(7 * BLOCK, 9 * BLOCK, 2 * BLOCK)])
    h = sender.post(peer, rows)
    assert wait_all(sender.t, [h]) == [XferState.DONE]
    sender.t.release(h)
    assert_written(sender, peer, rows)


def test_remove_peer_fails_its_pending_writes_at_once(link: Sender, peer: Peer) -> None:
    handles = [link.post(peer, [(0, 0, REGION)]) for _ in range(32)]
    t0 = time.monotonic()
    link.t.remove_peer(peer.name)
    link.peers.discard(peer.name)
    assert time.monotonic() - t0 < 2.0
    states = [link.t.poll(h) for h in handles]
    assert XferState.PENDING not in states
    assert XferState.ERROR in states or states == [XferState.DONE] * len(states)
    release_all(link.t, handles)


def test_close_with_writes_in_flight_returns_promptly(kind: str, peer: Peer) -> None:
    src = np.ones(REGION, dtype=np.uint8)
    t = create_transport(kind, _uid(f"closer-{kind}"))
    t.register_memory([(src.ctypes.data, src.nbytes)])
    name = t.add_peer(peer.metadata)
    for _ in range(16):
        t.post_write(name, np.array([[src.ctypes.data, peer.base, REGION]], dtype=np.int64))
    t0 = time.monotonic()
    t.close()
    assert time.monotonic() - t0 < 5.0
    with pytest.raises(TransportError):
        t.post_write(name, np.array([[src.ctypes.data, peer.base, 1]], dtype=np.int64))


def test_source_outside_registered_memory_is_refused(link: Sender, peer: Peer) -> None:
    outside = np.zeros(BLOCK, dtype=np.uint8)
    descs = np.array([[outside.ctypes.data, peer.base, BLOCK]], dtype=np.int64)
    try:
        h = link.t.post_write(peer.name, descs)
    except TransportError:
        return
    assert wait_all(link.t, [h]) == [XferState.ERROR]
    link.t.release(h)


def test_unknown_peer_and_garbage_metadata_are_refused(sender: Sender, kind: str) -> None:
    row = np.array([[sender.base, 1 << 20, 8]], dtype=np.int64)
    with pytest.raises(TransportError):
        sender.t.post_write("nobody", row)
    with pytest.raises(TransportError):
        sender.t.send_notif("nobody", b"x")
    for garbage in (b"", b"\x00not metadata\xff", b"nixlSerDes|"):
        with pytest.raises(TransportError):
            sender.t.add_peer(garbage)
    sender.t.remove_peer("nobody")  # unknown: no-op
    sender.t.release(123456789)  # unknown: no-op
    if kind == "nixl":
        with pytest.raises(KeyError):
            sender.t.poll(123456789)


# --- TCP only ------------------------------------------------------------------------------


class _Local:
    """An in-process TCP receiver with its own registered buffer."""

    def __init__(self, **options: object) -> None:
        self.buf = np.full(REGION, FILL, dtype=np.uint8)
        self.t = create_transport("tcp", _uid("local"), **options)
        self.t.register_memory([(self.buf.ctypes.data, REGION)])
        self.meta = decode_metadata(self.t.local_metadata())


@pytest.fixture
def secret_receiver() -> Iterator[_Local]:
    r = _Local(secret=b"right secret")
    yield r
    r.t.close()


@pytest.mark.parametrize("secret", [b"wrong secret", None])
def test_tcp_wrong_or_missing_secret_gets_nothing_written(
    secret_receiver: _Local, secret: bytes | None
) -> None:
    src = np.random.default_rng(2).integers(0, 256, REGION, dtype=np.uint8)
    with create_transport("tcp", _uid("intruder"), secret=secret) as t:
        t.register_memory([(src.ctypes.data, REGION)])
        name = t.add_peer(secret_receiver.t.local_metadata())
        h = t.post_write(
            name, np.array([[src.ctypes.data, secret_receiver.buf.ctypes.data, REGION]])
        )
        assert wait_all(t, [h]) == [XferState.ERROR]
        with pytest.raises(TransportError):
            t.send_notif(name, b"let me in")
    assert (secret_receiver.buf == FILL).all()
    assert secret_receiver.t.take_notifs() == []


def test_tcp_right_secret_writes_and_notifies(secret_receiver: _Local) -> None:
    src = np.random.default_rng(1).integers(0, 256, REGION, dtype=np.uint8)
    with create_transport("tcp", _uid("friend"), secret=b"right secret") as t:
        t.register_memory([(src.ctypes.data, REGION)])
        name = t.add_peer(secret_receiver.t.local_metadata())
        h = t.post_write(
            name, np.array([[src.ctypes.data, secret_receiver.buf.ctypes.data, REGION]])
        )
        assert wait_all(t, [h]) == [XferState.DONE]
        t.send_notif(name, b"hi")
        deadline = time.monotonic() + DEADLINE
        got: list[tuple[str, bytes]] = []
        while not got and time.monotonic() < deadline:
            got = secret_receiver.t.take_notifs()
        assert got == [(t.name, b"hi")]
    assert (secret_receiver.buf == src).all()


def _raw_connect(meta: Metadata) -> socket.socket:
    s = socket.create_connection((meta.host, meta.port), timeout=DEADLINE)
    header = _recv_n(s, HEADER_SIZE)  # CHALLENGE
    count = int.from_bytes(header[4:8], "little")
    assert header[3] == Kind.CHALLENGE
    _recv_n(s, count)
    return s


def _recv_n(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


def _closed_without_reply(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def _write_frame(dst: int, payload: bytes, req: int = 1) -> bytes:
    table = np.array([[dst, len(payload)]], dtype="<u8").tobytes()
    return pack_header(Kind.WRITE, 1, req) + table + payload


@pytest.mark.parametrize("secret", [b"right secret", None])
def test_tcp_write_before_handshake_is_dropped(secret: bytes | None) -> None:
    r = _Local(secret=secret)
    try:
        with _raw_connect(r.meta) as s:
            s.sendall(_write_frame(r.buf.ctypes.data, b"\x01" * 64))
            assert _closed_without_reply(s)
        assert (r.buf == FILL).all()
    finally:
        r.t.close()


def test_tcp_hello_with_bad_mac_is_dropped_and_later_writes_ignored(
    secret_receiver: _Local, caplog: pytest.LogCaptureFixture
) -> None:
    meta = secret_receiver.meta
    with caplog.at_level(logging.WARNING), _raw_connect(meta) as s:
        hello = Hello(name="mallory", nonce=b"n" * 32, instance=meta.instance, mac=b"x" * 32)
        s.sendall(encode_body(Kind.HELLO, hello))
        with contextlib.suppress(OSError):  # it may have been dropped already
            s.sendall(_write_frame(secret_receiver.buf.ctypes.data, b"\x02" * 64))
        assert _closed_without_reply(s)
    assert (secret_receiver.buf == FILL).all()
    assert any("authentication failed" in r.getMessage() and "mallory" in r.getMessage()
               for r in caplog.records)  # fmt: skip


def test_tcp_out_of_bounds_write_is_logged_with_the_peer(caplog: pytest.LogCaptureFixture) -> None:
    r = _Local()
    src = np.ones(BLOCK, dtype=np.uint8)
    try:
        with caplog.at_level(logging.WARNING), create_transport("tcp", _uid("oob")) as t:
            t.register_memory([(src.ctypes.data, BLOCK)])
            name = t.add_peer(r.t.local_metadata())
            h = t.post_write(name, np.array([[src.ctypes.data, r.buf.ctypes.data + REGION, 1]]))
            assert wait_all(t, [h]) == [XferState.ERROR]
            deadline = time.monotonic() + DEADLINE
            while time.monotonic() < deadline and not any(
                "not in registered memory" in x.getMessage() for x in caplog.records
            ):
                time.sleep(0.001)
            (record,) = [x for x in caplog.records if "not in registered memory" in x.getMessage()]
            assert t.name in record.getMessage() and "127.0.0.1" in record.getMessage()
    finally:
        r.t.close()
    assert (r.buf == FILL).all()


def test_tcp_stale_metadata_of_another_instance_is_refused() -> None:
    r = _Local()
    src = np.ones(BLOCK, dtype=np.uint8)
    try:
        stale = msgspec.structs.replace(r.meta, instance=b"\x00" * 16)
        with create_transport("tcp", _uid("stale")) as t:
            t.register_memory([(src.ctypes.data, BLOCK)])
            name = t.add_peer(encode_metadata(stale))
            h = t.post_write(name, np.array([[src.ctypes.data, r.buf.ctypes.data, BLOCK]]))
            assert wait_all(t, [h]) == [XferState.ERROR]
    finally:
        r.t.close()
    assert (r.buf == FILL).all()


def test_tcp_wildcard_bind_needs_an_advertised_host() -> None:
    with pytest.raises(ValueError, match="advertise_host"):
        create_transport("tcp", "w", host="0.0.0.0")


# --- TCP receiver state machine (no sockets) ----------------------------------------------


def _feed(machine: Inbound, data: bytes, sizes: Iterator[int] | None = None) -> list[Event]:
    """Feed `data` as the shell does (scatter reads into `want()`), each read at
    most the next of `sizes` bytes (all available if None). Raises ProtocolError."""
    events: list[Event] = []
    pos = 0
    while pos < len(data):
        limit = len(data) - pos if sizes is None else min(next(sizes), len(data) - pos)
        n = 0
        for buf in machine.want():
            k = min(len(buf), limit - n)
            buf[:k] = data[pos + n : pos + n + k]
            n += k
            if n == limit:
                break
        pos += n
        events += machine.received(n)
    return events


def _machine(buf: np.ndarray, **limits: int) -> Inbound:
    table = RegionTable([(buf.ctypes.data, buf.nbytes)])
    return Inbound(
        lambda: table, max_rows=limits.get("rows", 16), max_notif=limits.get("notif", 64)
    )


def test_tcp_inbound_lands_payload_in_place_then_notifies() -> None:
    buf = np.zeros(64, dtype=np.uint8)
    m = _machine(buf)
    frames = _write_frame(buf.ctypes.data + 8, b"abcd", req=9) + pack_header(Kind.NOTIF, 2) + b"ok"
    assert _feed(m, frames) == [Landed(9, 4), Notif(b"ok")]
    assert buf[8:12].tobytes() == b"abcd" and not buf[:8].any() and not buf[12:].any()


def _payload(i: int, n: int) -> bytes:
    return bytes((i * 31 + j) % 251 for j in range(n))


def _stream(frames: list[tuple[int, int, int]], base: int) -> tuple[bytes, list[Event]]:
    """Frames `(dst, n, kind)` as bytes: kind 0 a WRITE of n bytes at base+dst, kind 1
    the same split over two rows, kind 2 a NOTIF of n bytes. Also the events due."""
    stream, events = b"", []
    for i, (dst, n, kind) in enumerate(frames):
        payload = _payload(i, n)
        if kind == 2:
            stream += pack_header(Kind.NOTIF, n) + payload
            events.append(Notif(payload))
            continue
        rows = (
            [(base + dst, n // 2), (base + dst + n // 2, n - n // 2)] if kind else [(base + dst, n)]
        )
        table = np.array(rows, dtype="<u8").tobytes()
        stream += pack_header(Kind.WRITE, len(rows), i) + table + payload
        events.append(Landed(i, n))
    return stream, events


@settings(max_examples=60, deadline=None)
@given(
    frames=st.lists(
        st.tuples(st.integers(0, 40), st.integers(0, 24), st.integers(0, 2)), min_size=1, max_size=8
    ),
    sizes=st.lists(st.integers(1, 50), min_size=1, max_size=20),
)
def test_tcp_inbound_events_do_not_depend_on_how_reads_split_the_stream(
    frames: list[tuple[int, int, int]], sizes: list[int]
) -> None:
    results = []
    for split in (None, itertools.cycle(sizes)):
        buf = np.zeros(64, dtype=np.uint8)
        stream, due = _stream(frames, buf.ctypes.data)
        events = _feed(_machine(buf, rows=4, notif=64), stream, split)
        assert events == due
        results.append(buf.tobytes())
    assert results[0] == results[1]
    want = np.zeros(64, dtype=np.uint8)  # later writes win, as in stream order
    for i, (dst, n, kind) in enumerate(frames):
        if kind != 2:
            want[dst : dst + n] = np.frombuffer(_payload(i, n), dtype=np.uint8)
    assert results[0] == want.tobytes()


def test_tcp_inbound_acks_a_write_only_when_its_last_byte_is_in_memory() -> None:
    buf = np.zeros(64, dtype=np.uint8)
    m = _machine(buf)
    rows = [(buf.ctypes.data + 40, 3), (buf.ctypes.data + 8, 4)]
    frame = pack_header(Kind.WRITE, 2, 3) + np.array(rows, dtype="<u8").tobytes() + b"xyzabcd"
    assert _feed(m, frame[:-1]) == []
    assert buf[40:43].tobytes() == b"xyz" and buf[8:11].tobytes() == b"abc"
    assert _feed(m, frame[-1:]) == [Landed(3, 7)]
    assert buf[11] == ord("d")


def test_tcp_inbound_checks_every_row_before_reading_payload() -> None:
    buf = np.zeros(64, dtype=np.uint8)
    m = _machine(buf)
    table = np.array([[buf.ctypes.data, 4], [buf.ctypes.data + 62, 4]], dtype="<u8").tobytes()
    _feed(m, pack_header(Kind.WRITE, 2, 1))
    with pytest.raises(ProtocolError, match="not in registered memory"):
        _feed(m, table)
    assert not buf.any()


@pytest.mark.parametrize(
    "frame",
    [
        pack_header(Kind.WRITE, 17, 1),  # more rows than allowed
        pack_header(Kind.NOTIF, 65),  # notification over the limit
        pack_header(Kind.ACK, 0, 1),  # a receiver never gets ACKs
        pack_header(Kind.HELLO, 4),  # handshake frames after the handshake
        b"XX" + pack_header(Kind.NOTIF, 1)[2:],  # bad magic
    ],
)
def test_tcp_inbound_refuses_malformed_frames(frame: bytes) -> None:
    with pytest.raises(ProtocolError):
        _feed(_machine(np.zeros(64, dtype=np.uint8)), frame)


def test_tcp_inbound_refuses_addresses_that_would_overflow() -> None:
    buf = np.zeros(64, dtype=np.uint8)
    m = _machine(buf)
    table = np.array([[buf.ctypes.data, 2**64 - 1]], dtype="<u8").tobytes()
    _feed(m, pack_header(Kind.WRITE, 1, 1))
    with pytest.raises(ProtocolError):
        _feed(m, table)
