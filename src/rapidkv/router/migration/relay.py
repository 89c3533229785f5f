"""Relaying a migratable stream, and moving it to another instance on order.

`MigratingRelay` relays one streamed answer to the client through a
`StreamSplice`, one upstream at a time, and carries out the migrations ordered
through `migrate` (by `controller.MigrationController`, for the admin routes):

1. *pre-copy* (unless the order says stop-and-copy): while the source keeps
   streaming to the client, the destination is sent `bodies.precopy_body` for
   the tokens so far; its answer means those blocks are in its prefix cache;
2. *cut-over*: the router stops reading the source (its events wait in their
   queue), sends the destination `bodies.cutover_body` for the prompt plus the
   tokens the client has, and waits for its first output event. Then the
   source's answer is closed (vLLM aborts the request there; its connector
   holds the blocks until the transfer settled) and the destination's stream
   is relayed from that event on.

Before anything is sent to it, the destination is asked whether it has room
for the tokens so far (`room`): if not, the migration is refused at once (a
vLLM without room would queue the cut-over, not refuse it). If the
destination refuses, fails or gives no first token within
`cutover_timeout_s`, its request is closed and the source's stream resumes
from the queued events: the client sees a pause, nothing else. If the source
breaks off while the destination is being prepared, the cut-over still
completes when the destination can (it recomputes what it could not load);
otherwise the client gets the error event of any broken stream.

Invariants: exactly one upstream's events are relayed at any time and the
switch happens between two events, so the client sees no gap, duplicate or
reordering (`StreamSplice`); every upstream request is counted outstanding on
its instance until closed; nothing outlives the relay (cancelled: every
upstream request it opened is closed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from starlette.types import Send

from rapidkv.router.config import Instance
from rapidkv.router.migration.assemble import Assembler
from rapidkv.router.migration.bodies import cutover_body, precopy_body, remaining_budget
from rapidkv.router.migration.room import Busy
from rapidkv.router.migration.splice import StreamSplice
from rapidkv.router.rewrite import Body, Endpoint, encode
from rapidkv.router.stitch import EventSplitter, Payload, StreamError, is_output, sse
from rapidkv.router.tracing import NO_TRACING, Call, Tracing, request_id
from rapidkv.router.upstream import UPSTREAM_ERRORS

log = logging.getLogger(__name__)

COMPLETIONS = "/v1/completions"  # a continuation is a completions request, chat's too
CUTOVER_TIMEOUT_S = 30.0  # the destination's first token, after which the source resumes


class Fleet(Protocol):
    """What a relay needs of the router's instances (`fleet.Fleet`)."""

    @property
    def http(self) -> aiohttp.ClientSession: ...

    def hold(self, index: int) -> None:
        """Count one more request outstanding on instance `index`."""

    def let_go(self, index: int) -> None:
        """Count one request fewer outstanding on instance `index`."""


class Controller(Protocol):
    """What a relay tells of its migrations, and asks before one
    (`controller.MigrationController`)."""

    def migrated(self, xfer_id: str, index: int, instance: Instance) -> None:
        """The request `xfer_id` runs on instance `index` now."""

    def count_migration(self, outcome: str, downtime_s: float | None = None) -> None:
        """A migration ended (`ok`, `failed` or `refused`)."""

    async def require_room(self, target: Instance, tokens: int) -> None:
        """Raise `room.Busy` if `target` reports no room for `tokens` tokens."""


class MigrationError(Exception):
    """A migration that did not happen; the request runs on where it was."""


@dataclass
class Upstream:
    """One upstream answer being read: its events wait in `queue` until relayed."""

    index: int
    instance: Instance
    xfer_id: str  # the request's xfer_id there (a migration's `migrate_from`)
    resp: aiohttp.ClientResponse
    queue: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    reader: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        splitter = EventSplitter()
        try:
            async for chunk in self.resp.content.iter_any():
                for event in splitter.feed(chunk):
                    self.queue.put_nowait(("event", event))
            self.queue.put_nowait(("end", None))
        except (*UPSTREAM_ERRORS, StreamError) as e:
            self.queue.put_nowait(("error", e))

    def close(self) -> None:
        """Stop reading; closing the connection makes vLLM abort the request."""
        if self.reader is not None:
            self.reader.cancel()
        self.resp.close()


