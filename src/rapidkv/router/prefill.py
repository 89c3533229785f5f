"""P's part of a request: sent in the background, its answer dropped.

`Prefills.start` sends P its request (the whole prompt with one output token,
or a split's head: `rewrite.prefill_body`, `split.head_body`) as a task of its
own, counted outstanding on P until it is over. Its answer is read to its end
and dropped, except:

- the first output event of a stitched request, which resolves the request's
  `answer.Stitch.first` (None if P gave none);
- the control address P names in its answer, which the fleet learns
  (`fleet.addresses`: P may have restarted elsewhere).

When P's request is over, the request's prompt KV counts as ready on D
(`Exchange.kv_ready`: P sent it, or D computes it) and the adaptive placement
is told. A P request that failed is logged, counted (`exchange.upstream_error`),
marks P down if it got no status line, and P's connector is sent an Abort
(``prefill_failed``) so that D's TransferKV is answered at once (D recomputes)
rather than after P's park TTL. `stop` ends a P request whose answer can
serve nothing (the client left, D failed): cancelled if it still runs (vLLM
aborts it), and P's connector told with an Abort of that reason.

Rules: a P request never fails the client's; nothing here outlives `close`.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from rapidkv.control.messages import AbortReason
from rapidkv.router.aborts import ControlAborter
from rapidkv.router.config import Instance, RouterConfig
from rapidkv.router.exchange import Exchange, upstream_error
from rapidkv.router.fleet.fleet import Fleet
from rapidkv.router.metrics import RouterMetrics
from rapidkv.router.placement.placer import Placer
from rapidkv.router.stitch import EventSplitter, Payload, StreamError, is_output
from rapidkv.router.upstream import UPSTREAM_ERRORS

log = logging.getLogger(__name__)


class Prefills:
    """The P requests in flight (see the module)."""

    def __init__(
        self,
        config: RouterConfig,
        metrics: RouterMetrics,
        fleet: Fleet,
        placer: Placer | None = None,
    ) -> None:
        self._metrics = metrics
        self._fleet = fleet
        self._placer = placer
        self._aborter = ControlAborter(config.secret, config.abort_timeout_s, metrics)
        self._tasks: set[asyncio.Task[bool]] = set()

    def start(
        self,
        index: int,
        inst: Instance,
        content: bytes,
        ex: Exchange,
        first: asyncio.Future[Payload | None] | None = None,
        path: str | None = None,
    ) -> asyncio.Task[bool]:
        """Send `ex`'s P request (`content`) to member `index` (`inst`, with its
        control address), already counted outstanding there, at `path` (default:
        the client's); `first`: resolved with P's first output event. The task
        is True if P answered 2xx."""
        url = inst.url + (path or ex.path)
        task = asyncio.create_task(self._run(index, inst, url, content, ex, first))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda task: self._done(ex, task))
        return task

    @property
    def running(self) -> int:
        """P requests in flight (some outlive their client's answer: dual dispatch)."""
        return len(self._tasks)

    async def close(self) -> None:
        """Cancel the P requests in flight, close the Abort client."""
        pending = list(self._tasks)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await asyncio.to_thread(self._aborter.close)

    def _done(self, ex: Exchange, task: asyncio.Task[bool]) -> None:
        """P's request failed: tell P's connector, so that D's TransferKV is
        answered at once (GONE: D recomputes) rather than after P's park TTL; a
        split prefill's tail stops waiting for the head."""
        ok = not task.cancelled() and task.exception() is None and task.result()
        ex.kv_ready.set()  # P is done: its KV was sent (or D computes the prompt)
        if self._placer is not None:
            self._placer.prefill_done(ex.xfer_id, ok)
        if ok or task.cancelled():
            return
        if ex.prefill is not None and ex.prefill.control is not None:
            self._aborter.abort(ex.prefill.control, ex.xfer_id, AbortReason.PREFILL_FAILED)

    def stop(self, ex: Exchange, prefill: asyncio.Task[bool] | None, reason: AbortReason) -> None:
        """The client's answer is over and P's part of it can serve nothing (the
        client left, or D refused, never answered or broke off): stop P's request
        if it still runs (vLLM aborts it) and tell P's connector, which frees what
        it holds for the transfer now instead of after `finished_ttl_s`."""
        if ex.prefill is None:
            return  # local dispatch: P was never asked
        log.debug("xfer %s: %s; stopping the prefill", ex.xfer_id, reason.value)
        if prefill is not None and not prefill.done():
            prefill.cancel()
        if ex.prefill.control is not None:
            self._aborter.abort(ex.prefill.control, ex.xfer_id, reason)

    async def _run(
        self,
        index: int,
        inst: Instance,
        url: str,
        content: bytes,
        ex: Exchange,
        first: asyncio.Future[Payload | None] | None = None,
    ) -> bool:
        """P's request: sent to `url`, its answer read and dropped, except its
        first output event, which resolves `first` (None if P gave none). True
        if P answered 2xx."""
        answered = False  # P's status line arrived
        call = ex.tracing.call("rapidkv.prefill", ex.upstream_headers, **{"url.full": url})
        error: str | None = "cancelled"
        try:
            try:
                async with self._fleet.http.post(url, data=content, headers=call.headers) as resp:
                    answered = True
                    call.set("http.response.status_code", resp.status)
                    if first is None or resp.status >= 400:
                        data = await resp.read()
                    else:
                        data = b""
                        await first_output(resp, first)
            except (*UPSTREAM_ERRORS, StreamError) as e:
                kind = "stream" if answered else "connect"
                upstream_error(self._metrics, "prefill", inst, kind, ex, repr(e))
                if not answered:
                    self._fleet.mark_down(index, repr(e))
                error = f"{kind}: {e!r}"
                return False
            if resp.status >= 400:
                detail = f"HTTP {resp.status}: {data[:500]!r}"
                upstream_error(self._metrics, "prefill", inst, "status", ex, detail)
                error = f"HTTP {resp.status}"
                return False
            error = None
            if data:
                self._fleet.addresses.learn(self._fleet.member(index).instance, data)
            log.debug(
                "xfer %s: prefill on %s answered %d after %.3fs",
                ex.xfer_id,
                inst.url,
                resp.status,
                time.monotonic() - ex.t_start,
            )
            return True
        finally:
            call.end(error)
            if first is not None and not first.done():
                first.set_result(None)
            self._fleet.let_go(index)


async def first_output(resp: aiohttp.ClientResponse, first: asyncio.Future[Payload | None]) -> None:
    """Read P's streamed answer to its end; resolve `first` with its first output event."""
    splitter = EventSplitter()
    async for chunk in resp.content.iter_any():
        if first.done():
            continue  # the rest of P's answer (its finish, [DONE]) is dropped
        for event in splitter.feed(chunk):
            if event is not None and is_output(event) and not first.done():
                first.set_result(event)
