"""Following the fleet's members in etcd (`MembershipWatcher`).

A daemon thread reads every record under ``<prefix>instances/`` and then
watches the prefix from the revision it read at; after every change it calls
`on_change` with the whole membership (instance id -> `InstanceRecord`). A
broken watch (etcd restarted, a network cut) is followed by a fresh read after
`retry_s`, so nothing is missed: the read is the truth, the watch only keeps
it current. A record that does not decode is logged once and left out.

Invariants: `on_change` runs on the watcher's thread, never twice at once, and
only when the membership differs from what it last reported; `stop()` ends the
thread within the client's timeout.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from rapidkv.membership.etcd import EtcdClient, EtcdError
from rapidkv.membership.record import InstanceRecord, decode_record

log = logging.getLogger(__name__)

Members = dict[str, InstanceRecord]


class MembershipWatcher:
    def __init__(
        self,
        endpoints: Sequence[str],
        prefix: str,
        on_change: Callable[[Members], None],
        retry_s: float = 1.0,
        timeout_s: float = 5.0,
    ) -> None:
        self.prefix = f"{prefix}instances/"
        self._on_change = on_change
        self._retry_s = retry_s
        self._client = EtcdClient(endpoints, timeout_s=timeout_s)
        self._stop = threading.Event()
        self._raw: dict[str, str] = {}
        self._reported: Members | None = None
        self._bad: set[tuple[str, str]] = set()  # (key, value) already logged
        self._thread = threading.Thread(target=self._run, name="rapidkv-membership", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._client.interrupt_watch()  # ends a watch waiting for its next event
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(self._client.timeout_s + self._retry_s)
        self._client.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                revision, self._raw = self._client.get_prefix(self.prefix)
                self._report()
                for event in self._client.watch_prefix(self.prefix, revision, self._stop):
                    if event.kind == "delete":
                        self._raw.pop(event.key, None)
                    else:
                        assert event.value is not None
                        self._raw[event.key] = event.value
                    self._report()
            except EtcdError as e:
                if self._stop.is_set():
                    return
                log.warning("etcd membership under %s: %s; reading it again", self.prefix, e)
            self._stop.wait(self._retry_s)

    def _report(self) -> None:
        members: Members = {}
        for key, value in self._raw.items():
            try:
                record = decode_record(value)
            except ValueError as e:
                if (key, value) not in self._bad:
                    self._bad.add((key, value))
                    log.warning("etcd membership: %s left out: %s", key, e)
                continue
            members[record.instance_id] = record
        if members != self._reported:
            self._reported = members
            try:
                self._on_change(dict(members))
            except Exception:
                log.exception("etcd membership: on_change failed")
