"""Reading each decode instance's connector counters over the control plane, so
that a pair that is up but not transferring shows as degraded (`transfers`).

The instances read are those the fleet's `decoders` callable names at each
round: the members that may decode now and have a control address (configured
``--decode URL=HOST:PORT`` / ``--instance URL=HOST:PORT``, or from their etcd
record), so members that join through etcd are read from their first round on,
and those that left are no longer read. States are kept by member index. A
reading that fails (refused, timed out, wrong secret) makes that instance's
state ``unknown``; it is logged once per change.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from rapidkv.control.messages import Stats, StatsRequest
from rapidkv.router.config import Instance, RouterConfig
from rapidkv.router.fleet.transfers import TransferWatch
from rapidkv.router.metrics import RouterMetrics
from rapidkv.router.rpc import LazyRpc

log = logging.getLogger(__name__)


class TransferWatcher:
    """Polls decode instances' `Stats` every `transfer_check_interval_s`."""

    def __init__(
        self,
        config: RouterConfig,
        metrics: RouterMetrics,
        decoders: Callable[[], Sequence[tuple[int, Instance]]],
    ) -> None:
        self._config = config
        self._metrics = metrics
        self._decoders = decoders  # (member index, instance) of those that may decode now
        self._watch = TransferWatch()
        self._rpc = LazyRpc(config.secret)  # made at the first reading
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start polling (on the serving loop), unless the interval is 0."""
        if self._config.transfer_check_interval_s > 0:
            self._task = asyncio.create_task(self._run())

    def state(self, index: int) -> str:
        """Member `index`'s state: ``unknown``, ``ok`` or ``degraded`` (see `transfers`)."""
        return self._watch.state(index)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._config.transfer_check_interval_s)
            for index, inst in self._decoders():
                if inst.control:
                    self._observe(index, inst.url, await self._read(inst.control))

    async def _read(self, address: str) -> dict[str, float] | None:
        client = self._rpc.get()
        if client is None:  # closed
            return None
        try:
            future = client.submit(address, StatsRequest(), self._config.health_timeout_s)
            reply = await asyncio.wrap_future(future)
        except Exception as e:  # any failure: the state is unknown
            log.debug("transfer check of %s failed: %r", address, e)
            return None
        return reply.counters if isinstance(reply, Stats) else None

    def _observe(self, index: int, url: str, counters: dict[str, float] | None) -> None:
        changed = self._watch.observe(index, counters)
        if changed is None:
            return
        self._metrics.transfers_degraded.labels(url).set(1 if changed == "degraded" else 0)
        if changed == "degraded":
            log.warning(
                "decode instance %s is degraded: every TransferKV since the last check "
                "fell back to recompute (see its connector's log)",
                url,
            )
        else:
            log.info("decode instance %s transfers: %s", url, changed)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.to_thread(self._rpc.close)
