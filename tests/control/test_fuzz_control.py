"""Bad input on the control plane, fuzzed: the frame decoder, the message decoder
and a live `RpcServer` given malformed, truncated, oversized, mutated, replayed,
reordered, wrongly keyed and out-of-order input, and idle connections.

What the design promises (docs/protocol.md, `framing`, `server`): with a secret
no frame verifies unless it is the next one its sender sealed on this
connection (tampered, replayed, dropped, reordered, reflected or moved frames
fail); without one nothing is promised but the framing. A bad frame raises
`FrameError` and the server closes that connection with one warning naming the
peer; a sound frame holding no valid request gets `ErrorReply(ERROR)`; nothing
unauthenticated or invalid reaches the handler; and the server goes on serving.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rapidkv.control.address import format_address, parse_address
from rapidkv.control.client import RpcClient, RpcError
from rapidkv.control.codes import Code
from rapidkv.control.framing import (
    LENGTH,
    MAGIC,
    NONCE_BYTES,
    REQUEST_ID,
    TAG_BYTES,
    AuthError,
    ClientSession,
    FrameError,
    FrameTooLarge,
    ServerSession,
)
from rapidkv.control.messages import (
    MAX_ID,
    Abort,
    AbortReason,
    AbortReply,
    ErrorReply,
    Handshake,
    HandshakeReply,
    KVSpec,
    MessageError,
    RankEndpoint,
    Reply,
    Request,
    Stats,
    StatsRequest,
    StepTiming,
    Timeline,
    TimelineRequest,
    TransferKV,
    TransferKVReply,
    XferTimeline,
    answer_handshake,
    decode_reply,
    decode_request,
    encode,
    prompt_hash,
)
from rapidkv.control.server import RpcServer

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

SECRET = b"fuzzing secret"
DEADLINE = 5.0  # seconds any single wait may take before the test fails
HELLO_TIMEOUT = 5.0  # the shared servers: no test waits for it (the idle test sets its own)
MAX_FRAME = 4096
HELLO = {None: len(MAGIC) + NONCE_BYTES, SECRET: len(MAGIC) + NONCE_BYTES + TAG_BYTES}
PREAMBLE = len(MAGIC) + 1 + NONCE_BYTES
LOGGER = "rapidkv.control.server"
FEW = settings(max_examples=40, deadline=None)
LIVE = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
secrets = st.sampled_from([None, SECRET])

SPEC = KVSpec(
    block_size=16,
    kernel_blocks_per_block=1,
    dtype="bfloat16",
    num_layers=2,
    layer_block_bytes=(4096, 4096),
    layer_runs_per_block=(2, 2),
    tp_size=1,
    model_fingerprint="fp",
)
ENDPOINTS = [
    RankEndpoint(rank=0, transport="tcp", transport_metadata=b"m", layout=b"l", num_blocks=64)
]
REQUESTS: list[Request] = [
    Handshake(instance_id="D", control_address="127.0.0.1:7", spec=SPEC, endpoints=ENDPOINTS),
    TransferKV(
        xfer_id="x1",
        dst_instance="D",
        dst_blocks=[3, 4, 5],
        first_block=1,
        num_tokens=40,
        prompt_hash=prompt_hash(range(40)),
        transfer_kv_mode="substep",
        notify_layers=True,
    ),
    Abort(xfer_id="x1", reason=AbortReason.DECODE_FAILED),
    StatsRequest(),
    TimelineRequest(["x1", "x2"]),
]
REPLIES: list[Reply] = [
    answer_handshake(REQUESTS[0], instance_id="P", spec=SPEC, endpoints=ENDPOINTS),  # type: ignore[arg-type]
    HandshakeReply(code=Code.ERROR, instance_id="P", reasons=["dtype: a vs b"]),
    TransferKVReply(xfer_id="x1", code=Code.GONE, tokens_sent=16, message="aborted"),
    AbortReply(xfer_id="x1", code=Code.OK),
    Stats({"parked": 2.0}),
    Timeline(
        {"x1": XferTimeline(events={"arrived": 1.5}, state_at_arrival="last_chunk")},
        [StepTiming(1, 0.5, 0.75, 32)],
    ),
    ErrorReply(Code.BUSY, "64 requests already in flight"),
]
requests = st.sampled_from(REQUESTS)
messages = st.sampled_from([*REQUESTS, *REPLIES])


# ------------------------------------------------------------------ helpers


def connect(secret: bytes | None) -> tuple[ServerSession, ClientSession]:
    """A server and a client session that completed their opening frames."""
    server, client = ServerSession(secret), ClientSession(secret)
    assert client.receive(server.outgoing()) == []
    assert server.receive(client.outgoing()) == []
    return server, client


def feed(session: ServerSession | ClientSession, data: bytes) -> tuple[list[Any], Exception | None]:
    """What `session` delivers from `data` before it fails (and how it failed:
    any exception is returned, so that the callers' asserts on its type bite)."""
    got: list[Any] = []
    try:
        got += session.receive(data)
    except Exception as e:
        return got, e
    return got, None


def deliver_one_at_a_time(
    session: ServerSession | ClientSession, frames: list[bytes]
) -> tuple[list[Any], Exception | None]:
    got: list[Any] = []
    for frame in frames:
        more, error = feed(session, frame)
        got += more
        if error is not None:
            return got, error
    return got, None


def frame_ends(frames: list[bytes]) -> list[int]:
    ends, at = [], 0
    for frame in frames:
        at += len(frame)
        ends.append(at)
    return ends


def as_dict(msg: msgspec.Struct) -> dict[str, Any]:
    return msgspec.to_builtins(msg, builtin_types=(bytes,))  # type: ignore[no-any-return]


def decoder_of(msg: Any) -> Callable[[bytes], Any]:
    """The decoder of `msg`'s union."""
    return decode_request if type(msg) in {type(r) for r in REQUESTS} else decode_reply


def wrong_values() -> st.SearchStrategy[Any]:
    """Values of every msgpack type, with sizes and numbers at and past the bounds."""
    leaf = st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from([-1, 0, 1, 2**31, 2**62 + 1, 2**63, 2**64 - 1, -(2**63)]),
        st.integers(min_value=-(2**63), max_value=2**64 - 1),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from(["", "NaN", "-1", "1e999", "x" * (MAX_ID + 1), "\u0000", "0" * 32]),
        st.text(max_size=20),
        st.binary(max_size=20),
    )
    return st.recursive(
        leaf,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=8,
    )


