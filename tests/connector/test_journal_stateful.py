"""`connector.journal`: following a step's resolution writes every (entry, rank)
pair exactly once; every entry is resolved once; nothing is left behind once every
step is acked; steps without substeps hold no state; illegal events raise
`JournalError` and change nothing."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from rapidkv.connector.journal import Entry, JournalError, Resolution, SubstepJournal

pytestmark = pytest.mark.unit

XFERS = [f"x{i}" for i in range(6)]


class JournalMachine(RuleBasedStateMachine):
    """Steps run one after another; the step in flight gets substeps; when it ends
    each rank freezes at its own point (its ack, 0..opened); acks of all ended
    steps arrive in any order. An entry's undo record is a unique int."""

    @initialize(num_ranks=st.integers(1, 4))
    def init(self, num_ranks: int) -> None:
        self.n = num_ranks
        self.journal: SubstepJournal[int] = SubstepJournal(num_ranks)
        self.step = 0  # the step in flight
        self.substeps: dict[int, list[list[Entry[int]]]] = {}  # unresolved steps with substeps
        self.truth: dict[int, dict[int, int]] = {}  # step -> each rank's freeze point
        self.acked: dict[int, set[int]] = {}  # step -> ranks whose ack was delivered
        self.in_transit: list[tuple[int, int, int]] = []  # (step, rank, ack) not delivered
        self.max_acked = -1
        self.undo_seq = 0
        self.writes: Counter[tuple[int, int]] = Counter()  # (undo, rank) -> times written
        self.resolved: set[int] = set()  # undo records of resolved entries

    def open_xfers(self) -> set[str]:
        return {e.xfer_id for subs in self.substeps.values() for sub in subs for e in sub}

    def entry(self, xfer: str) -> Entry[int]:
        self.undo_seq += 1
        return Entry(xfer, (("task", self.undo_seq),), self.undo_seq)

    @rule(xfers=st.lists(st.sampled_from(XFERS), max_size=3))
    def open_substep(self, xfers: list[str]) -> None:
        entries = [self.entry(x) for x in xfers]
        if not xfers or len(set(xfers)) < len(xfers) or set(xfers) & self.open_xfers():
            with pytest.raises(JournalError):
                self.journal.open_substep(self.step, entries)
            return
        subs = self.substeps.setdefault(self.step, [])
        subs.append(entries)
        assert self.journal.open_substep(self.step, entries) == len(subs)

    @rule(data=st.data())
    def end_step(self, data: st.DataObject) -> None:
        opened = len(self.substeps.get(self.step, []))
        acks = {r: data.draw(st.integers(0, opened), label=f"ack_{r}") for r in range(self.n)}
        self.finish_step(acks)

    def finish_step(self, acks: dict[int, int]) -> None:
        """Each rank wrote the substeps it accepted; its ack is now on its way."""
        for r, a in acks.items():
            for sub in self.substeps.get(self.step, [])[:a]:
                for e in sub:
                    self.writes[e.undo, r] += 1
            self.in_transit.append((self.step, r, a))
        self.truth[self.step] = acks
        self.step += 1

    @precondition(lambda self: self.in_transit)
    @rule(data=st.data())
    def deliver_ack(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.in_transit) - 1), label="which")
        self.deliver(*self.in_transit.pop(i))

    def deliver(self, step: int, rank: int, ack: int) -> None:
        res = self.journal.ack(step, rank, ack)
        self.max_acked = max(self.max_acked, step)
        self.acked.setdefault(step, set()).add(rank)
        if step not in self.substeps or len(self.acked[step]) < self.n:
            assert res is None
            return
        assert res is not None and res.step_id == step
        self.check_resolution(res, self.substeps.pop(step), self.truth[step])

    def check_resolution(
        self, res: Resolution[int], subs: list[list[Entry[int]]], acks: dict[int, int]
    ) -> None:
        everyone = frozenset(range(self.n))
        got = (
            [(e, frozenset()) for e in res.accepted]
            + [(e, everyone) for e in res.rolled_back]  # everyone plans it again
            + list(res.resend)
        )
        undos = [e.undo for e, _ in got]
        want = [e for sub in subs for e in sub]
        assert sorted(undos) == sorted(e.undo for e in want), "each entry resolved once"
        assert not set(undos) & self.resolved, "entry resolved twice"
        self.resolved |= set(undos)
        for e, _ in res.resend:
            took = {r for r in everyone if self.writes[e.undo, r]}
            assert took and took != everyone, "resend of a substep nobody or everybody took"
        for e, again in got:
            for r in again:
                self.writes[e.undo, r] += 1
            for r in everyone:
                assert self.writes[e.undo, r] == 1, (e, r, acks)
        # the same, by category, against the ranks' freeze points
        for i, sub in enumerate(subs, start=1):
            rejected = frozenset(r for r, a in acks.items() if a < i)
            for e in sub:
                if not rejected:
                    assert e in res.accepted
                elif rejected == everyone:
                    assert e in res.rolled_back
                else:
                    assert (e, rejected) in res.resend

    # illegal events: each raises and leaves the journal as it was (see invariants)

    @precondition(lambda self: self.max_acked >= 0)
    @rule(data=st.data())
    def open_closed_step(self, data: st.DataObject) -> None:
        step = data.draw(st.integers(0, self.max_acked), label="closed step")
        with pytest.raises(JournalError):
            self.journal.open_substep(step, [self.entry("fresh")])

    @precondition(lambda self: any(s in self.substeps and rs for s, rs in self.acked.items()))
    @rule(data=st.data())
    def ack_twice(self, data: st.DataObject) -> None:
        step = data.draw(st.sampled_from(sorted(s for s in self.acked if s in self.substeps)))
        rank = data.draw(st.sampled_from(sorted(self.acked[step])))
        with pytest.raises(JournalError):
            self.journal.ack(step, rank, self.truth[step][rank])

    @rule(data=st.data(), excess=st.integers(1, 3))
    def ack_too_high(self, data: st.DataObject, excess: int) -> None:
        step = data.draw(st.integers(0, self.step + 1), label="step")
        opened = len(self.substeps.get(step, []))
        with pytest.raises(JournalError):
            self.journal.ack(step, data.draw(st.integers(0, self.n - 1)), opened + excess)

    @rule(rank=st.sampled_from([-1, 4, 5]))
    def ack_bad_rank(self, rank: int) -> None:
        with pytest.raises(JournalError):
            self.journal.ack(self.step, rank if rank < 0 else self.n + rank - 4, 0)

    @invariant()
    def journal_matches_model(self) -> None:
        assert len(self.journal) == sum(len(sub) for s in self.substeps.values() for sub in s)
        assert self.journal.open_xfers() == self.open_xfers()
        # only steps with unresolved substeps hold state: ack-0 steps leave none
        assert self.journal.pending_steps() == set(self.substeps)

    def teardown(self) -> None:
        # end the step in flight (rank r froze after substep r), deliver everything
        opened = len(self.substeps.get(self.step, []))
        self.finish_step({r: min(r, opened) for r in range(self.n)})
        while self.in_transit:
            self.deliver(*self.in_transit.pop())
        assert len(self.journal) == 0
        assert not self.journal.pending_steps()
        assert self.journal.open_xfers() == frozenset()


