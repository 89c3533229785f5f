"""D's answer to one request, relayed to the client as it comes.

`AnswerRelay.relay` sends D its request and relays the answer (status,
headers, body) in one of three ways:

- *byte for byte*, streaming or not: the common case;
- *stitched* (`Stitch`, a streamed greedy completion in ``dual`` mode): the
  first of P's and D's first tokens opens the client's stream, D's stream
  follows without the token P gave (`stitch`); if D's first token differs
  from P's, D's answer is dropped and the rest is asked of D as a
  continuation of the prompt plus P's token;
- *event by event through a* `migration.relay.MigratingRelay` (a request that
  may migrate): its stream can move to another instance mid-answer; a client
  that asked for one answer gets it assembled from the stream.

Every answer carries the request's ``x-rapidkv-xfer-id`` and, once known,
its ``x-rapidkv-placement``. The client's first token is timed (TTFT), and
D's own first token marks the prompt's KV ready on D (`Exchange.kv_ready`)
and teaches the adaptive placement.

Rules: a D that gives no status line is marked down (`fleet.Fleet.mark_down`)
and the client gets 502; a D error status is relayed as is; a stream that
breaks off ends with an error event the client can read (``data:
{"error": ...}`` then ``data: [DONE]``), unless it broke after its own
``data: [DONE]`` without an error event (`Exchange.served`: the client has the
whole answer, which ends as usual, outcome ``ok``; D's break is still counted
in ``rapidkv_router_upstream_errors_total{kind="stream"}``); a non-streamed
answer that breaks off is cut short (its length was announced). The outcome
returned is one of `metrics.OUTCOMES`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import aiohttp
from starlette.types import Send

from rapidkv.router.asgi import send_error
from rapidkv.router.config import Instance, RouterConfig
from rapidkv.router.exchange import PATHS, Exchange, upstream_error
from rapidkv.router.fleet.fleet import Fleet
from rapidkv.router.metrics import RouterMetrics
from rapidkv.router.migration.bodies import streamed
from rapidkv.router.migration.controller import MigrationController
from rapidkv.router.migration.relay import MigratingRelay
from rapidkv.router.placement.placer import Placer
from rapidkv.router.rewrite import Body, encode
from rapidkv.router.sse import FirstTokenDetector, sse_error
from rapidkv.router.stitch import (
    EventSplitter,
    FirstTokenStitch,
    Payload,
    StreamError,
    continuation_body,
)
from rapidkv.router.tracing import request_id
from rapidkv.router.upstream import UPSTREAM_ERRORS

log = logging.getLogger(__name__)

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
XFER_HEADER = b"x-rapidkv-xfer-id"
PLACEMENT_HEADER = b"x-rapidkv-placement"  # where the request ran (`placement.Decision`)
# a stitch's resolved state -> where the client's first token came from
FIRST_TOKEN_SOURCE = {"matched": "prefill", "decode_first": "decode", "mismatched": "continuation"}


@dataclass(frozen=True)
class Stitch:
    """A request whose stream P's first token may open: the client's body (for a
    continuation), the merge of the two streams, and P's first output event."""

    body: Body
    merge: FirstTokenStitch
    first: asyncio.Future[Payload | None]


