"""Serving one OpenAI completions or chat completions request: placed,
dispatched to its instances, answered.

Theory of operation
-------------------
`Router.serve` is the ASGI handler of ``POST /v1/completions`` and
``POST /v1/chat/completions``. It reads the client's body (413 over
``max_body_bytes``), checks it (`rewrite.parse_request`, 400 if refused) and
asks `fanout.plan` whether it is several sequences: a batch of prompts, or
``n > 1`` with sampling, fans out (`fanout.relay`), each sequence served by
`serve_one` as a request of its own (a lead is placed as any request; its
followers run locally on the lead's decode instance once its prompt KV is
there) and the answers merged into vLLM's one answer. Anything else is one
request for `serve_one`, which gives it a fresh ``xfer_id`` (also its
upstream ``x-request-id`` when the client sent none: `tracing`) and an
`Exchange`, listed while it runs (the admin routes, a migration, a fan-out's
followers find it there). Each request is a span (`tracing`), with its
placement, P's and D's requests and migrations as child spans.

Where it runs comes from one of two placements:

- ``--placement fixed``: D is the least outstanding available instance that
  may decode (ties in turn: `fleet.balance`), P the least outstanding other
  instance that may prefill; in ``dual`` mode (with ``split_prefill``, the
  default) the prompt of a request `split.splittable` allows is split while P
  and every instance that may decode have nothing else in flight (`split`);
- ``--placement adaptive``: once the start-up discoveries settled (block
  sizes, max_num_seqs), `placement.placer.Placer` decides local, PD, split
  or fetch (and the head's size) from learned costs, the SLOs and, with the
  prefix index (`fleet.prefix_caches`), the prompt's token ids and what each
  instance holds of them cached; 503 if no instance can take the request. It
  is told where the request really went, when P is done, D's first token and
  the end, and learns from them.

It is then dispatched by the configured mode:

- ``dual``: P's request is started in the background (`prefill`), and D's at
  once, without waiting for P. A split sends P only a block-aligned head of
  the prompt (as token ids, from P's ``/tokenize``) while D computes the tail;
  a fetch is a split whose head P holds cached: P is sent the head and one
  token more (the ids the router tokenized), so that it hits the whole head;
- ``serial``: P's request is sent and its answer awaited, then D's is sent
  (the conventional flow, for comparison);
- ``local``: D alone computes the prompt; it is sent the client's bytes
  untouched (a migratable request: streamed, tagged with its ``xfer_id``). A
  request placed local, one that is not a single transfer
  (`rewrite.transferable`: several engine requests, prompt logprobs), one whose
  decoder is the only instance that may prefill, and one with no prefill
  instance available (counted in ``without_prefill``) go this way in any mode.

P's control address (and block size) come from discovery (`fleet.addresses`)
when not configured; P's answers update it. D's body names P's control
address, so D's connector loads the prompt's KV from P (`rewrite`).

D's answer is relayed to the client as it arrives (`answer`), with the
request's ``x-rapidkv-xfer-id`` and ``x-rapidkv-placement`` headers; P's
answer is dropped (`prefill`). In ``dual`` mode with ``prefill_first_token``
(the default), a request `rewrite.stitchable` allows (streamed, greedy
completion) that is neither split nor migratable is *stitched*: P streams its
one token, and the first of P's and D's first tokens opens the client's
stream (`stitch`). With an admin token, a request `migration.bodies` finds
migratable is sent to D streamed and relayed event by event through a
`migration.relay.MigratingRelay`, so that ``/admin/migrate`` and
``/admin/drain`` (`migration.controller`) can move it to another instance
mid-answer.

While it serves, a watcher waits for the client's ``http.disconnect``. If it
comes before the answer is relayed in full, both upstream requests are
cancelled (closing an upstream connection makes vLLM abort the request) and,
when P's control address is known, P is sent a control-plane Abort
(`prefill.Prefills.stop`, fire and forget).

The instances, their health, outstanding counts, draining and etcd
membership are the fleet's (`fleet.fleet.Fleet`); this module only asks it.

Rules
-----
- A failed P request (error status, no answer) never fails the client in
  ``dual`` or ``serial`` mode: D's connector recomputes what P did not send. It
  is logged (warning) and counted, and P's connector is sent an Abort
  (``prefill_failed``), so that D's TransferKV is answered at once; a split's
  tail stops waiting for the head.
- A D error status is relayed as is (status and body); a D that does not
  answer gives the client 502. In both cases, and when D's answer breaks off,
  P's request is stopped if it still runs and P's connector is sent an Abort
  (``decode_failed``): P frees its blocks at once. A D stream that breaks off
  ends at once with an error event the client can read, as vLLM's own errors
  mid-stream do (``data: {"error": ...}`` then ``data: [DONE]``). A
  non-streamed D answer that breaks off closes the client's connection before
  the announced end, so the client sees it truncated.
- An instance whose request got no status line is down: nothing is
  dispatched to it until its ``/health`` answers 200 (`fleet.Fleet.mark_down`).
  With no P available, dual and serial requests go to D alone; with no D up
  and not draining, the client gets 503 at once and P is not asked.
- In ``dual`` mode P's request outlives the client's answer when it is slower:
  it runs to its end in the background (cancelled only by a client disconnect
  or shutdown), so the connector on P sees a normal request.
- Every upstream request counts as outstanding on its instance from the moment
  the instance is picked until the request is over, whatever the outcome (on
  the instance it ended on, if it migrated); D's, until its answer is complete:
  the client's next request, sent as soon as it read ``data: [DONE]``, finds D
  idle even while D's HTTP answer has yet to end (`exchange.CountingSend`).
- All state lives on the event loop that runs the ASGI app: no locks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Literal

from starlette.types import Message, Receive, Scope, Send

from rapidkv.control.messages import AbortReason
from rapidkv.router.answer import AnswerRelay, Stitch
from rapidkv.router.asgi import send_error, wait_disconnect
from rapidkv.router.config import RouterConfig
from rapidkv.router.exchange import PATHS, CountingSend, Exchange
from rapidkv.router.fanout.plan import plan
from rapidkv.router.fanout.relay import FanOut
from rapidkv.router.fleet.fleet import Fleet
from rapidkv.router.fleet.prefix_caches import PrefixCachesCollector
from rapidkv.router.metrics import RouterMetrics
from rapidkv.router.migration.bodies import local_body, migratable, streamed
from rapidkv.router.migration.controller import MigrationController
from rapidkv.router.model_metrics import ModelsCollector
from rapidkv.router.placement import NoPlacement, Placement
from rapidkv.router.placement.placer import adaptive_placer
from rapidkv.router.prefill import Prefills
from rapidkv.router.rewrite import (
    BadRequest,
    Body,
    Endpoint,
    client_transfer_kv_mode,
    decode_body,
    encode,
    new_xfer_id,
    parse_request,
    prefill_body,
    stitchable,
    transferable,
)
from rapidkv.router.split import head_body, prompt_ids, split_point, splittable
from rapidkv.router.stitch import FirstTokenStitch
from rapidkv.router.tracing import Tracing, upstream_headers

log = logging.getLogger(__name__)

# outcomes of D's request after which P's part of it is stopped and aborted
DECODE_FAILURES = frozenset({"upstream_error", "unreachable", "stream_error"})


class BodyTooLarge(Exception):
    pass


class Router:
    """The request path of one router (see the module): its fleet, its
    migrations, and the requests being served."""

    def __init__(self, config: RouterConfig, tracer_provider: Any = None) -> None:
        """`tracer_provider`: where its spans go (None: the process's global
        provider; `tracing`)."""
        self.config = config
        self.tracing = Tracing(tracer_provider)
        self.metrics = RouterMetrics(config)
        self._placer = adaptive_placer(config)
        self.fleet = Fleet(config, self.metrics, self._placer)
        if self._placer is not None:
            self.metrics.registry.register(
                ModelsCollector(
                    self._placer.models,
                    lambda: [m.instance.url for m in self.fleet.members],
                    self._placer.fleet,
                    self._placer.shape,
                )
            )
        if self.fleet.prefix_caches is not None:
            self.metrics.registry.register(PrefixCachesCollector(self.fleet.prefix_caches))
        self._exchanges: dict[str, Exchange] = {}  # requests being served, by xfer_id
        self.migrations = MigrationController(
            self.fleet, self._exchanges, self.metrics, self._placer
        )
        self._answers = AnswerRelay(config, self.metrics, self.fleet, self.migrations, self._placer)
        self._prefills = Prefills(config, self.metrics, self.fleet, self._placer)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start the fleet (its upstream HTTP client) on the serving loop."""
        await self.fleet.start()

    async def close(self) -> None:
        """Cancel background prefill requests, close the fleet and the RPC clients."""
        await self._prefills.close()
        await self.fleet.close()
        await self.migrations.close()

    @property
    def background(self) -> int:
        """P requests still running after their client's answer ended (dual dispatch)."""
        return self._prefills.running

    def requests(self) -> list[dict[str, Any]]:
        """The requests being served: where each runs and how far it got."""
        now = time.monotonic()
        return [ex.describe(now) for ex in self._exchanges.values()]

    # ------------------------------------------------------------------ serving

    async def serve(self, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI handler of one completions / chat completions request (one span)."""
        with self.tracing.request(scope, endpoint):
            await self._serve(endpoint, scope, receive, send)

    async def _serve(self, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send) -> None:
        dispatch = self.config.dispatch
        limit = self.config.max_body_bytes
        try:
            declared = _content_length(scope)
            if declared is not None and declared > limit:  # refused before it is read
                raise BodyTooLarge
            raw = await _read_body(receive, limit)
        except BodyTooLarge:
            await send_error(send, 413, f"request body larger than {limit} bytes")
            self.metrics.requests.labels(endpoint, dispatch, "bad_request").inc()
            return
        if raw is None:  # the client left while sending its body
            self.metrics.requests.labels(endpoint, dispatch, "client_abort").inc()
            return
        try:
            body = parse_request(raw)
            subs = plan(body, endpoint)
        except BadRequest as e:
            log.debug("%s request refused: %s", endpoint, e.message)
            await send_error(send, 400, e.message, e.param)
            self.metrics.requests.labels(endpoint, dispatch, "bad_request").inc()
            return
        if subs is not None:
            await FanOut(self, endpoint, body, subs, upstream_headers(scope)).run(receive, send)
            return
        await self.serve_one(endpoint, body, raw, upstream_headers(scope), receive, send)

    async def serve_one(
        self,
        endpoint: Endpoint,
        body: Body,
        raw: bytes,
        headers: dict[str, str],
        receive: Receive,
        send: Send,
        *,
        pinned: int | None = None,
        on_exchange: Callable[[Exchange], None] | None = None,
    ) -> str:
        """Serve one request (one engine request on vLLM) whose body was read
        and checked; its answer goes to `send`. `pinned`: decode it on that
        instance, computing its prompt there (local). `on_exchange` is told its
        `Exchange` once it exists. Returns the outcome."""
        dispatch = self.config.dispatch
        ex = Exchange(endpoint, new_xfer_id(), time.monotonic(), dict(headers), self.tracing)
        ex.upstream_headers.setdefault("x-request-id", ex.xfer_id)  # the client's, if given
        if on_exchange is not None:
            on_exchange(ex)
        outcome = "error"  # unless _route returns: a router failure, or shutdown
        self.metrics.in_flight.inc()
        self._exchanges[ex.xfer_id] = ex
        try:
            outcome = await self._route(ex, body, raw, receive, send, pinned)
            return outcome
        finally:
            ex.kv_ready.set()
            del self._exchanges[ex.xfer_id]
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(endpoint, dispatch, outcome).inc()
            self.tracing.event("rapidkv.sequence", xfer_id=ex.xfer_id, outcome=outcome)
            self.metrics.placed.labels(ex.kind or "none", outcome).inc()
            log.debug(
                "xfer %s: %s %s P=%s D=%s -> %s (D status %s) in %.3fs",
                ex.xfer_id,
                dispatch,
                endpoint,
                ex.prefill.url if ex.prefill else None,
                ex.decode.url if ex.decode else None,
                outcome,
                ex.status,
                time.monotonic() - ex.t_start,
            )

    async def _route(
        self,
        ex: Exchange,
        body: dict[str, Any],
        raw: bytes,
        receive: Receive,
        send: Send,
        pinned: int | None = None,
    ) -> str:
        """Dispatch `ex` (on D `pinned`, locally, if given); return its outcome
        (see `metrics.OUTCOMES`)."""
        mode = self.config.dispatch
        if pinned is not None:
            return await self._route_pinned(ex, body, raw, receive, send, pinned)
        if not self.fleet.up("decode"):  # nothing can answer: P is not asked either
            why = self.fleet.down_reasons()
            await send_error(send, 503, f"no decode instance is up and not draining: {why}")
            return "unavailable"
        # fixed: P by least outstanding, split while idle
        p_index: int | Literal["least"] | None = "least"
        split: float | Literal["auto"] | None = "auto"
        fetch = 0
        if self._placer is not None:
            await self.fleet.addresses.settled()
            splits = self.config.split_prefill and splittable(body, ex.endpoint)
            splits = splits and client_transfer_kv_mode(body) in (None, "substep")
            caches = self.fleet.prefix_caches
            if caches is not None:
                ex.prompt_ids, ex.cached = await caches.lookup(
                    body, ex.endpoint, len(self.fleet.members)
                )
            try:
                decision, request = self._placer.decide(
                    body, ex.endpoint, splits, ex.prompt_ids, ex.cached
                )
            except NoPlacement as e:
                await send_error(send, 503, f"no instance can take the request: {e}")
                return "unavailable"
            ex.decision = decision
            ex.estimated_tokens, ex.output_tokens = request.prompt_tokens, request.output_tokens
            d_index = decision.decode
            self.fleet.hold(d_index)
            p_index = None if decision.kind == "local" else decision.prefill
            split = None
            if decision.kind == "split":
                ex.estimated_tokens = max(ex.estimated_tokens, decision.head_tokens + 1)
                split = decision.head_tokens / ex.estimated_tokens
            elif decision.kind == "fetch":
                fetch = decision.head_tokens
        else:
            d_index = self.fleet.acquire("decode")
        ex.decode = self.fleet.member(d_index).instance
        ex.decode_index = d_index
        if self.config.admin_token is not None:
            ex.unmigratable = migratable(body, ex.endpoint)
        outcome = "error"
        counted = CountingSend(send, ex, lambda ok: self._answered(ex, ok))
        try:
            outcome = await self._route_to(
                ex, body, raw, receive, counted, mode, d_index, p_index, split, fetch
            )
            return outcome
        finally:
            self._answered(ex, outcome == "ok")

    async def _route_pinned(
        self, ex: Exchange, body: Body, raw: bytes, receive: Receive, send: Send, d_index: int
    ) -> str:
        """Dispatch `ex` locally on `d_index` (a fan-out's follower: its prompt's
        KV is there already, or is computed there)."""
        self.fleet.hold(d_index)
        ex.decode = self.fleet.member(d_index).instance
        ex.decode_index = d_index
        if self.config.admin_token is not None:
            ex.unmigratable = migratable(body, ex.endpoint)
        counted = CountingSend(send, ex, lambda ok: self._answered(ex, ok))
        outcome = "error"
        try:
            outcome = await self._route_to(
                ex, body, raw, receive, counted, "local", d_index, None, None
            )
            return outcome
        finally:
            self._answered(ex, outcome == "ok")

    def _answered(self, ex: Exchange, ok: bool | None) -> None:
        """`ex`'s answer is complete (or it is over): it is no longer
        outstanding on its decode instance (where it ended, if it migrated),
        once; and, once `ok` says how it ended (None: not known yet), the
        placer learns that it finished (`Exchange.placed`)."""
        if not ex.answered:
            ex.answered = True
            ex.served = ok is True
            self.fleet.let_go(ex.decode_index)
        if ok is not None and ex.placed and self._placer is not None:
            ex.placed = False
            self._placer.finished(ex.xfer_id, ex.output_events, ok=ok)

    async def _route_to(
        self,
        ex: Exchange,
        body: dict[str, Any],
        raw: bytes,
        receive: Receive,
        send: Send,
        mode: str,
        d_index: int,
        p_choice: int | Literal["least"] | None,
        split: float | Literal["auto"] | None,
        fetch: int = 0,
    ) -> str:
        """Dispatch `ex`, whose decode instance is `d_index`, its prompt computed
        on `p_choice` (an index; None: locally on D; ``least``: the least busy of
        the other instances that may prefill). `split`: ``auto`` (split while P
        and D are idle), None (never), or the head's share of the prompt.
        `fetch`: the head `p_choice` holds cached and sends (a fetch: P is sent
        the head and one token more, so that it hits the whole head and
        computes that one token). Returns the outcome."""
        assert ex.decode is not None
        if mode != "local" and p_choice is None:
            mode = "local"
        elif mode != "local" and not transferable(body, ex.endpoint):
            # several engine requests would share one xfer_id, or D would compute
            # the prompt anyway (prompt logprobs): one instance serves it all
            log.debug("xfer %s: served on D alone (not one transfer)", ex.xfer_id)
            mode = "local"
        elif mode != "local" and p_choice == "least":
            others = [i for i in self.fleet.pool("prefill") if i != d_index]
            if not others:
                mode = "local"  # the decoder is the only instance that may prefill
            elif not any(self.fleet.available(i) for i in others):
                mode = "local"  # D computes the prompt itself
                self.metrics.without_prefill.inc()
        migrating = ex.unmigratable is None
        stitching = (
            mode == "dual"
            and self.config.prefill_first_token
            and stitchable(body, ex.endpoint)
            and not migrating  # a migratable stream is relayed event by event (`migration`)
        )
        stitch: Stitch | None = None
        gone = asyncio.create_task(wait_disconnect(receive))
        prefill: asyncio.Task[bool] | None = None
        relay: asyncio.Task[str] | None = None
        try:
            p_index = -1
            if mode != "local":
                if isinstance(p_choice, int):
                    p_index = p_choice
                    self.fleet.hold(p_index)
                else:
                    p_index = self.fleet.acquire("prefill", exclude=d_index)
                ex.prefill = self.fleet.member(p_index).instance
                try:
                    ex.prefill = await self.fleet.addresses.with_control(ex.prefill, ex.xfer_id)
                except BaseException:
                    self.fleet.let_go(p_index)
                    raise
                if ex.prefill.control is None and self.config.discover:
                    # P's control address could not be learned: D computes the
                    # prompt whatever P does, and P would hold the KV it computed
                    # for `finished_ttl_s`, for a TransferKV that never comes
                    self.fleet.let_go(p_index)
                    ex.prefill = None
                    mode, stitching = "local", False
                    self.metrics.without_prefill.inc()
            if mode == "local":
                d_content = encode(local_body(streamed(body), ex.xfer_id)) if migrating else raw
                self._dispatched(ex, "local", d_index, d_index)
                ex.kv_ready.set()  # D computes the prompt
            else:
                assert ex.prefill is not None
                head, ids = 0, None
                try:
                    if fetch and ex.prompt_ids is not None and self._can_split(ex, body):
                        head, ids = fetch, ex.prompt_ids
                    elif split == "auto":
                        if mode == "dual" and self._may_split(ex, body, p_index, d_index):
                            head, ids = await self._split_point(ex, body)
                    elif split is not None and self._can_split(ex, body):
                        head, ids = await self._split_point(ex, body, split)
                except BaseException:
                    self.fleet.let_go(p_index)
                    raise
                fetched = bool(fetch) and head == fetch
                kind = "fetch" if fetched else "split" if head else "pd"
                self._dispatched(ex, kind, p_index, d_index, head)
                if head:
                    assert ids is not None
                    stitching = False  # P's token ends the head, not the prompt
                    self.metrics.split_prefills.inc()
                if stitching:
                    stitch = Stitch(
                        body,
                        FirstTokenStitch(
                            keep_token_ids=body.get("return_token_ids") is True,
                            debug_mismatch=self.config.debug_first_token_mismatch,
                        ),
                        asyncio.get_running_loop().create_future(),
                    )
                p_path = ex.path
                if head and ids is not None:
                    p_path = PATHS["completions"]  # a chat's head too: a completion of its ids
                    p_content = encode(
                        head_body(body, ex.endpoint, ex.xfer_id, ids, head + 1 if fetched else head)
                    )
                else:
                    p_content = encode(
                        prefill_body(body, ex.endpoint, ex.xfer_id, first_token=stitching)
                    )
                first = stitch.first if stitch is not None else None
                prefill = self._prefills.start(p_index, ex.prefill, p_content, ex, first, p_path)
                if mode == "serial":
                    await asyncio.wait({prefill, gone}, return_when=asyncio.FIRST_COMPLETED)
                    if not prefill.done():
                        self._prefills.stop(ex, prefill, AbortReason.CLIENT_ABORT)
                        return "client_abort"
                d_content = encode(
                    decode_body(
                        streamed(body) if migrating else body,
                        ex.xfer_id,
                        ex.prefill,
                        first_token=stitching or migrating,
                        split=head,
                    )
                )
            relay = asyncio.create_task(
                self._answers.relay(
                    d_index, ex.decode, d_content, ex, send, stitch, body if migrating else None
                )
            )
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
            if relay.done():
                outcome = relay.result()
                if outcome in DECODE_FAILURES:
                    self._prefills.stop(ex, prefill, AbortReason.DECODE_FAILED)
                return outcome
            relay.cancel()
            await asyncio.gather(relay, return_exceptions=True)
            if ex.served:  # it left after the answer's end (data: [DONE]): served
                return "ok"
            self._prefills.stop(ex, prefill, AbortReason.CLIENT_ABORT)
            return "client_abort"
        except asyncio.CancelledError:  # shutdown: nothing may outlive the request
            if prefill is not None:
                prefill.cancel()
            raise
        finally:
            gone.cancel()
            if relay is not None and not relay.done():
                relay.cancel()

    async def _split_point(
        self, ex: Exchange, body: Body, fraction: float | None = None
    ) -> tuple[int, list[int] | None]:
        """The head P computes (0: no split), about `fraction` of the prompt
        (default `split_fraction`), and the prompt's token ids."""
        assert ex.prefill is not None and ex.prefill.block_size is not None
        ids = await prompt_ids(
            self.fleet.http,
            ex.prefill.url,
            body,
            ex.endpoint,
            self.config.connect_timeout_s,
            {k: v for k, v in ex.upstream_headers.items() if k == "authorization"},
        )
        if not ids:
            return 0, None
        fraction = self.config.split_fraction if fraction is None else fraction
        head = split_point(len(ids), ex.prefill.block_size, fraction, self.config.split_min_tokens)
        return head, ids

    def _may_split(self, ex: Exchange, body: Body, p_index: int, d_index: int) -> bool:
        """Split this request's prefill: enabled, possible for this request and
        P, not asked for in a `transfer_kv_mode` that sends P's KV after its step
        (the client measures that mode), and nothing else in flight on P or on
        any instance that may decode (but this request's two parts)."""
        mine = {p_index, d_index}
        watched = {p_index, *self.fleet.pool("decode")}
        busy = self.fleet.outstanding_on
        return (
            self.config.split_prefill
            and self._can_split(ex, body)
            and all(busy(i) == (1 if i in mine else 0) for i in watched)
        )

    def _can_split(self, ex: Exchange, body: Body) -> bool:
        """This request's prompt may be split between its P and D: P's control
        address and block size are known, the request is a single-prompt
        completion or a text chat (`split.splittable`), not in a
        `transfer_kv_mode` that sends P's KV after its step (the client
        measures that mode)."""
        p = ex.prefill
        return (
            p is not None
            and p.control is not None
            and p.block_size is not None
            and splittable(body, ex.endpoint)
            and client_transfer_kv_mode(body) in (None, "substep")
        )

    def _dispatched(
        self, ex: Exchange, kind: str, p_index: int, d_index: int, head: int = 0
    ) -> None:
        """Where `ex` really went (a split that could not be made is PD): the
        placements metric, its header value, its span, the placement state."""
        ex.tracing.placement(
            ex.t_start,
            kind=kind,
            prefill=None if kind == "local" else self.fleet.member(p_index).instance.url,
            decode=self.fleet.member(d_index).instance.url,
            head_tokens=head or None,
            reason=ex.decision.reason if ex.decision is not None else "fixed",
        )
        ex.kind = kind
        if self._placer is None or ex.decision is None:
            self.metrics.placements.labels(kind, "fixed").inc()
            ex.placement = f"kind={kind};prefill={p_index};decode={d_index};reason=fixed"
            return
        placement = Placement(  # with what the index said the two instances hold
            kind,  # type: ignore[arg-type]
            p_index,
            d_index,
            head,
            0 if kind == "local" else _hit(ex.cached, p_index),
            _hit(ex.cached, d_index),
        )
        ex.decision = dataclasses.replace(ex.decision, placement=placement)
        self.metrics.placements.labels(kind, ex.decision.reason).inc()
        ex.placement = ex.decision.header_value()
        prompt_tokens = max(ex.estimated_tokens, head + 1)
        self._count_prefix_tokens(placement, prompt_tokens)
        self._placer.dispatched(ex.xfer_id, placement, prompt_tokens, ex.output_tokens)
        ex.placed = True

    def _count_prefix_tokens(self, placement: Placement, prompt_tokens: int) -> None:
        """The prompt's tokens by what became of them (`metrics`: hit, fetched, computed)."""
        computed = sum(placement.work(prompt_tokens).values())
        fetched = placement.transferred(prompt_tokens) if placement.kind == "fetch" else 0
        tokens = self.metrics.prefix_tokens
        tokens.labels("computed").inc(computed)
        tokens.labels("fetched").inc(fetched)
        tokens.labels("hit").inc(max(prompt_tokens - computed - fetched, 0))


# ---------------------------------------------------------------------- ASGI helpers


def _hit(cached: tuple[int, ...], index: int) -> int:
    return cached[index] if index < len(cached) else 0


def _content_length(scope: Scope) -> int | None:
    """The request's declared body size (the HTTP server has validated it), if any."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body; None if the client disconnected first."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)
