"""What each member holds in its prefix cache, as the adaptive placement reads it.

`PrefixCaches` joins the fleet to the prefix index (`kvindex`): a member whose
discovery answer names a KV-event publisher (`discovery.KVEvents`) is
subscribed to (`kvindex.KVIndexService`), keyed by its URL, with its identity
(instance id and incarnation) so that a restarted process's old blocks are
dropped; a member that is marked down, leaves the fleet or is rediscovered
without a publisher is unsubscribed and forgotten at once. For a request,
`lookup` gives the prompt's token ids (`prompt_tokens`, with the tokenizer of
the ``--tokenizer`` directory or of the model directory the first member
names) and, per member index, the prompt's leading tokens that member holds
and vLLM there would use (whole blocks, short of the block of the prompt's
last token: vLLM computes that token whatever it holds). A member whose
KV-event link breaks is told to the fleet (`on_lost`), which marks it down
and probes its ``/health``: vLLM's publisher lives as long as its engine, so
a broken link is most often a dead instance, seen before any request to it
fails.

One block size for the whole index: the first publishing member's. A member
with another block size is not indexed (logged once): vLLM's blocks and the
index's chained hashes would not line up.

Rules: every call on the serving loop; the subscriptions' starts and stops
run as tasks of it, one at a time in the order asked (`close` waits for
them); a member not subscribed, or not in sync with its publisher, holds
nothing as far as placement knows.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rapidkv.router.fleet.discovery import Discovered
from rapidkv.router.kvindex import KVIndexService, Member
from rapidkv.router.prompt_tokens import PromptTokens
from rapidkv.router.rewrite import Body, Endpoint, token_ids

log = logging.getLogger(__name__)


class PrefixCaches:
    """The members' prefix caches, from their KV events (see the module)."""

    def __init__(
        self, tokenizer: str | None = None, on_lost: Callable[[int], None] | None = None
    ) -> None:
        self.tokens = PromptTokens(tokenizer)
        self._on_lost = on_lost  # told the member index whose KV-event link broke
        self._service: KVIndexService | None = None
        self._keys: dict[int, str] = {}  # member index -> its key in the index (URL)
        self._tasks: set[asyncio.Task[None]] = set()
        self._lock = asyncio.Lock()  # subscriptions start and stop one at a time, in order
        self._refused: set[str] = set()  # URLs logged as not indexable

    @property
    def block_size(self) -> int | None:
        return self._service.index.block_size if self._service is not None else None

    def subscribed(self) -> dict[int, str]:
        """Member index -> URL, for the members followed now."""
        return dict(self._keys)

    def found(self, index: int, url: str, found: Discovered) -> None:
        """Member `index` at `url` told what it is: follow its publisher (again,
        if its identity changed), or forget it if it names none."""
        if found.model_root is not None:
            self.tokens.offer(found.model_root)
        events, block = found.kv_events, found.block_size
        if events is None or block is None:
            self.forget(index)
            return
        if self._service is None:
            self._service = KVIndexService(block, on_link=self._link)
        elif block != self._service.index.block_size:
            if url not in self._refused:
                self._refused.add(url)
                log.warning(
                    "prefix index: %s has block size %d, the index %d: not indexed",
                    url,
                    block,
                    self._service.index.block_size,
                )
            self.forget(index)
            return
        member = Member(url, events.endpoint, events.replay_endpoint, events.topic, found.identity)
        self._keys[index] = url
        self._spawn(self._service.add(member))
        log.info("prefix index: following %s's KV events at %s", url, events.endpoint)

    def stop_telling(self) -> None:
        """From now on a broken link is told to no one (the fleet is closing)."""
        self._on_lost = None

    def _link(self, key: str, up: bool) -> None:
        """A followed member's KV-event link went up or down: down, its process
        most likely died (vLLM's publisher lives as long as its engine)."""
        if up or self._on_lost is None:
            return
        for index, k in list(self._keys.items()):
            if k == key:
                self._on_lost(index)

    def forget(self, index: int) -> None:
        """Member `index` is down, left, or publishes nothing: it holds nothing."""
        key = self._keys.pop(index, None)
        if key is not None and self._service is not None:
            self._service.index.leave(key)  # at once: no placement reads it from now
            self._spawn(self._service.remove(key))

    async def lookup(
        self, body: Body, endpoint: Endpoint, members: int
    ) -> tuple[list[int] | None, tuple[int, ...]]:
        """The prompt's token ids (None: not known here, or no member followed)
        and, per member index below `members`, how many of its leading tokens
        that member holds. A text or chat prompt is tokenized on a thread (the
        tokenizer's first load too), not on the serving loop."""
        if self._service is None or not self._keys:
            return None, ()
        given = token_ids(body.get("prompt")) if endpoint == "completions" else None
        ids = list(given) if given is not None else None
        if ids is None:
            ids = await asyncio.to_thread(self.tokens.ids, body, endpoint)
        if ids is None or self._service is None or not self._keys:
            return ids, ()
        blocks = self._service.index.match(ids)
        size = self._service.index.block_size
        usable = (len(ids) - 1) // size  # vLLM computes a prompt's last token, and its block
        return ids, tuple(
            min(blocks.get(self._keys[i], 0), usable) * size if i in self._keys else 0
            for i in range(members)
        )

    def holdings(self) -> dict[str, tuple[int, bool]]:
        """Per followed member URL: the blocks the index says it holds and
        whether it is in sync with its publisher (out of sync it holds none)."""
        if self._service is None:
            return {}
        index = self._service.index
        members = set(index.members())
        out = {}
        for key in list(self._keys.values()):
            if key in members:
                synced = index.synced(key)
                out[key] = (len(index.blocks(key)) if synced else 0, synced)
        return out

    async def close(self) -> None:
        """Stop every subscription."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._service is not None:
            await self._service.close()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        async def in_turn() -> None:
            async with self._lock:
                await coro

        task = asyncio.ensure_future(in_turn())
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("prefix index: %r", task.exception())


class PrefixCachesCollector(Collector):
    """``rapidkv_router_prefix_index_blocks{upstream}`` (the blocks the index
    says each followed instance holds; 0 while out of sync) and
    ``rapidkv_router_prefix_index_synced{upstream}`` (1 while in sync with its
    publisher), read at each scrape."""

    def __init__(self, caches: PrefixCaches) -> None:
        self.caches = caches

    def collect(self) -> Iterator[GaugeMetricFamily]:
        blocks = GaugeMetricFamily(
            "rapidkv_router_prefix_index_blocks",
            "Blocks the prefix index says the instance holds (0 while out of sync)",
            labels=["upstream"],
        )
        synced = GaugeMetricFamily(
            "rapidkv_router_prefix_index_synced",
            "1 while the prefix index is in sync with the instance's KV events",
            labels=["upstream"],
        )
        for url, (count, ok) in sorted(self.caches.holdings().items()):
            blocks.add_metric([url], count)
            synced.add_metric([url], int(ok))
        yield blocks
        yield synced
