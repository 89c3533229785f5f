"""What the router must do when the fleet's membership in etcd changes
(`MembershipDiff`, pure: no I/O, no clock).

The router follows one record per instance URL. A restarted instance
registers again under a new instance id (a new key) while its old key may live
on until its lease expires, so a URL can have two records for a while: the
router follows the one that appeared last (it is the running process; the old
one goes when its lease does). Instances configured on the command line are
the operator's: records with their URLs are ignored.

Invariants: `update` returns, for the URLs it follows, a `Joined` the first
time a URL has a record (or again after a `Left`), a `Restarted` when the
record it follows is replaced by a newer one for the same URL, a `Left` when
no record for the URL remains; nothing for a membership that changes nothing.
After `update(records)`, `following()` maps every non-static URL with a record
to the newest of its records.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from rapidkv.membership.record import InstanceRecord


@dataclass(frozen=True)
class Joined:
    record: InstanceRecord


@dataclass(frozen=True)
class Restarted:
    record: InstanceRecord  # the new one


@dataclass(frozen=True)
class Left:
    url: str


Change = Joined | Restarted | Left


class MembershipDiff:
    """Successive memberships (instance id -> record) in, fleet changes out."""

    def __init__(self, static_urls: Iterable[str] = ()) -> None:
        self._static = frozenset(static_urls)
        self._following: dict[str, InstanceRecord] = {}
        self._seen: dict[str, int] = {}  # instance id -> when it first appeared
        self._clock = 0

    def following(self) -> dict[str, InstanceRecord]:
        return dict(self._following)

    def update(self, records: Mapping[str, InstanceRecord]) -> list[Change]:
        """The changes from the last membership to `records` (by instance id)."""
        for instance_id in records:
            if instance_id not in self._seen:
                self._seen[instance_id] = self._clock
                self._clock += 1
        for gone in self._seen.keys() - records.keys():  # ids are never reused
            del self._seen[gone]
        newest: dict[str, InstanceRecord] = {}
        for instance_id, record in records.items():
            if record.url in self._static:
                continue
            known = newest.get(record.url)
            if known is None or self._seen[instance_id] > self._seen[known.instance_id]:
                newest[record.url] = record
        changes: list[Change] = []
        for url, record in newest.items():
            followed = self._following.get(url)
            if followed is None:
                changes.append(Joined(record))
            elif followed.instance_id != record.instance_id or followed != record:
                changes.append(Restarted(record))
        changes.extend(Left(url) for url in sorted(self._following.keys() - newest.keys()))
        self._following = newest
        return changes
