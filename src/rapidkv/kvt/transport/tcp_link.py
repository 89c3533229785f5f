"""Outbound side of the TCP transport: one `Link` per peer this transport writes to.

Theory of operation
-------------------
A Link connects to the peer's listening socket, runs the handshake (see
`tcp_wire`), then runs two tasks on the transport's loop thread: the sender
drains a queue of WRITE and NOTIF items into `sendmsg` calls over views of the
source memory (headers and descriptor tables are the only bytes built), and the
ack reader resolves WRITEs in order as ACK frames come back.

Invariants
----------
- Every method of a Link runs on the loop thread; the owner thread reaches it
  only through `loop.call_soon_threadsafe`.
- An `Xfer` leaves PENDING once: DONE on its ACK, ERROR when the link fails
  (connect or handshake failure, EOF, reset, protocol error, removal). The
  transport's `resolve` makes the transition atomic against the owner thread.
- ACKs arrive in the order WRITEs were sent; an out-of-order or unknown ACK is a
  protocol error. An Xfer is appended to `inflight` before its first byte is sent.
- A failed link stays failed: items pushed afterwards fail at once.
- An Xfer released while still queued (`cancelled`) is dropped unsent; once its
  first byte is sent, it goes out whole (the stream cannot skip part of a frame).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections import deque
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from rapidkv.kvt.transport.base import XferState
from rapidkv.kvt.transport.tcp_io import (
    Buffer,
    PeerClosed,
    hard_close,
    read_body,
    sendmsg_all,
    tune,
)
from rapidkv.kvt.transport.tcp_memory import RegionTable, merge_runs
from rapidkv.kvt.transport.tcp_wire import (
    DESC_DTYPE,
    HEADER,
    NONCE_BYTES,
    Challenge,
    Hello,
    Kind,
    Metadata,
    ProtocolError,
    Welcome,
    encode_body,
    hello_mac,
    mac_ok,
    pack_header,
    unpack_header,
    welcome_mac,
)

log = logging.getLogger("rapidkv.kvt.transport.tcp")

_MAX_BATCH_BUFS = 4096  # soft cap on buffers gathered from the queue per send round


class Xfer:
    """One posted write. `descs` are merged `(src, dst, nbytes)` rows, all nbytes > 0;
    the handle doubles as the request id on the wire."""

    __slots__ = ("cancelled", "descs", "handle", "link", "nbytes", "state")

    def __init__(self, handle: int, link: Link, descs: np.ndarray) -> None:
        self.handle = handle
        self.link = link
        self.descs = descs
        self.nbytes = int(descs[:, 2].sum()) if len(descs) else 0
        self.state = XferState.PENDING
        self.cancelled = False


@dataclass(frozen=True)
class LinkConfig:
    local_name: str
    secret: bytes | None
    connect_timeout: float
    handshake_timeout: float


Resolve = Callable[[Iterable[Xfer], XferState], None]


class Link:
    """Connection to one peer; see the module docstring."""

    def __init__(
        self,
        meta: Metadata,
        config: LinkConfig,
        regions: Callable[[], RegionTable],
        resolve: Resolve,
    ) -> None:
        self.meta = meta
        self.broken: str | None = None  # why the link failed; set once
        self._config = config
        self._regions = regions
        self._resolve = resolve
        self._queue: deque[Xfer | bytes] = deque()
        self._inflight: deque[Xfer] = deque()
        self._wake: asyncio.Event | None = None
        self._sock: socket.socket | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # --- entry points (loop thread) -------------------------------------------------

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._tasks.append(asyncio.get_running_loop().create_task(self._run()))

    def push(self, item: Xfer | bytes) -> None:
        """Queue a WRITE (Xfer) or a NOTIF (its encoded frame)."""
        if self.broken is not None:
            if isinstance(item, Xfer):
                self._resolve([item], XferState.ERROR)
            return
        self._queue.append(item)
        assert self._wake is not None
        self._wake.set()

    def fail(self, reason: str) -> None:
        """Drop the connection; every queued or unacknowledged write becomes ERROR."""
        if self.broken is not None:
            return
        self.broken = reason
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        # Close after the cancelled tasks have unregistered the fd (callbacks run FIFO).
        asyncio.get_running_loop().call_soon(hard_close, self._sock)
        failed = [*self._inflight, *(x for x in self._queue if isinstance(x, Xfer))]
        self._inflight.clear()
        self._queue.clear()
        self._resolve(failed, XferState.ERROR)
        if reason.startswith(("removed", "closed")):
            level = logging.DEBUG
        else:
            level = logging.WARNING if failed else logging.INFO
        log.log(
            level,
            "tcp %s -> %s (%s:%d): link failed: %s (%d writes failed)",
            self._config.local_name, self.meta.name, self.meta.host, self.meta.port,
            reason, len(failed),
        )  # fmt: skip

    # --- tasks ------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await asyncio.wait_for(self._connect(), self._config.connect_timeout)
            await asyncio.wait_for(self._handshake(), self._config.handshake_timeout)
        except TimeoutError:
            self.fail("connect/handshake timed out")
            return
        except PeerClosed:
            self.fail("peer closed the connection in the handshake (wrong secret? stale metadata?)")
            return
        except (OSError, ProtocolError, ValueError) as e:
            self.fail(f"connect/handshake: {e!r}")
            return
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._guard(self._ack_loop())))
        await self._guard(self._send_loop())

    async def _guard(self, coro: Coroutine[Any, Any, None]) -> None:
        try:
            await coro
        except (OSError, ProtocolError) as e:
            self.fail(repr(e))
        except Exception as e:  # a bug must fail the link, not strand its writes
            log.exception("tcp %s -> %s: unexpected error", self._config.local_name, self.meta.name)
            self.fail(f"internal error: {e!r}")

    async def _connect(self) -> None:
        family = socket.AF_INET6 if ":" in self.meta.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock = sock
        tune(sock)
        await asyncio.get_running_loop().sock_connect(sock, (self.meta.host, self.meta.port))

    async def _handshake(self) -> None:
        loop, sock, cfg, meta = asyncio.get_running_loop(), self._sock, self._config, self.meta
        assert sock is not None
        challenge = await read_body(loop, sock, Kind.CHALLENGE, Challenge)
        if challenge.auth and cfg.secret is None:
            raise ProtocolError("peer requires a secret and none is configured")
        nonce = os.urandom(NONCE_BYTES)
        mac = b""
        if cfg.secret is not None:
            mac = hello_mac(cfg.secret, challenge.nonce, nonce, cfg.local_name, meta.instance)
        hello = Hello(name=cfg.local_name, nonce=nonce, instance=meta.instance, mac=mac)
        await loop.sock_sendall(sock, encode_body(Kind.HELLO, hello))
        welcome = await read_body(loop, sock, Kind.WELCOME, Welcome)
        if cfg.secret is not None and not mac_ok(
            welcome_mac(cfg.secret, challenge.nonce, nonce, welcome.name, welcome.instance),
            welcome.mac,
        ):
            raise ProtocolError("peer failed to prove it knows the secret")
        if welcome.name != meta.name or welcome.instance != meta.instance:
            raise ProtocolError(f"peer is {welcome.name!r}, not the one in the metadata")

    async def _send_loop(self) -> None:
        loop, sock, wake = asyncio.get_running_loop(), self._sock, self._wake
        assert sock is not None and wake is not None
        while True:
            if not self._queue:
                wake.clear()
                await wake.wait()
                continue
            bufs: list[Buffer] = []
            while self._queue and len(bufs) < _MAX_BATCH_BUFS:
                item = self._queue.popleft()
                if isinstance(item, bytes):
                    bufs.append(item)
                    continue
                if item.cancelled or item.state is not XferState.PENDING:
                    continue
                bufs.extend(_write_frame(item, self._regions()))
                self._inflight.append(item)
            if bufs:
                await sendmsg_all(loop, sock, bufs)

    async def _ack_loop(self) -> None:
        loop, sock = asyncio.get_running_loop(), self._sock
        assert sock is not None
        size = HEADER.size
        buf = bytearray(64 * size)
        view = memoryview(buf)
        have = 0
        while True:
            n = await loop.sock_recv_into(sock, view[have:])
            if n == 0:
                raise PeerClosed("connection closed by peer")
            have += n
            whole = have - have % size
            done: list[Xfer] = []
            for off in range(0, whole, size):
                kind, count, req = unpack_header(view[off : off + size])
                if kind is not Kind.ACK or count:
                    raise ProtocolError(f"unexpected {kind.name} frame from the receiver")
                if not self._inflight or self._inflight[0].handle != req:
                    raise ProtocolError(f"ACK for unknown or out-of-order write {req}")
                done.append(self._inflight.popleft())
            self._resolve(done, XferState.DONE)
            view[: have - whole] = view[whole:have]
            have -= whole


def _write_frame(x: Xfer, regions: RegionTable) -> list[Buffer]:
    """Header, descriptor table, and zero-copy views of the source bytes."""
    d = x.descs
    frame: list[Buffer] = [pack_header(Kind.WRITE, len(d), x.handle)]
    if len(d):
        frame.append(d[:, 1:3].astype(DESC_DTYPE).tobytes())
        src, lens = merge_runs(d[:, 0], d[:, 2])
        frame.extend(regions.views(src, lens))
    return frame
