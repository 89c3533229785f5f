"""Receiver side of one authenticated connection, as a sans-I/O state machine.

The machine keeps a queue of *segments*: buffers the next stream bytes belong in,
in order, each tagged with what it completes. The shell reads with
`recvmsg_into(machine.want())` (a scatter read over the first few segments) and
reports the count with `received(n)`, which returns the events that became true.
A WRITE's payload segments are views straight over registered memory at the
destination, so payload bytes are never copied; one read can fill many
destination blocks and the next frame's header.

Segments by frame::

    header                   16 bytes; completing it parses the frame and queues:
      WRITE n>0              -> table (n rows of dst, nbytes)
      WRITE n=0              -> [Landed] + next header
      NOTIF n>0 / n=0        -> body + next header / [Notif] + next header
    table                    completing it checks every row, then queues the
                             payload views + next header ([Landed] + header if empty)
    last payload view        completing it yields Landed (ack it)
    body                     completing it yields Notif

Rules: every destination row of a WRITE is bounds-checked against the current
`RegionTable` before any of its payload segments is queued, so a request with one
bad row lands nothing. Any other frame kind, an oversized count, or a bad row
raises ProtocolError; the shell must then drop the connection and read no more.
Exactly one header segment is queued at any time.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from rapidkv.kvt.transport.tcp_memory import OutOfBounds, RegionTable, merge_runs
from rapidkv.kvt.transport.tcp_wire import (
    DESC_DTYPE,
    HEADER_SIZE,
    Kind,
    ProtocolError,
    unpack_header,
)

_MAX_WANT_BUFS = 64
_MAX_WANT_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class Landed:
    """Every payload byte of WRITE `req_id` is in registered memory: ack it."""

    req_id: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Notif:
    payload: bytes


Event = Landed | Notif


class _Seg(enum.Enum):
    HEADER = "header"
    TABLE = "table"
    PAYLOAD = "payload"  # not the last view of its WRITE
    LAST = "last payload"
    BODY = "notification body"


class Inbound:
    """Parses frames from one sender; see the module docstring."""

    def __init__(
        self, regions: Callable[[], RegionTable], *, max_rows: int, max_notif: int
    ) -> None:
        self._regions = regions
        self._max_rows = max_rows
        self._max_notif = max_notif
        self._header = bytearray(HEADER_SIZE)
        # (buffer still to fill, what it is, request id or None)
        self._segs: deque[tuple[memoryview, _Seg, int]] = deque()
        self._table = np.zeros((0, 2), dtype=DESC_DTYPE)
        self._body = bytearray()
        self._req = 0
        self._nbytes = 0
        self._queue_header()

    @property
    def state(self) -> str:
        """What the next byte belongs to (for logs and tests)."""
        return self._segs[0][1].value

    def want(self) -> list[memoryview]:
        """Buffers for the next bytes, in stream order (the first few segments)."""
        out: list[memoryview] = []
        total = 0
        for view, _, _ in self._segs:
            out.append(view)
            total += len(view)
            if len(out) >= _MAX_WANT_BUFS or total >= _MAX_WANT_BYTES:
                break
        return out

    def received(self, n: int) -> list[Event]:
        """`n` more bytes were read into `want()`'s buffers: advance. ProtocolError
        if the peer broke the protocol (the connection must be dropped)."""
        events: list[Event] = []
        segs = self._segs
        while n:
            view, seg, req = segs[0]
            if n < len(view):
                segs[0] = (view[n:], seg, req)
                break
            n -= len(view)
            segs.popleft()
            if seg is not _Seg.PAYLOAD:
                self._complete(seg, req, events)
        return events

    def _complete(self, seg: _Seg, req: int, events: list[Event]) -> None:
        if seg is _Seg.HEADER:
            self._on_header(events)
        elif seg is _Seg.TABLE:
            self._on_table(events)
        elif seg is _Seg.LAST:  # the next table (which resets _nbytes) comes after it
            events.append(Landed(req, self._nbytes))
        else:
            events.append(Notif(bytes(self._body)))
            self._body = bytearray()

    def _on_header(self, events: list[Event]) -> None:
        kind, count, word = unpack_header(self._header)
        if kind is Kind.WRITE:
            if count > self._max_rows:
                raise ProtocolError(f"WRITE {word} has {count} rows (limit {self._max_rows})")
            self._req = word
            if count == 0:
                events.append(Landed(word, 0))
                self._queue_header()
                return
            self._table = np.empty((count, 2), dtype=DESC_DTYPE)
            self._segs.append((memoryview(self._table).cast("B"), _Seg.TABLE, word))
        elif kind is Kind.NOTIF:
            if count > self._max_notif:
                raise ProtocolError(f"NOTIF of {count} bytes (limit {self._max_notif})")
            if count == 0:
                events.append(Notif(b""))
            else:
                self._body = bytearray(count)
                self._segs.append((memoryview(self._body), _Seg.BODY, 0))
            self._queue_header()
        else:
            raise ProtocolError(f"unexpected {kind.name} frame after the handshake")

    def _on_table(self, events: list[Event]) -> None:
        dst, lens = self._table[:, 0], self._table[:, 1]
        keep = lens != 0
        dst, lens = dst[keep], lens[keep]
        regions = self._regions()
        try:
            regions.locate(dst, lens)  # every row as sent, before any merging
            dst, lens = merge_runs(dst, lens)  # fewer, larger buffers
            views = regions.views(dst, lens)
        except OutOfBounds as e:
            raise ProtocolError(f"WRITE {self._req}: {e}") from None
        self._nbytes = int(lens.sum())
        if not views:
            events.append(Landed(self._req, 0))
        else:
            for view in views[:-1]:
                self._segs.append((view, _Seg.PAYLOAD, self._req))
            self._segs.append((views[-1], _Seg.LAST, self._req))
        self._queue_header()

    def _queue_header(self) -> None:
        self._segs.append((memoryview(self._header), _Seg.HEADER, 0))
