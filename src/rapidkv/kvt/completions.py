"""The completion tracker: a pure state machine turning confirmed writes into
`SendDone` messages. It owns no threads, sockets or memory.

Theory of operation
-------------------
The shell registers each task it may send (`add_task`), tells the tracker about
each write it posts (`posted`: which layers of which tasks one transport request
carries) and about each write's outcome (`settled`). A transfer goes to one
or more destination peers (a destination of another TP size may take its KV
heads from several source ranks, and a source rank may send to several of its
ranks: `kvt.head_map`); the tracker keeps each `(xfer_id, peer)` apart, and
that is what *settles* on this rank, when

- ok:    a task with the last token is registered and every layer of every
         registered task of the transfer is confirmed written; or
- error: some write of it failed (or was given up on) and no write of it is
         still outstanding, so nothing more can land.

Settling emits one `SendDone` (ok or error) for that peer and forgets it;
later tasks of the transfer for that peer are refused (`add_task` raises) so it
cannot be reopened. `fail(xfer_id)` gives up on the transfer to every peer.

Invariants (proved by tests/kvt/test_coordinator_stateful.py)
----------
- A destination block appears in at most one task per peer among live
  transfers: no block is written twice, no two writes to one block in flight.
- `tokens_sent` is the end of the longest run of fully confirmed tasks that
  starts where the transfer's first task starts (what the destination had
  before: its prefix-cache hits); it never exceeds what arrived.
- Each `(xfer_id, peer)` emits exactly one `SendDone`, after its last
  outstanding write to that peer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from rapidkv.kvt.messages import SendDone
from rapidkv.kvt.task import InvalidTask, Task, validate_task


@dataclass(eq=False)
class Tracked:
    """A registered task and its progress; identity is the object itself."""

    task: Task
    confirmed: int = 0  # bit i set: layer i confirmed written

    @property
    def confirmed_layers(self) -> int:
        return self.confirmed.bit_count()

    @property
    def leading_layers(self) -> int:
        """Layers 0 .. n-1 all confirmed: n."""
        return (~self.confirmed & (self.confirmed + 1)).bit_length() - 1

    @property
    def has_last_token(self) -> bool:
        return self.task.has_last_token


def _key(tracked: Tracked) -> tuple[str, str]:
    return (tracked.task.xfer_id, tracked.task.peer)


@dataclass(frozen=True)
class Settled:
    """A transfer settled on this rank: `done` goes to the destination `peer`."""

    peer: str
    done: SendDone


@dataclass
class _Transfer:
    peer: str
    tasks: list[Tracked] = field(default_factory=list)
    outstanding: int = 0  # posted writes not yet settled
    error: str = ""


class CompletionTracker:
    FINISHED_MEMORY = 4096  # settled xfer ids remembered to refuse late tasks

    def __init__(self, num_layers: int, block_size: int, rank: int) -> None:
        self.num_layers = num_layers
        self.block_size = block_size
        self.rank = rank
        self._xfers: dict[tuple[str, str], _Transfer] = {}  # (xfer id, peer) ->
        self._peers_of: dict[str, set[str]] = {}  # xfer id -> its peers among _xfers
        self._busy: dict[str, set[int]] = {}  # peer -> dst blocks of live transfers
        # (xfer id, peer) -> settled ok
        self._finished: OrderedDict[tuple[str, str], bool] = OrderedDict()
        # write id -> (task, first layer, stop layer) it carries
        self._writes: dict[int, list[tuple[Tracked, int, int]]] = {}

    # -- events ---------------------------------------------------------------

    def add_task(self, task: Task) -> Tracked:
        """Register a task before it is handed to the coordinator."""
        validate_task(task, self.block_size)
        key = (task.xfer_id, task.peer)
        if key in self._finished:
            raise InvalidTask(
                f"xfer {task.xfer_id} to {task.peer} already settled on rank {self.rank}"
            )
        busy = self._busy.setdefault(task.peer, set())
        clash = busy.intersection(task.dst_blocks)
        if clash:
            raise InvalidTask(
                f"xfer {task.xfer_id}: destination blocks {sorted(clash)[:8]} of peer "
                f"{task.peer} are already being written"
            )
        busy.update(task.dst_blocks)
        tracked = Tracked(task)
        self._xfers.setdefault(key, _Transfer(task.peer)).tasks.append(tracked)
        self._peers_of.setdefault(task.xfer_id, set()).add(task.peer)
        return tracked

    def discard(self, tasks: Iterable[Tracked]) -> list[Settled]:
        """Forget tasks that will never be sent (rejected substeps)."""
        touched = set()
        for tracked in tasks:
            key = _key(tracked)
            xfer = self._xfers.get(key)
            if xfer is None or tracked not in xfer.tasks:
                continue
            xfer.tasks.remove(tracked)
            self._busy[tracked.task.peer].difference_update(tracked.task.dst_blocks)
            if not xfer.tasks and not xfer.outstanding and not xfer.error:
                self._forget(key)  # nothing left: as if never seen
            else:
                touched.add(key)
        return [done for k in touched if (done := self._maybe_settle(k))]

    def live(self, tracked: Tracked) -> bool:
        """The task's transfer is still open and has not failed: worth sending."""
        xfer = self._xfers.get(_key(tracked))
        return xfer is not None and not xfer.error

    def posted(self, write_id: int, pieces: list[tuple[Tracked, int, int]]) -> None:
        """A write carrying layers `[first, stop)` of each task was handed to the
        transport."""
        if write_id in self._writes:
            raise ValueError(f"write {write_id} posted twice")
        self._writes[write_id] = pieces
        for key in {_key(t) for t, _, _ in pieces}:
            self._xfers[key].outstanding += 1

    def settled(self, write_id: int, ok: bool, error: str = "") -> list[Settled]:
        """A posted write is confirmed DONE (`ok`) or failed/given up on."""
        pieces = self._writes.pop(write_id)
        keys = {_key(t) for t, _, _ in pieces}
        for tracked, first, stop in pieces:
            if ok:
                tracked.confirmed |= (1 << stop) - (1 << first)
        for key in keys:
            xfer = self._xfers[key]
            xfer.outstanding -= 1
            if not ok and not xfer.error:
                xfer.error = error or "write failed"
        return [done for k in keys if (done := self._maybe_settle(k))]

    def fail(self, xfer_id: str, error: str) -> list[Settled]:
        """Give up on a transfer (aborted, peer gone), to every peer: it settles
        with an error to each once its outstanding writes to it are settled."""
        out = []
        for peer in sorted(self._peers_of.get(xfer_id, ())):
            key = (xfer_id, peer)
            xfer = self._xfers[key]
            xfer.error = xfer.error or error
            done = self._maybe_settle(key)
            if done:
                out.append(done)
        return out

    # -- queries --------------------------------------------------------------

    def live_transfers(self) -> int:
        """Transfers with some peer not settled yet."""
        return len(self._peers_of)

    def settled_ok(self, xfer_id: str, peer: str) -> bool | None:
        """How a transfer to `peer` settled here (None: not among the last
        `FINISHED_MEMORY` settled, or live)."""
        return self._finished.get((xfer_id, peer))

    def is_live(self, xfer_id: str) -> bool:
        """The transfer is registered to some peer and has not settled there yet."""
        return xfer_id in self._peers_of

    def leading_layers(self, xfer_id: str, peer: str) -> int:
        """How many leading layers of the transfer are confirmed at `peer`:
        every registered task's to it, once its task with the last token is
        registered (0 before, or for a transfer not live there)."""
        xfer = self._xfers.get((xfer_id, peer))
        if xfer is None or xfer.error or not any(t.has_last_token for t in xfer.tasks):
            return 0
        return min(t.leading_layers for t in xfer.tasks)

    def outstanding_writes(self) -> int:
        return len(self._writes)

    # -- helpers --------------------------------------------------------------

    def _tokens_confirmed(self, xfer: _Transfer) -> int:
        ordered = sorted(xfer.tasks, key=lambda t: t.task.seen_tokens)
        prefix = ordered[0].task.seen_tokens if ordered else 0
        for tracked in ordered:
            task = tracked.task
            if task.seen_tokens > prefix or tracked.confirmed_layers < self.num_layers:
                break
            prefix = max(prefix, task.end_tokens)
        return prefix

    def _forget(self, key: tuple[str, str]) -> None:
        del self._xfers[key]
        peers = self._peers_of[key[0]]
        peers.discard(key[1])
        if not peers:
            del self._peers_of[key[0]]

    def _maybe_settle(self, key: tuple[str, str]) -> Settled | None:
        xfer_id = key[0]
        xfer = self._xfers[key]
        if xfer.outstanding:
            return None
        if xfer.error:
            done = SendDone(xfer_id, self.rank, self._tokens_confirmed(xfer), False, xfer.error)
        elif any(t.has_last_token for t in xfer.tasks) and all(
            t.confirmed_layers == self.num_layers for t in xfer.tasks
        ):
            done = SendDone(xfer_id, self.rank, self._tokens_confirmed(xfer), True)
        else:
            return None
        self._forget(key)
        for tracked in xfer.tasks:
            self._busy[tracked.task.peer].difference_update(tracked.task.dst_blocks)
        self._finished[key] = done.ok
        while len(self._finished) > self.FINISHED_MEMORY:
            self._finished.popitem(last=False)
        return Settled(xfer.peer, done)