TestJournal = JournalMachine.TestCase
TestJournal.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# --- plain cases ---


def e(xfer: str, undo: str = "") -> Entry[str]:
    return Entry(xfer, (xfer,), undo or f"undo-{xfer}")


def test_lagging_rank_gets_the_resend_alone() -> None:
    j: SubstepJournal[str] = SubstepJournal(2)
    assert j.open_substep(7, [e("a")]) == 1
    assert j.open_substep(7, [e("b"), e("c")]) == 2
    assert j.open_substep(7, [e("d")]) == 3
    assert j.ack(7, 1, 1) is None
    res = j.ack(7, 0, 2)
    assert res == Resolution(
        7,
        accepted=(e("a"),),
        rolled_back=(e("d"),),
        resend=((e("b"), frozenset({1})), (e("c"), frozenset({1}))),
    )
    assert len(j) == 0 and not j.pending_steps() and not j.open_xfers()


def test_all_ranks_reject_rolls_back() -> None:
    j: SubstepJournal[str] = SubstepJournal(3)
    j.open_substep(1, [e("a")])
    assert j.open_xfers() == {"a"} and len(j) == 1
    assert j.ack(1, 2, 0) is None and j.ack(1, 0, 0) is None
    assert j.ack(1, 1, 0) == Resolution(1, (), (e("a"),), ())
    assert len(j) == 0
    j.open_substep(2, [e("a")])  # the xfer is free again once resolved


def test_steps_without_substeps_hold_no_state() -> None:
    j: SubstepJournal[str] = SubstepJournal(2)
    for step in range(1000):
        assert j.ack(step, 0, 0) is None
        assert j.ack(step, 1, 0) is None
    assert not j.pending_steps() and len(j) == 0


@pytest.mark.parametrize(
    "event",
    [
        pytest.param(lambda j: j.open_substep(5, []), id="empty substep"),
        pytest.param(lambda j: j.open_substep(5, [e("x")]), id="xfer already open"),
        pytest.param(lambda j: j.open_substep(5, [e("y"), e("y")]), id="xfer twice in one"),
        pytest.param(lambda j: j.open_substep(3, [e("y")]), id="step already acked"),
        pytest.param(lambda j: j.open_substep(2, [e("y")]), id="step older than acked"),
        pytest.param(lambda j: j.ack(5, 2, 0), id="rank too high"),
        pytest.param(lambda j: j.ack(5, -1, 0), id="negative rank"),
        pytest.param(lambda j: j.ack(5, 0, 0), id="rank acks twice"),
        pytest.param(lambda j: j.ack(5, 1, 2), id="ack above opened"),
        pytest.param(lambda j: j.ack(5, 1, -1), id="negative ack"),
        pytest.param(lambda j: j.ack(6, 0, 1), id="ack > 0 without substeps"),
    ],
)
def test_illegal_events_raise_and_change_nothing(event) -> None:
    j: SubstepJournal[str] = SubstepJournal(2)
    j.ack(3, 0, 0)  # step 3 had no substeps: closed all the same
    j.open_substep(5, [e("x")])
    assert j.ack(5, 0, 1) is None
    with pytest.raises(JournalError):
        event(j)
    assert len(j) == 1 and j.open_xfers() == {"x"} and j.pending_steps() == {5}
    assert j.ack(5, 1, 0) == Resolution(5, (), (), ((e("x"), frozenset({1})),))


def test_num_ranks_must_be_positive() -> None:
    with pytest.raises(ValueError):
        SubstepJournal(0)