def check_decoded(decode: Callable[[bytes], Any], data: bytes) -> Any:
    """`decode(data)` is a valid message (it round-trips) or raises MessageError."""
    try:
        msg = decode(data)
    except MessageError as e:
        assert str(e).startswith(("invalid request: ", "invalid reply: ")), e
        return None
    assert decode(encode(msg)) == msg
    return msg


# ------------------------------------------------------------------ the frame decoder


@FEW
@given(st.lists(messages, min_size=1, max_size=5), st.data(), secrets)
def test_a_truncated_stream_delivers_its_whole_frames_and_waits_for_the_rest(
    msgs: list[Any], data: st.DataObject, secret: bytes | None
) -> None:
    server, client = connect(secret)
    frames = [client.seal(i, encode(m)) for i, m in enumerate(msgs, 1)]
    stream = b"".join(frames)
    cut = data.draw(st.integers(0, len(stream)), label="cut")
    whole = sum(end <= cut for end in frame_ends(frames))
    assert server.receive(stream[:cut]) == [(i, encode(m)) for i, m in enumerate(msgs, 1)][:whole]
    assert server.pending == cut - ([0, *frame_ends(frames)][whole])
    rest = server.receive(stream[cut:])
    assert len(rest) == len(msgs) - whole and server.pending == 0


@FEW
@given(
    st.sampled_from(["server-opening", "client-opening", "server", "client"]),
    st.integers(min_value=1, max_value=2**32 - 1),
    secrets,
)
@example("server-opening", 1 << 20, SECRET)  # a HELLO of 1 MiB: was buffered whole before
@example("server-opening", 1 << 20, None)
def test_an_oversized_length_prefix_is_refused_from_its_four_bytes(
    where: str, length: int, secret: bytes | None
) -> None:
    """Past the opening, over `max_frame`; in the opening frames, over the opening
    frame's fixed size: refused from the length alone, no byte of the body read."""
    if where.endswith("opening"):
        session: ServerSession | ClientSession = (
            ServerSession(secret, MAX_FRAME) if where == "server-opening" else ClientSession(secret)
        )
        limit = HELLO[secret] if where == "server-opening" else PREAMBLE
    else:
        server, client = connect(secret)
        session, limit = (server if where == "server" else client), 16 << 20
    if length <= limit:
        assert session.receive(LENGTH.pack(length)) == []  # waits for the body
        return
    with pytest.raises(FrameTooLarge, match=f"{length} bytes exceeds the limit of {limit}"):
        session.receive(LENGTH.pack(length))
    with pytest.raises(FrameError):
        session.receive(b"")  # the session stays failed


