"""A `NixlTransport` receiver in a second process, for test_transport_nixl.

The child (`serve`, multiprocessing *spawn*) owns a buffer ``guard | region | guard``
filled with FILL, registers only the region, and answers commands from the parent
over a Pipe. While idle it keeps progressing its transport (`take_notifs` every
0.2 ms), as a real receiver's polling thread does; notifications that arrive are
recorded (with the CRC-32 of every `bs`-byte block of the region at that moment,
when `watch` asked for it) or echoed back to their sender (`echo`).

Commands (parent → child), each answered with one message:
  ("reset",)                  fill the buffer with FILL, forget recorded notifications
  ("read",)                   the whole buffer (guards included) as bytes
  ("watch", bs)               from now on record CRCs of `bs`-byte blocks with each notif
  ("echo", md)                load the agent metadata `md` (a sender's) and send every
                              notification back to its sender, unrecorded; md=None: stop
  ("notifs", count, timeout)  wait up to `timeout` s for `count` recorded notifications;
                              the list of (peer, payload, crcs | None)
  ("close",)                  close the transport and exit
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
import zlib
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

FILL = 0xEE
IDLE_POLL = 0.0002  # seconds between two progress calls while no command waits


def serve(conn: Connection, name: str, nbytes: int, guard: int, options: dict) -> None:
    from rapidkv.kvt.transport.nixl import NixlTransport

    buf = np.full(nbytes + 2 * guard, FILL, dtype=np.uint8)
    region = buf[guard : guard + nbytes]
    try:
        t = NixlTransport(name, **options)
        t.register_memory([(region.ctypes.data, nbytes)])
    except Exception as e:
        conn.send(RuntimeError(f"peer {name} failed to start: {e!r}"))
        return
    conn.send({"metadata": t.local_metadata(), "base": region.ctypes.data, "pid": os.getpid()})
    recorded: list[tuple[str, bytes, list[int] | None]] = []
    bs = 0
    echo = False

    def progress() -> None:
        for peer, payload in t.take_notifs():
            if echo:
                t.send_notif(peer, payload)
                continue
            crcs = None
            if bs:
                mv = memoryview(region)
                crcs = [zlib.crc32(mv[i : i + bs]) for i in range(0, nbytes, bs)]
            recorded.append((peer, payload, crcs))

    while True:
        while not conn.poll(IDLE_POLL):
            progress()
        cmd, *args = conn.recv()
        if cmd == "reset":
            progress()
            recorded.clear()
            buf[:] = FILL
            conn.send(None)
        elif cmd == "read":
            conn.send(buf.tobytes())
        elif cmd == "watch":
            bs = int(args[0])
            conn.send(None)
        elif cmd == "echo":
            echo = args[0] is not None
            if echo:
                t.add_peer(args[0])
            conn.send(None)
        elif cmd == "notifs":
            count, timeout = args
            deadline = time.monotonic() + timeout
            while len(recorded) < count and time.monotonic() < deadline:
                progress()
            conn.send(recorded[:count])
            del recorded[:count]
        elif cmd == "close":
            t.close()
            conn.send(None)
            return
        else:
            conn.send(ValueError(f"unknown command {cmd!r}"))


@dataclass
class Peer:
    """Parent-side handle of a peer process (call `ready` before using it)."""

    name: str
    nbytes: int
    guard: int
    process: Any
    conn: Connection
    metadata: bytes = b""
    base: int = 0
    pid: int = 0

    def ready(self, timeout: float = 60.0) -> Peer:
        """Wait for the child's hello (metadata, region base); idempotent."""
        if self.metadata:
            return self
        if not self.conn.poll(timeout):
            self.process.kill()
            raise TimeoutError(f"peer {self.name} did not start in {timeout}s")
        hello = self.conn.recv()
        if isinstance(hello, Exception):
            raise hello
        self.metadata, self.base, self.pid = hello["metadata"], hello["base"], hello["pid"]
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
        os.kill(self.pid, signal.SIGSTOP)

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    def stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGCONT)
            with contextlib.suppress(TimeoutError, EOFError, OSError):
                self.call("close", timeout=10)
            self.process.join(10)
            if self.process.is_alive():
                self.kill()
        self.conn.close()


def start_peer(name: str, nbytes: int, guard: int = 4096, options: dict | None = None) -> Peer:
    """Spawn a peer process named `name` with a `nbytes` region; returns at once."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(
        target=serve, args=(child, name, nbytes, guard, options or {}), daemon=True
    )
    process.start()
    child.close()
    return Peer(name, nbytes, guard, process, parent)