@dataclass
class Order:
    """A migration asked for: to instance `index` (`target`, its control
    address known), from a source whose control address is `source_control`,
    with or without pre-copy."""

    index: int
    target: Instance
    source_control: str | None
    precopy: bool
    result: asyncio.Future[dict[str, Any]]


class MigratingRelay:
    """One migratable streamed answer: relayed, and moved on order."""

    def __init__(
        self,
        fleet: Fleet,
        controller: Controller,
        xfer_id: str,
        endpoint: Endpoint,
        body: Body,
        headers: dict[str, str],
        send: Send | None,
        on_first_output: Callable[[], None],
        tracing: Tracing = NO_TRACING,
    ) -> None:
        """`body`: the client's, streamed (`bodies.streamed`); `headers`: what
        upstream requests carry; `send`: the client's stream (None: the client
        asked for one answer, which `assembled` holds at the end);
        `on_first_output`: called when the client's first output event is sent;
        `tracing`: each migration carried out is a span of the request's."""
        self._fleet = fleet
        self._controller = controller
        self._on_first_output: Callable[[], None] | None = on_first_output
        self._xfer_id = xfer_id
        self._endpoint = endpoint
        self._body = body
        self._headers_base = headers
        self._tracing = tracing
        self._call: Call | None = None  # the migration in progress's span
        self._send = send
        keep = body.get("return_token_ids") is True
        self._splice = StreamSplice(endpoint, keep_token_ids=keep)
        self.assembled = Assembler(endpoint, keep_token_ids=keep) if send is None else None
        self._orders: asyncio.Queue[Order] = asyncio.Queue()
        self._current: Upstream | None = None
        self._count = 0  # migration attempts so far (each has its own xfer_ids)
        self._last_sent = time.monotonic()  # the client's last event

    # ---------------------------------------------------------------- orders

    async def migrate(
        self, index: int, target: Instance, source_control: str | None, precopy: bool = True
    ) -> dict[str, Any]:
        """Move the request to instance `index` (`target`); what happened
        (`MigrationError` if it did not: the request runs on where it was)."""
        loop = asyncio.get_running_loop()
        order = Order(index, target, source_control, precopy, loop.create_future())
        self._orders.put_nowait(order)
        return await order.result

    @property
    def source(self) -> Instance | None:
        """The instance that serves the request now (None before `run`)."""
        return self._current.instance if self._current is not None else None

    @property
    def generated(self) -> int:
        return len(self._splice.generated)

    # ---------------------------------------------------------------- relaying

    async def run(self, index: int, instance: Instance, resp: aiohttp.ClientResponse) -> None:
        """Relay `resp` (the source's answer, its status line already relayed)
        and whatever replaces it, to the end of the stream. Raises what a
        broken upstream stream raises."""
        self._current = Upstream(index, instance, self._xfer_id, resp)
        self._current.start()
        precopy: asyncio.Task[None] | None = None
        order: Order | None = None
        next_order = asyncio.ensure_future(self._orders.get())
        try:
            while True:
                item = asyncio.ensure_future(self._current.queue.get())
                waiting: set[asyncio.Future[Any]] = {item, next_order}
                if precopy is not None:
                    waiting.add(precopy)
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if item in done:
                    if await self._relay_item(item.result()):
                        return
                else:
                    item.cancel()
                if next_order in done:
                    new = next_order.result()
                    next_order = asyncio.ensure_future(self._orders.get())
                    if order is not None:
                        new.result.set_exception(MigrationError("a migration is in progress"))
                        continue
                    why = self._refusal(new)
                    if why is not None:
                        self._refused(new, why)
                        continue
                    order = new
                    self._count += 1  # every attempt gets its own transfer ids
                    self._traced(order)
                    order_t0 = time.monotonic()
                    if order.precopy:
                        precopy = asyncio.create_task(self._precopy(order))
                    else:
                        await self._cut_over(order, order_t0, None)
                        order = None
                if precopy is not None and precopy in done:
                    assert order is not None
                    pre = precopy
                    precopy = None
                    error = pre.exception()
                    if isinstance(error, Busy):
                        self._refused(order, str(error))
                    elif error is not None:
                        self._failed(order, str(error))
                    elif (why := self._refusal(order)) is not None:  # it may have ended since
                        self._refused(order, why)
                    else:
                        await self._cut_over(order, order_t0, pre.result())
                    order = None
        finally:
            next_order.cancel()
            if precopy is not None:
                precopy.cancel()
            if order is not None and not order.result.done():
                order.result.set_exception(MigrationError("the request ended first"))
            self._fail_queued_orders("the request ended first")
            if self._current is not None:
                self._current.close()

    async def _relay_item(self, item: tuple[str, Any]) -> bool:
        """Relay one item of the current upstream's queue; True at the stream's end."""
        kind, value = item
        if kind == "error":
            raise value
        if kind == "end":
            return True
        if self._on_first_output is not None and value is not None and is_output(value):
            self._on_first_output()
            self._on_first_output = None
        await self._emit(self._splice.feed(value))
        return False

    async def _emit(self, event: Payload | None) -> None:
        """One event for the client: sent, or kept for the assembled answer."""
        if self.assembled is not None:
            if event is not None:
                self.assembled.feed(event)
        else:
            assert self._send is not None
            await self._send({"type": "http.response.body", "body": sse(event), "more_body": True})
        self._last_sent = time.monotonic()

    def _refusal(self, order: Order) -> str | None:
        """Why `order` cannot be carried out now (None: it can)."""
        assert self._current is not None
        if order.index == self._current.index:
            return "the request already runs there"
        if self._splice.finished:
            return "the request has finished"
        if self._splice.prompt_ids is None:
            return "the request has not produced its first token yet"
        if order.source_control is None:
            return f"no control address known for {self._current.instance.url}"
        left = remaining_budget(self._body, self._endpoint, len(self._splice.generated))
        if left is not None and left < 1:
            return "no output budget left"
        return None

    def _fail_queued_orders(self, why: str) -> None:
        while not self._orders.empty():
            order = self._orders.get_nowait()
            if not order.result.done():
                order.result.set_exception(MigrationError(why))

    # ---------------------------------------------------------------- migration

    def _migration_id(self, kind: str) -> str:
        """The xfer_id of this attempt's pre-copy or cut-over (unique per attempt)."""
        return f"{self._xfer_id}-m{self._count}{kind}"

    async def _precopy(self, order: Order) -> dict[str, Any]:
        """Load the tokens so far into the destination's prefix cache."""
        assert self._current is not None
        source = self._current
        tokens = self._splice.tokens
        assert order.source_control is not None
        await self._controller.require_room(order.target, len(tokens))
        body = precopy_body(
            self._body,
            self._endpoint,
            tokens,
            self._migration_id("p"),
            order.source_control,
            source.xfer_id,
        )
        target = order.target
        t0 = time.monotonic()
        url = target.url + COMPLETIONS
        timeout = aiohttp.ClientTimeout(total=CUTOVER_TIMEOUT_S)
        try:
            async with self._fleet.http.post(
                url, data=encode(body), headers=self._headers("p"), timeout=timeout
            ) as resp:
                data = await resp.read()
        except UPSTREAM_ERRORS as e:
            raise MigrationError(f"pre-copy to {target.url} failed: {e!r}") from None
        if resp.status >= 400:
            raise MigrationError(f"pre-copy to {target.url}: HTTP {resp.status}: {data[:300]!r}")
        return {
            "precopy_xfer_id": self._migration_id("p"),
            "precopy_tokens": len(tokens),
            "precopy_ms": (time.monotonic() - t0) * 1000,
        }

    async def _cut_over(
        self, order: Order, order_t0: float, precopied: dict[str, Any] | None
    ) -> None:
        """Stop relaying the source, start the destination; resolve `order`."""
        assert self._current is not None and order.source_control is not None
        source = self._current
        t0 = time.monotonic()
        last_sent = self._last_sent
        generated = len(self._splice.generated)
        xfer_id = self._migration_id("c")
        body = cutover_body(
            self._body,
            self._endpoint,
            self._splice.tokens,
            generated,
            xfer_id,
            order.source_control,
            source.xfer_id,
        )
        target = order.target
        if precopied is None:  # stop-and-copy: nothing asked the destination yet
            try:
                await self._controller.require_room(target, len(self._splice.tokens))
            except Busy as e:
                self._refused(order, str(e))
                return
        self._fleet.hold(order.index)
        try:
            dest, payload = await asyncio.wait_for(
                self._open_destination(order.index, target, xfer_id, body), CUTOVER_TIMEOUT_S
            )
        except (MigrationError, TimeoutError) as e:
            self._fleet.let_go(order.index)
            self._failed(
                order, str(e) or f"no first token from {target.url} within {CUTOVER_TIMEOUT_S}s"
            )
            return
        except BaseException:  # cancelled (the client left, shutdown)
            self._fleet.let_go(order.index)
            raise
        # the destination has the KV and its first token: the source goes
        source.close()
        self._current = dest
        self._splice.switch()
        self._controller.migrated(self._xfer_id, order.index, target)
        self._fleet.let_go(source.index)
        await self._emit(self._splice.feed(payload))
        now = self._last_sent
        result = {
            "xfer_id": self._xfer_id,
            "from": source.instance.url,
            "to": target.url,
            "precopy": precopied is not None,
            "cutover_xfer_id": xfer_id,
            "tokens_at_cutover": generated,
            "downtime_ms": (now - last_sent) * 1000,
            "cutover_ms": (now - t0) * 1000,
            "total_ms": (now - order_t0) * 1000,
            **(precopied or {}),
        }
        log.info(
            "xfer %s: migrated %s -> %s after %d tokens (downtime %.1f ms)",
            self._xfer_id,
            source.instance.url,
            target.url,
            generated,
            result["downtime_ms"],
        )
        self._controller.count_migration("ok", now - last_sent)
        order.result.set_result(result)

    def _refused(self, order: Order, why: str) -> None:
        """`order` was refused before anything was sent: the request runs on."""
        assert self._current is not None
        log.info("xfer %s: not migrated (%s); it runs on", self._xfer_id, why)
        self._controller.count_migration("refused")
        order.result.set_exception(MigrationError(why))

    def _failed(self, order: Order, why: str) -> None:
        """`order` did not happen (pre-copy or cut-over): the request runs on."""
        assert self._current is not None
        log.warning(
            "xfer %s: migration to %s failed (%s); it runs on on %s",
            self._xfer_id,
            order.target.url,
            why,
            self._current.instance.url,
        )
        self._controller.count_migration("failed")
        order.result.set_exception(MigrationError(why))

    async def _open_destination(
        self, index: int, target: Instance, xfer_id: str, body: Body
    ) -> tuple[Upstream, Payload]:
        """The destination's streamed answer, read up to its first output event."""
        url = target.url + COMPLETIONS
        try:
            resp = await self._fleet.http.post(url, data=encode(body), headers=self._headers("c"))
        except UPSTREAM_ERRORS as e:
            raise MigrationError(f"{target.url} did not answer: {e!r}") from None
        dest = Upstream(index, target, xfer_id, resp)
        ok = False
        try:
            if resp.status >= 400:
                detail = (await resp.read())[:300]
                raise MigrationError(f"{target.url} answered HTTP {resp.status}: {detail!r}")
            dest.start()
            while True:
                kind, value = await dest.queue.get()
                if kind == "error":
                    raise MigrationError(f"{target.url} broke off: {value!r}")
                if kind == "end" or value is None:
                    raise MigrationError(f"{target.url} ended without output")
                if "error" in value and "choices" not in value:
                    raise MigrationError(f"{target.url} sent an error: {value['error']!r}")
                if is_output(value):
                    ok = True
                    return dest, value
        finally:
            if not ok:
                dest.close()

    def _headers(self, kind: str) -> dict[str, str]:
        """A migration request's: the migration span's context, the client's
        x-request-id (or, where the router made one up, the attempt's)."""
        base = self._call.headers if self._call is not None else self._headers_base
        return request_id(base, self._xfer_id, self._migration_id(kind))

    def _traced(self, order: Order) -> None:
        """`order`, carried out from now on, is a span until its result."""
        assert self._current is not None
        call = self._tracing.call(
            "rapidkv.migration",
            self._headers_base,
            source=self._current.instance.url,
            target=order.target.url,
            precopy=order.precopy,
            attempt=self._count,
        )
        self._call = call

        def over(result: asyncio.Future[dict[str, Any]]) -> None:
            error = None if result.cancelled() else result.exception()
            call.end(None if error is None else str(error) or repr(error))
            if self._call is call:
                self._call = None

        order.result.add_done_callback(over)