edits = st.one_of(
    st.tuples(st.just("flip"), st.integers(min_value=0), st.integers(1, 255)),
    st.tuples(st.just("insert"), st.integers(min_value=0), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), st.integers(min_value=0), st.integers(1, 40)),
    st.tuples(st.just("truncate"), st.integers(min_value=0), st.just(0)),
)


def edit(stream: bytes, how: tuple[str, int, Any]) -> bytes:
    kind, at, arg = how
    if not stream and kind != "insert":
        return stream
    at %= len(stream) + (kind == "insert")
    if kind == "flip":
        return stream[:at] + bytes([stream[at] ^ arg]) + stream[at + 1 :]
    if kind == "insert":
        return stream[:at] + arg + stream[at:]
    if kind == "delete":
        return stream[:at] + stream[at + arg :]
    return stream[:at]


@settings(max_examples=150, deadline=None)
@given(st.lists(messages, min_size=1, max_size=4), st.lists(edits, min_size=1, max_size=3))
def test_with_a_secret_an_edited_stream_delivers_only_the_frames_before_the_edit(
    msgs: list[Any], how: list[tuple[str, int, Any]]
) -> None:
    """Bytes flipped, inserted, deleted or cut anywhere (length prefixes too): the
    server delivers exactly the messages sent before the first changed byte,
    then fails or waits; never a changed or shifted message."""
    server, client = connect(SECRET)
    sent = [(i, encode(m)) for i, m in enumerate(msgs, 1)]
    frames = [client.seal(i, p) for i, p in sent]
    stream = b"".join(frames)
    changed = stream
    for h in how:
        changed = edit(changed, h)
    first = next(
        (i for i, (a, b) in enumerate(zip(stream, changed, strict=False)) if a != b),
        min(len(stream), len(changed)),
    )
    untouched = sum(end <= first for end in frame_ends(frames))
    got, error = feed(server, changed)
    assert got == sent[: len(got)]
    assert len(got) <= untouched or changed[: len(stream)] == stream
    assert error is None or isinstance(error, FrameError)


@settings(max_examples=100, deadline=None)
@given(st.lists(messages, min_size=1, max_size=4), st.lists(edits, max_size=3))
def test_without_a_secret_an_edited_stream_fails_only_with_frame_errors(
    msgs: list[Any], how: list[tuple[str, int, Any]]
) -> None:
    """Both directions, edited or not: messages or `FrameError`, nothing else."""
    server, client = connect(None)
    for sender, receiver in ((client, server), (server, client)):
        stream = b"".join(sender.seal(i, encode(m)) for i, m in enumerate(msgs, 1))
        for h in how:
            stream = edit(stream, h)
        got, error = feed(receiver, stream)
        assert error is None or isinstance(error, FrameError)
        for _, payload in got:
            check_decoded(decode_request, payload)
            check_decoded(decode_reply, payload)


@FEW
@given(
    st.lists(messages, min_size=2, max_size=5),
    st.lists(st.integers(-5, 4), min_size=1, max_size=8),
    st.booleans(),
)
@example([StatsRequest(), StatsRequest()], [0, 0], False)  # an exact duplicate
@example([StatsRequest(), StatsRequest()], [1, 0], False)  # swapped
@example([StatsRequest(), StatsRequest()], [0, -1], False)  # the server's own frame back
@example([StatsRequest(), StatsRequest()], [0, 1], True)  # recorded, moved to another connection
def test_with_a_secret_a_replayed_dropped_reordered_reflected_or_moved_frame_fails(
    msgs: list[Any], order: list[int], elsewhere: bool
) -> None:
    """Frames delivered in any order other than the one they were sealed in, or
    the server's own frames sent back (negative indices), or everything recorded
    and sent on another connection: the server delivers the frames that are in
    their place up to the first that is not, and fails there."""
    server, client = connect(SECRET)
    frames = [client.seal(i, encode(m)) for i, m in enumerate(msgs, 1)]
    reflected = [server.seal(i, encode(m)) for i, m in enumerate(msgs, 1)]
    order = [i % len(msgs) if i >= 0 else -1 - (-1 - i) % len(msgs) for i in order]
    stream = [frames[i] if i >= 0 else reflected[-1 - i] for i in order]
    if elsewhere:
        server, _ = connect(SECRET)
    in_place = 0 if elsewhere else next((n for n, i in enumerate(order) if i != n), len(order))
    got, error = deliver_one_at_a_time(server, stream)
    assert got == [(i + 1, encode(msgs[i])) for i in order[:in_place]]
    assert (error is None) == (in_place == len(order))
    assert error is None or isinstance(error, AuthError)


