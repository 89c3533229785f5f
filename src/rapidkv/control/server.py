"""`RpcServer`: answers control-plane requests on an asyncio loop thread of its own.

Theory of operation
-------------------
The scheduler-side connector owns one server. `start()` binds one listening
socket on exactly the configured host and runs an asyncio loop on a daemon
thread. Each accepted connection runs a `ServerSession` (see `framing`): the
server sends the preamble, waits (at most `hello_timeout`) for a HELLO that
verifies, then reads frames. Every request decodes into a `Request` and runs as
its own task, ``await handler(request)``, so requests of one connection are
served concurrently: a TransferKV held open for seconds does not delay a Stats
asked after it. Each reply goes back under its request's id as soon as it is
ready (out of order).

The handler is an ``async def handle(request) -> reply`` that runs on this
server's loop: it must not block (take locks only briefly; wait on
`asyncio` futures, completed from other threads with
``loop.call_soon_threadsafe``). It returns the request's reply type
(`messages.REPLY_TYPE`) or an `ErrorReply`.

Rules
-----
- Bad input never stops the server. A frame that breaks the framing (too large,
  bad tag, garbage where a frame was due, a frame the peer left unfinished when
  it closed) closes its connection and logs one warning with the peer's
  address; nothing is replied. A peer that sends no valid HELLO within
  `hello_timeout` is dropped the same way. A frame that is sound but
  does not hold a valid request gets `ErrorReply(ERROR)` naming the problem.
- Unauthenticated peers get nothing but the preamble, and the handler never
  sees anything from them.
- At most `max_in_flight` requests run per connection; one more is answered
  `ErrorReply(BUSY)` at once. At most `max_connections` connections are open;
  one more is closed on accept.
- A handler exception becomes `ErrorReply(ERROR)` (and is logged); a handler
  returning the wrong type likewise.
- A client that disconnects does not cancel its requests' handlers (their
  replies are dropped); `stop()` cancels every handler still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Awaitable, Callable
from types import TracebackType

from rapidkv.control.address import format_address
from rapidkv.control.codes import Code
from rapidkv.control.framing import (
    DEFAULT_MAX_FRAME,
    AuthError,
    FrameError,
    FrameTooLarge,
    ServerSession,
    check_max_frame,
    normalize_secret,
)
from rapidkv.control.messages import (
    MAX_TEXT,
    REPLY_TYPE,
    ErrorReply,
    MessageError,
    Reply,
    Request,
    decode_request,
    encode,
)
from rapidkv.listen import listen_socket

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Reply]]

READ_CHUNK = 1 << 16
COUNTERS = (
    "connections_accepted",
    "connections_refused",
    "auth_failures",
    "frame_errors",
    "oversized_frames",
    "hello_timeouts",
    "requests",
    "bad_requests",
    "busy_replies",
    "handler_errors",
)


def _clip(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 3] + "..."


class _Connection:
    """One accepted connection: its session, writer and the requests in flight."""

    def __init__(self, peer: str, session: ServerSession, writer: asyncio.StreamWriter) -> None:
        self.peer = peer
        self.session = session
        self.writer = writer
        self.in_flight: dict[int, asyncio.Task[None]] = {}

    def send(self, request_id: int, reply: Reply) -> None:
        """Seal and write one reply (dropped if the connection is closing)."""
        if self.writer.is_closing():
            return
        try:
            frame = self.session.seal(request_id, encode(reply))
        except ValueError as e:  # a reply over max_frame
            log.warning("rpc: reply to %s too large: %s", self.peer, e)
            frame = self.session.seal(
                request_id, encode(ErrorReply(Code.ERROR, _clip(f"reply too large: {e}")))
            )
        self.writer.write(frame)


class RpcServer:
    """See the module docstring. Use from any thread except its own loop's."""

    def __init__(
        self,
        handler: Handler,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: bytes | str | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        *,
        max_in_flight: int = 64,
        max_connections: int = 256,
        hello_timeout: float = 10.0,
    ) -> None:
        if not host:
            raise ValueError("give the host to bind explicitly (0.0.0.0 for every interface)")
        self._handler = handler
        self._host = host
        self._port = port
        self._secret = normalize_secret(secret)
        self._max_frame = check_max_frame(max_frame)
        self._max_in_flight = max_in_flight
        self._max_connections = max_connections
        self._hello_timeout = hello_timeout
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._conns: set[asyncio.Task[None]] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None
        self._sockname: tuple[str, int] | None = None
        self._serving = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Bind and start serving; raises OSError if the address cannot be bound."""
        if self._thread is not None:
            raise RuntimeError("server already started")
        sock = listen_socket(self._host, self._port)
        self._sockname = sock.getsockname()[:2]
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(sock, started), name="rapidkv-rpc-server", daemon=True
        )
        self._thread.start()
        started.wait()
        if not self._serving:
            raise RuntimeError(f"rpc server on {self.address} failed to start")
        log.info("rpc: serving on %s (auth %s)", self.address, "on" if self._secret else "off")

    def stop(self, timeout: float = 10.0) -> None:
        """Close every connection, cancel running handlers, end the thread. Idempotent."""
        thread, loop, stopping = self._thread, self._loop, self._stopping
        if thread is None or loop is None or stopping is None:
            return
        if threading.current_thread() is thread:
            raise RuntimeError("stop() called from the server's own loop")
        with contextlib.suppress(RuntimeError):  # the loop already ended
            loop.call_soon_threadsafe(stopping.set)
        thread.join(timeout)

    def __enter__(self) -> RpcServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def address(self) -> str:
        """``host:port`` of the bound socket. When bound to a wildcard host,
        advertise a reachable host to peers instead."""
        if self._sockname is None:
            raise RuntimeError("server not started")
        return format_address(*self._sockname)

    def counters(self) -> dict[str, int]:
        """Monotonic counters of the RPC layer, every name in `COUNTERS` (safe
        from any thread: the keys are fixed, only the loop thread increments).

        What the server refused: `connections_refused` (over `max_connections`),
        `auth_failures`, `frame_errors` (every other framing violation;
        `oversized_frames` counts those that were over `max_frame`),
        `hello_timeouts` (no valid HELLO within `hello_timeout`), `bad_requests`
        (a sound frame holding no valid request), `busy_replies` (over
        `max_in_flight`). Also `connections_accepted`, `requests`,
        `handler_errors`."""
        return dict(self._counters)

    # ------------------------------------------------------------------ loop thread

    def _run(self, sock: socket.socket, started: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve(sock, started))
        except BaseException:
            log.exception("rpc: server on %s failed", self.address)
            raise
        finally:
            started.set()  # never leave start() waiting
            sock.close()
            loop.close()

    async def _serve(self, sock: socket.socket, started: threading.Event) -> None:
        self._stopping = asyncio.Event()
        accepting = asyncio.get_running_loop().create_task(self._accept(sock))
        self._serving = True
        started.set()
        try:
            await self._stopping.wait()
        finally:
            accepting.cancel()
            await asyncio.gather(accepting, return_exceptions=True)
            tasks = [*self._conns, *self._handlers]  # complete: nothing adds to them now
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _accept(self, lsock: socket.socket) -> None:
        """Accept connections until cancelled; each gets a task, registered at once."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, addr = await loop.sock_accept(lsock)
            except OSError as e:  # e.g. out of file descriptors: back off, go on
                log.warning("rpc: accept on %s failed: %r", self.address, e)
                await asyncio.sleep(0.1)
                continue
            peer = format_address(*addr[:2]) if isinstance(addr, tuple) else "unknown peer"
            self._counters["connections_accepted"] += 1
            if len(self._conns) >= self._max_connections:
                self._counters["connections_refused"] += 1
                log.warning("rpc: refusing %s: %d connections open", peer, len(self._conns))
                sock.close()
                continue
            task = loop.create_task(self._connection(sock, peer))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _connection(self, sock: socket.socket, peer: str) -> None:
        try:
            reader, writer = await asyncio.open_connection(sock=sock, limit=READ_CHUNK)
        except BaseException:
            sock.close()
            raise
        session = ServerSession(self._secret, self._max_frame)
        conn = _Connection(peer, session, writer)
        writer.write(session.outgoing())
        try:
            async with asyncio.timeout(self._hello_timeout):
                while not session.ready:
                    if not await self._read(reader, conn):
                        self._ended(conn)
                        return
            log.debug("rpc: %s connected", peer)
            while await self._read(reader, conn):
                await writer.drain()  # backpressure: stop reading while replies pile up
            self._ended(conn)
        except FrameError as e:
            self._counters["auth_failures" if isinstance(e, AuthError) else "frame_errors"] += 1
            if isinstance(e, FrameTooLarge):
                self._counters["oversized_frames"] += 1
            log.warning("rpc: closing connection from %s: %s", peer, e)
        except TimeoutError:
            self._counters["hello_timeouts"] += 1
            log.warning("rpc: closing connection from %s: no valid HELLO in time", peer)
        except (ConnectionError, OSError) as e:
            log.debug("rpc: connection from %s lost: %r", peer, e)
        finally:
            if not writer.is_closing():
                writer.transport.abort()

    def _ended(self, conn: _Connection) -> None:
        """The peer closed its end: a frame it left unfinished (truncated) is a
        framing error, logged like any; a clean end is logged at debug level."""
        session = conn.session
        stage = "" if session.ready else " before its HELLO"
        if session.pending:
            self._counters["frame_errors"] += 1
            log.warning(
                "rpc: closing connection from %s: it closed%s, inside a frame (%d bytes of it)",
                conn.peer,
                stage,
                session.pending,
            )
        else:
            log.debug("rpc: %s disconnected%s", conn.peer, stage)
        conn.writer.close()

    async def _read(self, reader: asyncio.StreamReader, conn: _Connection) -> bool:
        """Read one chunk and dispatch its requests; False at end of stream."""
        data = await reader.read(READ_CHUNK)
        if not data:
            return False
        for request_id, payload in conn.session.receive(data):
            self._dispatch(conn, request_id, payload)
        return True

    def _dispatch(self, conn: _Connection, request_id: int, payload: bytes) -> None:
        if request_id in conn.in_flight:
            raise FrameError(f"request id {request_id} reused while still in flight")
        self._counters["requests"] += 1
        try:
            request = decode_request(payload)
        except MessageError as e:
            self._counters["bad_requests"] += 1
            log.warning("rpc: bad request %d from %s: %s", request_id, conn.peer, e)
            conn.send(request_id, ErrorReply(Code.ERROR, _clip(str(e))))
            return
        if len(conn.in_flight) >= self._max_in_flight:
            self._counters["busy_replies"] += 1
            conn.send(
                request_id,
                ErrorReply(Code.BUSY, f"{self._max_in_flight} requests already in flight"),
            )
            return
        task = asyncio.get_running_loop().create_task(self._serve_one(conn, request_id, request))
        conn.in_flight[request_id] = task
        task.add_done_callback(lambda _: conn.in_flight.pop(request_id, None))
        self._handlers.add(task)  # stop() cancels it, even after its connection closed
        task.add_done_callback(self._handlers.discard)

    async def _serve_one(self, conn: _Connection, request_id: int, request: Request) -> None:
        name = type(request).__name__
        try:
            reply = await self._handler(request)
            if not isinstance(reply, REPLY_TYPE[type(request)] | ErrorReply):
                raise TypeError(f"handler returned {type(reply).__name__} for {name}")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._counters["handler_errors"] += 1
            log.exception("rpc: handler failed on %s %d from %s", name, request_id, conn.peer)
            reply = ErrorReply(Code.ERROR, _clip(f"handler failed on {name}: {e!r}"))
        conn.send(request_id, reply)
        with contextlib.suppress(ConnectionError, OSError):
            await conn.writer.drain()
