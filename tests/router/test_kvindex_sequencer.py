"""`kvindex.sequencer`: one publisher's batches applied in seq order, gaps
replayed, duplicates dropped, restarts told apart from both."""

from __future__ import annotations

import pytest

from rapidkv.router.kvindex.sequencer import Apply, AskReplay, Batch, Forget, Sequencer

pytestmark = pytest.mark.unit


def b(seq: int, era: str = "x") -> Batch:
    """Batch `seq` of publisher `era` (payloads of different eras differ)."""
    return Batch(seq, f"{era}{seq}".encode(), body=(era, seq))


def applied(steps) -> list[int]:
    return [s.batch.seq for s in steps if isinstance(s, Apply)]


def asks(steps) -> list[AskReplay]:
    return [s for s in steps if isinstance(s, AskReplay)]


def forgets(steps) -> list[Forget]:
    return [s for s in steps if isinstance(s, Forget)]


def following(n: int = 0) -> Sequencer:
    """A sequencer connected, caught up, with batches 0..n-1 of "x" applied."""
    s = Sequencer()
    (ask,) = s.connected()
    assert ask.start_seq == 0
    assert s.replay_ended(ask.token) == [] and s.synced
    for seq in range(n):
        assert applied(s.live(b(seq))) == [seq]
    return s


def test_the_first_connect_asks_for_everything_from_0_and_waits_for_it() -> None:
    s = Sequencer()
    assert not s.synced and s.live(b(0)) == []  # not connected: nothing applied
    (ask,) = s.connected()
    assert (ask.start_seq, s.synced) == (0, False)
    s.live(b(3))
    assert applied(s.replayed(ask.token, b(0))) == [0]
    assert applied(s.replayed(ask.token, b(1))) == [1]
    assert applied(s.replayed(ask.token, b(2))) == [2, 3]
    assert s.replayed(ask.token, b(3)) == [] and s.counts["duplicates"] == 1
    assert s.replay_ended(ask.token) == [] and s.synced and s.last == (3, b"x3")


def test_a_gap_asks_for_a_replay_from_the_last_batch_applied_which_fills_it() -> None:
    s = following(3)
    (ask,) = asks(s.live(b(5)))
    assert ask.start_seq == 2 and not s.synced
    assert s.live(b(6)) == []  # waits behind the gap
    assert s.replayed(ask.token, b(2)) == []  # the anchor: same publisher
    assert applied(s.replayed(ask.token, b(3))) == [3]
    assert applied(s.replayed(ask.token, b(4))) == [4, 5, 6]
    s.replayed(ask.token, b(5))
    assert s.replay_ended(ask.token) == [] and s.synced and s.next_seq == 7


def test_a_live_batch_seen_again_is_dropped() -> None:
    s = following(3)
    assert s.live(b(1)) == [] and s.counts["duplicates"] == 1 and s.synced


def test_a_seq_seen_again_with_another_payload_is_a_new_publisher() -> None:
    s = following(3)
    steps = s.live(b(0, era="y"))
    assert forgets(steps) == [Forget(forgets(steps)[0].reason, True, 0)]
    assert applied(steps) == [0] and s.last == (0, b"y0")


def test_a_new_publisher_seen_mid_stream_is_caught_up_from_0() -> None:
    s = following(3)
    steps = s.live(b(1, era="y"))
    assert [f.full for f in forgets(steps)] == [True]
    (ask,) = asks(steps)
    assert ask.start_seq == 0 and not s.synced
    assert applied(s.replayed(ask.token, b(0, "y"))) == [0, 1]


def test_a_replay_whose_anchor_differs_starts_over_from_0() -> None:
    """The link dropped; the replay of the process behind it is another's."""
    s = following(3)
    s.disconnected()
    assert not s.synced
    (ask,) = s.connected()
    assert ask.start_seq == 2
    s.live(b(4, "y"))
    steps = s.replayed(ask.token, b(2, "y"))
    assert [f.full for f in forgets(steps)] == [True]
    (again,) = asks(steps)
    assert again.start_seq == 0 and s.replayed(ask.token, b(3, "y")) == []  # stale token
    assert applied(s.replayed(again.token, b(0, "y"))) == [0]


