"""The substep journal: which substeps each worker rank took, and what the
scheduler side must do about the others. Pure: no threads, no I/O.

The scheduler side may attach *substeps* (1, 2, 3, ... per step) to the engine
step in flight; each is sent to every tensor-parallel rank, and each rank's kvt
coordinator accepts substeps 1..k in id order while the step is open and rejects
every later one. At the end of the step every rank reports its *ack*: rank r
accepted exactly substeps 1..ack_r (0: none).

Events:

- `open_substep(N, entries)`  record a substep of step N (before any ack of N);
  each entry is one transfer's tasks plus an opaque undo record of what the
  caller changed when it planned them.
- `ack(N, rank, ack)`         one rank's ack. Once every rank has acked a step
  with substeps, the step is resolved (`Resolution`) and forgotten: substep i is
  *accepted* if i <= min(acks), *rolled back* if i > max(acks) (the caller
  restores the undo record and plans it again), otherwise *resent* to exactly
  the ranks with ack_r < i.

Invariants (proved by tests/connector/test_journal_stateful.py):

- Every (entry, rank) pair is written exactly once if the caller follows the
  resolution: by the rank's acceptance, by a resend to that rank, or by the
  re-planning after a rollback; never two of these.
- Every entry is resolved exactly once; an xfer_id has at most one unresolved
  entry; `len()` counts unresolved entries, so 0 once every step is acked.
- Only steps with substeps hold state; acks of other steps (every step, from
  every rank) leave none. A step is closed to substeps once any rank acked it
  or a later step.
- An illegal event raises `JournalError` and changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

U = TypeVar("U")


class JournalError(RuntimeError):
    """An event that is illegal in the journal's state (a caller bug)."""


@dataclass(frozen=True)
class Entry(Generic[U]):
    """What one substep sends for one transfer."""

    xfer_id: str
    tasks: tuple[Any, ...]
    undo: U  # opaque: what the caller restores on rollback


@dataclass(frozen=True)
class Resolution(Generic[U]):
    """What became of a step's substeps, entries in substep then entry order."""

    step_id: int
    accepted: tuple[Entry[U], ...]  # every rank took it
    rolled_back: tuple[Entry[U], ...]  # no rank took it: undo, plan again
    resend: tuple[tuple[Entry[U], frozenset[int]], ...]  # these ranks must send it again


@dataclass
class _Step(Generic[U]):
    substeps: list[tuple[Entry[U], ...]] = field(default_factory=list)  # substep i at i - 1
    acks: dict[int, int] = field(default_factory=dict)  # rank -> ack


class SubstepJournal(Generic[U]):
    """Substeps of unresolved steps, and the acks they have had so far."""

    def __init__(self, num_ranks: int) -> None:
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        self.num_ranks = num_ranks
        self._steps: dict[int, _Step[U]] = {}  # only steps with substeps
        self._open: dict[str, int] = {}  # xfer_id -> step of its unresolved entry
        self._closed_upto = -1  # highest step id any rank acked

    def open_substep(self, step_id: int, entries: Sequence[Entry[U]]) -> int:
        """Record a substep of step `step_id`; returns its id (1, 2, ... per step)."""
        if step_id <= self._closed_upto:
            raise JournalError(f"step {step_id} is closed (acks up to {self._closed_upto})")
        if not entries:
            raise JournalError("a substep needs at least one entry")
        xfers = [e.xfer_id for e in entries]
        if len(set(xfers)) != len(xfers):
            raise JournalError(f"duplicate xfer_id in one substep: {xfers}")
        if busy := [x for x in xfers if x in self._open]:
            raise JournalError(f"xfer_id already has an unresolved entry: {busy}")
        step = self._steps.setdefault(step_id, _Step())
        step.substeps.append(tuple(entries))
        self._open.update(dict.fromkeys(xfers, step_id))
        return len(step.substeps)

    def ack(self, step_id: int, rank: int, ack: int) -> Resolution[U] | None:
        """Record `rank`'s ack of `step_id`. Returns the step's resolution once
        every rank has acked a step with substeps (the step is then forgotten);
        None while ranks are missing or when the step has no substeps."""
        if not 0 <= rank < self.num_ranks:
            raise JournalError(f"rank {rank} out of range 0..{self.num_ranks - 1}")
        step = self._steps.get(step_id)
        opened = len(step.substeps) if step else 0
        if not 0 <= ack <= opened:
            raise JournalError(f"ack {ack} of step {step_id}: {opened} substeps opened")
        if step and rank in step.acks:
            raise JournalError(f"rank {rank} acked step {step_id} twice")
        self._closed_upto = max(self._closed_upto, step_id)
        if step is None:
            return None
        step.acks[rank] = ack
        if len(step.acks) < self.num_ranks:
            return None
        del self._steps[step_id]
        return self._resolve(step_id, step)

    def _resolve(self, step_id: int, step: _Step[U]) -> Resolution[U]:
        lo, hi = min(step.acks.values()), max(step.acks.values())
        accepted: list[Entry[U]] = []
        rolled_back: list[Entry[U]] = []
        resend: list[tuple[Entry[U], frozenset[int]]] = []
        for i, entries in enumerate(step.substeps, start=1):
            for e in entries:
                del self._open[e.xfer_id]
            if i <= lo:
                accepted.extend(entries)
            elif i > hi:
                rolled_back.extend(entries)
            else:
                ranks = frozenset(r for r, a in step.acks.items() if a < i)
                resend.extend((e, ranks) for e in entries)
        return Resolution(step_id, tuple(accepted), tuple(rolled_back), tuple(resend))

    def open_xfers(self) -> frozenset[str]:
        """xfer_ids with an unresolved entry."""
        return frozenset(self._open)

    def pending_steps(self) -> frozenset[int]:
        """Steps with substeps that still wait for acks (no other step holds state)."""
        return frozenset(self._steps)

    def __len__(self) -> int:
        """Unresolved entries (0: nothing leaked)."""
        return len(self._open)
