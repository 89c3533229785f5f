"""The interface every kvt transport implements.

Theory of operation
-------------------
A transport belongs to one worker. It knows the worker's registered memory
(regions of KV cache), publishes an opaque metadata blob that a peer passes to
`add_peer`, and performs one-sided WRITEs from local registered memory into a
peer's registered memory. It also carries small notifications (the SendDone of a
finished transfer) that are delivered to the peer after every write posted
before them *and confirmed DONE* has landed.

Rules
-----
- Every method is called from one thread, the thread that owns the transport
  (kvt's sender thread), except `take_notifs`, which the receiving side may call
  from its own polling thread, and `close`.
- `poll` also drives progress: a transport never needs a thread of its own to
  finish a write once the owner keeps polling (a transport may still run one,
  e.g. an asyncio loop for TCP).
- A receiving transport must be progressed too: its owner or polling thread
  calls `take_notifs` regularly, also while it expects nothing. NIXL without a
  progress thread answers a new writer's connection setup only then: until the
  receiver progresses once, that writer's first write stays PENDING.
- A write is DONE only when the transport knows the bytes are in the peer's
  memory; ERROR when it knows they may not be. A transfer that never resolves is
  the caller's to time out (`abort`), never the transport's to hang on.
- Nothing here may abort the hosting process: errors are states or exceptions.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np


class XferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    ERROR = "error"


class TransportError(RuntimeError):
    """A transport call failed (bad peer, bad address, peer gone)."""


class Transport(ABC):
    name: str

    @abstractmethod
    def register_memory(self, regions: Sequence[tuple[int, int]]) -> None:
        """Register local memory regions `(base_address, nbytes)`: the only memory
        writes may come from (as source) or land in (as destination)."""

    @abstractmethod
    def local_metadata(self) -> bytes:
        """Opaque blob a peer passes to `add_peer` to reach this transport."""

    @abstractmethod
    def add_peer(self, metadata: bytes) -> str:
        """Connect to the peer described by `metadata`; return its name."""

    @abstractmethod
    def remove_peer(self, peer: str) -> None:
        """Forget a peer; its pending writes become ERROR."""

    @abstractmethod
    def post_write(self, peer: str, descs: np.ndarray) -> int:
        """Start one transfer: `descs` is an int64 array of shape (n, 3), rows of
        `(local_src_addr, remote_dst_addr, nbytes)`. Returns a handle."""

    @abstractmethod
    def poll(self, handle: int) -> XferState:
        """Progress and report the state of a posted write."""

    @abstractmethod
    def release(self, handle: int) -> None:
        """Forget a handle (DONE, ERROR, or given up on after a timeout)."""

    @abstractmethod
    def send_notif(self, peer: str, payload: bytes) -> None:
        """Send a small message to `peer`, delivered after every write to that
        peer that was confirmed DONE before this call."""

    @abstractmethod
    def take_notifs(self) -> list[tuple[str, bytes]]:
        """Receiving side: notifications that arrived since the last call, as
        `(peer_name, payload)`, in arrival order per peer."""

    @abstractmethod
    def close(self) -> None:
        """Release every resource; pending writes are abandoned."""
