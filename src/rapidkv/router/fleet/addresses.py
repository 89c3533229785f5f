"""What each instance tells of itself when asked (`discovery`): where its
connector's control plane listens, its block size and max_num_seqs.

`Addresses` keeps one probe per instance URL, on the serving loop (no locks):

- an instance is asked once (`probe`); a probe that failed is repeated on the
  next use, at most every ``RouterConfig.discovery_retry_s``;
- `with_control` gives a request's instance with what was discovered filled
  in (a configured control address is kept), waiting for the probe if need be;
- `learn` reads P's answers: when P names another control address than the one
  discovered (it restarted elsewhere), later requests use the new one;
- `rediscover` (an instance up again after it was down) and `forget` (an
  instance that registered again through etcd, whose record says where it
  listens) drop what was known.

Every successful probe, and every address learnt from an answer, is told to
`on_found` (the fleet's adaptive placement learns block sizes and
max_num_seqs from it, and its prefix index follows the KV events it
names). With ``discover`` off nothing is asked: instances are used as
configured.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable

import aiohttp

from rapidkv.router.config import Instance, RouterConfig
from rapidkv.router.fleet.discovery import (
    Discovered,
    DiscoveryError,
    discover_control,
    discovered_from_answer,
)
from rapidkv.router.metrics import RouterMetrics

log = logging.getLogger(__name__)


class Addresses:
    """The probes of the fleet's instances, by URL (see the module)."""

    def __init__(
        self,
        config: RouterConfig,
        metrics: RouterMetrics,
        http: Callable[[], aiohttp.ClientSession],
        on_found: Callable[[str, Discovered], None] | None = None,
    ) -> None:
        self._config = config
        self._metrics = metrics
        self._http = http
        self._on_found = on_found
        # instance URL -> (its probe, when it started)
        self._probes: dict[str, tuple[asyncio.Future[Discovered], float]] = {}
        self._announced: set[str] = set()  # URLs whose discovered address was logged

    def probe(self, inst: Instance) -> asyncio.Future[Discovered]:
        """The probe of `inst` (a new one if the last failed over `discovery_retry_s` ago)."""
        entry = self._probes.get(inst.url)
        if entry is not None:
            task, started = entry
            failed = task.done() and (task.cancelled() or task.exception() is not None)
            if not failed or time.monotonic() - started < self._config.discovery_retry_s:
                return task
        task = asyncio.create_task(
            discover_control(self._http(), inst, self._config.connect_timeout_s)
        )
        self._probes[inst.url] = (task, time.monotonic())
        if self._on_found is not None:
            task.add_done_callback(lambda t: self._found(inst.url, t))
        return task

    def rediscover(self, inst: Instance) -> asyncio.Future[Discovered]:
        """A new probe of `inst`, whatever was known (a restarted instance may
        listen elsewhere, and run another block size or max_num_seqs)."""
        self._probes.pop(inst.url, None)
        self._announced.discard(inst.url)
        return self.probe(inst)

    def forget(self, url: str) -> None:
        """Drop what the instance at `url` told (its etcd record says it now)."""
        self._probes.pop(url, None)

    async def settled(self) -> None:
        """Wait for the probes in flight (at start-up: placement needs the
        block sizes to consider splits); their failures are dealt with where
        an instance is used."""
        pending = [task for task, _ in self._probes.values() if not task.done()]
        if pending:
            await asyncio.wait([asyncio.shield(t) for t in pending])

    def _found(self, url: str, task: asyncio.Future[Discovered]) -> None:
        if task.cancelled() or task.exception() is not None or self._on_found is None:
            return
        self._on_found(url, task.result())

    async def with_control(self, inst: Instance, xfer_id: str) -> Instance:
        """`inst` with its control address (and block size, for split prefills)
        filled in, discovered if need be; as is if the instance cannot tell (D
        then computes the prompt itself when the address is missing). `xfer_id`:
        the request it is for (logged)."""
        config = self._config
        splits = config.split_prefill and config.dispatch == "dual"
        known = inst.control is not None and (inst.block_size is not None or not splits)
        if known or not config.discover:
            return inst
        try:
            found = await asyncio.shield(self.probe(inst))
            control, block_size = found.control, found.block_size
        except DiscoveryError as e:
            if inst.control is not None:
                return inst  # configured address; no block size: no split prefills
            self._metrics.upstream_errors.labels("prefill", inst.url, "discovery").inc()
            log.warning(
                "xfer %s: no control address for %s (%s); decode will compute the prompt",
                xfer_id,
                inst.url,
                e,
            )
            return inst
        if inst.url not in self._announced:
            self._announced.add(inst.url)
            log.info(
                "prefill %s: control plane discovered at %s (block size %s)",
                inst.url,
                control,
                block_size,
            )
        return dataclasses.replace(inst, control=inst.control or control, block_size=block_size)

    def learn(self, inst: Instance, data: bytes) -> None:
        """P's answer names the control address its connector listens on: if
        it is not the one discovered (P restarted elsewhere), later requests use
        the new one. `inst` is as configured: a configured address is kept."""
        if inst.control is not None or not self._config.discover:
            return
        entry = self._probes.get(inst.url)
        known = entry[0] if entry is not None else None
        if known is None or not known.done() or known.cancelled() or known.exception():
            return  # being discovered, or not at all: that answer comes first
        try:
            found = discovered_from_answer(inst, json.loads(data))
        except (ValueError, DiscoveryError):
            return  # no connector, or not ours: nothing to learn
        if found.control == known.result().control:
            return
        log.warning(
            "prefill %s: control plane now at %s, not %s (restarted?)",
            inst.url,
            found.control,
            known.result().control,
        )
        learnt: asyncio.Future[Discovered] = asyncio.get_running_loop().create_future()
        learnt.set_result(found)
        self._probes[inst.url] = (learnt, time.monotonic())
        self._found(inst.url, learnt)  # its block size and max_num_seqs may differ too

    async def close(self) -> None:
        """Cancel the probes in flight."""
        pending = [task for task, _ in self._probes.values()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
