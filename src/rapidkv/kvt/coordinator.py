"""The step/substep coordinator: a pure state machine deciding *when* each layer
of each task may be sent. It owns no threads, sockets or memory.

Theory of operation
-------------------
A worker runs engine steps one after another. Step N computes layers 0..L-1 in
order; after layer i the KV of every request in the step is final for layer i.
The coordinator sees five events and answers each with `Send` actions, one per
batch of (task, layer range) that may now go on the wire:

- `begin_step(N, tasks)`  step N starts; `tasks` are its substep 0. Pending
  substeps that arrived early for N are attached now, in id order; those for
  steps before N that never ran are dropped and returned.
- `layer_done(i)`          layer i of the current step is computed: send layer i
  of every task attached to the step.
- `freeze_step()`          the step is over; no substep can join it any more.
  Returns the ack: the highest substep id whose tasks this step sends in full.
- `attach_substep(N, k, tasks)`  append tasks to step N (from any thread, via
  the shell). Late (N < current, or N current and frozen) -> REJECTED, nothing
  sent. Early (N > current) -> PENDING until `begin_step(N)`. Current and open
  -> ATTACHED: layers already done are sent now, the rest as they finish.
- `send_full(tasks)`       tasks whose KV is complete: send every layer now.

States of the current step: NONE (no step yet) -> OPEN -> FROZEN -> (next
begin) OPEN ... A step with no forward (freeze with no layer done) sends
nothing: its substeps are dropped and the ack is 0, so the scheduler side rolls
them back and schedules them again.

Invariants (proved by tests/kvt/test_coordinator_stateful.py)
----------
- Every layer of every accepted task is sent exactly once; rejected or dropped
  tasks send nothing; no layer goes out before `layer_done` for it, except in
  `send_full`.
- Accepted substep ids of a step are exactly 1..ack. Substeps of a step must
  arrive in id order starting at 1; anything else is a `CoordinatorError`.
- Only tasks carrying the request's last token may be attached as substeps.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar


class HasLastToken(Protocol):
    @property
    def has_last_token(self) -> bool: ...


T = TypeVar("T", bound=HasLastToken)


class CoordinatorError(RuntimeError):
    """An event that is illegal in the coordinator's state (a caller bug)."""


class StepState(enum.Enum):
    NONE = "none"
    OPEN = "open"
    FROZEN = "frozen"


class Attach(enum.Enum):
    ATTACHED = "attached"
    PENDING = "pending"
    REJECTED = "rejected"


@dataclass(frozen=True)
class Send(Generic[T]):
    """Send layers `first <= layer < stop` of each task."""

    tasks: tuple[T, ...]
    first: int
    stop: int


@dataclass(frozen=True)
class Frozen(Generic[T]):
    ack: int  # highest substep id sent in full by this step
    dropped: tuple[T, ...]  # tasks of rejected substeps (step without forward)


@dataclass
class _Pending(Generic[T]):
    next_id: int = 1
    substeps: list[tuple[int, tuple[T, ...]]] = field(default_factory=list)


class StepCoordinator(Generic[T]):
    def __init__(self, num_layers: int) -> None:
        if num_layers <= 0:
            raise ValueError("num_layers must be positive")
        self.num_layers = num_layers
        self.step_id = -1
        self.state = StepState.NONE
        self.layers_done = 0
        self.ack = 0  # highest substep attached to the current step
        self._base: tuple[T, ...] = ()  # substep 0 tasks
        self._substeps: list[tuple[T, ...]] = []  # accepted substeps 1..ack
        self._pending: dict[int, _Pending[T]] = {}

    # -- events ---------------------------------------------------------------

    def begin_step(self, step_id: int, tasks: Sequence[T]) -> tuple[T, ...]:
        """Start step `step_id`. Returns the tasks of pending substeps for earlier
        steps that never ran here (dropped: they count as rejected)."""
        if self.state is StepState.OPEN:
            raise CoordinatorError(f"begin_step({step_id}) while step {self.step_id} is open")
        if step_id <= self.step_id:
            raise CoordinatorError(f"begin_step({step_id}) after step {self.step_id}")
        self.step_id = step_id
        self.state = StepState.OPEN
        self.layers_done = 0
        self.ack = 0
        self._base = tuple(tasks)
        self._substeps = []
        dropped: list[T] = []
        for skipped in [s for s in self._pending if s < step_id]:
            dropped.extend(t for _, sub in self._pending.pop(skipped).substeps for t in sub)
        pending = self._pending.pop(step_id, None)
        if pending:
            self._substeps = [sub for _, sub in pending.substeps]
            self.ack = len(self._substeps)
        return tuple(dropped)

    def layer_done(self, layer: int) -> list[Send[T]]:
        if self.state is not StepState.OPEN:
            raise CoordinatorError(
                f"layer_done({layer}) with step {self.step_id} {self.state.value}"
            )
        if layer != self.layers_done:
            raise CoordinatorError(
                f"layer_done({layer}) out of order in step {self.step_id}: "
                f"expected {self.layers_done}"
            )
        self.layers_done += 1
        tasks = self._base + tuple(t for sub in self._substeps for t in sub)
        return [Send(tasks, layer, layer + 1)] if tasks else []

    def freeze_step(self) -> Frozen[T]:
        if self.state is not StepState.OPEN:
            raise CoordinatorError(f"freeze_step with step {self.step_id} {self.state.value}")
        self.state = StepState.FROZEN
        if self.layers_done == self.num_layers:
            return Frozen(self.ack, ())
        if self.layers_done == 0 and not self._base:
            dropped = tuple(t for sub in self._substeps for t in sub)
            self._substeps = []
            self.ack = 0
            return Frozen(0, dropped)
        raise CoordinatorError(
            f"freeze_step of step {self.step_id} after {self.layers_done}/{self.num_layers} "
            f"layers with {len(self._base)} scheduled tasks"
        )

    def attach_substep(
        self, step_id: int, substep_id: int, tasks: Sequence[T]
    ) -> tuple[Attach, list[Send[T]]]:
        tasks = tuple(tasks)
        if not all(t.has_last_token for t in tasks):
            raise CoordinatorError(
                f"substep {step_id}.{substep_id}: only last-token tasks may be attached"
            )
        if step_id > self.step_id:
            pending = self._pending.setdefault(step_id, _Pending())
            self._expect(step_id, substep_id, pending.next_id)
            pending.next_id += 1
            pending.substeps.append((substep_id, tasks))
            return Attach.PENDING, []
        if step_id < self.step_id or self.state is StepState.FROZEN:
            return Attach.REJECTED, []
        self._expect(step_id, substep_id, self.ack + 1)
        self.ack = substep_id
        self._substeps.append(tasks)
        done = self.layers_done
        return Attach.ATTACHED, ([Send(tasks, 0, done)] if done and tasks else [])

    def send_full(self, tasks: Sequence[T]) -> list[Send[T]]:
        tasks = tuple(tasks)
        return [Send(tasks, 0, self.num_layers)] if tasks else []

    # -- helpers --------------------------------------------------------------

    @staticmethod
    def _expect(step_id: int, substep_id: int, expected: int) -> None:
        if substep_id != expected:
            raise CoordinatorError(
                f"substep {step_id}.{substep_id} out of order: expected {step_id}.{expected}"
            )
