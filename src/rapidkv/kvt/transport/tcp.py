"""TCP transport: the fallback with no extra dependency, and the tests' reference.

Theory of operation
-------------------
Each `TcpTransport` owns an asyncio loop on a daemon thread of its own. On that
loop it listens on `host:port` (exactly what was asked; loopback by default) and
keeps one outbound `Link` per peer it writes to (`tcp_link`). Inbound
connections are served by `tcp_server`: payload bytes go straight from the socket
into registered memory. The wire format is in `tcp_wire`.

The owner thread's calls (`post_write`, `poll`, `release`, `send_notif`,
`add_peer`, `remove_peer`) validate, update the handle table, and hand work to
the loop through a FIFO outbox drained by a `call_soon_threadsafe` callback; none
of them waits on the network.

Invariants
----------
- A handle's state leaves PENDING exactly once (`_resolve`, under `_lock`).
- DONE means the receiver acknowledged that every byte of the write is in its
  registered memory. ERROR means the link failed (or the peer was removed, or
  the transport closed) before that ACK; the bytes may or may not have landed.
- A notification follows every earlier write to the same peer on one ordered
  stream, and the receiver handles frames in order: it is delivered after the
  data of every write posted before it (not only of those already DONE).
- The handle table and the peer table are changed by the owner thread only (and
  by `close`); the loop thread only resolves states and appends notifications.
- Registered memory must stay valid until `close()` returns: a write released
  while in flight may still be reading its source.

Polling: `poll` of a PENDING handle, and `take_notifs` with nothing to take, yield
the GIL once, so a thread spinning on them lets the loop thread run instead of
stalling it for a GIL switch interval (5 ms) after each of its system calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence

import numpy as np

from rapidkv.kvt.transport.base import Transport, TransportError, XferState
from rapidkv.kvt.transport.tcp_link import Link, LinkConfig, Xfer
from rapidkv.kvt.transport.tcp_memory import OutOfBounds, RegionTable, merge_rows
from rapidkv.kvt.transport.tcp_server import Server, ServerConfig
from rapidkv.kvt.transport.tcp_wire import (
    MAX_NAME,
    Kind,
    Metadata,
    decode_metadata,
    encode_metadata,
    pack_header,
)
from rapidkv.listen import listen_socket

log = logging.getLogger("rapidkv.kvt.transport.tcp")

_WILDCARDS = {"", "0.0.0.0", "::"}
_CLOSE_TIMEOUT = 5.0


class TcpTransport(Transport):
    """asyncio TCP transport; see the module docstring.

    Options:
      host, port        address to listen on (port 0: pick a free one).
      secret            shared secret; if set, peers must prove it (HMAC
                        challenge/response) both ways before anything is exchanged.
      advertise_host    host put in `local_metadata()` (default: `host`); required
                        when `host` is a wildcard address.
      connect_timeout   seconds to connect to a peer; handshake_timeout: to
                        complete the handshake, on either side.
      max_rows          descriptor rows one WRITE may carry (receiver's limit).
      max_notif_bytes   size limit of one notification (both sides).
    """

    def __init__(
        self,
        name: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: bytes | None = None,
        advertise_host: str | None = None,
        connect_timeout: float = 5.0,
        handshake_timeout: float = 5.0,
        max_rows: int = 1 << 20,
        max_notif_bytes: int = 1 << 20,
    ) -> None:
        if not name or len(name) > MAX_NAME:
            raise ValueError(f"transport name must be 1..{MAX_NAME} characters")
        if secret is not None and (not isinstance(secret, bytes) or not secret):
            raise ValueError("secret must be non-empty bytes (or None)")
        if advertise_host is None and host in _WILDCARDS:
            raise ValueError(f"listening on wildcard {host!r} needs advertise_host")
        self.name = name
        self._secret = secret
        self._max_notif = max_notif_bytes
        self._instance = os.urandom(16)
        self._lock = threading.Lock()
        self._regions = RegionTable()
        self._xfers: dict[int, Xfer] = {}
        self._links: dict[str, Link] = {}
        self._notifs: list[tuple[str, bytes]] = []
        self._handles = itertools.count(1)
        self._outbox: deque[tuple[Link, Xfer | bytes]] = deque()  # owner -> loop, FIFO
        self._kicked = False  # a _drain_outbox is scheduled and has not started yet
        self._closed = False
        self._link_config = LinkConfig(name, secret, connect_timeout, handshake_timeout)

        lsock = _listen(host, port)
        self._meta = Metadata(
            name=name, host=advertise_host or host, port=lsock.getsockname()[1],
            instance=self._instance,
        )  # fmt: skip
        server_config = ServerConfig(
            name, self._instance, secret, handshake_timeout, max_rows, max_notif_bytes
        )
        self._server = Server(lsock, server_config, lambda: self._regions, self._on_notif)
        self._loop = asyncio.new_event_loop()
        self._server_task: asyncio.Task[None] | None = None
        self._thread = threading.Thread(
            target=self._run_loop, name=f"rapidkv-tcp-{name}", daemon=True
        )
        self._thread.start()
        self._loop.call_soon_threadsafe(self._start_server)

    # --- memory & peers ---------------------------------------------------------------

    def register_memory(self, regions: Sequence[tuple[int, int]]) -> None:
        """Add regions; the memory must stay valid until `close()` returns."""
        try:
            self._regions = self._regions.with_regions(regions)
        except (TypeError, ValueError) as e:
            raise TransportError(f"register_memory: {e}") from None

    def local_metadata(self) -> bytes:
        """msgspec-encoded `Metadata` (name, host, port, instance)."""
        return encode_metadata(self._meta)

    def add_peer(self, metadata: bytes) -> str:
        """Start connecting to the peer (in the background) and return its name.

        Does not wait for the connection: a peer that cannot be reached, or that
        fails the handshake, turns every write posted to it into ERROR. Adding a
        peer whose link is up with the same metadata is a no-op; otherwise an
        existing link of that name is replaced (its pending writes fail)."""
        meta = decode_metadata(metadata)
        self._check_open()
        old = self._links.get(meta.name)
        if old is not None:
            if old.meta == meta and old.broken is None:
                return meta.name
            self.remove_peer(meta.name)
        link = Link(meta, self._link_config, lambda: self._regions, self._resolve)
        self._links[meta.name] = link
        self._loop.call_soon_threadsafe(link.start)
        return meta.name

    def remove_peer(self, peer: str) -> None:
        """Drop the connection (RST: unsent bytes are discarded); the peer's
        pending writes are ERROR when this returns. Unknown peers are ignored."""
        link = self._links.pop(peer, None)
        if link is None:
            return
        with self._lock:
            pending = [x for x in self._xfers.values() if x.link is link]
        self._resolve(pending, XferState.ERROR)
        self._call(link.fail, "removed by owner")

    # --- writes -----------------------------------------------------------------------

    def post_write(self, peer: str, descs: np.ndarray) -> int:
        """Queue one WRITE of `(local_src, remote_dst, nbytes)` rows; return its handle.

        Raises TransportError for an unknown peer, malformed rows, or a source
        range outside registered memory. Rows contiguous in both src and dst are
        merged; zero-length rows are dropped."""
        link = self._link(peer)
        d = np.asarray(descs)
        if d.ndim != 2 or d.shape[1] != 3 or (d.size and d.dtype.kind not in "iu"):
            raise TransportError(f"descs must be an (n, 3) integer array, got {d.dtype}{d.shape}")
        d = d.astype(np.int64, copy=False)
        if (d < 0).any():
            raise TransportError("descs hold a negative address or size")
        d = merge_rows(d[d[:, 2] > 0])
        try:
            self._regions.locate(d[:, 0], d[:, 2])
        except OutOfBounds as e:
            raise TransportError(f"post_write to {peer}: source {e}") from None
        with self._lock:
            x = Xfer(next(self._handles), link, d)
            self._xfers[x.handle] = x
        if link.broken is not None:
            self._resolve([x], XferState.ERROR)
        else:
            self._hand_over(link, x)
        return x.handle

    def poll(self, handle: int) -> XferState:
        x = self._xfers.get(handle)
        if x is None:
            raise TransportError(f"unknown handle {handle}")
        state = x.state
        if state is XferState.PENDING:
            time.sleep(0)  # let the loop thread take the GIL (see module docstring)
        return state

    def release(self, handle: int) -> None:
        """Forget a handle. A PENDING write not yet started is dropped unsent; one
        already on the wire still completes on the stream (its ack is ignored)."""
        with self._lock:
            x = self._xfers.pop(handle, None)
        if x is not None and x.state is XferState.PENDING:
            x.cancelled = True

    # --- notifications ----------------------------------------------------------------

    def send_notif(self, peer: str, payload: bytes) -> None:
        """Queue a notification after every write already posted to `peer`.
        TransportError if the peer is unknown or its link has failed; a link that
        fails later loses it (and fails those writes too)."""
        link = self._link(peer)
        if len(payload) > self._max_notif:
            raise TransportError(f"notification of {len(payload)} bytes (limit {self._max_notif})")
        if link.broken is not None:
            raise TransportError(f"peer {peer}: link failed: {link.broken}")
        self._hand_over(link, pack_header(Kind.NOTIF, len(payload)) + bytes(payload))

    def take_notifs(self) -> list[tuple[str, bytes]]:
        with self._lock:
            out, self._notifs = self._notifs, []
        if not out:
            time.sleep(0)  # let the loop thread take the GIL (see module docstring)
        return out

    # --- lifecycle --------------------------------------------------------------------

    def close(self) -> None:
        """Stop the loop and drop every connection; pending writes become ERROR.
        Idempotent, callable from any thread, bounded in time."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._xfers.values())
        self._resolve(pending, XferState.ERROR)
        self._call(self._shutdown)
        if threading.current_thread() is not self._thread:
            self._thread.join(_CLOSE_TIMEOUT)
            if self._thread.is_alive():
                log.warning("tcp %s: loop thread did not stop within %.0fs", self.name, 5.0)

    def __enter__(self) -> TcpTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        m = self._meta
        return f"TcpTransport({self.name!r}, {m.host}:{m.port}, peers={sorted(self._links)})"

    # --- internals --------------------------------------------------------------------

    def _link(self, peer: str) -> Link:
        self._check_open()
        link = self._links.get(peer)
        if link is None:
            raise TransportError(f"unknown peer {peer!r}")
        return link

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"transport {self.name} is closed")

    def _call(self, fn: object, *args: object) -> None:
        with contextlib.suppress(RuntimeError):  # loop closed: everything has been failed
            self._loop.call_soon_threadsafe(fn, *args)  # type: ignore[arg-type]

    def _hand_over(self, link: Link, item: Xfer | bytes) -> None:
        """Queue an item for the loop thread; wake the loop only if no wake-up is
        pending already (one self-pipe write per burst of posts, not per post)."""
        self._outbox.append((link, item))
        if not self._kicked:
            self._kicked = True
            self._call(self._drain_outbox)

    def _drain_outbox(self) -> None:  # loop thread
        self._kicked = False  # cleared before draining: a later append kicks again
        outbox = self._outbox
        while outbox:
            link, item = outbox.popleft()
            link.push(item)

    def _resolve(self, xfers: Iterable[Xfer], state: XferState) -> None:
        with self._lock:
            for x in xfers:
                if x.state is XferState.PENDING:
                    x.state = state

    def _on_notif(self, peer: str, payload: bytes) -> None:
        with self._lock:
            self._notifs.append((peer, payload))

    def _start_server(self) -> None:
        self._server_task = self._loop.create_task(self._server.serve())

    def _shutdown(self) -> None:
        for link in list(self._links.values()):
            link.fail("closed")
        if self._server_task is not None:
            self._server_task.cancel()
        self._loop.call_soon(self._loop.stop)

    def _run_loop(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.wait(tasks, timeout=_CLOSE_TIMEOUT / 2))
            loop.run_until_complete(asyncio.sleep(0))  # deferred socket closes
            loop.close()


def _listen(host: str, port: int) -> socket.socket:
    """Bind exactly `host:port` and listen (blocking-free; before the loop starts)."""
    try:
        return listen_socket(host, port)
    except OSError as e:
        raise TransportError(f"cannot listen on {host}:{port}: {e}") from None