@FEW
@given(
    st.one_of(st.none(), st.binary(min_size=1, max_size=40)),
    st.one_of(st.none(), st.binary(min_size=1, max_size=40)),
    requests,
)
@example(SECRET, SECRET + b"x", StatsRequest())
@example(SECRET, None, StatsRequest())
@example(None, SECRET, StatsRequest())
def test_a_wrong_or_missing_secret_never_gets_a_message_through(
    server_secret: bytes | None, client_secret: bytes | None, request: Request
) -> None:
    server, client = ServerSession(server_secret), ClientSession(client_secret)
    preamble = server.outgoing()
    refused, error = feed(client, preamble)
    if (server_secret is None) != (client_secret is None):
        assert isinstance(error, AuthError)  # the client refuses: no downgrade, no guess
        # a HELLO forged without the client's refusal: untagged, or tagged by a
        # guess at the key (random bytes)
        hello = MAGIC + bytes(NONCE_BYTES) + (b"\x01" * TAG_BYTES if client_secret else b"")
        got, error = feed(server, LENGTH.pack(len(hello)) + hello)
        assert got == [] and isinstance(error, FrameError) and not server.ready
        return
    assert refused == [] and error is None
    stream = client.outgoing() + client.seal(1, encode(request))
    got, error = feed(server, stream)
    if server_secret == client_secret:
        assert got == [(1, encode(request))] and error is None
    else:
        assert got == [] and isinstance(error, AuthError) and not server.ready


# ------------------------------------------------------------------ the message decoder


@settings(max_examples=150, deadline=None)
@given(messages, st.lists(edits, min_size=1, max_size=3))
def test_an_edited_encoding_decodes_to_a_valid_message_or_a_message_error(
    msg: Any, how: list[tuple[str, int, Any]]
) -> None:
    data = encode(msg)
    for h in how:
        data = edit(data, h)
    for decode in (decode_request, decode_reply):
        check_decoded(decode, data)


@settings(max_examples=150, deadline=None)
@given(messages, st.data(), wrong_values())
def test_a_field_replaced_by_any_value_is_refused_naming_it_or_is_valid(
    msg: Any, data: st.DataObject, value: Any
) -> None:
    fields = as_dict(msg)
    names = sorted(set(fields) - {"type"} | set(type(msg).__struct_fields__))
    if not names:
        return
    name = data.draw(st.sampled_from(names), label="field")
    changed = dict(fields, **{name: value})
    decoder = decoder_of(msg)
    try:
        raw = msgspec.msgpack.encode(changed)
    except (OverflowError, TypeError):
        return  # not encodable as msgpack (an int past u64): a peer cannot send it
    try:
        got = decoder(raw)
    except MessageError as e:
        text = str(e)
        if "- at `$." in text:  # msgspec names the path; the cross-field checks name it in words
            assert f"`$.{name}" in text, text
        return
    assert decoder(encode(got)) == got
    assert type(got) is type(msg)


@FEW
@given(messages, st.data())
def test_a_missing_field_is_refused_naming_it_or_takes_its_default(
    msg: Any, data: st.DataObject
) -> None:
    fields = as_dict(msg)
    names = sorted(set(fields) - {"type"})
    if not names:
        return
    name = data.draw(st.sampled_from(names), label="field")
    del fields[name]
    info = next(f for f in msgspec.structs.fields(type(msg)) if f.name == name)
    try:
        got = decoder_of(msg)(msgspec.msgpack.encode(fields))
    except MessageError as e:
        if info.required:
            assert f"missing required field `{name}`" in str(e), e
        return  # else a cross-field check refused the default
    assert not info.required
    default = info.default if info.default is not msgspec.NODEFAULT else info.default_factory()
    assert getattr(got, name) == default


