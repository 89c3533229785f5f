"""The receiving side of a worker (`kvt.inbox.Inbox`) and the per-transfer
fault plans of a sending one (`kvt.faults.FaultPlans`): pure, no transport."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from rapidkv.kvt.faults import FaultPlans, SendFaults
from rapidkv.kvt.inbox import Inbox
from rapidkv.kvt.messages import LayersLanded, SendDone, encode_notif

pytestmark = pytest.mark.unit


@dataclass
class Counters:
    received_ok: int = 0
    received_failed: int = 0


def test_the_inbox_hands_out_one_send_done_once_every_source_rank_sent_one() -> None:
    counters = Counters()
    inbox = Inbox(0, counters)
    inbox.collect(
        [
            ("p0", encode_notif(LayersLanded("x", 0, 3, sources=2))),
            ("p1", encode_notif(LayersLanded("x", 1, 2, sources=2))),
            ("p0", encode_notif(SendDone("x", 0, 64, True, sources=2))),
            ("p9", b"\xffnot a notification"),  # dropped, logged
        ]
    )
    assert inbox.landed("x") == 2  # the least over the source ranks
    assert inbox.take() == [] and not inbox.wait(0.0)  # rank 1 still owes its SendDone
    inbox.collect([("p1", encode_notif(SendDone("x", 1, 64, False, "write failed", sources=2)))])
    assert inbox.wait(0.0)
    [done] = inbox.take()
    assert (done.xfer_id, done.ok) == ("x", False) and "write failed" in done.error
    assert inbox.take() == [] and not inbox.wait(0.0)
    assert counters == Counters(received_ok=0, received_failed=1)
    inbox.forget(["x"])
    assert inbox.landed("x") == 0


def test_a_waiter_wakes_when_a_send_done_is_collected() -> None:
    counters = Counters()
    inbox = Inbox(0, counters)
    woke = threading.Event()
    t = threading.Thread(target=lambda: inbox.wait(5.0) and woke.set())
    t.start()
    inbox.collect([("p0", encode_notif(SendDone("y", 0, 16, True)))])
    t.join(5.0)
    assert woke.is_set() and counters.received_ok == 1


def piece(xfer_id: str, first: int, stop: int) -> tuple[object, int, int]:
    return (SimpleNamespace(task=SimpleNamespace(xfer_id=xfer_id)), first, stop)


def test_fault_plans_fail_the_piece_with_the_planned_layer_and_hold_delayed_ones() -> None:
    faults = SendFaults(fail_rate=0.5, send_delay_s=0.0)
    ids = [f"t{i}" for i in range(64)]
    failed = [x for x in ids if faults.plan(x, 4)[0] is not None]
    kept = [x for x in ids if faults.plan(x, 4)[0] is None]
    assert failed and kept
    plans = FaultPlans(faults, 4)
    bad, good = failed[0], kept[0]
    layer = faults.plan(bad, 4)[0]
    assert layer is not None
    before = [piece(bad, 0, layer)] if layer else []
    post, failing, held = plans.sort([*before, piece(bad, layer, 4), piece(good, 0, 4)], 0.0)
    assert [p[0].task.xfer_id for p in failing] == [bad] and failing[0][1] == layer
    assert [p[0].task.xfer_id for p in post] == [bad] * len(before) + [good]
    assert held == []

    delayed = FaultPlans(SendFaults(send_delay_s=1.0), 4)
    x = next(i for i in ids if SendFaults(send_delay_s=1.0).plan(i, 4)[1] > 0.1)
    post, failing, held = delayed.sort([piece(x, 0, 1)], 100.0)
    assert post == failing == [] and len(held) == 1
    at = held[0][0]
    assert 100.0 < at <= 101.0
    # the hold is fixed at the first piece: a later one waits for the same moment
    post, _, held = delayed.sort([piece(x, 1, 2)], 100.05)
    assert post == [] and held[0][0] == at
    post, _, held = delayed.sort([piece(x, 2, 3)], at)
    assert len(post) == 1 and held == []
    delayed.forget(x)  # a settled transfer's plan is dropped: planned afresh from now
    _, _, held = delayed.sort([piece(x, 0, 1)], 200.0)
    assert held[0][0] > 200.0


def test_fault_plans_remember_at_most_memory_transfers() -> None:
    """Past `memory` transfers the oldest plan is dropped: a piece of it is
    planned afresh (held again from now), a newer one keeps its plan."""
    faults = SendFaults(send_delay_s=1.0)
    ids = [f"m{i}" for i in range(200) if faults.plan(f"m{i}", 4)[1] > 0.1][:3]
    plans = FaultPlans(faults, 4, memory=2)
    for x in ids:
        plans.sort([piece(x, 0, 1)], 0.0)
    oldest, newest = ids[0], ids[-1]
    post, _, held = plans.sort([piece(newest, 1, 2)], 50.0)
    assert len(post) == 1 and held == []  # its hold, counted from 0, is over
    post, _, held = plans.sort([piece(oldest, 1, 2)], 50.0)
    assert post == [] and held[0][0] > 50.0  # forgotten: held again from 50


def test_a_prefix_limits_the_faults_to_the_transfers_it_starts() -> None:
    """With a prefix, a transfer outside it is neither failed nor held; one
    inside it is planned as without the prefix."""
    every = SendFaults(fail_rate=1.0, send_delay_s=1.0)
    scoped = SendFaults(fail_rate=1.0, send_delay_s=1.0, prefix="faulty-")
    assert scoped.plan("healthy-1", 4) == (None, 0.0)
    assert scoped.plan("faulty-1", 4) == every.plan("faulty-1", 4)
    assert scoped.plan("faulty-1", 4)[0] is not None
    post, failing, held = FaultPlans(scoped, 4).sort([piece("healthy-1", 0, 4)], 0.0)
    assert len(post) == 1 and failing == held == []
