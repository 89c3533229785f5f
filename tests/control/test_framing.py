"""The framing core, without sockets: frames survive any split of the stream, a
frame over the limit is refused from its length alone, and with a secret no frame
verifies if it was tampered with, replayed (on this or another connection),
reordered or reflected."""

from __future__ import annotations

import contextlib
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rapidkv.control.framing import (
    LENGTH,
    MAGIC,
    AuthError,
    ClientSession,
    FrameError,
    FrameReader,
    FrameTooLarge,
    ServerSession,
)

pytestmark = pytest.mark.unit

SECRET = b"correct horse battery staple"


def connect(
    server_secret: bytes | None = SECRET, client_secret: bytes | None = SECRET
) -> tuple[ServerSession, ClientSession]:
    """A server and a client session that completed their opening frames."""
    server = ServerSession(server_secret)
    client = ClientSession(client_secret)
    assert client.receive(server.outgoing()) == []
    assert server.receive(client.outgoing()) == []
    assert server.ready and client.ready
    return server, client


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2**64 - 1), st.binary(max_size=300)), max_size=8),
    st.lists(st.integers(min_value=0), max_size=10),
    st.sampled_from([None, SECRET]),
)
def test_messages_arrive_whole_and_in_order_however_the_stream_is_split(
    messages: list[tuple[int, bytes]], cuts: list[int], secret: bytes | None
) -> None:
    server, client = connect(secret, secret)
    for direction in ((client, server), (server, client)):
        sender, receiver = direction
        stream = b"".join(sender.seal(rid, payload) for rid, payload in messages)
        got = [m for chunk in split(stream, cuts) for m in receiver.receive(chunk)]
        assert got == messages


def test_a_frame_over_the_limit_is_refused_from_its_length_alone() -> None:
    reader = FrameReader(max_frame=1000)
    reader.feed(LENGTH.pack(1000) + b"x" * 999)
    assert reader.next_frame() is None  # within the limit: waits for the last byte
    reader.feed(b"x")
    assert reader.next_frame() == b"x" * 1000
    reader.feed(LENGTH.pack(1001))  # nothing of the body sent
    with pytest.raises(FrameTooLarge, match="1001 bytes exceeds the limit of 1000"):
        reader.next_frame()


def test_sealing_a_frame_over_the_limit_raises_and_keeps_the_counter() -> None:
    server = ServerSession(SECRET, max_frame=1024)
    client = ClientSession(SECRET, max_frame=1024)
    client.receive(server.outgoing())
    server.receive(client.outgoing())
    with pytest.raises(ValueError, match="exceeds the limit"):
        client.seal(1, b"x" * 1024)
    assert server.receive(client.seal(2, b"ok")) == [(2, b"ok")]


def test_without_a_secret_nothing_is_tagged() -> None:
    _server, client = connect(None, None)
    frame = client.seal(5, b"payload")
    assert frame == LENGTH.pack(8 + 7) + (5).to_bytes(8, "big") + b"payload"


def test_a_tampered_frame_fails_and_the_session_stays_failed() -> None:
    server, client = connect()
    frame = bytearray(client.seal(1, b"transfer"))
    frame[12] ^= 1
    with pytest.raises(AuthError, match="bad tag"):
        server.receive(bytes(frame))
    with pytest.raises(FrameError):
        server.receive(client.seal(2, b"fine"))


def test_a_replayed_or_reordered_frame_fails() -> None:
    server, client = connect()
    first, second = client.seal(1, b"a"), client.seal(2, b"b")
    assert server.receive(first) == [(1, b"a")]
    with pytest.raises(AuthError):
        server.receive(first)  # replay on the same connection
    server, client = connect()
    first, second = client.seal(1, b"a"), client.seal(2, b"b")
    with pytest.raises(AuthError):
        server.receive(second)  # reordered (or the first dropped)


def test_frames_recorded_on_one_connection_verify_on_no_other() -> None:
    server_a, client_a = ServerSession(SECRET), ClientSession(SECRET)
    client_a.receive(server_a.outgoing())
    recorded_hello, recorded_request = client_a.outgoing(), client_a.seal(1, b"abort")
    assert server_a.receive(recorded_hello + recorded_request) == [(1, b"abort")]
    with pytest.raises(AuthError, match="frame 0"):
        ServerSession(SECRET).receive(recorded_hello + recorded_request)
    server_b, _ = connect()
    with pytest.raises(AuthError, match="frame 1"):
        server_b.receive(recorded_request)


def test_a_reflected_frame_fails() -> None:
    server, _client = connect()
    reply = server.seal(1, b"stats")
    with pytest.raises(AuthError):
        server.receive(reply)  # the server's own frame sent back to it


def test_a_wrong_secret_fails_at_the_hello() -> None:
    server = ServerSession(SECRET)
    client = ClientSession(b"wrong")
    client.receive(server.outgoing())
    with pytest.raises(AuthError, match="bad tag on frame 0"):
        server.receive(client.outgoing())
    assert not server.ready


def test_a_hello_without_a_tag_fails_when_the_server_has_a_secret() -> None:
    server = ServerSession(SECRET)
    preamble = server.outgoing()
    client = ClientSession(None)
    with pytest.raises(AuthError, match="requires a shared secret"):
        client.receive(preamble)
    hello = MAGIC + b"n" * 32
    with pytest.raises(AuthError, match="no valid tag"):
        server.receive(LENGTH.pack(len(hello)) + hello)


def test_a_client_with_a_secret_refuses_a_server_without_one() -> None:
    with pytest.raises(AuthError, match="does not authenticate"):
        ClientSession(SECRET).receive(ServerSession(None).outgoing())


def test_messages_before_the_hello_are_not_messages() -> None:
    server = ServerSession(None)
    body = (1).to_bytes(8, "big") + b"stats"
    with pytest.raises(FrameError, match="bad HELLO"):
        server.receive(LENGTH.pack(len(body)) + body)


def test_an_empty_secret_is_refused() -> None:
    with pytest.raises(ValueError, match="empty shared secret"):
        ServerSession(b"")


@settings(max_examples=300, deadline=None)
@given(
    st.binary(max_size=600),
    st.sampled_from([None, SECRET]),
    st.booleans(),
    st.lists(st.integers(min_value=0), max_size=4),
)
def test_random_bytes_raise_only_frame_errors(
    data: bytes, secret: bytes | None, after_opening: bool, cuts: list[int]
) -> None:
    """Whatever a peer sends, a session returns messages or raises `FrameError`
    (then refuses everything after)."""
    if after_opening:
        server, client = connect(secret, secret)
    else:
        server, client = ServerSession(secret, max_frame=256), ClientSession(secret, max_frame=256)
    for session in (server, client):
        try:
            for chunk in split(data, cuts):
                session.receive(chunk)
        except FrameError:
            with pytest.raises(FrameError):
                session.receive(b"")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.sampled_from([None, SECRET]))
def test_random_frames_raise_only_frame_errors(body: bytes, secret: bytes | None) -> None:
    """Well-framed random bodies (what gets past the length check) too."""
    frame = LENGTH.pack(len(body)) + body
    for session in (ServerSession(secret), ClientSession(secret), *connect(secret, secret)):
        with contextlib.suppress(FrameError):
            session.receive(frame)
