"""`CompletionTracker` with one transfer to several peers (a source rank whose
KV heads several destination ranks need): each (transfer, peer) settles on its
own, once, with its own SendDone; `fail` gives the transfer up to every peer;
a failed write to one peer does not settle the other."""

from __future__ import annotations

import pytest

from rapidkv.kvt.completions import CompletionTracker
from rapidkv.kvt.task import InvalidTask, Task

pytestmark = pytest.mark.unit

LAYERS, BLOCK = 3, 16


def task(peer: str, xfer: str = "x") -> Task:
    return Task(xfer, peer, (0, 1), (4, 5), 0, 2 * BLOCK, True)


def test_one_transfer_to_two_peers_settles_apart() -> None:
    t = CompletionTracker(LAYERS, BLOCK, rank=0)
    a, b = t.add_task(task("d.r0")), t.add_task(task("d.r1"))  # same blocks, other peers
    t.posted(1, [(a, 0, LAYERS)])
    t.posted(2, [(b, 0, LAYERS)])
    [first] = t.settled(1, True)
    assert (first.peer, first.done.ok, first.done.tokens_sent) == ("d.r0", True, 2 * BLOCK)
    assert t.is_live("x") and t.live(b) and not t.live(a)
    assert t.settled_ok("x", "d.r0") is True and t.settled_ok("x", "d.r1") is None
    with pytest.raises(InvalidTask, match="already settled"):
        t.add_task(task("d.r0"))
    [second] = t.settled(2, False, "write failed")
    assert (second.peer, second.done.ok) == ("d.r1", False)
    assert not t.is_live("x") and t.live_transfers() == 0
    assert t.settled_ok("x", "d.r1") is False


def test_fail_gives_up_to_every_peer_once_nothing_is_in_flight() -> None:
    t = CompletionTracker(LAYERS, BLOCK, rank=1)
    a, b = t.add_task(task("d.r0")), t.add_task(task("d.r1"))
    t.posted(7, [(a, 0, 1)])
    dones = t.fail("x", "aborted")
    assert [(s.peer, s.done.ok) for s in dones] == [("d.r1", False)]  # d.r0 has a write out
    assert t.live_transfers() == 1 and not t.live(a) and not t.live(b)
    [late] = t.settled(7, True)
    assert (late.peer, late.done.ok, late.done.error) == ("d.r0", False, "aborted")
    assert t.live_transfers() == 0


def test_leading_layers_are_per_peer() -> None:
    t = CompletionTracker(LAYERS, BLOCK, rank=0)
    a, b = t.add_task(task("d.r0")), t.add_task(task("d.r1"))
    t.posted(1, [(a, 0, 2), (b, 0, 1)])
    t.settled(1, True)
    assert t.leading_layers("x", "d.r0") == 2
    assert t.leading_layers("x", "d.r1") == 1
    assert t.leading_layers("x", "elsewhere") == 0
