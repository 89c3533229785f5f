"""`RpcClient`: asks peers' `RpcServer`s, without ever blocking the caller.

Theory of operation
-------------------
One client per process side (the scheduler-side connector holds one). It runs
an asyncio loop on a daemon thread of its own and keeps at most one connection
per peer address, multiplexed by request id: many requests to one peer are in
flight at once on that connection and their replies resolve in whatever order
they come. A connection is opened on first use (its `ClientSession` checks the
server's preamble and sends the HELLO), and again after it failed.

`submit(address, request, timeout)` encodes the request on the caller's thread,
hands it to the loop and returns a `concurrent.futures.Future` at once, so the
vLLM engine thread may call it. The future resolves with the request's reply
type (`messages.REPLY_TYPE`) or raises:

- `RpcError`: the peer answered `ErrorReply` (`code`: ERROR for an invalid
  request or a handler failure, BUSY for admission refused), or sent a reply
  that did not decode or was not the type asked for;
- `TimeoutError`: no reply within `timeout` seconds (the request may still run
  on the peer; a late reply is dropped);
- `ConnectionError`: no connection (refused, authentication failed, protocol
  violation) or it was lost before the reply. The request may or may not have
  reached the peer; resend it only if it is idempotent for the peer.

Done-callbacks of the returned futures run on the client's loop thread: they
must not block. `call()` is the blocking convenience for other threads.

Rules
-----
- No automatic retries: whether to resend is the caller's decision (codes and
  errors above say what each outcome means).
- A connection that fails (end of stream, reset, a bad frame or tag from the
  peer) fails every request pending on it with `ConnectionError` and is
  forgotten; the next request to that address connects anew.
- `close()` fails whatever is still pending with `ConnectionError`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from types import TracebackType

from rapidkv.control.address import parse_address
from rapidkv.control.codes import Code
from rapidkv.control.framing import (
    DEFAULT_MAX_FRAME,
    REQUEST_ID,
    TAG_BYTES,
    ClientSession,
    FrameError,
    check_max_frame,
    normalize_secret,
)
from rapidkv.control.messages import (
    REPLY_TYPE,
    ErrorReply,
    MessageError,
    Reply,
    Request,
    decode_reply,
    encode,
)

log = logging.getLogger(__name__)

READ_CHUNK = 1 << 16


class RpcError(Exception):
    """The peer at `address` answered, but not with the reply asked for."""

    def __init__(self, code: Code, message: str, address: str) -> None:
        super().__init__(f"{address}: {code.name}: {message}")
        self.code = code
        self.message = message
        self.address = address


class _Peer:
    """One connection to one peer address, and the requests waiting on it."""

    def __init__(
        self,
        address: str,
        session: ClientSession,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.address = address
        self.session = session
        self.reader = reader
        self.writer = writer
        self.pending: dict[int, asyncio.Future[bytes]] = {}
        self.next_id = 1
        self.closed = False
        self.reader_task: asyncio.Task[None] | None = None
        self.replied = False  # any byte arrived after the handshake

    def send(self, payload: bytes) -> tuple[int, asyncio.Future[bytes]]:
        """Write one request; return its id and the future of its reply payload."""
        if self.closed:
            raise ConnectionError(f"connection to {self.address} closed")
        request_id = self.next_id
        self.next_id += 1
        frame = self.session.seal(request_id, payload)
        reply = asyncio.get_running_loop().create_future()
        self.pending[request_id] = reply
        self.writer.write(frame)
        return request_id, reply

    def fail(self, error: ConnectionError) -> None:
        """Close the connection and fail every pending request with `error`."""
        self.closed = True
        self.writer.transport.abort()
        for reply in self.pending.values():
            if not reply.done():
                reply.set_exception(error)
        self.pending.clear()


class RpcClient:
    """See the module docstring. Thread-safe; every I/O runs on its own loop."""

    def __init__(
        self,
        secret: bytes | str | None = None,
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
        connect_timeout: float = 5.0,
    ) -> None:
        self._secret = normalize_secret(secret)
        self._max_frame = check_max_frame(max_frame)
        self._connect_timeout = connect_timeout
        self._peers: dict[str, _Peer] = {}
        self._connecting: dict[str, asyncio.Task[_Peer]] = {}
        self._closing = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="rapidkv-rpc-client", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------ caller's thread

    def submit(
        self, address: str, request: Request, timeout: float
    ) -> concurrent.futures.Future[Reply]:
        """Send `request` to the server at `address`; never blocks. Raises at once
        (TypeError, ValueError) only for caller bugs: not a request, a malformed
        address, a request too large for one frame; RuntimeError after close()."""
        if self._closing:
            raise RuntimeError("rpc client closed")
        expect = REPLY_TYPE.get(type(request))
        if expect is None:
            raise TypeError(f"{type(request).__name__} is not a control-plane request")
        parse_address(address)
        payload = encode(request)
        size = REQUEST_ID.size + len(payload) + TAG_BYTES
        if size > self._max_frame:
            raise ValueError(
                f"{type(request).__name__} of {size} bytes exceeds the frame limit "
                f"{self._max_frame}"
            )
        return asyncio.run_coroutine_threadsafe(
            self._call(address, payload, expect, timeout), self._loop
        )

    def call(self, address: str, request: Request, timeout: float) -> Reply:
        """`submit` and wait for the outcome (from any thread but the client's)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("call() would block the rpc client's own loop; use submit()")
        return self.submit(address, request, timeout).result()

    def connected(self, address: str) -> bool:
        """Whether a live connection to `address` is open now."""
        peer = self._peers.get(address)
        return peer is not None and not peer.closed

    def close(self, timeout: float = 5.0) -> None:
        """Fail pending requests, close every connection, end the thread. Idempotent."""
        if self._closing:
            return
        self._closing = True
        if threading.current_thread() is self._thread:
            raise RuntimeError("close() called from the rpc client's own loop")
        with contextlib.suppress(concurrent.futures.TimeoutError):
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ loop thread

    async def _call(self, address: str, payload: bytes, expect: type, timeout: float) -> Reply:
        if self._closing:  # submitted while close() ran
            raise ConnectionError("rpc client closed")
        try:
            async with asyncio.timeout(timeout):
                peer = await self._peer(address)
                request_id, reply = peer.send(payload)
                try:
                    await peer.writer.drain()
                    raw = await reply
                finally:
                    peer.pending.pop(request_id, None)
        except asyncio.CancelledError:
            if self._closing:
                raise ConnectionError(f"rpc client closed before {address} replied") from None
            raise
        except TimeoutError:
            raise TimeoutError(f"no reply from {address} within {timeout}s") from None
        except ConnectionError:
            raise
        except OSError as e:
            raise ConnectionError(f"connection to {address} failed: {e!r}") from None
        try:
            msg = decode_reply(raw)
        except MessageError as e:
            raise RpcError(Code.ERROR, str(e), address) from None
        if isinstance(msg, ErrorReply):
            raise RpcError(msg.code, msg.message, address)
        if not isinstance(msg, expect):
            raise RpcError(
                Code.ERROR, f"expected {expect.__name__}, got {type(msg).__name__}", address
            )
        return msg

    async def _peer(self, address: str) -> _Peer:
        """The live connection to `address`, opened if needed (one open at a time
        per address; concurrent callers share it)."""
        peer = self._peers.get(address)
        if peer is not None and not peer.closed:
            return peer
        task = self._connecting.get(address)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._connect(address))
            self._connecting[address] = task
            task.add_done_callback(lambda t: self._connected(address, t))
        return await asyncio.shield(task)

    def _connected(self, address: str, task: asyncio.Task[_Peer]) -> None:
        if self._connecting.get(address) is task:
            del self._connecting[address]
        if not task.cancelled():
            task.exception()  # retrieved: the waiters (if any) got it

    async def _connect(self, address: str) -> _Peer:
        host, port = parse_address(address)
        session = ClientSession(self._secret, self._max_frame)
        writer = None
        try:
            async with asyncio.timeout(self._connect_timeout):
                reader, writer = await asyncio.open_connection(host, port, limit=READ_CHUNK)
                while not session.ready:
                    data = await reader.read(READ_CHUNK)
                    if not data:
                        raise ConnectionError(f"{address} closed the connection at once")
                    if session.receive(data):
                        raise FrameError("message before the handshake")
            writer.write(session.outgoing())
        except FrameError as e:
            log.warning("rpc: refusing server %s: %s", address, e)
            if writer is not None:
                writer.transport.abort()
            raise ConnectionError(f"{address}: {e}") from None
        except TimeoutError:
            if writer is not None:
                writer.transport.abort()
            raise ConnectionError(f"connecting to {address} timed out") from None
        except BaseException:
            if writer is not None:
                writer.transport.abort()
            raise
        peer = _Peer(address, session, reader, writer)
        self._peers[address] = peer
        peer.reader_task = asyncio.get_running_loop().create_task(self._read_replies(peer))
        log.debug("rpc: connected to %s", address)
        return peer

    async def _read_replies(self, peer: _Peer) -> None:
        """Resolve replies as they arrive, until the connection ends."""
        error = ConnectionError(f"{peer.address} closed the connection")
        try:
            while data := await peer.reader.read(READ_CHUNK):
                peer.replied = True
                for request_id, payload in peer.session.receive(data):
                    reply = peer.pending.get(request_id)
                    if reply is not None and not reply.done():
                        reply.set_result(payload)
            if not peer.replied:
                error = ConnectionError(
                    f"{peer.address} closed the connection without replying "
                    "(a wrong shared secret looks like this)"
                )
        except FrameError as e:
            log.warning("rpc: dropping connection to %s: %s", peer.address, e)
            error = ConnectionError(f"{peer.address}: {e}")
        except OSError as e:
            error = ConnectionError(f"connection to {peer.address} lost: {e!r}")
        except asyncio.CancelledError:
            error = ConnectionError("rpc client closed")
            raise
        finally:
            peer.fail(error)
            if self._peers.get(peer.address) is peer:
                del self._peers[peer.address]
            log.debug("rpc: connection to %s closed: %s", peer.address, error)

    async def _shutdown(self) -> None:
        for peer in list(self._peers.values()):
            peer.fail(ConnectionError("rpc client closed"))
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
