"""`Sequencer`: one publisher's batches in, batches to apply in seq order out.

Pure: it owns no socket. The shell tells it what arrived and what happened to
the link; it answers with `Step`s: `Apply` a batch, `Forget` what is held, or
`AskReplay` from a seq.

Theory of operation
-------------------
vLLM numbers its batches 0, 1, 2, ... from the start of the publishing
process and keeps the last `buffer_steps` of them for replay. Batches arrive
live (PUB/SUB: in order, but any may be lost at a high-water mark or while
the link is down) and from replays (in order, from the requested seq to the
newest, then an end marker). The sequencer applies batches strictly in seq
order and tells three kinds of trouble apart:

- a gap (a batch beyond `next_seq` arrives): the batch waits in `ahead` and a
  replay is asked for; batches fill the gap as they come;
- a duplicate (a seq already applied, the same payload digest): dropped;
- another publisher (a seq already applied with another digest, or a seq
  older than the digests kept): the instance restarted; everything is
  forgotten (`Forget(full=True)`) and the new publisher is followed from 0.

Every replay re-reads the *anchor*, the last batch applied, and compares its
digest: the same digest proves the replay comes from the publisher we followed
(vLLM's `ts` makes every payload unique); another digest, a replay that starts
after the anchor, or a replay that ends without it (or times out) means the
publisher cannot be shown to be the same one, and everything is forgotten.
While a replay is verifying, nothing is applied. A replay that starts after
`next_seq` without an anchor to check, or one that ends with the gap still
open and no progress made, cannot fill the gap: what is held is forgotten
(`Forget(full=False)`) and the sequencer resumes at the first seq it has.

The link: after `disconnected` nothing is applied; `connected` drops what
waits in `ahead` and asks for a verifying replay (the first connect asks for
a replay from 0, the catch-up). Without a replay endpoint (`can_replay=False`)
a gap is forgotten at once and a reconnect forgets everything.

Invariants (tests/router/test_kvindex_stateful.py):
- `Apply` steps come in strictly increasing seq order with no seq skipped
  between two of them, unless a `Forget` lies between; every `Forget(full=True)`
  restarts the order at the new publisher's seqs.
- `last` (the anchor) is None or ``last[0] == next_seq - 1``: a batch applied
  right before `next_seq`; a skip over a gap leaves no anchor until the next
  batch is applied.
- `synced` (link up, no replay outstanding, nothing waiting) is the only state
  in which the caller may answer queries from what was applied.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

PENDING_CAP = 4096
"""Batches waiting beyond a gap; beyond it the farthest are dropped (a replay
brings them again)."""


@dataclass(frozen=True, slots=True)
class Batch:
    """A batch as received: its seq, its payload's digest, and what the caller
    made of the payload (opaque here)."""

    seq: int
    digest: bytes
    body: Any


@dataclass(frozen=True, slots=True)
class Apply:
    batch: Batch


@dataclass(frozen=True, slots=True)
class Forget:
    """Drop what is held (`full`: translations too); resume at `resume_seq`."""

    reason: str
    full: bool
    resume_seq: int


@dataclass(frozen=True, slots=True)
class AskReplay:
    start_seq: int
    token: int


Step = Apply | Forget | AskReplay


@dataclass(slots=True)
class _Replay:
    token: int
    start_seq: int
    anchor: tuple[int, bytes] | None  # still to verify
    progress_at_ask: int
    started: bool = False


class Sequencer:
    """Seq bookkeeping for one publisher (see the module's theory of operation)."""

    def __init__(
        self, *, can_replay: bool = True, pending_cap: int = PENDING_CAP, window: int = 0
    ) -> None:
        self.can_replay = can_replay
        self.pending_cap = pending_cap
        self.window = window or 2 * pending_cap  # digests of applied batches kept
        self.next_seq = 0
        self.last: tuple[int, bytes] | None = None
        self.link_up = False
        self.counts: Counter[str] = Counter()
        self._recent: OrderedDict[int, bytes] = OrderedDict()
        self._ahead: dict[int, Batch] = {}
        self._replay: _Replay | None = None
        self._token = 0

    @property
    def synced(self) -> bool:
        return self.link_up and self._replay is None and not self._ahead

    def connected(self) -> list[Step]:
        """The link to the publisher is (again) up."""
        self.link_up = True
        self._ahead.clear()
        if self.can_replay:
            return [self._ask()]
        if self.last is None:
            return []
        return self._new_publisher("reconnected, and no replay endpoint to verify the publisher")

    def disconnected(self) -> list[Step]:
        self.link_up = False
        return []

    def restarted(self, reason: str) -> list[Step]:
        """The instance is known to be a new process (a new identity)."""
        steps = self._new_publisher(reason)
        if self.link_up and self.can_replay:
            steps.append(self._ask())
        return steps

    def live(self, batch: Batch) -> list[Step]:
        """A batch from the PUB socket."""
        self._hold(batch)
        return self._progress()

    def replayed(self, token: int, batch: Batch) -> list[Step]:
        """A batch from the replay asked for with `token`."""
        replay = self._replay
        if replay is None or token != replay.token or batch.seq < replay.start_seq:
            self.counts["replay_stale"] += 1
            return []
        steps: list[Step] = []
        if not replay.started:
            replay.started = True
            if replay.anchor is not None:
                anchor_seq, anchor_digest = replay.anchor
                if batch.seq == anchor_seq and batch.digest == anchor_digest:
                    replay.anchor = None
                    return self._progress()
                why = "differs from" if batch.seq == anchor_seq else "starts after"
                steps = self._new_publisher(f"replay {why} the last batch applied ({anchor_seq})")
                return [*steps, self._ask()] if self.link_up else steps
            if batch.seq > self.next_seq:
                steps.append(self._skip_to(batch.seq, f"replay starts at {batch.seq}"))
        self._hold(batch)
        return steps + self._progress()

    def replay_ended(self, token: int) -> list[Step]:
        """The replay asked for with `token` ended (end marker or timeout)."""
        replay = self._replay
        if replay is None or token != replay.token:
            return []
        self._replay = None
        if replay.anchor is not None:
            return self._new_publisher("replay ended without the last batch applied")
        steps: list[Step] = []
        if self._gap() and self.next_seq == replay.progress_at_ask:
            first = min(self._ahead)
            steps.append(self._skip_to(first, f"replay did not reach {first - 1}"))
        return steps + self._progress()

    # ------------------------------------------------------------------ internals

    def _gap(self) -> bool:
        return bool(self._ahead) and min(self._ahead) > self.next_seq

    def _verifying(self) -> bool:
        return self._replay is not None and self._replay.anchor is not None

    def _hold(self, batch: Batch) -> None:
        """Keep `batch` until its turn; at the cap, the farthest batch goes (the
        nearest are the ones that let the sequencer progress)."""
        if batch.seq not in self._ahead and len(self._ahead) >= self.pending_cap:
            self.counts["dropped_pending_cap"] += 1
            farthest = max(self._ahead)
            if batch.seq > farthest:
                return
            del self._ahead[farthest]
        self._ahead[batch.seq] = batch

    def _progress(self) -> list[Step]:
        """Apply what can be applied; ask for a replay if a gap remains."""
        steps: list[Step] = []
        while self.link_up and not self._verifying() and self._ahead:
            seq = min(self._ahead)
            if seq > self.next_seq:
                if self._replay is not None:
                    break
                if self.can_replay:
                    steps.append(self._ask())
                    break
                steps.append(self._skip_to(seq, "gap, and no replay endpoint"))
                continue
            batch = self._ahead.pop(seq)
            if seq == self.next_seq:
                steps.append(self._apply(batch))
            elif self._recent.get(seq) == batch.digest:
                self.counts["duplicates"] += 1
            else:
                steps += self._new_publisher(f"batch {seq} is not the one applied: seq restarted")
                self._ahead[seq] = batch
        return steps

    def _apply(self, batch: Batch) -> Apply:
        self.last = (batch.seq, batch.digest)
        self.next_seq = batch.seq + 1
        self._recent[batch.seq] = batch.digest
        while len(self._recent) > self.window:
            self._recent.popitem(last=False)
        self.counts["applied"] += 1
        return Apply(batch)

    def _ask(self) -> AskReplay:
        self._token += 1
        anchor = self.last
        start = anchor[0] if anchor is not None else self.next_seq
        self._replay = _Replay(self._token, start, anchor, self.next_seq)
        self.counts["replays"] += 1
        return AskReplay(start, self._token)

    def _skip_to(self, seq: int, reason: str) -> Forget:
        self.next_seq = seq
        self.last = None
        self.counts["gaps_forgotten"] += 1
        return Forget(reason, full=False, resume_seq=seq)

    def _new_publisher(self, reason: str) -> list[Step]:
        self.next_seq = 0
        self.last = None
        self._recent.clear()
        self._ahead.clear()
        self._replay = None
        self.counts["publishers"] += 1
        return [Forget(reason, full=True, resume_seq=0)]
