"""The bypass channel: the scheduler side hands send tasks to every worker rank
*now*, without waiting for the next engine step.

One channel per worker rank: the worker binds a ZeroMQ PULL socket on an IPC
path in a private (0700) directory and runs a thread that applies each message
to its kvt worker; the scheduler side connects one PUSH socket per rank (the
address travels in `RankInfo.bypass_address`, through vLLM's
`get_handshake_metadata` -> `set_xfer_handshake_metadata`).

Invariants:
- lossless and ordered per rank: PUSH blocks rather than drop, and one socket
  carries every message to a rank, so substeps of a step reach the rank in id
  order (kvt's coordinator requires it);
- nothing from outside the instance reaches it: the socket is a file in a
  directory only this user can enter; messages are size-limited and decoded
  into typed structs, anything else is logged and dropped;
- the step path never overtakes it: every message counts (`BypassSender.sent`,
  the same on every rank since each message goes to all of them); a step's
  metadata carries the count at the time it was built, and the worker waits
  until its bypass thread has applied that many (`wait_applied`) before it acts
  on the step, so a send planned after a bypass send is posted after it;
- the worker thread never raises into the engine: a bad message or a refused
  task is counted and logged. A substep that is not attached is simply not in
  the rank's ack, and the scheduler side rolls it back.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Literal

import msgspec
import zmq

from rapidkv.kvt.task import Task

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20


class Peer(msgspec.Struct, frozen=True):
    """A destination rank to connect to (from a Handshake).

    `generation` grows with every handshake P accepts: a worker applies a
    peer's entry only if it is newer than the one it has (the same peer can
    arrive both with the step metadata and over the bypass channel, and a
    restarted peer's entry replaces its old process's)."""

    instance_id: str
    rank: int
    transport_metadata: bytes
    layout: bytes  # msgspec-encoded kvt Layout
    generation: int = 0


class BypassMsg(msgspec.Struct, frozen=True, kw_only=True):
    """`peers`: connect to these destination ranks (sent when a Handshake is
    accepted, so it precedes every send to them). `full`: send every layer of
    `tasks` now. `substep`: attach `tasks` to step `step_id` as substep
    `substep_id` (kvt `attach_substep`). `recv_over` (D): P answered the
    TransferKV of `xfer_id`, a split prefill's load, so no more of its writes can
    land; `ok`: every layer is in place."""

    kind: Literal["peers", "full", "substep", "recv_over"]
    tasks: list[Task] = []
    peers: list[Peer] = []
    step_id: int = 0
    substep_id: int = 0
    xfer_id: str = ""
    ok: bool = False


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(BypassMsg)


class BypassReceiver:
    """Worker side: binds the rank's socket and applies messages on its thread."""

    def __init__(self, rank: int, apply: Callable[[BypassMsg], None], delay_s: float = 0.0) -> None:
        self.rank = rank
        self._apply = apply
        self._delay_s = delay_s  # testing aid: hold each message this long
        self._dir = tempfile.mkdtemp(prefix="rapidkv-bypass-")  # mode 0700
        self.address = f"ipc://{os.path.join(self._dir, f'rank{rank}.sock')}"
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.address)
        self._stopping = False
        self._applied = 0  # messages taken off the socket and acted on
        self._applied_cond = threading.Condition()
        self._thread = threading.Thread(
            target=self._run, name=f"rapidkv-bypass-{rank}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stopping:
            if not poller.poll(100):
                continue
            try:
                raw = self._sock.recv(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            try:
                self._handle(raw)
            finally:
                with self._applied_cond:
                    self._applied += 1
                    self._applied_cond.notify_all()

    def _handle(self, raw: bytes) -> None:
        try:
            msg = _decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("rapidkv bypass rank %d: bad message dropped: %s", self.rank, e)
            return
        if self._delay_s:
            time.sleep(self._delay_s)
        try:
            self._apply(msg)
        except Exception:
            log.exception("rapidkv bypass rank %d: %s message failed", self.rank, msg.kind)

    def wait_applied(self, count: int, timeout: float) -> bool:
        """Block until `count` messages have been applied; False on timeout."""
        with self._applied_cond:
            return self._applied_cond.wait_for(lambda: self._applied >= count, timeout)

    def close(self) -> None:
        self._stopping = True
        self._thread.join(timeout=2)
        self._sock.close(0)
        try:
            os.unlink(self.address.removeprefix("ipc://"))
            os.rmdir(self._dir)
        except OSError:
            pass


class BypassSender:
    """Scheduler side: one PUSH socket per worker rank. Not thread-safe: the
    caller serializes sends (the scheduler side's lock)."""

    def __init__(self, addresses: dict[int, str]) -> None:
        self.sent = 0  # messages sent (to every rank)
        self._ctx = zmq.Context.instance()
        self._socks: dict[int, zmq.Socket] = {}
        for rank, address in sorted(addresses.items()):
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)  # never drop: queue without bound
            sock.connect(address)
            self._socks[rank] = sock

    def send(self, msg: BypassMsg) -> None:
        """Queue `msg` for every rank (never blocks on a slow rank: no HWM)."""
        raw = _encoder.encode(msg)
        for sock in self._socks.values():
            sock.send(raw)
        self.sent += 1

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(0)
        self._socks.clear()
