"""The completion tracker: a pure state machine turning confirmed writes into
`SendDone` messages. It owns no threads, sockets or memory.

Theory of operation
-------------------
The shell registers each task it may send (`add_task`), tells the tracker about
each write it posts (`posted`: which layers of which tasks one transport request
carries) and about each write's outcome (`settled`). A transfer (`xfer_id`) is
*settled* on this rank when

- ok:    a task with the last token is registered and every layer of every
         registered task of the transfer is confirmed written; or
- error: some write of it failed (or was given up on) and no write of it is
         still outstanding, so nothing more can land.

Settling emits one `SendDone` (ok or error) for the transfer's destination peer
and forgets the transfer; later tasks for it are refused (`add_task` raises) so
it cannot be reopened. All tasks of a transfer go to one peer.

Invariants (proved by tests/kvt/test_coordinator_stateful.py)
----------
- A destination block appears in at most one task per peer among live
  transfers: no block is written twice, no two writes to one block in flight.
- `tokens_sent` is the end of the longest run of fully confirmed tasks that
  starts where the transfer's first task starts (what the destination had
  before: its prefix-cache hits); it never exceeds what arrived.
- Each transfer emits exactly one `SendDone`, after its last outstanding write.
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
        self._xfers: dict[str, _Transfer] = {}
        self._busy: dict[str, set[int]] = {}  # peer -> dst blocks of live transfers
        self._finished: OrderedDict[str, bool] = OrderedDict()  # xfer id -> settled ok
        # write id -> (task, first layer, stop layer) it carries
        self._writes: dict[int, list[tuple[Tracked, int, int]]] = {}

    # -- events ---------------------------------------------------------------

    def add_task(self, task: Task) -> Tracked:
        """Register a task before it is handed to the coordinator."""
        validate_task(task, self.block_size)
        if task.xfer_id in self._finished:
            raise InvalidTask(f"xfer {task.xfer_id} already settled on rank {self.rank}")
        xfer = self._xfers.get(task.xfer_id)
        if xfer is not None and xfer.peer != task.peer:
            raise InvalidTask(
                f"xfer {task.xfer_id}: task for peer {task.peer}, transfer goes to {xfer.peer}"
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
        self._xfers.setdefault(task.xfer_id, _Transfer(task.peer)).tasks.append(tracked)
        return tracked

    def discard(self, tasks: Iterable[Tracked]) -> list[Settled]:
        """Forget tasks that will never be sent (rejected substeps)."""
        touched = set()
        for tracked in tasks:
            xfer = self._xfers.get(tracked.task.xfer_id)
            if xfer is None or tracked not in xfer.tasks:
                continue
            xfer.tasks.remove(tracked)
            self._busy[tracked.task.peer].difference_update(tracked.task.dst_blocks)
            if not xfer.tasks and not xfer.outstanding and not xfer.error:
                del self._xfers[tracked.task.xfer_id]  # nothing left: as if never seen
            else:
                touched.add(tracked.task.xfer_id)
        return [done for x in touched if (done := self._maybe_settle(x))]

    def live(self, tracked: Tracked) -> bool:
        """The task's transfer is still open and has not failed: worth sending."""
        xfer = self._xfers.get(tracked.task.xfer_id)
        return xfer is not None and not xfer.error

    def posted(self, write_id: int, pieces: list[tuple[Tracked, int, int]]) -> None:
        """A write carrying layers `[first, stop)` of each task was handed to the
        transport."""
        if write_id in self._writes:
            raise ValueError(f"write {write_id} posted twice")
        self._writes[write_id] = pieces
        for xfer_id in {t.task.xfer_id for t, _, _ in pieces}:
            self._xfers[xfer_id].outstanding += 1

    def settled(self, write_id: int, ok: bool, error: str = "") -> list[Settled]:
        """A posted write is confirmed DONE (`ok`) or failed/given up on."""
        pieces = self._writes.pop(write_id)
        xfer_ids = {t.task.xfer_id for t, _, _ in pieces}
        for tracked, first, stop in pieces:
            if ok:
                tracked.confirmed |= (1 << stop) - (1 << first)
        for xfer_id in xfer_ids:
            xfer = self._xfers[xfer_id]
            xfer.outstanding -= 1
            if not ok and not xfer.error:
                xfer.error = error or "write failed"
        return [done for x in xfer_ids if (done := self._maybe_settle(x))]

    def fail(self, xfer_id: str, error: str) -> list[Settled]:
        """Give up on a transfer (aborted, peer gone): it settles with an error
        once its outstanding writes are settled."""
        xfer = self._xfers.get(xfer_id)
        if xfer is None:
            return []
        xfer.error = xfer.error or error
        done = self._maybe_settle(xfer_id)
        return [done] if done else []

    # -- queries --------------------------------------------------------------

    def live_transfers(self) -> int:
        return len(self._xfers)

    def settled_ok(self, xfer_id: str) -> bool | None:
        """How a transfer settled here (None: not among the last
        `FINISHED_MEMORY` settled, or live)."""
        return self._finished.get(xfer_id)

    def is_live(self, xfer_id: str) -> bool:
        """The transfer is registered and has not settled yet."""
        return xfer_id in self._xfers

    def leading_layers(self, xfer_id: str) -> int:
        """How many leading layers of the whole transfer are confirmed at the
        destination: every registered task's, once the task with the last token
        is registered (0 before, or for a transfer not live)."""
        xfer = self._xfers.get(xfer_id)
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

    def _maybe_settle(self, xfer_id: str) -> Settled | None:
        xfer = self._xfers[xfer_id]
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
        del self._xfers[xfer_id]
        for tracked in xfer.tasks:
            self._busy[tracked.task.peer].difference_update(tracked.task.dst_blocks)
        self._finished[xfer_id] = done.ok
        while len(self._finished) > self.FINISHED_MEMORY:
            self._finished.popitem(last=False)
        return Settled(xfer.peer, done)
