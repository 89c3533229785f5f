"""A transport in a second process, and the test process's side of a write to it.

Used by the transport conformance suite (test_transports) and the NIXL-specific
tests (test_transport_nixl).

The child (`serve`, started with multiprocessing *spawn*) builds one transport of
the requested kind (with the given constructor options), owns a buffer laid out as
``guard | region | guard``, registers only the region, and answers commands from
the parent over a Pipe. The guards are ordinary memory next to the region: a write
that escapes the region's bounds lands there and is seen by the parent.

Like a receiving worker, the child polls `take_notifs` all the time on a thread
of its own (some transports need the receiver to progress, e.g. NIXL without a
progress thread); once started, that thread makes every call on the transport but
`close`. For each notification it records (peer, payload, crcs): crcs are the
CRC-32 of every block of the region the moment it was taken, if a block size is
being watched. While echoing, it sends each notification back to its sender
instead of recording it.

Commands (parent -> child), answered with one message each:
  ("reset",)                  fill the whole buffer with FILL, forget notifications,
                              stop watching and echoing
  ("watch", bs)               snapshot `bs`-byte block CRCs at each notification
  ("echo", md)                add the peer of metadata `md` (a sender's) and from now
                              on send every notification back to its sender,
                              unrecorded; md=None: record them again
  ("read",)                   bytes of the whole buffer (guards included)
  ("notifs", count, timeout)  the first `count` notifications not yet returned,
                              waiting up to `timeout` seconds (fewer if it passes)
  ("close",)                  close the transport and exit

The parent may also freeze the child (SIGSTOP: alive, never progressing) or kill it.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from rapidkv.kvt.transport import Transport, XferState

FILL = 0xEE


class _Receiver:
    """The child's notification poller (a thread) and what it has seen."""

    def __init__(self, transport: Any, region: np.ndarray) -> None:
        self.transport = transport
        self.region = region
        self.block = 0
        self.echo = False
        self.arrived: list[tuple[str, bytes, list[int] | None]] = []
        self.cond = threading.Condition()
        self.jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple, Future[Any]]]
        self.jobs = queue.SimpleQueue()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping:
            while not self.jobs.empty():
                job, args, done = self.jobs.get()
                try:
                    done.set_result(job(*args))
                except Exception as e:
                    done.set_exception(e)
            got = self.transport.take_notifs()
            if self.echo:
                for peer, payload in got:
                    self.transport.send_notif(peer, payload)
                got = []
            with self.cond:
                for peer, payload in got:
                    self.arrived.append((peer, bytes(payload), self._crcs()))
                self.cond.notify_all()
            if not got:
                time.sleep(0.0002)  # poll interval of an idle receiver

    def _crcs(self) -> list[int] | None:
        if not self.block:
            return None
        mv, bs = memoryview(self.region), self.block
        return [zlib.crc32(mv[i : i + bs]) for i in range(0, len(mv), bs)]

    def on_thread(self, job: Callable[..., Any], *args: Any) -> Any:
        """Run `job(*args)` on the poller thread; its result, or the exception it raised."""
        done: Future[Any] = Future()
        self.jobs.put((job, args, done))
        try:
            return done.result(20)
        except Exception as e:
            return e

    def set_echo(self, metadata: bytes | None) -> None:
        """(On the poller thread.) Echo to the sender of `metadata`; None: stop."""
        if metadata is not None:
            self.transport.add_peer(metadata)
        self.echo = metadata is not None

    def take(self, count: int, timeout: float) -> list:
        with self.cond:
            self.cond.wait_for(lambda: len(self.arrived) >= count, timeout)
            out, self.arrived = self.arrived[:count], self.arrived[count:]
        return out

    def stop(self) -> None:
        self.stopping = True
        self.thread.join(10)


def serve(conn: Connection, kind: str, name: str, nbytes: int, guard: int, options: dict) -> None:
    from rapidkv.kvt.transport import create_transport

    buf = np.full(nbytes + 2 * guard, FILL, dtype=np.uint8)
    region = buf[guard : guard + nbytes]
    try:
        transport = create_transport(kind, name, **options)
        transport.register_memory([(region.ctypes.data, nbytes)])
    except Exception as e:  # report it to the parent instead of a bare EOF
        conn.send(RuntimeError(f"peer {name} ({kind}) failed to start: {e!r}"))
        return
    receiver = _Receiver(transport, region)
    conn.send({"metadata": transport.local_metadata(), "base": region.ctypes.data})
    while True:
        cmd, *args = conn.recv()
        if cmd == "reset":
            with receiver.cond:
                receiver.block = 0
                receiver.echo = False
                buf[:] = FILL
                receiver.arrived.clear()
            conn.send(None)
        elif cmd == "watch":
            receiver.block = args[0]
            conn.send(None)
        elif cmd == "echo":
            conn.send(receiver.on_thread(receiver.set_echo, args[0]))
        elif cmd == "read":
            conn.send(buf.tobytes())
        elif cmd == "notifs":
            conn.send(receiver.take(*args))
        elif cmd == "close":
            receiver.stop()
            transport.close()
            conn.send(None)
            return
        else:
            conn.send(ValueError(f"unknown command {cmd!r}"))


