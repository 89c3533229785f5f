"""`MembershipDiff`: successive etcd memberships in, the router's fleet changes
out; with a property test that `following()` always holds the newest record of
every URL that has one."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rapidkv.membership.record import InstanceRecord
from rapidkv.router.fleet.membership_diff import Joined, Left, MembershipDiff, Restarted

pytestmark = pytest.mark.unit


def rec(instance_id: str, port: int, control: int = 7000) -> InstanceRecord:
    return InstanceRecord(
        url=f"http://127.0.0.1:{port}",
        control=f"127.0.0.1:{control}",
        roles=("prefill", "decode"),
        block_size=16,
        instance_id=instance_id,
    )


def by_id(*records: InstanceRecord) -> dict[str, InstanceRecord]:
    return {r.instance_id: r for r in records}


def test_instances_join_and_leave_and_an_unchanged_membership_changes_nothing() -> None:
    diff = MembershipDiff()
    a, b = rec("a", 8001), rec("b", 8002)
    assert diff.update(by_id(a)) == [Joined(a)]
    assert diff.update(by_id(a, b)) == [Joined(b)]
    assert diff.update(by_id(a, b)) == []
    assert diff.update(by_id(b)) == [Left(a.url)]
    assert diff.update({}) == [Left(b.url)]
    assert diff.update(by_id(a)) == [Joined(a)]  # back under the same id (etcd outage)


def test_a_restart_under_a_new_id_is_followed_while_the_old_key_lives_on() -> None:
    """The old record stays until its lease expires; the new one is followed
    from when it appears, and the old one going changes nothing."""
    diff = MembershipDiff()
    old, new = rec("old", 8001, control=7001), rec("new", 8001, control=7002)
    assert diff.update(by_id(old)) == [Joined(old)]
    assert diff.update(by_id(old, new)) == [Restarted(new)]
    assert diff.following() == {new.url: new}
    assert diff.update(by_id(new)) == []


def test_both_records_read_at_once_follow_the_one_seen_last() -> None:
    """A router that starts (or reads again after an outage) while a URL has
    two records follows one of them, and a later newer record replaces it."""
    diff = MembershipDiff()
    old, new = rec("old", 8001, control=7001), rec("new", 8001, control=7002)
    [joined] = diff.update(by_id(old, new))
    assert isinstance(joined, Joined) and joined.record.url == old.url
    newer = rec("newer", 8001, control=7003)
    assert diff.update(by_id(old, new, newer)) == [Restarted(newer)]


def test_a_record_rewritten_in_place_is_a_restart_and_static_urls_are_ignored() -> None:
    diff = MembershipDiff(static_urls=["http://127.0.0.1:8009"])
    a = rec("a", 8001)
    moved = rec("a", 8001, control=7100)
    assert diff.update(by_id(a, rec("s", 8009))) == [Joined(a)]
    assert diff.update(by_id(moved, rec("s", 8009))) == [Restarted(moved)]
    assert diff.update(by_id(moved)) == []  # the static one is not followed either way


memberships = st.lists(
    st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(0, 2)), max_size=6), max_size=12
)


@given(memberships)
def test_following_always_holds_the_newest_record_of_each_url(steps: list) -> None:
    diff = MembershipDiff()
    followed: dict[str, InstanceRecord] = {}
    first_seen: dict[str, int] = {}
    for t, step in enumerate(steps):
        records = by_id(*(rec(i, 8000 + port) for i, port in dict(step).items()))
        for i in records:
            first_seen.setdefault(i, t)
        for i in list(first_seen):
            if i not in records:
                del first_seen[i]
        for change in diff.update(records):
            if isinstance(change, Left):
                assert change.url in followed
                del followed[change.url]
            elif isinstance(change, Joined):
                assert change.record.url not in followed
                followed[change.record.url] = change.record
            else:
                assert change.record.url in followed
                followed[change.record.url] = change.record
        assert followed == diff.following()
        assert set(followed) == {r.url for r in records.values()}
        for url, record in followed.items():
            rivals = [i for i, r in records.items() if r.url == url]
            assert first_seen[record.instance_id] == max(first_seen[i] for i in rivals)
