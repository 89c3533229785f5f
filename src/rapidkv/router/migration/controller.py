"""Migration and drain orders, carried out on the requests being served.

`MigrationController` takes the admin routes' orders (`admin`):

- `migrate`: move one running request to a named instance. The request must
  be streaming through a `relay.MigratingRelay` (a migratable request, once
  D's answer started), the destination must be available and allowed to
  decode; both ends' control addresses are filled in from discovery, and the
  relay does the rest (pre-copy, cut-over);
- `drain_migrating`: drain an instance (`fleet.Fleet.drain`) and move every
  migratable request it decodes to the least busy other instance that may
  decode, spreading the moves (a move counts on its destination only at
  cut-over); requests that cannot move run to their end where they are.

It is also each relay's `relay.Controller`: a cut-over moves the request's
decode (`migrated`: its `Exchange` and placement follow), every migration is
counted (`count_migration`), and a destination is asked for room before
anything is sent to it (`require_room`, `room`).

Rules: an order for an unknown request or instance raises `KeyError`; one
that cannot be carried out raises `relay.MigrationError`, and the request
runs on where it was.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from rapidkv.router.config import Instance
from rapidkv.router.exchange import Exchange
from rapidkv.router.fleet.fleet import Fleet
from rapidkv.router.metrics import RouterMetrics
from rapidkv.router.migration.relay import MigrationError
from rapidkv.router.migration.room import RoomCheck
from rapidkv.router.placement.placer import Placer


class MigrationController:
    """Migrations of the requests in `exchanges` (by xfer_id) across `fleet`."""

    def __init__(
        self,
        fleet: Fleet,
        exchanges: Mapping[str, Exchange],
        metrics: RouterMetrics,
        placer: Placer | None = None,
    ) -> None:
        self._fleet = fleet
        self._exchanges = exchanges
        self._metrics = metrics
        self._placer = placer
        self._room = RoomCheck(fleet.config.secret, fleet.config.health_timeout_s)

    async def close(self) -> None:
        await asyncio.to_thread(self._room.close)

    # ------------------------------------------------------------------ orders

    async def migrate(self, xfer_id: str, to: str, precopy: bool = True) -> dict[str, Any]:
        """Move the running request `xfer_id` to the instance at URL `to`
        (`migration.relay`); what happened. `KeyError` for an unknown request
        or instance; `MigrationError` if it was not moved (it runs on where
        it was)."""
        fleet = self._fleet
        ex = self._exchanges.get(xfer_id)
        if ex is None:
            raise KeyError(f"no request {xfer_id!r} is being served")
        index = fleet.index_of(to)
        if index is None:
            raise KeyError(f"no instance {to!r} in this router's configuration")
        if ex.relay is None or ex.relay.source is None:
            raise MigrationError(ex.unmigratable or "it is not streaming yet")
        if "decode" not in fleet.member(index).roles:
            raise MigrationError(f"{to} may not decode")
        if not fleet.available(index):
            raise MigrationError(f"{to} is down or draining")
        # as configured (a configured control address is kept), the one it decodes on now
        source = await fleet.addresses.with_control(
            fleet.member(ex.decode_index).instance, ex.xfer_id
        )
        target = await fleet.addresses.with_control(fleet.member(index).instance, ex.xfer_id)
        return await ex.relay.migrate(index, target, source.control, precopy)

    async def drain_migrating(self, url: str) -> dict[str, Any] | None:
        """Drain the instance at `url` (`Fleet.drain`) and move every migratable
        request it decodes to the least busy instance that may decode; what
        happened to each (None: no such instance). Requests that cannot move
        run to their end there."""
        fleet = self._fleet
        index = fleet.index_of(url)
        if index is None or not fleet.drain(url):
            return None
        moves: dict[str, asyncio.Future[dict[str, Any]]] = {}
        staying: dict[str, str] = {}
        targets = [i for i in fleet.up("decode") if i != index]
        # a move counts on its destination only at cut-over: spread them meanwhile
        planned = dict.fromkeys(targets, 0)
        for ex in list(self._exchanges.values()):
            if ex.decode_index != index:
                continue
            if not targets:
                staying[ex.xfer_id] = "no other instance may decode"
            elif ex.relay is None:
                staying[ex.xfer_id] = ex.unmigratable or "it is not streaming yet"
            else:
                to = min(targets, key=lambda i: fleet.outstanding_on(i) + planned[i])
                planned[to] += 1
                moves[ex.xfer_id] = asyncio.ensure_future(
                    self.migrate(ex.xfer_id, fleet.member(to).instance.url)
                )
        migrated, failed = [], {}
        for xfer_id, move in moves.items():
            try:
                migrated.append(await move)
            except (KeyError, MigrationError) as e:
                failed[xfer_id] = str(e)
        return {
            "instance": url,
            "draining": True,
            "migrated": migrated,
            "failed": failed,
            "staying": staying,
        }

    # ------------------------------------------------------------------ the relays' view

    def migrated(self, xfer_id: str, index: int, instance: Instance) -> None:
        ex = self._exchanges.get(xfer_id)
        if ex is not None:
            ex.decode_index = index
            ex.decode = instance
        if self._placer is not None:
            self._placer.migrated(xfer_id, index)

    def count_migration(self, outcome: str, downtime_s: float | None = None) -> None:
        self._metrics.migrations.labels(outcome).inc()
        if downtime_s is not None:
            self._metrics.migration_downtime.observe(downtime_s)

    async def require_room(self, target: Instance, tokens: int) -> None:
        await self._room.require(target.url, target.control, tokens)
