"""Serving one OpenAI request through a prefill (P) and a decode (D) instance.

Theory of operation
-------------------
`Router.serve` is the ASGI handler of ``POST /v1/completions`` and
``POST /v1/chat/completions``. It reads and checks the client's body
(`rewrite.parse_request`), gives the request a fresh ``xfer_id``, picks P and D
(least outstanding, ties in turn) and dispatches by the configured mode:

- ``dual``: P's request is started, and D's at once, without waiting for P;
  while P and D have nothing else to do, P is sent only a head of the prompt
  and D computes the tail at the same time (`split`);
- ``serial``: P's request is sent and its answer awaited, then D's is sent
  (the conventional flow, for comparison);
- ``local``: only D, sent the client's bytes untouched. A request that is
  several engine requests on vLLM and does not fan out (`fanout.plan`: greedy
  ``n > 1``, ``best_of``, a prompt list vLLM refuses) goes this way in any
  mode: its engine requests would all carry the same ``kv_transfer_params``,
  and no transfer could serve them.

A batch of prompts or ``n > 1`` with sampling fans out (`fanout.relay`): each
sequence is served by `serve_one` as a request of its own, and the answers
are merged into vLLM's one answer.

D's answer (status, headers, body) is relayed to the client as it arrives,
streaming or not, byte for byte; P's answer is dropped. Except, in ``dual``
mode, for a request `rewrite.stitchable` allows (streamed, greedy completion):
P streams its one token, and the first of P's and D's first tokens opens the
client's stream; D's stream follows without the token P gave (`stitch`).

While it serves, a watcher waits for the client's ``http.disconnect``. If it
comes before the answer is relayed in full, both upstream requests are
cancelled (closing an upstream connection makes vLLM abort the request) and,
when P's control address is known, P is sent a control-plane Abort
(`aborts.ControlAborter`, fire and forget).

Rules
-----
- A failed P request (error status, no answer) never fails the client in
  ``dual`` or ``serial`` mode: D's connector recomputes what P did not send. It
  is logged (warning) and counted, and P's connector is sent an Abort
  (``prefill_failed``), so that D's TransferKV is answered at once.
- A D error status is relayed as is (status and body); a D that does not
  answer gives the client 502. In both cases, and when D's answer breaks off,
  P's request is stopped if it still runs and P's connector is sent an Abort
  (``decode_failed``): P frees its blocks at once. A D stream that breaks off
  ends at once with an error event the client can read, as vLLM's own errors
  mid-stream do
  (``data: {"error": ...}`` then ``data: [DONE]``). A non-streamed D answer that
  breaks off closes the client's connection before the announced end, so the
  client sees it truncated.
- An instance whose request got no status line is down (`health`): nothing is
  dispatched to it until its ``/health`` answers 200 (probed every
  ``probe_interval_s``). With no P up, dual and serial requests go to D alone;
  with no D up, the client gets 503 at once and P is not asked.
- In ``dual`` mode P's request outlives the client's answer when it is slower:
  it runs to its end in the background (cancelled only by a client disconnect
  or shutdown), so the connector on P sees a normal request.
- Every upstream request counts as outstanding on its instance from the moment
  the instance is picked until the request is over, whatever the outcome.
- All state lives on the event loop that runs the ASGI app: no locks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
from starlette.types import Message, Receive, Scope, Send

from rapidkv.control.messages import AbortReason
from rapidkv.membership.record import InstanceRecord
from rapidkv.router.aborts import ControlAborter
from rapidkv.router.asgi import send_error, wait_disconnect
from rapidkv.router.fleet.balance import LeastOutstanding
from rapidkv.router.config import ROLES, Instance, Member, Role, RouterConfig
from rapidkv.router.fleet.discovery import (
    Discovered,
    DiscoveryError,
    discover_control,
    discovered_from_answer,
)
from rapidkv.router.fanout.plan import plan
from rapidkv.router.fanout.relay import FanOut
from rapidkv.router.fleet.health import InstanceHealth
from rapidkv.router.fleet.membership_diff import Left, MembershipDiff
from rapidkv.router.metrics import RouterMetrics
from rapidkv.router.migration.bodies import local_body, migratable, streamed
from rapidkv.router.migration.relay import MigratingRelay, MigrationError
from rapidkv.router.migration.room import RoomCheck
from rapidkv.router.model_metrics import ModelsCollector
from rapidkv.router.placement import (
    SLO,
    Decision,
    NoPlacement,
    Placement,
    Policy,
    Specializer,
)
from rapidkv.router.placement.placer import Placer
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
from rapidkv.router.sse import FirstTokenDetector, sse_error
from rapidkv.router.stitch import (
    EventSplitter,
    FirstTokenStitch,
    Payload,
    StreamError,
    continuation_body,
    is_output,
)
from rapidkv.router.fleet.transfer_watcher import TransferWatcher
from rapidkv.router.upstream import UPSTREAM_ERRORS, get, open_session

log = logging.getLogger(__name__)

PATHS: dict[Endpoint, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}

# Response headers not relayed from D: per-connection ones, and those the
# router's own HTTP server sets.
NOT_RELAYED = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
        b"date",
        b"server",
    }
)
# Request headers passed from the client to P and D.
PASSED_ON = (b"authorization", b"accept-encoding")
XFER_HEADER = b"x-rapidkv-xfer-id"
PLACEMENT_HEADER = b"x-rapidkv-placement"  # where the request ran (`placement.Decision`)
# a stitch's resolved state -> where the client's first token came from
FIRST_TOKEN_SOURCE = {"matched": "prefill", "decode_first": "decode", "mismatched": "continuation"}
DISCOVERY_RETRY_S = 10.0  # a failed control-address probe is repeated at most this often
# outcomes of D's request after which P's part of it is stopped and aborted
DECODE_FAILURES = frozenset({"upstream_error", "unreachable", "stream_error"})


class BodyTooLarge(Exception):
    pass


@dataclass(frozen=True)
class Stitch:
    """A request whose stream P's first token may open: the client's body (for a
    continuation), the merge of the two streams, and P's first output event."""

    body: Body
    merge: FirstTokenStitch
    first: asyncio.Future[Payload | None]