@FEW
@given(messages, st.dictionaries(st.text(max_size=12), wrong_values(), min_size=1, max_size=4))
def test_unknown_fields_are_ignored(msg: Any, extra: dict[str, Any]) -> None:
    fields = as_dict(msg)
    extra = {k: v for k, v in extra.items() if k not in fields and k not in msg.__struct_fields__}
    decoder = decoder_of(msg)
    try:
        raw = msgspec.msgpack.encode({**fields, **extra})
    except (OverflowError, TypeError):
        return
    assert decoder(raw) == msg


@pytest.mark.parametrize("msg", [*REQUESTS, *REPLIES], ids=lambda m: type(m).__name__)
def test_a_message_decoded_as_the_other_union_is_refused_by_type(msg: Any) -> None:
    """A reply sent as a request (or the reverse) is refused, naming its tag."""
    is_request = type(msg) in {type(r) for r in REQUESTS}
    wrong = decode_reply if is_request else decode_request
    with pytest.raises(MessageError, match=f"Invalid value '{msg.__struct_config__.tag}'"):
        wrong(encode(msg))


# ------------------------------------------------------------------ a live server


class Recorder:
    """A handler that records every request and answers each at once."""

    def __init__(self) -> None:
        self.calls: list[Request] = []

    async def __call__(self, msg: Request) -> Reply:
        self.calls.append(msg)
        match msg:
            case Handshake():
                return answer_handshake(msg, instance_id="P", spec=SPEC, endpoints=ENDPOINTS)
            case TransferKV():
                return TransferKVReply(xfer_id=msg.xfer_id, code=Code.OK, tokens_sent=1)
            case Abort():
                return AbortReply(xfer_id=msg.xfer_id, code=Code.OK)
            case TimelineRequest():
                return Timeline()
        return Stats({"calls": float(len(self.calls))})


class Live:
    """One running server, its handler, and a well-formed client of it."""

    def __init__(self, secret: bytes | None, **options: Any) -> None:
        self.secret = secret
        self.handler = Recorder()
        self.server = RpcServer(
            self.handler,
            secret=secret,
            max_frame=MAX_FRAME,
            hello_timeout=options.pop("hello_timeout", HELLO_TIMEOUT),
            **options,
        )
        self.server.start()
        self.client = RpcClient(secret=secret, max_frame=MAX_FRAME)

    def close(self) -> None:
        self.client.close()
        self.server.stop()

    def still_serves(self) -> None:
        """A well-formed client is answered, and the handler sees exactly that."""
        before = len(self.handler.calls)
        assert self.client.call(self.server.address, StatsRequest(), DEADLINE) == Stats(
            {"calls": float(before + 1)}
        )
        assert self.handler.calls[before:] == [StatsRequest()]


@pytest.fixture(scope="module", params=[None, SECRET], ids=["plain", "hmac"])
def live(request: pytest.FixtureRequest) -> Iterator[Live]:
    server = Live(request.param)
    yield server
    server.close()