@dataclass
class Peer:
    """Parent-side handle of a peer process (`metadata` and `base` once `ready`)."""

    kind: str
    name: str
    nbytes: int
    guard: int
    process: Any
    conn: Connection
    metadata: bytes = b""
    base: int = 0

    def ready(self, timeout: float = 60.0) -> Peer:
        """Wait for the child's hello (metadata, region base); idempotent."""
        if self.metadata:
            return self
        if not self.conn.poll(timeout):
            self.process.kill()
            raise TimeoutError(f"peer {self.name} ({self.kind}) did not start in {timeout}s")
        hello = self.conn.recv()
        if isinstance(hello, Exception):
            self.process.join(10)
            raise hello
        self.metadata, self.base = hello["metadata"], hello["base"]
        return self

    def call(self, *cmd: Any, timeout: float = 20.0) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer {self.name} did not answer {cmd[0]!r} in {timeout}s")
        reply = self.conn.recv()
        if isinstance(reply, Exception):
            raise reply
        return reply

    def memory(self) -> np.ndarray:
        """The whole buffer, guards included, as it is now."""
        return np.frombuffer(self.call("read"), dtype=np.uint8)

    def freeze(self) -> None:
        """Stop the child (SIGSTOP): alive, but its transport never progresses."""
        os.kill(self.process.pid, signal.SIGSTOP)

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    def stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGCONT)  # in case it is frozen
            with contextlib.suppress(TimeoutError, EOFError, OSError):
                self.call("close", timeout=10)
            self.process.join(10)
            if self.process.is_alive():
                self.kill()
        self.conn.close()


def start_peer(
    kind: str,
    name: str,
    nbytes: int,
    guard: int = 4096,
    options: dict | None = None,
    wait: bool = True,
) -> Peer:
    """Spawn a peer process hosting a transport of `kind` named `name`, built with
    `options`; with wait=False return at once (call `ready` before using it)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(
        target=serve, args=(child, kind, name, nbytes, guard, options or {}), daemon=True
    )
    process.start()
    child.close()
    peer = Peer(kind, name, nbytes, guard, process, parent)
    return peer.ready() if wait else peer


# --- the test process's side ------------------------------------------------------------------


@dataclass
class Sender:
    """The test process's transport and its registered source bytes."""

    t: Transport
    src: np.ndarray
    peers: set[str] = field(default_factory=set)

    @property
    def base(self) -> int:
        return self.src.ctypes.data

    def connect(self, peer: Peer) -> str:
        """A fresh link to `peer` (removes any previous one)."""
        if peer.name in self.peers:
            self.t.remove_peer(peer.name)
        name = self.t.add_peer(peer.metadata)
        self.peers.add(name)
        return name

    def descs(self, peer: Peer, rows: Any) -> np.ndarray:
        """`(src_offset, dst_offset, nbytes)` rows → absolute descriptor rows."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
        return rows + np.array([self.base, peer.base, 0], dtype=np.int64)

    def post(self, peer: Peer, rows: Any) -> int:
        return self.t.post_write(peer.name, self.descs(peer, rows))

    def expected(self, peer: Peer, rows: Any) -> np.ndarray:
        """The peer's buffer (guards included) after `rows` land on a reset peer."""
        out = np.full(peer.nbytes + 2 * peer.guard, FILL, dtype=np.uint8)
        for s, d, n in np.asarray(rows, dtype=np.int64).reshape(-1, 3):
            out[peer.guard + d : peer.guard + d + n] = self.src[s : s + n]
        return out


def wait_all(t: Transport, handles: list[int], timeout: float = 10.0) -> list[XferState]:
    """Poll until no handle is PENDING or the deadline passes; return the states."""
    deadline = time.monotonic() + timeout
    states = {h: XferState.PENDING for h in handles}
    pending = list(handles)
    while pending:
        for h in pending:
            states[h] = t.poll(h)
        pending = [h for h in pending if states[h] is XferState.PENDING]
        if time.monotonic() > deadline:
            break
    return [states[h] for h in handles]


def release_all(t: Transport, handles: list[int]) -> None:
    for h in handles:
        t.release(h)


def assert_written(sender: Sender, peer: Peer, rows: Any) -> None:
    """The peer's whole buffer is what `rows` make of a reset peer."""
    got = peer.memory()
    want = sender.expected(peer, rows)
    bad = np.flatnonzero(got != want)
    assert not len(bad), f"{len(bad)} bytes differ, first at buffer offset {bad[0] - peer.guard}"
