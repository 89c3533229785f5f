"""A transport in a second process, for the transport conformance tests.

The child (`serve`, started with multiprocessing *spawn*) builds one transport of
the requested kind, owns a buffer laid out as ``guard | region | guard``,
registers only the region, and answers commands from the parent over a Pipe.
The guards are ordinary memory next to the region: a write that escapes the
region's bounds lands there and is seen by the parent.

Like a receiving worker, the child polls `take_notifs` all the time on a thread
of its own (some transports need the receiver to progress, e.g. NIXL without a
progress thread). For each notification it records (peer, payload, crcs): crcs
are the CRC-32 of every block of the region the moment it was taken, if a block
size is being watched.

Commands (parent -> child), answered with one message each:
  ("reset",)                  fill the whole buffer with FILL, forget notifications,
                              stop watching
  ("watch", bs)               snapshot `bs`-byte block CRCs at each notification
  ("read",)                   bytes of the whole buffer (guards included)
  ("notifs", count, timeout)  the first `count` notifications not yet returned,
                              waiting up to `timeout` seconds (fewer if it passes)
  ("close",)                  close the transport and exit
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import threading
import time
import zlib
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

FILL = 0xEE


class _Receiver:
    """The child's notification poller (a thread) and what it has seen."""

    def __init__(self, transport: Any, region: np.ndarray) -> None:
        self.transport = transport
        self.region = region
        self.block = 0
        self.arrived: list[tuple[str, bytes, list[int] | None]] = []
        self.cond = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping:
            got = self.transport.take_notifs()
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
    conn.send(
        {"metadata": transport.local_metadata(), "base": region.ctypes.data, "pid": os.getpid()}
    )
    while True:
        cmd, *args = conn.recv()
        if cmd == "reset":
            with receiver.cond:
                receiver.block = 0
                buf[:] = FILL
                receiver.arrived.clear()
            conn.send(None)
        elif cmd == "watch":
            receiver.block = args[0]
            conn.send(None)
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
    """Parent-side handle of a peer process."""

    kind: str
    name: str
    nbytes: int
    guard: int
    metadata: bytes
    base: int
    process: Any
    conn: Connection

    def call(self, *cmd: Any, timeout: float = 20.0) -> Any:
        self.ask(*cmd)
        return self.answer(timeout)

    def ask(self, *cmd: Any) -> None:
        """Send a command without waiting (the child works on it meanwhile)."""
        self.conn.send(cmd)

    def answer(self, timeout: float = 20.0) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer {self.name} did not answer in {timeout}s")
        reply = self.conn.recv()
        if isinstance(reply, Exception):
            raise reply
        return reply

    def memory(self) -> np.ndarray:
        """The whole buffer, guards included, as it is now."""
        return np.frombuffer(self.call("read"), dtype=np.uint8)

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    def stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(TimeoutError, EOFError, OSError):
                self.call("close", timeout=10)
            self.process.join(10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(10)
        self.conn.close()


def start_peer(
    kind: str, name: str, nbytes: int, guard: int = 4096, options: dict | None = None
) -> Peer:
    """Spawn a peer process hosting a transport of `kind` named `name`."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(
        target=serve, args=(child, kind, name, nbytes, guard, options or {}), daemon=True
    )
    process.start()
    child.close()
    if not parent.poll(60):
        process.kill()
        raise TimeoutError(f"peer {name} ({kind}) did not start")
    hello = parent.recv()
    if isinstance(hello, Exception):
        process.join(10)
        raise hello
    return Peer(kind, name, nbytes, guard, hello["metadata"], hello["base"], process, parent)