class Raw:
    """A hand-driven connection: a blocking socket, optionally a `ClientSession`."""

    def __init__(self, address: str, secret: bytes | None = None, *, preamble: bool = True):
        self.sock = socket.create_connection(parse_address(address), timeout=DEADLINE)
        self.peer = format_address(*self.sock.getsockname()[:2])
        self.session = ClientSession(secret)
        if preamble:  # read it (a session with the wrong secret refuses it: no matter)
            head = self.recv_exactly(LENGTH.size)
            feed(self.session, head + self.recv_exactly(LENGTH.unpack(head)[0]))

    def recv_exactly(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            assert chunk, "connection closed"
            buf += chunk
        return buf

    def hello(self) -> bytes:
        hello = self.session.outgoing()
        self.sock.sendall(hello)
        return hello

    def send(self, data: bytes, *, then_close: bool = False) -> None:
        with contextlib.suppress(ConnectionError):  # the server may close first
            self.sock.sendall(data)
            if then_close:
                self.sock.shutdown(socket.SHUT_WR)

    def until_closed(self) -> bytes:
        """Everything the server sends until it closes (within DEADLINE)."""
        data = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := self.sock.recv(65536):
                data += chunk
        return data

    def close(self) -> None:
        self.sock.close()


def warnings_about(caplog: pytest.LogCaptureFixture, peer: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER and r.levelno >= logging.WARNING and peer in r.getMessage()
    ]


def lines_about(caplog: pytest.LogCaptureFixture, peer: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and peer in r.getMessage()]


def replies_in(session: ClientSession, data: bytes) -> list[tuple[int, Reply]]:
    got, _ = feed(session, data)
    return [(rid, decode_reply(p)) for rid, p in got]


garbage = st.one_of(
    st.binary(max_size=300),
    st.lists(  # frames of random bodies, a frame's worth of junk, ...
        st.one_of(
            st.binary(max_size=60).map(lambda b: LENGTH.pack(len(b)) + b),
            st.binary(max_size=60).map(lambda b: LENGTH.pack(len(b) + 8) + REQUEST_ID.pack(1) + b),
            st.binary(max_size=20),
        ),
        max_size=5,
    ).map(b"".join),
    st.sampled_from([b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x16\x03\x01\x02\x00\x01", b"\n"]),
)


@LIVE
@given(garbage, st.booleans())
@example(b"", False)  # connect, then close
@example(b"\x00\x00", False)  # half a length prefix
@example(b"\x00\x00\x00\x26" + MAGIC, False)  # a truncated HELLO
@example(LENGTH.pack(8) + REQUEST_ID.pack(1), True)  # an empty message (without a secret)
def test_garbage_reaches_no_handler_closes_its_connection_logs_and_the_server_goes_on(
    live: Live, caplog: pytest.LogCaptureFixture, junk: bytes, after_hello: bool
) -> None:
    """Whatever is sent, before or after a valid HELLO, then the peer closes its
    end: the handler sees nothing, each sound frame of junk gets an ERROR
    reply (no secret) and the server closes the connection, logging a line
    naming the peer (a warning unless the peer sent nothing wrong at all)."""
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    caplog.clear()
    before = len(live.handler.calls)
    raw = Raw(live.server.address, live.secret)
    if after_hello:
        raw.hello()
    raw.send(junk, then_close=True)
    answer = raw.until_closed()
    raw.close()
    assert live.handler.calls[before:] == []
    replies = replies_in(raw.session, answer) if after_hello else []
    assert (answer == b"") == (not replies)
    assert all(isinstance(r, ErrorReply) and r.code == Code.ERROR for _, r in replies)
    if live.secret is not None:
        assert replies == []  # nothing unauthenticated is answered
    lines = lines_about(caplog, raw.peer)
    assert lines, "no log line about the dropped connection"
    if junk and not replies:
        assert warnings_about(caplog, raw.peer), lines
    live.still_serves()


@LIVE
@given(requests, st.data(), st.booleans())
@example(StatsRequest(), None, False)
def test_a_truncated_frame_reaches_no_handler_and_is_logged(
    live: Live,
    caplog: pytest.LogCaptureFixture,
    request: Request,
    data: st.DataObject | None,
    in_hello: bool,
) -> None:
    """A HELLO or a request frame cut short, then the peer closes: no reply, no
    handler call, one warning naming the peer."""
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    caplog.clear()
    before = len(live.handler.calls)
    raw = Raw(live.server.address, live.secret)
    hello = raw.session.outgoing()
    frame = raw.session.seal(1, encode(request))
    whole = hello if in_hello else frame
    cut = 1 if data is None else data.draw(st.integers(1, len(whole) - 1), label="cut")
    raw.send((whole[:cut] if in_hello else hello + frame[:cut]), then_close=True)
    assert raw.until_closed() == b""
    raw.close()
    assert live.handler.calls[before:] == []
    assert any("inside a frame" in w for w in warnings_about(caplog, raw.peer)), caplog.text
    live.still_serves()


@pytest.mark.parametrize("live", [SECRET], ids=["hmac"], indirect=True)
@LIVE
@given(st.binary(min_size=1, max_size=32), requests)
def test_a_wrong_secret_gets_nothing_but_the_preamble_and_is_logged(
    live: Live, caplog: pytest.LogCaptureFixture, wrong: bytes, request: Request
) -> None:
    if wrong == live.secret:
        return
    caplog.set_level(logging.WARNING, logger=LOGGER)
    caplog.clear()
    failures = live.server.counters()["auth_failures"]
    before = len(live.handler.calls)
    raw = Raw(live.server.address, wrong)
    raw.send(raw.session.outgoing() + raw.session.seal(1, encode(request)))
    assert raw.until_closed() == b""
    raw.close()
    assert live.handler.calls[before:] == []
    assert live.server.counters()["auth_failures"] == failures + 1
    assert any("bad tag" in w for w in warnings_about(caplog, raw.peer)), caplog.text
    live.still_serves()


@LIVE
@given(st.integers(min_value=0, max_value=2**32 - 1), st.booleans())
@example(1 << 20, False)  # a 1 MiB HELLO: refused from its length alone
@example(MAX_FRAME + 1, True)
def test_an_oversized_length_prefix_closes_the_connection_at_once(
    live: Live, caplog: pytest.LogCaptureFixture, length: int, after_hello: bool
) -> None:
    """A length over the limit (a HELLO's size before the HELLO, `max_frame`
    after) closes the connection without waiting for the body; within the limit
    the server waits for it (and, the peer gone, logs a truncated frame)."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    caplog.clear()
    raw = Raw(live.server.address, live.secret)
    if after_hello:
        raw.hello()
    limit = MAX_FRAME if after_hello else HELLO[live.secret]
    raw.send(LENGTH.pack(length))  # and not one byte of the body
    if length > limit:
        assert raw.until_closed() == b""  # the socket's timeout is DEADLINE
        assert any("exceeds the limit" in w for w in warnings_about(caplog, raw.peer))
    else:  # the server waits for the body; the peer leaves
        raw.send(b"", then_close=True)
        assert raw.until_closed() == b""
        warned = warnings_about(caplog, raw.peer)
        assert warned and (length == 0 or any("inside a frame" in w for w in warned)), warned
    raw.close()
    live.still_serves()


@pytest.mark.parametrize("reply", REPLIES, ids=lambda r: type(r).__name__)
def test_a_reply_sent_as_a_request_gets_an_error_reply_and_reaches_no_handler(
    live: Live, reply: Reply
) -> None:
    before = len(live.handler.calls)
    raw = Raw(live.server.address, live.secret)
    raw.hello()
    raw.send(raw.session.seal(9, encode(reply)) + raw.session.seal(10, encode(StatsRequest())))
    got: list[tuple[int, Reply]] = []
    while len(got) < 2:
        chunk = raw.sock.recv(65536)
        assert chunk, "the server closed the connection"
        got += replies_in(raw.session, chunk)
    raw.close()
    by_id = dict(got)
    assert isinstance(by_id[9], ErrorReply) and by_id[9].code == Code.ERROR
    assert f"Invalid value '{reply.__struct_config__.tag}'" in by_id[9].message
    assert isinstance(by_id[10], Stats)  # the connection goes on
    assert live.handler.calls[before:] == [StatsRequest()]


def test_a_frame_replayed_on_its_connection_or_another_reaches_the_handler_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    live = Live(SECRET)
    try:
        abort = Abort(xfer_id="x9", reason=AbortReason.CLIENT_ABORT)
        raw = Raw(live.server.address, SECRET)
        hello = raw.hello()
        frame = raw.session.seal(1, encode(abort))
        raw.send(frame)
        assert replies_in(raw.session, raw.sock.recv(65536)) == [
            (1, AbortReply(xfer_id="x9", code=Code.OK))
        ]
        raw.send(frame)  # the same frame again: its counter is past
        assert raw.until_closed() == b""
        raw.close()
        again = Raw(live.server.address)  # reads the new preamble, answers nothing
        again.send(hello + frame)  # everything recorded, on a new connection
        assert again.until_closed() == b""
        again.close()
        assert live.handler.calls == [abort]
        assert live.server.counters()["auth_failures"] == 2
        assert warnings_about(caplog, raw.peer) and warnings_about(caplog, again.peer)
        live.still_serves()
    finally:
        live.close()


def test_idle_connections_are_dropped_at_the_hello_timeout_and_the_cap_refuses_more(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Peers that connect and send nothing (or dribble a HELLO too slowly) hold
    no handler and are dropped with a warning after `hello_timeout`; while they
    are open they count against `max_connections`, and a connection past it is
    closed on accept with a warning. Then a well-formed client is served."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    live = Live(SECRET, max_connections=3, hello_timeout=0.5)
    try:
        t0 = time.monotonic()
        idle = [Raw(live.server.address) for _ in range(2)]
        slow = Raw(live.server.address, SECRET)
        dribble = threading.Thread(target=_dribble, args=(slow, slow.session.outgoing()))
        dribble.start()
        refused = Raw(live.server.address, preamble=False)
        assert refused.until_closed() == b""  # not even a preamble
        refused.close()
        for raw in [*idle, slow]:
            assert raw.until_closed() == b""
            raw.close()
        dropped = time.monotonic() - t0
        dribble.join()
        assert 0.4 < dropped < 0.5 + DEADLINE
        for raw in [*idle, slow]:
            assert any("no valid HELLO in time" in w for w in warnings_about(caplog, raw.peer))
        assert any("refusing" in w for w in warnings_about(caplog, refused.peer))
        assert live.server.counters()["connections_refused"] == 1
        assert live.handler.calls == []
        _eventually(live.still_serves)  # the dropped ones' slots free up at once
    finally:
        live.close()


def _dribble(raw: Raw, hello: bytes) -> None:
    """Send `hello` a byte every 0.1 s (slower than a 0.5 s HELLO timeout allows)."""
    for byte in hello:
        try:
            raw.sock.sendall(bytes([byte]))
        except OSError:
            return
        time.sleep(0.1)


def _eventually(check: Callable[[], None]) -> None:
    deadline = time.monotonic() + DEADLINE
    while True:
        try:
            check()
            return
        except ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


# ------------------------------------------------------------------ a bad server, for the client


class ScriptedServer:
    """A server that answers its first request with `answer(request id)` bytes
    (a `ServerSession` on a blocking socket, one connection)."""

    def __init__(self, answer: Callable[[ServerSession, int], bytes]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = format_address(*self.listener.getsockname()[:2])
        self.answer = answer
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        sock, _ = self.listener.accept()
        with sock:
            session = ServerSession(None)
            sock.sendall(session.outgoing())
            got: list[tuple[int, bytes]] = []
            while not got and (data := sock.recv(65536)):
                got = session.receive(data)
            if got:
                sock.sendall(self.answer(session, got[0][0]))
                with contextlib.suppress(OSError):
                    while sock.recv(65536):
                        pass

    def close(self) -> None:
        self.listener.close()
        self.thread.join(DEADLINE)


@pytest.mark.parametrize(
    ("answer", "raises"),
    [
        (lambda s, rid: s.seal(rid, encode(StatsRequest())), "Invalid value 'stats_request'"),
        (
            lambda s, rid: s.seal(rid, encode(AbortReply(xfer_id="x", code=Code.OK))),
            "expected Stats",
        ),
        (lambda s, rid: s.seal(rid, b"\xc1 junk"), "invalid reply"),
        (lambda s, rid: s.seal(rid + 1, encode(Stats())) + s.seal(rid, encode(Stats())), None),
        (lambda s, rid: s.seal(rid, encode(Stats()))[:-3], TimeoutError),
    ],
    ids=["a-request-as-reply", "the-wrong-reply", "not-msgpack", "unknown-id-first", "truncated"],
)
def test_the_client_refuses_out_of_order_and_malformed_replies_cleanly(
    answer: Callable[[ServerSession, int], bytes], raises: str | type | None
) -> None:
    """A reply of a request type or of another request's type, junk, or a reply
    cut short: the caller gets `RpcError` (or its timeout), never another
    exception; a reply under an id nobody asked is dropped."""
    server = ScriptedServer(answer)
    try:
        with RpcClient() as client:
            future = client.submit(server.address, StatsRequest(), 1.0)
            if raises is None:
                assert future.result(DEADLINE) == Stats()
            elif isinstance(raises, str):
                with pytest.raises(RpcError, match=raises):
                    future.result(DEADLINE)
            else:
                with pytest.raises(raises, match="no reply"):
                    future.result(DEADLINE)
    finally:
        server.close()


def test_a_valid_request_from_a_raw_peer_reaches_the_handler() -> None:
    """Sanity for the live tests above: a valid request from a raw peer does
    reach the handler (so 'no call' there means refused, not unheard)."""
    live = Live(None)
    try:
        raw = Raw(live.server.address)
        raw.hello()
        raw.send(raw.session.seal(1, encode(REQUESTS[2])))
        assert replies_in(raw.session, raw.sock.recv(65536))[0][0] == 1
        raw.close()
        assert live.handler.calls == [REQUESTS[2]]
    finally:
        live.close()
