"""Instance choice: least outstanding requests, ties served in turn."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rapidkv.router.fleet.balance import LeastOutstanding

pytestmark = pytest.mark.unit


def test_equal_loads_are_served_round_robin() -> None:
    b = LeastOutstanding(3)
    picks = []
    for _ in range(6):
        i = b.acquire()
        picks.append(i)
        b.release(i)
    assert picks == [0, 1, 2, 0, 1, 2]


def test_the_least_loaded_instance_is_picked() -> None:
    b = LeastOutstanding(3)
    assert [b.acquire() for _ in range(3)] == [0, 1, 2]  # 1 each
    b.release(1)  # 1 now has the fewest
    assert b.acquire() == 1
    assert b.acquire() == 2  # all at 1 again: the turn passes to the one after 1
    assert [b.outstanding(i) for i in range(3)] == [1, 1, 2]
    assert b.acquire() == 0


def test_a_busy_instance_is_skipped_until_the_others_catch_up() -> None:
    b = LeastOutstanding(2)
    first = b.acquire()  # long request stays outstanding on 0
    assert first == 0
    picks = []
    for _ in range(3):
        i = b.acquire()
        picks.append(i)
        b.release(i)
    assert picks == [1, 1, 1]


def test_releasing_more_than_acquired_is_a_bug() -> None:
    b = LeastOutstanding(2)
    with pytest.raises(ValueError, match="no outstanding"):
        b.release(0)
    with pytest.raises(ValueError):
        LeastOutstanding(-1)


def test_an_instance_added_later_is_picked_while_it_has_the_fewest_requests() -> None:
    b = LeastOutstanding(0)
    with pytest.raises(ValueError, match="no eligible"):
        b.acquire()
    assert b.add() == 0
    assert b.acquire() == 0
    assert b.add() == 1
    assert b.outstanding(1) == 0
    assert b.acquire() == 1  # 0 has one outstanding
    assert len(b) == 2


@given(
    n=st.integers(1, 5),
    ops=st.lists(st.one_of(st.none(), st.integers(0, 100)), max_size=200),
)
def test_every_pick_has_the_fewest_outstanding(n: int, ops: list[int | None]) -> None:
    """None acquires; an integer k releases the (k mod len)-th outstanding request."""
    b = LeastOutstanding(n)
    held: list[int] = []
    for op in ops:
        if op is None or not held:
            before = [b.outstanding(i) for i in range(n)]
            i = b.acquire()
            assert before[i] == min(before)
            held.append(i)
        else:
            b.release(held.pop(op % len(held)))
        assert [b.outstanding(i) for i in range(n)] == [held.count(i) for i in range(n)]


def test_only_eligible_instances_are_picked() -> None:
    b = LeastOutstanding(3)
    assert [b.acquire([0, 2]) for _ in range(4)] == [0, 2, 0, 2]
    assert b.outstanding(1) == 0
    assert b.acquire() == 1  # the least loaded of all
    with pytest.raises(ValueError):
        b.acquire([])


def test_instance_health_marks_down_until_marked_up() -> None:
    from rapidkv.router.fleet.health import InstanceHealth

    h = InstanceHealth(3)
    assert h.up() == [0, 1, 2] and h.down(1) is None
    assert h.mark_down(1, "refused") is True
    assert h.mark_down(1, "reset") is False  # the first reason is kept
    assert h.down(1) == "refused"
    assert h.up() == [0, 2] and not h.is_up(1)
    assert h.mark_up(1) is True and h.mark_up(1) is False
    assert h.up() == [0, 1, 2]
    with pytest.raises(IndexError):
        h.mark_down(3, "x")


def test_hold_counts_a_chosen_instance_without_moving_the_turn() -> None:
    b = LeastOutstanding(2)
    b.hold(1)
    assert [b.outstanding(i) for i in range(2)] == [0, 1]
    b.release(1)
    b.hold(0)
    b.release(0)
    assert [b.acquire(), b.acquire()] == [0, 1]  # the turn still starts at 0
    with pytest.raises(IndexError):
        b.hold(2)
