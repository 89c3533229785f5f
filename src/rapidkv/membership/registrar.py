"""Keeping one key in etcd under a lease for as long as a process runs
(`Registrar`): how an instance stays a member of the fleet.

`start()` returns at once; a daemon thread waits until `ready()` (if given:
an instance is registered once it can serve), grants a lease of `ttl_s`, puts
the key under it and refreshes the lease every `ttl_s / 3`. If the lease is lost
(etcd unreachable for longer than the TTL, the process paused) it is granted
again and the key put again, so a member that comes back is a member again
without a restart. `stop()` revokes the lease: the key goes at once. A process
that dies stops refreshing: the key goes when the lease expires, which is how
routers learn of a dead instance.

Invariants: the key is only ever written under the current lease; at most one
lease is held; `stop()` is idempotent and returns within `timeout_s` plus a
refresh's request time.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from rapidkv.membership.etcd import EtcdClient, EtcdError

log = logging.getLogger(__name__)


class Registrar:
    def __init__(
        self,
        endpoints: Sequence[str],
        key: str,
        value: str,
        ttl_s: float = 5.0,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        if ttl_s < 2:
            raise ValueError(f"an etcd lease TTL is at least 2 s, not {ttl_s}")
        self.key = key
        self.value = value
        self.ttl_s = ttl_s
        self._ready = ready
        self._client = EtcdClient(endpoints, timeout_s=max(1.0, ttl_s / 3))
        self._stop = threading.Event()
        self._lease: int | None = None
        self._registered = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rapidkv-registrar", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait_registered(self, timeout_s: float) -> bool:
        """Whether the key was put within `timeout_s` (for tests and start-up logs)."""
        return self._registered.wait(timeout_s)

    def stop(self) -> None:
        """Stop refreshing and revoke the lease (the key goes at once)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.ttl_s)
        lease, self._lease = self._lease, None
        if lease is not None:
            try:
                self._client.revoke(lease)
            except EtcdError as e:  # the lease expires on its own
                log.warning("rapidkv: etcd: could not revoke the lease of %s: %s", self.key, e)
        self._client.close()

    def _run(self) -> None:
        refresh_s = self.ttl_s / 3
        failing = False
        while self._ready is not None and not self._stop.is_set():
            try:
                if self._ready():
                    break
            except Exception as e:  # a readiness probe that fails is "not yet"
                log.debug("rapidkv: etcd: %s not ready: %s", self.key, e)
            self._stop.wait(min(refresh_s, 0.5))
        while not self._stop.is_set():
            try:
                if self._lease is None or self._client.keepalive(self._lease) == 0:
                    if self._lease is not None:
                        log.warning("rapidkv: etcd: the lease of %s expired; again", self.key)
                    self._lease = self._client.grant(max(2, round(self.ttl_s)))
                    self._client.put(self.key, self.value, self._lease)
                    log.info("rapidkv: etcd: %s registered (lease ttl %gs)", self.key, self.ttl_s)
                    self._registered.set()
                if failing:
                    log.info("rapidkv: etcd reachable again for %s", self.key)
                failing = False
            except EtcdError as e:
                if not failing:
                    log.warning("rapidkv: etcd: %s not refreshed: %s", self.key, e)
                failing = True
            self._stop.wait(refresh_s)
