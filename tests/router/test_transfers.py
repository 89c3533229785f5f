"""`TransferWatch`: a decode instance whose TransferKVs all fall back is degraded."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rapidkv.router.fleet.transfers import STATES, TransferWatch

pytestmark = pytest.mark.unit


def reading(ok: float, fell_back: float, sent: float = 0) -> dict[str, float]:
    return {"transfer_kv_ok": ok, "recompute_fallbacks": fell_back, "transfer_kv_sent": sent}


def test_every_transfer_falling_back_is_degraded_and_one_success_is_ok() -> None:
    watch = TransferWatch()
    assert watch.observe(0, reading(10, 0)) is None  # a first reading compares nothing
    assert watch.state(0) == "unknown"
    assert watch.observe(0, reading(10, 4)) == "degraded"
    assert watch.observe(0, reading(10, 4)) is None  # idle: the state stays
    assert watch.state(0) == "degraded"
    assert watch.observe(0, reading(11, 9)) == "ok"  # one of six crossed
    assert watch.state(1) == "unknown"


def test_transfers_in_flight_at_a_reading_do_not_make_a_failing_pair_look_ok() -> None:
    """Sent before a reading, fallen back after it: only ends are compared."""
    watch = TransferWatch()
    watch.observe(0, reading(0, 0, sent=0))
    assert watch.observe(0, reading(0, 0, sent=1)) is None  # in flight: nothing ended
    assert watch.observe(0, reading(0, 1, sent=2)) == "degraded"
    assert watch.observe(0, reading(0, 1, sent=2)) is None
    assert watch.observe(0, reading(0, 2, sent=2)) is None  # the last one fell back too
    assert watch.state(0) == "degraded"


def test_a_restart_or_an_unreadable_instance_starts_over() -> None:
    watch = TransferWatch()
    watch.observe(0, reading(10, 0))
    assert watch.observe(0, reading(10, 2)) == "degraded"
    assert watch.observe(0, reading(1, 1)) is None  # counters went down: restarted
    assert watch.state(0) == "degraded"
    assert watch.observe(0, reading(3, 1)) == "ok"
    assert watch.observe(0, None) == "unknown"
    assert watch.observe(0, reading(5, 5)) is None


@given(st.lists(st.one_of(st.none(), st.tuples(st.integers(0, 50), st.integers(0, 50)))))
def test_the_state_follows_the_latest_window_with_transfers(readings: list) -> None:
    watch = TransferWatch()
    last = None
    expected = "unknown"
    for r in readings:
        watch.observe(0, None if r is None else reading(*r))
        if r is None:
            expected, last = "unknown", None
            continue
        grew = last is not None and r[0] >= last[0] and r[1] >= last[1]
        if grew and r != last:
            expected = "ok" if r[0] > last[0] else "degraded"
        last = r
        assert watch.state(0) in STATES
    assert watch.state(0) == expected