class AnswerRelay:
    """D's answers to the client (see the module)."""

    def __init__(
        self,
        config: RouterConfig,
        metrics: RouterMetrics,
        fleet: Fleet,
        migrations: MigrationController,
        placer: Placer | None = None,
    ) -> None:
        self._config = config
        self._metrics = metrics
        self._fleet = fleet
        self._migrations = migrations
        self._placer = placer

    async def relay(
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
        returns the outcome. Its span (`tracing`) lasts to the answer's end."""
        url = inst.url + ex.path
        call = ex.tracing.call("rapidkv.decode", ex.upstream_headers, **{"url.full": url})
        outcome = "cancelled"
        try:
            outcome = await self._relay(
                index, inst, content, ex, send, stitch, migratable_body, call.headers
            )
            return outcome
        finally:
            call.set("http.response.status_code", ex.status)
            call.set("rapidkv.outcome", outcome)
            call.end(None if outcome == "ok" else outcome)

    async def _relay(
        self,
        index: int,
        inst: Instance,
        content: bytes,
        ex: Exchange,
        send: Send,
        stitch: Stitch | None,
        migratable_body: Body | None,
        headers: dict[str, str],
    ) -> str:
        try:
            resp = await self._fleet.http.post(inst.url + ex.path, data=content, headers=headers)
        except UPSTREAM_ERRORS as e:
            upstream_error(self._metrics, "decode", inst, "connect", ex, repr(e))
            self._fleet.mark_down(index, repr(e))
            await send_error(send, 502, f"decode instance {inst.url} did not answer: {e!r}")
            return "unreachable"
        try:
            ex.status = resp.status
            content_type = resp.headers.get("content-type", "")
            streaming = resp.status < 400 and content_type.startswith("text/event-stream")
            if streaming and migratable_body is not None:
                return await self._migratable(index, inst, resp, ex, send, migratable_body)
            await send(
                {
                    "type": "http.response.start",
                    "status": resp.status,
                    "headers": relayed_headers(resp.raw_headers, ex),
                }
            )
            try:
                if streaming and stitch is not None:
                    failed = await self._stitched(resp, stitch, inst, ex, send, headers)
                    if failed is not None:
                        return failed
                else:
                    await self._raw(resp, streaming, ex, send)
            except (*UPSTREAM_ERRORS, StreamError) as e:
                upstream_error(self._metrics, "decode", inst, "stream", ex, repr(e))
                if not streaming:
                    return "stream_error"  # its length was announced: the client sees it cut
                if not ex.served:
                    why = f"decode instance {inst.url} broke off the answer: {e!r}"
                    await send({"type": "http.response.body", "body": sse_error(why)})
                    return "stream_error"
                # it broke after data: [DONE]: the client has the whole answer
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            resp.release()  # back to the pool if read to its end, else closed (D aborts)
        if resp.status >= 400:
            upstream_error(self._metrics, "decode", inst, "status", ex, f"HTTP {resp.status}")
            return "upstream_error"
        self._metrics.e2e.labels(ex.endpoint, self._config.dispatch).observe(
            time.monotonic() - ex.t_start
        )
        return "ok"

    async def _migratable(
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
            self._fleet,
            self._migrations,
            ex.xfer_id,
            ex.endpoint,
            streamed(body),
            ex.upstream_headers,
            send if client_streams else None,
            lambda: self._relayed_first_token(ex),
            ex.tracing,
        )
        if client_streams:
            start = relayed_headers(resp.raw_headers, ex)
            await send({"type": "http.response.start", "status": resp.status, "headers": start})
        try:
            await ex.relay.run(index, inst, resp)
        except (*UPSTREAM_ERRORS, StreamError) as e:
            source = ex.relay.source or inst
            upstream_error(self._metrics, "decode", source, "stream", ex, repr(e))
            if not ex.served:  # else it broke after data: [DONE]: the client has it all
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
                for k, v in relayed_headers(resp.raw_headers, ex)
                if k.lower() not in (b"content-type", b"content-length")
            ]
            headers += [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(answer)),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": answer, "more_body": False})
        self._metrics.e2e.labels(ex.endpoint, self._config.dispatch).observe(
            time.monotonic() - ex.t_start
        )
        return "ok"

    async def _raw(
        self, resp: aiohttp.ClientResponse, streaming: bool, ex: Exchange, send: Send
    ) -> None:
        """D's answer, byte for byte."""
        detector = FirstTokenDetector() if streaming else None
        async for chunk in resp.content.iter_any():
            if detector is not None and detector.feed(chunk):
                self._relayed_first_token(ex)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def _stitched(
        self,
        resp: aiohttp.ClientResponse,
        st: Stitch,
        inst: Instance,
        ex: Exchange,
        send: Send,
        headers: dict[str, str],
    ) -> str | None:
        """D's stream with P's first token in front (see `stitch`); an outcome
        if it failed. `headers`: D's request's (a continuation's are these)."""
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
                    self._metrics.first_token.labels(source).inc()
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
        headers = request_id(headers, ex.xfer_id, f"{ex.xfer_id}-cont")
        url = inst.url + PATHS["completions"]
        async with self._fleet.http.post(url, data=encode(cont), headers=headers) as cresp:
            if cresp.status >= 400:
                detail = f"HTTP {cresp.status}: {(await cresp.read())[:500]!r}"
                upstream_error(self._metrics, "decode", inst, "status", ex, detail)
                return "stream_error"
            splitter = EventSplitter()
            async for chunk in cresp.content.iter_any():
                out = [b for event in splitter.feed(chunk) for b in stitch.on_continuation(event)]
                if out:
                    await send(
                        {"type": "http.response.body", "body": b"".join(out), "more_body": True}
                    )
        return None

    # ------------------------------------------------------------------ first tokens

    def _relayed_first_token(self, ex: Exchange) -> None:
        """D's first output event is being relayed as it came."""
        self._first_token_sent(ex)
        self._decode_first_token(ex)
        if self._config.dispatch == "dual":
            self._metrics.first_token.labels("decode").inc()

    def _decode_first_token(self, ex: Exchange) -> None:
        """D's own first output event arrived (placement learns from it)."""
        ex.kv_ready.set()
        if self._placer is not None:
            self._placer.first_token(ex.xfer_id)

    def _first_token_sent(self, ex: Exchange) -> None:
        self._metrics.ttft.labels(ex.endpoint, self._config.dispatch).observe(
            time.monotonic() - ex.t_start
        )


def relayed_headers(
    raw: tuple[tuple[bytes, bytes], ...], ex: Exchange
) -> list[tuple[bytes, bytes]]:
    """D's response headers as the client gets them: with the request's
    xfer_id and placement, without per-connection ones."""
    out = [(k, v) for k, v in raw if k.lower() not in NOT_RELAYED]
    out.append((XFER_HEADER, ex.xfer_id.encode()))
    if ex.placement is not None:
        out.append((PLACEMENT_HEADER, ex.placement.encode()))
    return out
