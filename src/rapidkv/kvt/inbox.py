"""`Inbox`: a worker's receiving side, the notifications source workers send it.

The owner thread of a `KvtWorker` (which makes every transport call) hands it
each batch the transport collected (`collect`); any thread takes what is due:

- `SendDone`s, gathered over every source rank that writes this one
  (`kvt.gather`): one combined `SendDone` per transfer, handed out once by
  `take` (and signalled to `wait`);
- `LayersLanded`: the leading layers of a transfer in place (`landed`), until
  the transfer is forgotten (`forget`).

A notification that does not decode is logged and dropped; nothing raises
into the owner thread for a peer's bad bytes. Thread-safe: one lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Protocol

import msgspec

from rapidkv.kvt.gather import Gather
from rapidkv.kvt.messages import LayersLanded, SendDone, decode_notif

log = logging.getLogger(__name__)

LANDED_MEMORY = 4096  # transfers whose LayersLanded a receiving worker remembers


class ReceivedCounters(Protocol):
    received_ok: int
    received_failed: int


class Inbox:
    def __init__(self, rank: int, stats: ReceivedCounters) -> None:
        self.rank = rank
        self.stats = stats  # received_ok / received_failed counted here
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._received: list[SendDone] = []
        self._gather = Gather(LANDED_MEMORY)

    def collect(self, notifs: Sequence[tuple[str, bytes]]) -> None:
        """(peer, payload) pairs the transport collected (owner thread)."""
        received: list[SendDone] = []
        landed: list[LayersLanded] = []
        for peer, payload in notifs:
            try:
                msg = decode_notif(payload)
            except (msgspec.DecodeError, ValueError) as e:
                log.warning("kvt rank %d: bad notification from %s: %s", self.rank, peer, e)
                continue
            (landed if isinstance(msg, LayersLanded) else received).append(msg)
        with self._lock:
            for msg in landed:
                self._gather.landed(msg)
            for msg in received:
                whole = self._gather.send_done(msg)  # None: other source ranks still owe one
                if whole is None:
                    continue
                if whole.ok:
                    self.stats.received_ok += 1
                else:
                    self.stats.received_failed += 1
                self._received.append(whole)
            if self._received:
                self._event.set()

    def take(self) -> list[SendDone]:
        """SendDones gathered since the last call."""
        with self._lock:
            out, self._received = self._received, []
            self._event.clear()
        return out

    def wait(self, timeout: float) -> bool:
        """Block until a SendDone is available or `timeout` passes."""
        return self._event.wait(timeout)

    def landed(self, xfer_id: str) -> int:
        """Leading layers of `xfer_id` that every source rank said are in place."""
        with self._lock:
            return self._gather.layers(xfer_id)

    def forget(self, xfer_ids: Sequence[str]) -> None:
        with self._lock:
            for xfer_id in xfer_ids:
                self._gather.forget(xfer_id)