@dataclass
class Exchange:
    """One client request on its way through the router."""

    endpoint: Endpoint
    xfer_id: str
    t_start: float
    upstream_headers: dict[str, str]
    prefill: Instance | None = None
    decode: Instance | None = None
    status: int | None = None  # D's status
    placement: str | None = None  # the x-rapidkv-placement header's value
    decision: Decision | None = None  # adaptive placement's, for the request
    output_events: int = 0  # streamed output events relayed (about the tokens)
    estimated_tokens: int = 0  # the prompt's length as placement estimated it
    output_tokens: int = 0  # the output it asks for, as placement read it
    decode_index: int = -1  # the instance that decodes it now (counted outstanding)
    # why it cannot be migrated (None: it can, once `relay` exists)
    unmigratable: str | None = "migration is off (no admin token)"
    relay: MigratingRelay | None = None  # a migratable stream's, once streaming
    # set once D has the prompt's KV or computes it (D's first token, P's answer,
    # local dispatch, or the request's end): a fan-out's followers wait for it
    kv_ready: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    @property
    def path(self) -> str:
        return PATHS[self.endpoint]


class Router:
    """The request-serving state of one router: config, HTTP client, balancers, metrics."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.metrics = RouterMetrics(config)
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
        self._exchanges: dict[str, Exchange] = {}  # requests being served, by xfer_id
        self._placer = (
            Placer(
                self._members,
                SLO(config.ttft_slo_ms, config.tpot_slo_ms),
                Policy(
                    split=config.split_prefill,
                    split_min_tokens=config.split_min_tokens,
                    ttft_headroom=config.ttft_headroom,
                    tpot_margin=config.tpot_margin,
                    idle_crossings=config.idle_crossings,
                    stitch=config.prefill_first_token and config.dispatch == "dual",
                ),
                Specializer() if config.specialize else None,
            )
            if config.placement == "adaptive"
            else None
        )
        if self._placer is not None:
            self.metrics.registry.register(
                ModelsCollector(
                    self._placer.models,
                    lambda: [m.instance.url for m in self._members],
                    self._placer.fleet,
                    self._placer.shape,
                )
            )
        self._aborter = ControlAborter(config.secret, config.abort_timeout_s, self.metrics)
        self._transfers = TransferWatcher(
            config,
            self.metrics,
            lambda: [(i, self._members[i].instance) for i in self._pools["decode"]],
        )
        self._room = RoomCheck(config.secret, config.health_timeout_s)
        self._http: aiohttp.ClientSession | None = None
        self._background: set[asyncio.Task[Any]] = set()
        # prefill URL -> its control address, once discovered (see `discovery`)
        # (probe, started)
        self._discovery: dict[str, tuple[asyncio.Future[Discovered], float]] = {}
        self._announced: set[str] = set()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Open the shared upstream HTTP client (on the serving loop)."""
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
                self._discovery_task(inst)

    def _discovery_task(self, inst: Instance) -> asyncio.Future[Discovered]:
        """The probe of `inst` (a new one if the last failed over DISCOVERY_RETRY_S ago)."""
        entry = self._discovery.get(inst.url)
        if entry is not None:
            task, started = entry
            failed = task.done() and (task.cancelled() or task.exception() is not None)
            if not failed or time.monotonic() - started < DISCOVERY_RETRY_S:
                return task
        task = asyncio.create_task(discover_control(self.http, inst, self.config.connect_timeout_s))
        self._discovery[inst.url] = (task, time.monotonic())
        if self._placer is not None:
            task.add_done_callback(lambda t: self._discovered(inst.url, t))
        return task

    async def _discovery_settled(self) -> None:
        """Wait for the discoveries in flight (at start-up: placement needs the
        block sizes to consider splits); their failures are dealt with where
        an instance is used."""
        pending = [task for task, _ in self._discovery.values() if not task.done()]
        if pending:
            await asyncio.wait([asyncio.shield(t) for t in pending])

    def _discovered(self, url: str, task: asyncio.Future[Discovered]) -> None:
        """Placement learns an instance's block size (split heads are whole
        blocks) and its max_num_seqs (beyond which requests wait)."""
        if task.cancelled() or task.exception() is not None or self._placer is None:
            return
        index = self._index_of(url)
        if index is not None:
            found = task.result()
            self._placer.set_block_size(index, found.block_size)
            self._placer.set_max_num_seqs(index, found.max_num_seqs)

    async def _with_control(self, inst: Instance, ex: Exchange) -> Instance:
        """`inst` with its control address (and block size, for split prefills)
        filled in, discovered if need be; as is if the instance cannot tell (D
        then computes the prompt itself when the address is missing)."""
        splits = self.config.split_prefill and self.config.dispatch == "dual"
        known = inst.control is not None and (inst.block_size is not None or not splits)
        if known or not self.config.discover:
            return inst
        try:
            control, block_size, _ = await asyncio.shield(self._discovery_task(inst))
        except DiscoveryError as e:
            if inst.control is not None:
                return inst  # configured address; no block size: no split prefills
            self.metrics.upstream_errors.labels("prefill", inst.url, "discovery").inc()
            log.warning(
                "xfer %s: no control address for %s (%s); decode will compute the prompt",
                ex.xfer_id,
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

    def _learn_control(self, inst: Instance, data: bytes) -> None:
        """P's answer names the control address its connector listens on: if
        it is not the one discovered (P restarted elsewhere), later requests use
        the new one. `inst` is as configured: a configured address is kept."""
        if inst.control is not None or not self.config.discover:
            return
        entry = self._discovery.get(inst.url)
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
        self._discovery[inst.url] = (learnt, time.monotonic())
        self._discovered(inst.url, learnt)  # its block size and max_num_seqs may differ too

    async def close(self) -> None:
        """Cancel background prefill requests, close the HTTP and RPC clients."""
        pending = [*self._background, *(task for task, _ in self._discovery.values())]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await self._transfers.close()
        if self._http is not None:
            await self._http.close()
        await asyncio.to_thread(self._aborter.close)
        await asyncio.to_thread(self._room.close)

    @property
    def http(self) -> aiohttp.ClientSession:
        if self._http is None:
            raise RuntimeError("router not started")
        return self._http

    # ------------------------------------------------------------------ serving

    async def serve(self, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI handler of one completions / chat completions request."""
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
            await FanOut(self, endpoint, body, subs, _upstream_headers(scope)).run(receive, send)
            return
        await self.serve_one(endpoint, body, raw, _upstream_headers(scope), receive, send)

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
        ex = Exchange(endpoint, new_xfer_id(), time.monotonic(), dict(headers))
        ex.upstream_headers["x-request-id"] = ex.xfer_id
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
        if not self._up("decode"):  # nothing can answer: P is not asked either
            why = self._down_reasons()
            await send_error(send, 503, f"no decode instance is up and not draining: {why}")
            return "unavailable"
        # fixed: P by least outstanding, split while idle
        p_index: int | Literal["least"] | None = "least"
        split: float | Literal["auto"] | None = "auto"
        if self._placer is not None:
            await self._discovery_settled()
            splits = self.config.split_prefill and splittable(body, ex.endpoint)
            splits = splits and client_transfer_kv_mode(body) in (None, "substep")
            try:
                decision, request = self._placer.decide(body, ex.endpoint, splits)
            except NoPlacement as e:
                await send_error(send, 503, f"no instance can take the request: {e}")
                return "unavailable"
            ex.decision = decision
            ex.estimated_tokens, ex.output_tokens = request.prompt_tokens, request.output_tokens
            d_index = self._take(decision.decode)
            p_index = None if decision.kind == "local" else decision.prefill
            split = None
            if decision.kind == "split":
                ex.estimated_tokens = max(ex.estimated_tokens, decision.head_tokens + 1)
                split = decision.head_tokens / ex.estimated_tokens
        else:
            d_index = self._acquire("decode")
        ex.decode = self._members[d_index].instance
        ex.decode_index = d_index
        if self.config.admin_token is not None:
            ex.unmigratable = migratable(body, ex.endpoint)
        outcome = "error"
        counted = _CountingSend(send, ex)
        try:
            outcome = await self._route_to(
                ex, body, raw, receive, counted, mode, d_index, p_index, split
            )
            return outcome
        finally:
            self._release(ex.decode_index)  # where it ended, if it migrated
            if self._placer is not None:
                self._placer.finished(ex.xfer_id, ex.output_events, ok=outcome == "ok")

    async def _route_pinned(
        self, ex: Exchange, body: Body, raw: bytes, receive: Receive, send: Send, d_index: int
    ) -> str:
        """Dispatch `ex` locally on `d_index` (a fan-out's follower: its prompt's
        KV is there already, or is computed there)."""
        self._take(d_index)
        ex.decode = self._members[d_index].instance
        ex.decode_index = d_index
        if self.config.admin_token is not None:
            ex.unmigratable = migratable(body, ex.endpoint)
        try:
            return await self._route_to(
                ex, body, raw, receive, _CountingSend(send, ex), "local", d_index, None, None
            )
        finally:
            self._release(ex.decode_index)

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
    ) -> str:
        """Dispatch `ex`, whose decode instance is `d_index`, its prompt computed
        on `p_choice` (an index; None: locally on D; ``least``: the least busy of
        the other instances that may prefill). `split`: ``auto`` (split while P
        and D are idle), None (never), or the head's share of the prompt.
        Returns the outcome."""
        assert ex.decode is not None
        if mode != "local" and p_choice is None:
            mode = "local"
        elif mode != "local" and not transferable(body, ex.endpoint):
            # several engine requests would share one xfer_id, or D would compute
            # the prompt anyway (prompt logprobs): one instance serves it all
            log.debug("xfer %s: served on D alone (not one transfer)", ex.xfer_id)
            mode = "local"
        elif mode != "local" and p_choice == "least":
            others = [i for i in self._pools["prefill"] if i != d_index]
            if not others:
                mode = "local"  # the decoder is the only instance that may prefill
            elif not any(self._available(i) for i in others):
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
            if mode == "local":
                d_content = encode(local_body(streamed(body), ex.xfer_id)) if migrating else raw
                self._dispatched(ex, "local", d_index, d_index)
                ex.kv_ready.set()  # D computes the prompt
            else:
                if isinstance(p_choice, int):
                    p_index = self._take(p_choice)
                else:
                    p_index = self._acquire("prefill", exclude=d_index)
                ex.prefill = self._members[p_index].instance
                head, ids = 0, None
                try:
                    ex.prefill = await self._with_control(ex.prefill, ex)
                    if split == "auto":
                        if mode == "dual" and self._may_split(ex, body, p_index, d_index):
                            head, ids = await self._split_point(ex, body)
                    elif split is not None and self._can_split(ex, body):
                        head, ids = await self._split_point(ex, body, split)
                except BaseException:
                    self._release(p_index)
                    raise
                self._dispatched(ex, "split" if head else "pd", p_index, d_index, head)
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
                p_content = encode(
                    head_body(body, ex.xfer_id, ids, head)
                    if head and ids is not None
                    else prefill_body(body, ex.endpoint, ex.xfer_id, first_token=stitching)
                )
                first = stitch.first if stitch is not None else None
                prefill = self._spawn(self._prefill(p_index, ex.prefill, p_content, ex, first))
                prefill.add_done_callback(lambda task: self._prefill_done(ex, task))
                if mode == "serial":
                    await asyncio.wait({prefill, gone}, return_when=asyncio.FIRST_COMPLETED)
                    if not prefill.done():
                        self._stop_prefill(ex, prefill, AbortReason.CLIENT_ABORT)
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
                self._relay(
                    d_index, ex.decode, d_content, ex, send, stitch, body if migrating else None
                )
            )
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
            if relay.done():
                outcome = relay.result()
                if outcome in DECODE_FAILURES:
                    self._stop_prefill(ex, prefill, AbortReason.DECODE_FAILED)
                return outcome
            relay.cancel()
            await asyncio.gather(relay, return_exceptions=True)
            self._stop_prefill(ex, prefill, AbortReason.CLIENT_ABORT)
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
            self.http,
            ex.prefill.url,
            body,
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
        busy = self._balancer.outstanding
        return (
            self.config.split_prefill
            and self._can_split(ex, body)
            and all(busy(i) == (1 if i in mine else 0) for i in {p_index, *self._pools["decode"]})
        )

    def _can_split(self, ex: Exchange, body: Body) -> bool:
        """This request's prompt may be split between its P and D: P's control
        address and block size are known, the request is a single-prompt
        completion, not in a `transfer_kv_mode` that sends P's KV after its step
        (the client measures that mode)."""
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
        placements metric, its header value, the placement state."""
        if self._placer is None or ex.decision is None:
            self.metrics.placements.labels(kind, "fixed").inc()
            ex.placement = f"kind={kind};prefill={p_index};decode={d_index};reason=fixed"
            return
        placement = Placement(kind, p_index, d_index, head)  # type: ignore[arg-type]
        ex.decision = dataclasses.replace(ex.decision, placement=placement)
        self.metrics.placements.labels(kind, ex.decision.reason).inc()
        ex.placement = ex.decision.header_value()
        prompt_tokens = max(ex.estimated_tokens, head + 1)
        self._placer.dispatched(ex.xfer_id, placement, prompt_tokens, ex.output_tokens)

    def _prefill_done(self, ex: Exchange, task: asyncio.Task[bool]) -> None:
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

    def _stop_prefill(
        self, ex: Exchange, prefill: asyncio.Task[bool] | None, reason: AbortReason
    ) -> None:
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

    async def _prefill(
        self,
        index: int,
        inst: Instance,
        content: bytes,
        ex: Exchange,
        first: asyncio.Future[Payload | None] | None = None,
    ) -> bool:
        """P's request: sent, its answer read and dropped, except its first output
        event, which resolves `first` (None if P gave none). True if P answered 2xx."""
        url = inst.url + ex.path
        answered = False  # P's status line arrived
        try:
            try:
                async with self.http.post(url, data=content, headers=ex.upstream_headers) as resp:
                    answered = True
                    if first is None or resp.status >= 400:
                        data = await resp.read()
                    else:
                        data = b""
                        await _first_output(resp, first)
            except (*UPSTREAM_ERRORS, StreamError) as e:
                kind = "stream" if answered else "connect"
                self._upstream_error("prefill", inst, kind, ex, repr(e))
                if not answered:
                    self._mark_down(index, repr(e))
                return False
            if resp.status >= 400:
                detail = f"HTTP {resp.status}: {data[:500]!r}"
                self._upstream_error("prefill", inst, "status", ex, detail)
                return False
            if data:
                self._learn_control(self._members[index].instance, data)
            log.debug(
                "xfer %s: prefill on %s answered %d after %.3fs",
                ex.xfer_id,
                inst.url,
                resp.status,
                time.monotonic() - ex.t_start,
            )
            return True
        finally:
            if first is not None and not first.done():
                first.set_result(None)
            self._release(index)

    async def _relay(
        self,
        index: int,
        inst: Instance,
        content: bytes,
        ex: Exchange,
        send: Send,
        stitch: Stitch | None,
        migratable_body: Body | None = None,
    ) -> str:
        """D's request, its answer relayed to the client as it comes (P's first token
        stitched in front with `stitch`; event by event through a `MigratingRelay`
        for a request that may migrate, `migratable_body` being the client's);
        returns the outcome."""
        try:
            resp = await self.http.post(
                inst.url + ex.path, data=content, headers=ex.upstream_headers
            )
        except UPSTREAM_ERRORS as e:
            self._upstream_error("decode", inst, "connect", ex, repr(e))
            self._mark_down(index, repr(e))
            await send_error(send, 502, f"decode instance {inst.url} did not answer: {e!r}")
            return "unreachable"
        try:
            ex.status = resp.status
            content_type = resp.headers.get("content-type", "")
            streaming = resp.status < 400 and content_type.startswith("text/event-stream")
            if streaming and migratable_body is not None:
                return await self._relay_migratable(index, inst, resp, ex, send, migratable_body)
            await send(
                {
                    "type": "http.response.start",
                    "status": resp.status,
                    "headers": _relayed_headers(resp.raw_headers, ex),
                }
            )
            try:
                if streaming and stitch is not None:
                    failed = await self._relay_stitched(resp, stitch, inst, ex, send)
                    if failed is not None:
                        return failed
                else:
                    await self._relay_raw(resp, streaming, ex, send)
            except (*UPSTREAM_ERRORS, StreamError) as e:
                self._upstream_error("decode", inst, "stream", ex, repr(e))
                if not streaming:
                    return "stream_error"  # its length was announced: the client sees it cut
                why = f"decode instance {inst.url} broke off the answer: {e!r}"
                await send({"type": "http.response.body", "body": sse_error(why)})
                return "stream_error"
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            resp.release()  # back to the pool if read to its end, else closed (D aborts)
        if resp.status >= 400:
            self._upstream_error("decode", inst, "status", ex, f"HTTP {resp.status}")
            return "upstream_error"
        self.metrics.e2e.labels(ex.endpoint, self.config.dispatch).observe(
            time.monotonic() - ex.t_start
        )
        return "ok"

    async def _relay_migratable(
        self,
        index: int,
        inst: Instance,
        resp: aiohttp.ClientResponse,
        ex: Exchange,
        send: Send,
        body: Body,
    ) -> str:
        """A migratable request's stream (`migration.relay`), relayed event by
        event or, for a client that asked for one answer, assembled into it."""
        client_streams = body.get("stream") is True
        ex.relay = MigratingRelay(
            self,
            ex.xfer_id,
            ex.endpoint,
            streamed(body),
            ex.upstream_headers,
            send if client_streams else None,
            lambda: self._relayed_first_token(ex),
        )
        if client_streams:
            start = _relayed_headers(resp.raw_headers, ex)
            await send({"type": "http.response.start", "status": resp.status, "headers": start})
        try:
            await ex.relay.run(index, inst, resp)
        except (*UPSTREAM_ERRORS, StreamError) as e:
            source = ex.relay.source or inst
            self._upstream_error("decode", source, "stream", ex, repr(e))
            why = f"decode instance {source.url} broke off the answer: {e!r}"
            if client_streams:
                await send({"type": "http.response.body", "body": sse_error(why)})
            else:
                await send_error(send, 502, why)
            return "stream_error"
        if client_streams:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            assert ex.relay.assembled is not None
            answer = encode(ex.relay.assembled.answer())
            headers = [
                (k, v)
                for k, v in _relayed_headers(resp.raw_headers, ex)
                if k.lower() not in (b"content-type", b"content-length")
            ]
            headers += [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(answer)),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": answer, "more_body": False})
        self.metrics.e2e.labels(ex.endpoint, self.config.dispatch).observe(
            time.monotonic() - ex.t_start
        )
        return "ok"

    async def _relay_raw(
        self, resp: aiohttp.ClientResponse, streaming: bool, ex: Exchange, send: Send
    ) -> None:
        """D's answer, byte for byte."""
        detector = FirstTokenDetector() if streaming else None
        async for chunk in resp.content.iter_any():
            if detector is not None and detector.feed(chunk):
                self._relayed_first_token(ex)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def _relay_stitched(
        self, resp: aiohttp.ClientResponse, st: Stitch, inst: Instance, ex: Exchange, send: Send
    ) -> str | None:
        """D's stream with P's first token in front (see `stitch`); an outcome if it failed."""
        stitch = st.merge
        splitter = EventSplitter()
        chunks = resp.content.iter_any()
        next_chunk: asyncio.Future[bytes] = asyncio.ensure_future(anext(chunks))
        prefill: asyncio.Future[Payload | None] | None = st.first
        counted = opened = False  # first token's source counted; client's stream opened
        try:
            while stitch.state != "mismatched":
                waiting = {next_chunk} if prefill is None else {next_chunk, prefill}
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                out: list[bytes] = []
                if prefill is not None and prefill in done:
                    payload = prefill.result()
                    prefill = None
                    if payload is not None:
                        out += stitch.on_prefill(payload)
                ended = raw = False
                if next_chunk in done:
                    try:
                        chunk = next_chunk.result()
                    except StopAsyncIteration:
                        ended = True
                    else:
                        for event in splitter.feed(chunk):
                            out += stitch.on_decode(event)
                        raw = stitch.passthrough
                        if raw:  # the rest of D's answer goes as it comes
                            out.append(splitter.take_rest())
                        else:
                            next_chunk = asyncio.ensure_future(anext(chunks))
                source = FIRST_TOKEN_SOURCE.get(stitch.state)
                if source is not None and not counted:
                    counted = True
                    self.metrics.first_token.labels(source).inc()
                    self._decode_first_token(ex)
                if out:
                    if stitch.state != "waiting" and not opened:
                        opened = True
                        self._first_token_sent(ex)
                    await send(
                        {"type": "http.response.body", "body": b"".join(out), "more_body": True}
                    )
                if ended:
                    return None
                if raw:
                    async for chunk in chunks:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    return None
        finally:
            next_chunk.cancel()
        # D's first token differed from P's, which the client has: drop D's
        # answer (closing it aborts D's request), continue from prompt + P's token.
        resp.close()
        log.warning(
            "xfer %s: decode's first token differs from prefill's %s; continuing from the "
            "prompt plus prefill's token on %s",
            ex.xfer_id,
            stitch.prefill_tokens,
            inst.url,
        )
        cont = continuation_body(st.body, stitch)  # StreamError: nothing to continue from
        if cont is None:  # P's token was the whole answer
            end = b"".join(stitch.finish_after_prefill())
            await send({"type": "http.response.body", "body": end, "more_body": True})
            return None
        headers = dict(ex.upstream_headers, **{"x-request-id": f"{ex.xfer_id}-cont"})
        url = inst.url + PATHS["completions"]
        async with self.http.post(url, data=encode(cont), headers=headers) as cresp:
            if cresp.status >= 400:
                detail = f"HTTP {cresp.status}: {(await cresp.read())[:500]!r}"
                self._upstream_error("decode", inst, "status", ex, detail)
                return "stream_error"
            splitter = EventSplitter()
            async for chunk in cresp.content.iter_any():
                out = [b for event in splitter.feed(chunk) for b in stitch.on_continuation(event)]
                if out:
                    await send(
                        {"type": "http.response.body", "body": b"".join(out), "more_body": True}
                    )
        return None

    def _relayed_first_token(self, ex: Exchange) -> None:
        """D's first output event is being relayed as it came."""
        self._first_token_sent(ex)
        self._decode_first_token(ex)
        if self.config.dispatch == "dual":
            self.metrics.first_token.labels("decode").inc()

    def _decode_first_token(self, ex: Exchange) -> None:
        """D's own first output event arrived (placement learns from it)."""
        ex.kv_ready.set()
        if self._placer is not None:
            self._placer.first_token(ex.xfer_id)

    def _first_token_sent(self, ex: Exchange) -> None:
        self.metrics.ttft.labels(ex.endpoint, self.config.dispatch).observe(
            time.monotonic() - ex.t_start
        )

    # ------------------------------------------------------------------ bookkeeping

    def _spawn(self, coro: Coroutine[Any, Any, bool]) -> asyncio.Task[bool]:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _mark_down(self, index: int, reason: str) -> None:
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
        self._spawn(self._probe(index))

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
                    self._discovery.pop(inst.url, None)
                    self._announced.discard(inst.url)
                    try:
                        await self._discovery_task(inst)
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

    @property
    def members(self) -> tuple[Member, ...]:
        """Every instance the router has known, by index (those that left too)."""
        return tuple(self._members)

    def pool(self, role: Role) -> tuple[int, ...]:
        """Indices of the members that may play `role` (those that left excepted)."""
        return tuple(self._pools[role])

    def transfers(self, index: int) -> str:
        """Whether member `index` (one that may decode) transfers: ``ok``,
        ``degraded`` or ``unknown`` (`transfers`)."""
        return self._transfers.state(index)

    def is_up(self, index: int) -> bool:
        """Whether member `index` answers (it may be draining)."""
        return self._health.is_up(index) and index not in self._retired

    def _available(self, index: int) -> bool:
        """Up, in the fleet and not draining: new requests may go there."""
        return self.is_up(index) and index not in self._draining

    def _up(self, role: Role) -> list[int]:
        """The instances that may play `role`, up and not draining."""
        return [i for i in self._pools[role] if self._available(i)]

    def _down_reasons(self) -> str:
        if not self._pools["decode"]:
            return "no instance that may decode is in the fleet"
        reasons = []
        for i in self._pools["decode"]:
            why = self._health.down(i) or ("draining" if i in self._draining else None)
            if why is not None:
                reasons.append(f"{self._members[i].instance.url} ({why})")
        return "; ".join(reasons)

    # ------------------------------------------------------------------ admin

    def drain(self, url: str, draining: bool = True) -> bool:
        """Stop (or, `draining` False, resume) dispatching new requests to the
        instance at `url`; the requests it serves run to their end. False if
        no instance has that URL."""
        index = self._index_of(url)
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

    async def migrate(self, xfer_id: str, to: str, precopy: bool = True) -> dict[str, Any]:
        """Move the running request `xfer_id` to the instance at URL `to`
        (`migration.relay`); what happened. `KeyError` for an unknown request
        or instance; `MigrationError` if it was not moved (it runs on where
        it was)."""
        ex = self._exchanges.get(xfer_id)
        if ex is None:
            raise KeyError(f"no request {xfer_id!r} is being served")
        index = self._index_of(to)
        if index is None:
            raise KeyError(f"no instance {to!r} in this router's configuration")
        if ex.relay is None or ex.relay.source is None:
            raise MigrationError(ex.unmigratable or "it is not streaming yet")
        if "decode" not in self._members[index].roles:
            raise MigrationError(f"{to} may not decode")
        if not self._available(index):
            raise MigrationError(f"{to} is down or draining")
        # as configured (a configured control address is kept), the one it decodes on now
        source = await self._with_control(self._members[ex.decode_index].instance, ex)
        target = await self._with_control(self._members[index].instance, ex)
        return await ex.relay.migrate(index, target, source.control, precopy)

    async def drain_migrating(self, url: str) -> dict[str, Any] | None:
        """Drain the instance at `url` (`drain`) and move every migratable
        request it decodes to the least busy instance that may decode; what
        happened to each (None: no such instance). Requests that cannot move
        run to their end there."""
        index = self._index_of(url)
        if index is None or not self.drain(url):
            return None
        moves: dict[str, asyncio.Future[dict[str, Any]]] = {}
        staying: dict[str, str] = {}
        targets = [i for i in self._up("decode") if i != index]
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
                to = min(targets, key=lambda i: self._balancer.outstanding(i) + planned[i])
                planned[to] += 1
                moves[ex.xfer_id] = asyncio.ensure_future(
                    self.migrate(ex.xfer_id, self._members[to].instance.url)
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
        index = self._index_of(record.url)
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
        self._discovery.pop(record.url, None)  # its record says where it listens
        if self._placer is not None:
            self._placer.join(index, member)
        log.info(
            "%s instance %s is in the fleet (etcd; control %s, block size %d, instance %s)",
            member.label,
            record.url,
            record.control,
            record.block_size,
            record.instance_id,
        )

    def _leave(self, url: str) -> None:
        index = self._index_of(url)
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
        log.warning(
            "%s instance %s left the fleet (its etcd record is gone): no new request goes there",
            member.label,
            url,
        )

    def _index_of(self, url: str) -> int | None:
        """The member whose base URL is `url` (None: no such instance)."""
        for index, member in enumerate(self._members):
            if member.instance.url == url:
                return index
        return None

    # the pass-through routes' view of the router (`passthrough`)

    def index_of(self, url: str) -> int | None:
        """The member whose base URL is `url`, while it is in the fleet."""
        index = self._index_of(url)
        return None if index is None or index in self._retired else index

    def any_decode_up(self) -> bool:
        return bool(self._up("decode"))

    def acquire(self, role: Role) -> int:
        """The least outstanding instance that may play `role`, counted outstanding
        (`let_go` when its request is over)."""
        return self._acquire(role)

    def mark_down(self, index: int, reason: str) -> None:
        self._mark_down(index, reason)

    # the relay's view of the router (`migration.relay.Fleet`)

    def hold(self, index: int) -> None:
        self._take(index)

    def let_go(self, index: int) -> None:
        self._release(index)

    def migrated(self, xfer_id: str, index: int, instance: Instance) -> None:
        ex = self._exchanges.get(xfer_id)
        if ex is not None:
            ex.decode_index = index
            ex.decode = instance
        if self._placer is not None:
            self._placer.migrated(xfer_id, index)

    def count_migration(self, outcome: str, downtime_s: float | None = None) -> None:
        self.metrics.migrations.labels(outcome).inc()
        if downtime_s is not None:
            self.metrics.migration_downtime.observe(downtime_s)

    async def require_room(self, target: Instance, tokens: int) -> None:
        await self._room.require(target.url, target.control, tokens)

    def is_draining(self, index: int) -> bool:
        """Whether member `index` is drained (`drain`)."""
        return index in self._draining

    def requests(self) -> list[dict[str, Any]]:
        """The requests being served: where each runs and how far it got."""
        now = time.monotonic()
        return [
            {
                "xfer_id": ex.xfer_id,
                "endpoint": ex.endpoint,
                "prefill": ex.prefill.url if ex.prefill else None,
                "decode": ex.decode.url if ex.decode else None,
                "placement": ex.placement,
                "age_s": round(now - ex.t_start, 3),
                "output_events": ex.output_events,
                "tokens": ex.relay.generated if ex.relay is not None else None,
                "migratable": ex.relay is not None,
                "unmigratable": None if ex.relay is not None else ex.unmigratable,
            }
            for ex in self._exchanges.values()
        ]

    def _acquire(self, role: Role, exclude: int | None = None) -> int:
        """An instance for a request of `role` (not `exclude`), least outstanding
        (ties in turn), counted outstanding."""
        # every instance down since the caller looked: try them all (the request fails
        # like any to a dead instance) rather than fail here
        pool = [i for i in self._pools[role] if i != exclude]
        up = [i for i in pool if self._available(i)]
        return self._counted(self._balancer.acquire(up or pool, turn=role))

    def _take(self, index: int) -> int:
        """Instance `index` (placement chose it), counted outstanding."""
        self._balancer.hold(index)
        return self._counted(index)

    def _counted(self, index: int) -> int:
        member = self._members[index]
        self.metrics.outstanding.labels(member.label, member.instance.url).inc()
        return index

    def _release(self, index: int) -> None:
        self._balancer.release(index)
        member = self._members[index]
        self.metrics.outstanding.labels(member.label, member.instance.url).dec()

    def outstanding(self, role: Role) -> list[int]:
        """Requests in flight on each instance that may play `role`, in `pool` order."""
        return [self._balancer.outstanding(i) for i in self._pools[role]]

    def _upstream_error(
        self, role: str, inst: Instance, kind: str, ex: Exchange, detail: str
    ) -> None:
        self.metrics.upstream_errors.labels(role, inst.url, kind).inc()
        consequence = " (decode will compute the prompt itself)" if role == "prefill" else ""
        log.warning(
            "xfer %s: %s request to %s failed (%s): %s%s",
            ex.xfer_id,
            role,
            inst.url,
            kind,
            detail,
            consequence,
        )


# ---------------------------------------------------------------------- ASGI helpers


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


async def _first_output(
    resp: aiohttp.ClientResponse, first: asyncio.Future[Payload | None]
) -> None:
    """Read P's streamed answer to its end; resolve `first` with its first output event."""
    splitter = EventSplitter()
    async for chunk in resp.content.iter_any():
        if first.done():
            continue  # the rest of P's answer (its finish, [DONE]) is dropped
        for event in splitter.feed(chunk):
            if event is not None and is_output(event) and not first.done():
                first.set_result(event)


def _upstream_headers(scope: Scope) -> dict[str, str]:
    headers = {"content-type": "application/json", "accept-encoding": "identity"}
    for name, value in scope.get("headers", []):
        if name.lower() in PASSED_ON:
            headers[name.lower().decode("latin-1")] = value.decode("latin-1")
    return headers


def _relayed_headers(
    raw: tuple[tuple[bytes, bytes], ...], ex: Exchange
) -> list[tuple[bytes, bytes]]:
    out = [(k, v) for k, v in raw if k.lower() not in NOT_RELAYED]
    out.append((XFER_HEADER, ex.xfer_id.encode()))
    if ex.placement is not None:
        out.append((PLACEMENT_HEADER, ex.placement.encode()))
    return out


class _CountingSend:
    """The client's `send`, counting the streamed output events relayed through
    it (``data: {`` at an event's start: about one per token) into `ex`."""

    MARK = b"data: {"

    def __init__(self, send: Send, ex: Exchange) -> None:
        self._send = send
        self._ex = ex
        self._tail = b""

    async def __call__(self, message: Message) -> None:
        body = message.get("body") if message["type"] == "http.response.body" else None
        if body:
            data = self._tail + body
            self._ex.output_events += data.count(self.MARK)  # the tail is too short to hold one
            self._tail = data[-(len(self.MARK) - 1) :]
        await self._send(message)