def test_a_replay_that_starts_after_the_anchor_starts_over_from_0() -> None:
    s = following(3)
    (ask,) = s.connected()
    steps = s.replayed(ask.token, b(5))
    assert [f.full for f in forgets(steps)] == [True] and asks(steps)[0].start_seq == 0


def test_a_replay_that_ends_without_the_anchor_forgets_everything() -> None:
    """Nothing came back, or it timed out: the publisher cannot be shown to be the same."""
    s = following(3)
    (ask,) = s.connected()
    steps = s.replay_ended(ask.token)
    assert [(f.full, f.resume_seq) for f in forgets(steps)] == [(True, 0)]
    assert s.synced and s.last is None


def test_a_gap_no_replay_can_fill_forgets_and_resumes_at_the_first_batch_held() -> None:
    s = following(3)
    (ask,) = asks(s.live(b(9)))
    s.replayed(ask.token, b(2))  # verified, but the buffer ends there
    steps = s.replay_ended(ask.token)
    assert [(f.full, f.resume_seq) for f in forgets(steps)] == [(False, 9)]
    assert applied(steps) == [9] and s.synced


def test_a_replay_that_starts_past_next_seq_without_anchor_resumes_where_it_starts() -> None:
    s = Sequencer()
    (ask,) = s.connected()
    steps = s.replayed(ask.token, b(40))
    assert [(f.full, f.resume_seq) for f in forgets(steps)] == [(False, 40)]
    assert applied(steps) == [40]


def test_a_replay_that_makes_progress_but_leaves_a_gap_asks_again() -> None:
    s = following(3)
    (ask,) = asks(s.live(b(5)))
    s.replayed(ask.token, b(2))
    s.replayed(ask.token, b(3))
    s.live(b(7))  # 6 lost after the replay was served
    s.replayed(ask.token, b(4))
    s.replayed(ask.token, b(5))
    (again,) = asks(s.replay_ended(ask.token))
    assert again.start_seq == 5 and not forgets(s.replay_ended(ask.token))


def test_nothing_is_applied_while_the_link_is_down_or_the_publisher_unverified() -> None:
    s = following(2)
    s.disconnected()
    assert s.live(b(2)) == [] and not s.synced
    (ask,) = s.connected()  # what waited is dropped: the replay brings it again
    assert s.live(b(3)) == []
    assert s.replayed(ask.token, b(1)) == []  # the anchor
    assert applied(s.replayed(ask.token, b(2))) == [2, 3]


def test_without_a_replay_endpoint_gaps_are_skipped_and_a_reconnect_forgets() -> None:
    s = Sequencer(can_replay=False)
    assert s.connected() == []
    steps = s.live(b(4))
    assert [(f.full, f.resume_seq) for f in forgets(steps)] == [(False, 4)] and applied(steps) == [
        4
    ]
    steps = s.live(b(7))
    assert [f.resume_seq for f in forgets(steps)] == [7] and applied(steps) == [7]
    s.disconnected()
    assert [f.full for f in forgets(s.connected())] == [True]


def test_a_new_identity_starts_over_and_catches_up_from_0() -> None:
    s = following(3)
    steps = s.restarted("identity 2")
    assert [f.full for f in forgets(steps)] == [True] and asks(steps)[0].start_seq == 0


def test_batches_beyond_the_pending_cap_are_dropped_and_replayed_later() -> None:
    s = Sequencer(pending_cap=2)
    (ask,) = s.connected()
    for seq in (5, 6, 7):
        s.live(b(seq))
    assert s.counts["dropped_pending_cap"] == 1  # 7: the farthest
    for seq in range(8):
        s.replayed(ask.token, b(seq))  # each is the nearest: 6 makes room for it
    assert s.replay_ended(ask.token) == [] and s.next_seq == 8 and s.synced
