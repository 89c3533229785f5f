"""The instances one router dispatches to, and what it knows of each.

Theory of operation
-------------------
Every instance the router has known is a `Member` with an index: the
configured ones first (`RouterConfig.members`), then those that joined through
etcd (`follow`), appended and never removed, so every index the balancer,
health, placement and the metrics keep stays valid. The members that may play
each role, those that left excepted, are that role's *pool*.

A member takes new requests while it is *available*: up (`health`), in the
fleet (not left) and not draining (`drain`). Requests are counted outstanding
on their instance from `acquire` (least outstanding among the available
members of a role, ties in turn: `balance`) or `hold` (an instance chosen
elsewhere: placement, a fan-out's follower, a migration's destination) until
`let_go`.

- *Health*: a request that got no status line marks its instance down
  (`mark_down`); its ``/health`` is then probed every ``probe_interval_s``
  until it answers 200 and, with discovery on, one that needs it (a prefill
  instance without a configured control address; any, for adaptive
  placement) has been asked again what it is (`addresses`): then it is up.
- *Discovery*: `addresses` holds what each instance told of itself (control
  address, block size, max_num_seqs); `discover_all` asks every instance that
  needs it at start-up.
- *Membership*: `follow` applies the fleet's etcd records (`membership_diff`):
  an instance joins (appended, or back in its pools and up, restarted) or
  leaves (out of its pools: no new request; those it serves run on).
- *Draining*: `drain` stops (or resumes) new requests to a member; what it
  serves runs to its end.
- *Prefix caches*: with adaptive placement and the prefix index on, each
  member whose discovery names a KV-event publisher is followed
  (`prefix_caches`); one marked down or that left is forgotten at once, and
  one whose KV-event stream breaks is marked down (its engine most likely
  died: it is probed, and followed again once it answers).
- *Transfers*: each decode member's connector counters are read every
  ``transfer_check_interval_s`` (`transfer_watcher`): ``ok``, ``degraded``
  or ``unknown``.

The fleet owns the upstream HTTP client (`upstream`), opened by `start` on
the serving loop, and tells the adaptive placement (`placement.placer`, if
any) of every change it sees: health, draining, joins, block sizes.

Rules: all state lives on the event loop that runs the ASGI app (no locks);
outstanding counts never go negative (`balance`); a member that left is never
dispatched to, whatever its health.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import aiohttp

from rapidkv.membership.record import InstanceRecord
from rapidkv.router.config import ROLES, Instance, Member, Role, RouterConfig
from rapidkv.router.fleet.addresses import Addresses
from rapidkv.router.fleet.balance import LeastOutstanding
from rapidkv.router.fleet.discovery import Discovered, DiscoveryError
from rapidkv.router.fleet.health import InstanceHealth
from rapidkv.router.fleet.membership_diff import Left, MembershipDiff
from rapidkv.router.fleet.prefix_caches import PrefixCaches
from rapidkv.router.fleet.transfer_watcher import TransferWatcher
from rapidkv.router.metrics import RouterMetrics
from rapidkv.router.placement.placer import Placer
from rapidkv.router.upstream import UPSTREAM_ERRORS, get, open_session

log = logging.getLogger(__name__)


class Fleet:
    """The router's instances: members, pools, health, outstanding counts,
    draining, etcd membership, discovery and transfer state (see the module)."""

    def __init__(
        self, config: RouterConfig, metrics: RouterMetrics, placer: Placer | None = None
    ) -> None:
        self.config = config
        self.metrics = metrics
        self._placer = placer
        # every instance once (`RouterConfig.members`); health and the
        # outstanding counts are per instance, whatever role its requests play
        self._members = list(config.members)  # members that joined (etcd) are appended
        # the members that may play each role, those that left the fleet excepted
        self._pools = {role: list(config.pool(role)) for role in ROLES}
        self._retired: set[int] = set()  # left the fleet (etcd), until they join again
        self._membership = MembershipDiff(m.instance.url for m in self._members)
        self._balancer = LeastOutstanding(len(self._members))
        self._health = InstanceHealth(len(self._members))
        self._draining: set[int] = set()  # no new requests (`drain`), until `undrain`
        self._probes: set[asyncio.Task[bool]] = set()  # /health of down instances
        self._http: aiohttp.ClientSession | None = None
        self.addresses = Addresses(
            config, metrics, lambda: self.http, self._found if placer is not None else None
        )
        self.prefix_caches: PrefixCaches | None = None
        if placer is not None and config.prefix_index:
            self.prefix_caches = PrefixCaches(
                config.tokenizer, lambda i: self.mark_down(i, "its KV-event stream broke")
            )
        self._transfers = TransferWatcher(
            config,
            metrics,
            lambda: [(i, self._members[i].instance) for i in self._pools["decode"]],
        )

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Open the upstream HTTP client and start watching transfers (on the serving loop)."""
        self._http = open_session(self.config)
        self._transfers.start()

    def discover_all(self) -> None:
        """Start asking every prefill instance configured without a control
        address for it (done again on first use if an instance was not up yet)
        and, for adaptive placement, every instance for its block size and
        max_num_seqs (a configured control address is kept)."""
        if not self.config.discover:
            return
        for member in self._members:
            inst = member.instance
            if self._placer is not None or (inst.control is None and "prefill" in member.roles):
                self.addresses.probe(inst)

    async def close(self) -> None:
        """Stop probing and watching, close the HTTP client."""
        if (
            self.prefix_caches is not None
        ):  # first: a link that breaks as it closes marks no one down
            self.prefix_caches.stop_telling()
            await self.prefix_caches.close()
        for task in self._probes:
            task.cancel()
        await asyncio.gather(*self._probes, self.addresses.close(), return_exceptions=True)
        await self._transfers.close()
        if self._http is not None:
            await self._http.close()

    @property
    def http(self) -> aiohttp.ClientSession:
        """The upstream HTTP client (`upstream`), once started."""
        if self._http is None:
            raise RuntimeError("router not started")
        return self._http

    # ------------------------------------------------------------------ members

    @property
    def members(self) -> tuple[Member, ...]:
        """Every instance the router has known, by index (those that left too)."""
        return tuple(self._members)

    def member(self, index: int) -> Member:
        return self._members[index]

    def pool(self, role: Role) -> tuple[int, ...]:
        """Indices of the members that may play `role` (those that left excepted)."""
        return tuple(self._pools[role])

    def index_of(self, url: str, *, in_fleet: bool = False) -> int | None:
        """The member whose base URL is `url` (None: no such instance; with
        `in_fleet`, also None for one that left)."""
        for index, member in enumerate(self._members):
            if member.instance.url == url:
                return None if in_fleet and index in self._retired else index
        return None

    def is_up(self, index: int) -> bool:
        """Whether member `index` answers (it may be draining)."""
        return self._health.is_up(index) and index not in self._retired

    def is_draining(self, index: int) -> bool:
        """Whether member `index` is drained (`drain`)."""
        return index in self._draining

    def available(self, index: int) -> bool:
        """Up, in the fleet and not draining: new requests may go there."""
        return self.is_up(index) and index not in self._draining

    def up(self, role: Role) -> list[int]:
        """The instances that may play `role`, up and not draining."""
        return [i for i in self._pools[role] if self.available(i)]

    def down_reasons(self) -> str:
        """Why no instance that may decode takes requests."""
        if not self._pools["decode"]:
            return "no instance that may decode is in the fleet"
        reasons = []
        for i in self._pools["decode"]:
            why = self._health.down(i) or ("draining" if i in self._draining else None)
            if why is not None:
                reasons.append(f"{self._members[i].instance.url} ({why})")
        return "; ".join(reasons)

    def transfers(self, index: int) -> str:
        """Whether member `index` (one that may decode) transfers: ``ok``,
        ``degraded`` or ``unknown`` (`transfers`)."""
        return self._transfers.state(index)

    # ------------------------------------------------------------------ outstanding

    def acquire(self, role: Role, exclude: int | None = None) -> int:
        """An instance for a request of `role` (not `exclude`), least outstanding
        (ties in turn), counted outstanding (`let_go` when its request is over)."""
        # every instance down since the caller looked: try them all (the request fails
        # like any to a dead instance) rather than fail here
        pool = [i for i in self._pools[role] if i != exclude]
        up = [i for i in pool if self.available(i)]
        return self._counted(self._balancer.acquire(up or pool, turn=role))

    def hold(self, index: int) -> None:
        """Count one more request outstanding on instance `index`, chosen elsewhere."""
        self._balancer.hold(index)
        self._counted(index)

    def let_go(self, index: int) -> None:
        """Count one request fewer outstanding on instance `index`."""
        self._balancer.release(index)
        member = self._members[index]
        self.metrics.outstanding.labels(member.label, member.instance.url).dec()

    def outstanding_on(self, index: int) -> int:
        """Requests in flight on member `index`."""
        return self._balancer.outstanding(index)

    def outstanding(self, role: Role) -> list[int]:
        """Requests in flight on each instance that may play `role`, in `pool` order."""
        return [self._balancer.outstanding(i) for i in self._pools[role]]

    def _counted(self, index: int) -> int:
        member = self._members[index]
        self.metrics.outstanding.labels(member.label, member.instance.url).inc()
        return index

    # ------------------------------------------------------------------ health

    def mark_down(self, index: int, reason: str) -> None:
        """A request to this instance got no answer: dispatch nothing more to it
        until its /health answers 200 (probed every `probe_interval_s`)."""
        if not self._health.mark_down(index, reason):
            return
        member = self._members[index]
        log.warning(
            "%s instance %s is down (%s); probing its /health every %gs",
            member.label,
            member.instance.url,
            reason,
            self.config.probe_interval_s,
        )
        self.metrics.instance_up.labels(member.label, member.instance.url).set(0)
        if self._placer is not None:
            self._placer.set_healthy(index, False)
        if self.prefix_caches is not None:
            self.prefix_caches.forget(index)  # followed again once rediscovered
        task = asyncio.create_task(self._probe(index))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _probe(self, index: int) -> bool:
        member = self._members[index]
        inst = member.instance
        while True:
            await asyncio.sleep(self.config.probe_interval_s)
            if index in self._retired or self._members[index] is not member:
                return False  # it left the fleet, or joined again (`follow` marks it up)
            try:
                status, _, _ = await get(
                    self.http, f"{inst.url}/health", self.config.health_timeout_s
                )
            except UPSTREAM_ERRORS:
                continue
            if status == 200:
                needs_control = "prefill" in member.roles and inst.control is None
                if self.config.discover and (needs_control or self._placer is not None):
                    # a restarted instance may listen elsewhere, and run another
                    # block size or max_num_seqs: ask again before dispatching to it
                    try:
                        await self.addresses.rediscover(inst)
                    except DiscoveryError as e:
                        log.info("%s instance %s answers /health: %s", member.label, inst.url, e)
                        if needs_control:
                            continue
                self._health.mark_up(index)
                self.metrics.instance_up.labels(member.label, inst.url).set(1)
                if self._placer is not None:
                    self._placer.set_healthy(index, True)
                log.info("%s instance %s is up again", member.label, inst.url)
                return True

    def _found(self, url: str, found: Discovered) -> None:
        """Placement learns an instance's block size (split heads are whole
        blocks) and its max_num_seqs (beyond which requests wait); its KV
        events are followed (it answered: down or not; not once it left)."""
        index = self.index_of(url)
        if index is not None and self._placer is not None:
            self._placer.set_block_size(index, found.block_size)
            self._placer.set_max_num_seqs(index, found.max_num_seqs)
        if index is not None and self.prefix_caches is not None and index not in self._retired:
            self.prefix_caches.found(index, url, found)

    # ------------------------------------------------------------------ draining

    def drain(self, url: str, draining: bool = True) -> bool:
        """Stop (or, `draining` False, resume) dispatching new requests to the
        instance at `url`; the requests it serves run to their end. False if
        no instance has that URL."""
        index = self.index_of(url)
        if index is None:
            return False
        if draining:
            self._draining.add(index)
        else:
            self._draining.discard(index)
        self.metrics.instance_draining.labels(self._members[index].label, url).set(int(draining))
        if self._placer is not None:
            self._placer.set_draining(index, draining)
        log.info("instance %s %s", url, "draining" if draining else "undrained")
        return True

    # ------------------------------------------------------------------ membership

    def follow(self, records: Mapping[str, InstanceRecord]) -> None:
        """The fleet's membership in etcd is `records` now (instance id ->
        record; `MembershipWatcher`, posted to the serving loop): instances
        join, come back restarted, or leave (`MembershipDiff`). One that left
        gets no new request; those it serves run on (or fail as at any dead
        instance)."""
        for change in self._membership.update(records):
            if isinstance(change, Left):
                self._leave(change.url)
            else:
                self._join(change.record)

    def _join(self, record: InstanceRecord) -> None:
        roles = frozenset(role for role in ROLES if role in record.roles)
        instance = Instance(record.url, record.control, record.block_size, record.max_num_seqs)
        member = Member(instance, roles)
        index = self.index_of(record.url)
        if index is None:
            index = len(self._members)
            self._members.append(member)
            self._balancer.add()
            self._health.add()
            self.metrics.add_member(member)
        else:  # back, restarted: it answered /health before registering
            old = self._members[index]
            if old.label != member.label:  # other roles now: the old series would stay, stale
                self.metrics.remove_member(old)
                self.metrics.add_member(member)
            self._members[index] = member
            self._health.mark_up(index)
            self.metrics.instance_up.labels(member.label, member.instance.url).set(1)
        self._retired.discard(index)
        for role, pool in self._pools.items():
            if role in roles and index not in pool:
                pool.append(index)
                pool.sort()
            elif role not in roles and index in pool:
                pool.remove(index)
        self.addresses.forget(record.url)  # its record says where it listens
        if self._placer is not None:
            self._placer.join(index, member)
        if self.prefix_caches is not None:
            # a process new to the index (or restarted): its old blocks go, and
            # a probe names its KV-event publisher (etcd records do not)
            self.prefix_caches.forget(index)
            if self.config.discover:
                self.addresses.probe(instance)
        log.info(
            "%s instance %s is in the fleet (etcd; control %s, block size %d, instance %s)",
            member.label,
            record.url,
            record.control,
            record.block_size,
            record.instance_id,
        )

    def _leave(self, url: str) -> None:
        index = self.index_of(url)
        if index is None:
            return
        member = self._members[index]
        self._retired.add(index)
        for pool in self._pools.values():
            if index in pool:
                pool.remove(index)
        self.metrics.instance_up.labels(member.label, url).set(0)
        if self._placer is not None:
            self._placer.set_healthy(index, False)
        if self.prefix_caches is not None:
            self.prefix_caches.forget(index)
        log.warning(
            "%s instance %s left the fleet (its etcd record is gone): no new request goes there",
            member.label,
            url,
        )
