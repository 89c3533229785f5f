"""Hypothesis stateful test of kvt's pure core: the step coordinator and the
completion tracker driven together, as the threaded shell drives them, against
a model of what must be sent and what the destination must end up holding."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rapidkv.kvt.completions import CompletionTracker, Settled, Tracked
from rapidkv.kvt.coordinator import Attach, Send, StepCoordinator, StepState
from rapidkv.kvt.messages import SendDone
from rapidkv.kvt.task import Task

pytestmark = pytest.mark.unit

LAYERS = 3
BLOCK = 4
PEER = "d0"


@dataclass
class Xfer:
    """One request's transfer: `prompt` tokens, sent in chunks in order."""

    xfer_id: str
    prompt: int
    first_dst: int
    next_seen: int = 0  # tokens covered by tasks handed out and not rolled back
    tasks: list[Tracked] = field(default_factory=list)

    def remaining(self) -> int:
        return self.prompt - self.next_seen

    def task(self, tokens: int | None) -> Task:
        """The next chunk: `tokens` full-block tokens, or everything left (None)."""
        last = tokens is None or tokens >= self.remaining()
        new = self.remaining() if last else tokens
        first_block = self.next_seen // BLOCK
        nblocks = -(-new // BLOCK)
        blocks = tuple(range(first_block, first_block + nblocks))
        task = Task(
            xfer_id=self.xfer_id,
            peer=PEER,
            src_blocks=tuple(1000 + b for b in blocks),
            dst_blocks=tuple(self.first_dst + b for b in blocks),
            seen_tokens=self.next_seen,
            new_tokens=new,
            has_last_token=last,
        )
        self.next_seen += new
        return task


class KvtCore(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.coord: StepCoordinator[Tracked] = StepCoordinator(LAYERS)
        self.tracker = CompletionTracker(LAYERS, BLOCK, rank=0)
        self.xfers: dict[str, Xfer] = {}
        self.n_xfers = 0
        self.next_dst = 0
        self.emitted: Counter[tuple[int, int]] = Counter()  # (id(task), layer) -> sends
        self.task_step: dict[int, int] = {}  # id(task) -> step it belongs to (-1: full send)
        self.accepted: list[Tracked] = []
        self.rejected: list[Tracked] = []
        self.sub_ids: dict[int, list[int]] = defaultdict(list)  # step -> accepted substep ids
        self.next_sub: dict[int, int] = defaultdict(lambda: 1)
        self.writes: dict[int, list[tuple[Tracked, int, int]]] = {}
        self.next_write = 0
        self.dst_written: Counter[tuple[int, int]] = Counter()  # (dst block, layer) posted
        self.confirmed: dict[str, set[int]] = defaultdict(set)  # xfer -> tokens' blocks done
        self.done: dict[str, SendDone] = {}
        self.settled_layers: Counter[int] = Counter()  # id(task) -> layers confirmed
        self.layers_ok: dict[int, set[int]] = defaultdict(set)  # id(task) -> layers confirmed
        self.failed: set[str] = set()  # xfers with a failed write

    # -- model helpers ----------------------------------------------------------

    def new_xfer(self, prompt: int) -> Xfer:
        self.n_xfers += 1
        xfer = Xfer(f"x{self.n_xfers}", prompt, self.next_dst)
        self.next_dst += -(-prompt // BLOCK) + 1  # distinct blocks, with a gap
        self.xfers[xfer.xfer_id] = xfer
        return xfer

    def open_xfers(self, *, last: bool) -> list[Xfer]:
        return [
            x
            for x in self.xfers.values()
            if x.remaining() > 0 and x.xfer_id not in self.done and (last or x.remaining() > BLOCK)
        ]

    def register(self, task: Task, step: int) -> Tracked:
        tracked = self.tracker.add_task(task)
        self.xfers[task.xfer_id].tasks.append(tracked)
        self.task_step[id(tracked)] = step
        return tracked

    def roll_back(self, tasks: tuple[Tracked, ...]) -> None:
        """Rejected tasks: the scheduler will hand out the same tokens again."""
        for dones in [self.tracker.discard(tasks)]:
            self.record(dones)
        for tracked in tasks:
            xfer = self.xfers[tracked.task.xfer_id]
            xfer.tasks.remove(tracked)
            xfer.next_seen = min(xfer.next_seen, tracked.task.seen_tokens)
            self.rejected.append(tracked)

    def post(self, sends: list[Send[Tracked]], *, full: bool = False) -> None:
        for send in sends:
            pieces = []
            for tracked in send.tasks:
                step = self.task_step[id(tracked)]
                if full:
                    assert (send.first, send.stop) == (0, LAYERS)
                else:
                    # never before layer_done, only for the current step's tasks
                    assert step == self.coord.step_id
                    assert send.stop <= self.coord.layers_done
                for layer in range(send.first, send.stop):
                    self.emitted[(id(tracked), layer)] += 1
                if self.tracker.live(tracked):
                    pieces.append((tracked, send.first, send.stop))
                    for b in tracked.task.dst_blocks:
                        for layer in range(send.first, send.stop):
                            self.dst_written[(b, layer)] += 1
            if pieces:
                self.tracker.posted(self.next_write, list(pieces))
                self.writes[self.next_write] = pieces
                self.next_write += 1

    def record(self, settled: list[Settled]) -> None:
        for item in settled:
            done = item.done
            assert item.peer == PEER
            assert done.xfer_id not in self.done, f"second SendDone for {done.xfer_id}"
            self.done[done.xfer_id] = done
            xfer = self.xfers[done.xfer_id]
            # tokens whose every layer was confirmed, counted as a prefix
            have = {
                b
                for t in xfer.tasks
                if self.settled_layers[id(t)] == LAYERS
                for b in t.task.dst_blocks
            }
            base = min((t.task.seen_tokens for t in xfer.tasks), default=0)
            prefix = base
            while prefix < xfer.prompt and (xfer.first_dst + prefix // BLOCK) in have:
                prefix = min(xfer.prompt, (prefix // BLOCK + 1) * BLOCK)
            assert done.tokens_sent <= prefix, (done, prefix)
            if done.ok:
                assert done.tokens_sent == xfer.prompt
                assert prefix == xfer.prompt

    # -- rules ------------------------------------------------------------------

    @rule(
        chunks=st.lists(st.tuples(st.booleans(), st.integers(1, 3)), max_size=3),
        new=st.lists(st.integers(1, 14), max_size=2),
    )
    @precondition(lambda self: self.coord.state is not StepState.OPEN)
    def begin_step(self, chunks: list[tuple[bool, int]], new: list[int]) -> None:
        for prompt in new:
            self.new_xfer(prompt)
        step = self.coord.step_id + 1
        tasks = []
        used = set()
        for last, nblocks in chunks:
            candidates = [x for x in self.open_xfers(last=last) if x.xfer_id not in used]
            if not candidates:
                continue
            xfer = candidates[0]
            used.add(xfer.xfer_id)
            tasks.append(self.register(xfer.task(None if last else nblocks * BLOCK), step))
        dropped = self.coord.begin_step(step, tasks)
        self.roll_back(dropped)
        self.accepted.extend(tasks)
        for tracked in self.coord._substeps:  # pending substeps attached now
            for t in tracked:
                self.task_step[id(t)] = step

    @rule()
    @precondition(
        lambda self: self.coord.state is StepState.OPEN and self.coord.layers_done < LAYERS
    )
    def layer_done(self) -> None:
        self.post(self.coord.layer_done(self.coord.layers_done))

    @rule()
    @precondition(
        lambda self: (
            self.coord.state is StepState.OPEN
            and (
                self.coord.layers_done == LAYERS
                or (self.coord.layers_done == 0 and not self.coord._base)
            )
        )
    )
    def freeze(self) -> None:
        step = self.coord.step_id
        complete = self.coord.layers_done == LAYERS
        frozen = self.coord.freeze_step()
        self.roll_back(frozen.dropped)
        ids = self.sub_ids[step]
        if not complete:
            self.sub_ids[step] = ids = []
        assert frozen.ack == (max(ids) if ids else 0)
        assert ids == list(range(1, frozen.ack + 1))
        # every task of a complete step sent every layer exactly once
        for tracked, tstep in list(self.task_step.items()):
            if tstep == step and complete:
                for layer in range(LAYERS):
                    assert self.emitted[(tracked, layer)] == 1

    @rule(
        when=st.sampled_from(["early", "far_early", "current", "late"]), prompt=st.integers(1, 14)
    )
    def attach(self, when: str, prompt: int) -> None:
        cur = self.coord.step_id
        step = {"early": cur + 1, "far_early": cur + 2, "current": cur, "late": cur - 1}[when]
        if step < 0:
            return
        candidates = self.open_xfers(last=True)
        xfer = candidates[-1] if candidates and prompt % 2 else self.new_xfer(prompt)
        tracked = self.register(xfer.task(None), step)
        if step > cur:
            sub = self.next_sub[step]
        elif step == cur and self.coord.state is StepState.OPEN:
            sub = self.coord.ack + 1
        else:
            sub = 1
        result, sends = self.coord.attach_substep(step, sub, [tracked])
        if step > cur:
            assert result is Attach.PENDING and not sends
            self.next_sub[step] += 1
            self.sub_ids[step].append(sub)
        elif step == cur and self.coord.state is StepState.OPEN:
            assert result is Attach.ATTACHED
            self.sub_ids[step].append(sub)
            self.accepted.append(tracked)
            self.post(sends)
        else:
            assert result is Attach.REJECTED and not sends
            self.roll_back((tracked,))

    @rule(prompt=st.integers(1, 14))
    def send_full(self, prompt: int) -> None:
        tracked = self.register(self.new_xfer(prompt).task(None), -1)
        self.accepted.append(tracked)
        self.post(self.coord.send_full([tracked]), full=True)

    @rule(data=st.data(), ok=st.booleans())
    @precondition(lambda self: self.writes)
    def settle_write(self, data: st.DataObject, ok: bool) -> None:
        write_id = data.draw(st.sampled_from(sorted(self.writes)))
        pieces = self.writes.pop(write_id)
        if ok:
            for tracked, first, stop in pieces:
                self.settled_layers[id(tracked)] += stop - first
                self.layers_ok[id(tracked)].update(range(first, stop))
        else:
            self.failed.update(t.task.xfer_id for t, _, _ in pieces)
        self.record(self.tracker.settled(write_id, ok, "" if ok else "injected failure"))

    # -- invariants -------------------------------------------------------------

    @invariant()
    def nothing_sent_twice(self) -> None:
        assert all(n == 1 for n in self.emitted.values())
        assert all(n == 1 for n in self.dst_written.values()), "a block was written twice"

    @invariant()
    def rejected_send_nothing(self) -> None:
        for tracked in self.rejected:
            assert not any(self.emitted[(id(tracked), layer)] for layer in range(LAYERS))

    @invariant()
    def settled_when_all_confirmed(self) -> None:
        for xfer in self.xfers.values():
            if xfer.xfer_id in self.done or not xfer.tasks:
                continue
            complete = xfer.next_seen == xfer.prompt and all(
                self.settled_layers[id(t)] == LAYERS for t in xfer.tasks
            )
            assert not complete, f"{xfer.xfer_id} fully confirmed but no SendDone"

    @invariant()
    def leading_layers_are_those_confirmed_in_order(self) -> None:
        for xfer in self.xfers.values():
            if not self.tracker.is_live(xfer.xfer_id):
                continue
            expected = 0
            if xfer.xfer_id not in self.failed and any(t.has_last_token for t in xfer.tasks):
                leading = []
                for t in xfer.tasks:
                    n = 0
                    while n in self.layers_ok[id(t)]:
                        n += 1
                    leading.append(n)
                expected = min(leading)
            assert self.tracker.leading_layers(xfer.xfer_id, PEER) == expected, xfer.xfer_id


KvtCore.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
test_kvt_core = KvtCore.TestCase
