"""Routes the router serves on one instance, the client's bytes untouched.

=============================== ==============================================
``POST /v1/responses``          the Responses API, on one decode instance
                                (least outstanding); a request that names a
                                ``previous_response_id`` the router saw goes
                                where that response was made (vLLM keeps a
                                response's state, with ``store``, in the
                                instance that made it)
``GET /v1/responses/{id}``      to the instance that made response ``id``
``POST /v1/responses/{id}/cancel``  likewise (an id the router did not see:
                                the least outstanding decode instance, which
                                answers vLLM's 404)
``POST /tokenize``,             one decode instance (least outstanding)
``/detokenize``,
``/v1/embeddings``,
``/v1/chat/completions/batch``
``GET /version``                likewise
=============================== ==============================================

Invariants: the request's bytes and its ``authorization``, trace
(``traceparent``, ``tracestate``) and ``x-request-id`` headers go to the
instance as the client sent them (no span of the router's: `tracing`); the
answer (status, headers, body) comes back as the instance sent it, streamed as
it comes; a request counts as outstanding on its instance until it is over; an
instance that does not answer is marked down (as for completions) and the
client gets a 502. A client that disconnects
closes the upstream request (vLLM aborts it). Response ids are remembered for
the last `MAX_REMEMBERED` responses.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from typing import Any

from starlette.requests import Request
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from rapidkv.router.asgi import send_error, wait_disconnect
from rapidkv.router.fleet.fleet import Fleet
from rapidkv.router.stitch import EventSplitter, StreamError
from rapidkv.router.upstream import UPSTREAM_ERRORS

log = logging.getLogger(__name__)

MAX_REMEMBERED = 100_000  # response ids -> instance url
MAX_ID_SCAN_BYTES = 1 << 20  # of a streamed answer, looking for its response id
PASSED_ON = (
    b"authorization",
    b"content-type",
    b"accept",
    b"accept-encoding",
    b"traceparent",
    b"tracestate",
    b"x-request-id",
)
NOT_RELAYED = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"date", b"server", b"upgrade"}
)


class Passthrough:
    """The routes of this module, over `fleet`'s decode instances."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self._responses: OrderedDict[str, str] = OrderedDict()  # response id -> instance url

    def routes(self) -> list[Route]:
        return [
            Route("/v1/responses", self._endpoint(self._responses_create), methods=["POST"]),
            Route("/v1/responses/{response_id}", self._endpoint(self._by_id), methods=["GET"]),
            Route(
                "/v1/responses/{response_id}/cancel",
                self._endpoint(self._by_id),
                methods=["POST"],
            ),
            *(
                Route(path, self._endpoint(self._any), methods=[method])
                for path, method in (
                    ("/tokenize", "POST"),
                    ("/detokenize", "POST"),
                    ("/v1/embeddings", "POST"),
                    ("/v1/chat/completions/batch", "POST"),
                    ("/version", "GET"),
                )
            ),
        ]

    def _endpoint(self, handler: Any) -> Any:
        class _Endpoint:  # Route passes raw ASGI to a class instance
            async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
                await handler(scope, receive, send)

        return _Endpoint()

    # ------------------------------------------------------------------ handlers

    async def _any(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = await Request(scope, receive).body()
        await self._relay(scope, receive, send, raw, None)

    async def _responses_create(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = await Request(scope, receive).body()
        url = None
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            body = None  # vLLM's to refuse
        if isinstance(body, dict) and isinstance(body.get("previous_response_id"), str):
            url = self._responses.get(body["previous_response_id"])
        await self._relay(scope, receive, send, raw, url, learn=True)

    async def _by_id(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = await Request(scope, receive).body()
        url = self._responses.get(scope["path_params"]["response_id"])
        await self._relay(scope, receive, send, raw, url)

    # ------------------------------------------------------------------ relaying

    async def _relay(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        raw: bytes,
        url: str | None,
        learn: bool = False,
    ) -> None:
        """The request to the instance at `url` (None, or one no longer in the
        fleet: the least outstanding decode instance), its answer to the client."""
        fleet = self.fleet
        index = fleet.index_of(url, in_fleet=True) if url is not None else None
        if index is None:
            if not fleet.up("decode"):
                await send_error(send, 503, "no decode instance is up and not draining")
                return
            index = fleet.acquire("decode")
        else:
            fleet.hold(index)
        inst = fleet.member(index).instance
        target = inst.url + scope["path"]
        if scope.get("query_string"):
            target += "?" + scope["query_string"].decode("latin-1")
        headers = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in scope.get("headers", ())
            if k.lower() in PASSED_ON
        }
        relay = asyncio.ensure_future(
            self._relay_to(index, scope["method"], target, raw, headers, send, learn)
        )
        gone = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not relay.done():
                relay.cancel()  # the client left: closing the connection aborts it
            await asyncio.gather(relay, gone, return_exceptions=True)
            fleet.let_go(index)
        if relay.done() and not relay.cancelled() and relay.exception() is not None:
            raise relay.exception()  # type: ignore[misc]

    async def _relay_to(
        self,
        index: int,
        method: str,
        target: str,
        raw: bytes,
        headers: dict[str, str],
        send: Send,
        learn: bool,
    ) -> None:
        fleet = self.fleet
        inst_url = fleet.member(index).instance.url
        try:
            resp = await fleet.http.request(method, target, data=raw or None, headers=headers)
        except UPSTREAM_ERRORS as e:
            fleet.mark_down(index, repr(e))
            await send_error(send, 502, f"instance {inst_url} did not answer: {e!r}")
            return
        try:
            out = [(k, v) for k, v in resp.raw_headers if k.lower() not in NOT_RELAYED]
            await send({"type": "http.response.start", "status": resp.status, "headers": out})
            streaming = resp.headers.get("content-type", "").startswith("text/event-stream")
            scan = _IdScan(streaming) if learn and resp.status < 400 else None
            try:
                async for chunk in resp.content.iter_any():
                    if scan is not None and scan.feed(chunk):
                        self._remember(scan.found, inst_url)
                        scan = None
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except UPSTREAM_ERRORS as e:
                log.warning("%s %s: the instance broke off the answer: %r", method, target, e)
                return  # the client sees its answer cut
            if scan is not None and scan.finish():
                self._remember(scan.found, inst_url)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            resp.release()

    def _remember(self, response_id: str | None, url: str) -> None:
        if response_id is None:
            return
        self._responses[response_id] = url
        self._responses.move_to_end(response_id)
        while len(self._responses) > MAX_REMEMBERED:
            self._responses.popitem(last=False)


class _IdScan:
    """A Responses answer's id: the JSON's ``id``, or in a stream the first
    event's ``response.id`` (``response.created``)."""

    def __init__(self, streaming: bool) -> None:
        self.streaming = streaming
        self.found: str | None = None
        self._splitter = EventSplitter()
        self._whole = bytearray()
        self._seen = 0

    def feed(self, chunk: bytes) -> bool:
        """True once the id is found (then `found`)."""
        self._seen += len(chunk)
        if self._seen > MAX_ID_SCAN_BYTES:
            return False
        if not self.streaming:
            self._whole += chunk
            return False
        try:
            events = self._splitter.feed(chunk)
        except StreamError:
            self._seen = MAX_ID_SCAN_BYTES + 1
            return False
        for event in events:
            response = event.get("response") if event is not None else None
            if isinstance(response, dict) and isinstance(response.get("id"), str):
                self.found = response["id"]
                return True
        return False

    def finish(self) -> bool:
        """At the answer's end (a whole answer's id is read here)."""
        if self.streaming or self._seen > MAX_ID_SCAN_BYTES:
            return False
        try:
            answer = json.loads(self._whole)
        except ValueError:
            return False
        if isinstance(answer, dict) and isinstance(answer.get("id"), str):
            self.found = answer["id"]
            return True
        return False
