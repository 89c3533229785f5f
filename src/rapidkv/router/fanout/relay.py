"""A fanned-out request served: its sub-requests run through the router, their
answers merged into the client's (`merge`).

Theory of operation: every lead (`plan.Sub.lead` is None) is served at once as
an ordinary request (`Router.serve_one`: PD, split or local, as placement
decides); each follower waits until its lead's prompt KV is on the lead's
decode instance (`Exchange.kv_ready`) and is then served there, locally (with
prefix caching on, vLLM finds the prompt's blocks cached: the prompt crossed
once). Each sub-request answers into a `_Capture` instead of the client.

- The client's answer starts once every lead has its status: if one failed
  (a status >= 400, or no answer), the client gets the first such answer in
  choice order, as is, and the other sub-requests are stopped; otherwise a
  streamed answer merges the events as they come, a whole one is sent once
  every sub-request's answer is in.
- A follower that fails after the client's stream opened ends it with an
  error event, as an upstream failure mid-stream does.
- A client that disconnects stops every sub-request, as it stops one request
  (each sees the disconnect: P's part is aborted, D's connection closed).
- No sub-request outlives the client's request.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from starlette.types import Message, Receive, Send

from rapidkv.router.asgi import send_error, wait_disconnect
from rapidkv.router.exchange import Exchange
from rapidkv.router.fanout.merge import StreamMerge, merge_answers
from rapidkv.router.fanout.plan import Sub
from rapidkv.router.rewrite import Body, Endpoint, encode, error_body
from rapidkv.router.sse import sse_error
from rapidkv.router.stitch import EventSplitter, StreamError

log = logging.getLogger(__name__)

_END = None  # a sub-request's answer is over (queued after its last chunk)


class Server(Protocol):
    """What a fan-out needs of its router (`proxy.Router`)."""

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
        """Serve one request into `send` (decoded on `pinned`, locally, if
        given; `on_exchange` told its `Exchange`); its outcome."""
        ...


class _Capture:
    """A sub-request's `send`: its status and headers, its body chunks queued
    (`_END` after the last), tagged with its position `k`."""

    def __init__(self, k: int, queue: asyncio.Queue[tuple[int, bytes | None]]) -> None:
        self.k = k
        self.status: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.started = asyncio.Event()  # status known, or the sub-request is over
        self.ended = False
        self._queue = queue

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = list(message.get("headers", ()))
            self.started.set()
        elif message["type"] == "http.response.body" and not self.ended:
            if message.get("body"):
                self._queue.put_nowait((self.k, message["body"]))
            if not message.get("more_body", False):
                self.end()

    def end(self) -> None:
        """The sub-request is over (whether or not it answered in full)."""
        self.started.set()
        if not self.ended:
            self.ended = True
            self._queue.put_nowait((self.k, _END))


class FanOut:
    """One client request served as the sub-requests `subs` (see the module)."""

    def __init__(
        self,
        router: Server,
        endpoint: Endpoint,
        body: Body,
        subs: Sequence[Sub],
        headers: dict[str, str],
    ) -> None:
        self.router = router
        self.endpoint = endpoint
        self.body = body
        self.subs = subs
        self.headers = headers
        self._queue: asyncio.Queue[tuple[int, bytes | None]] = asyncio.Queue()
        self._captures = [_Capture(k, self._queue) for k in range(len(subs))]
        self._stops = [asyncio.Event() for _ in subs]  # a sub-request's client left
        self._exchanges: dict[int, Exchange] = {}
        self._known = [asyncio.Event() for _ in subs]  # its Exchange exists, or never will
        self._tasks: list[asyncio.Task[None]] = []

    async def run(self, receive: Receive, send: Send) -> None:
        """Serve the client's request (its body was read) into `send`."""
        log.debug("%s request fanned out into %d sub-requests", self.endpoint, len(self.subs))
        gone = asyncio.ensure_future(wait_disconnect(receive))
        answer = asyncio.ensure_future(self._answer(send))
        self._tasks = [asyncio.create_task(self._sub(k)) for k in range(len(self.subs))]
        try:
            await asyncio.wait({gone, answer}, return_when=asyncio.FIRST_COMPLETED)
            if not answer.done():
                answer.cancel()
        finally:
            gone.cancel()
            for stop in self._stops:  # nothing outlives the client's request
                stop.set()
            await asyncio.gather(answer, *self._tasks, return_exceptions=True)
        if answer.done() and not answer.cancelled() and answer.exception() is not None:
            raise answer.exception()  # type: ignore[misc]

    async def _sub(self, k: int) -> None:
        """Sub-request `k`, served (a follower once its lead's KV is there)."""
        sub, capture = self.subs[k], self._captures[k]
        try:
            pinned = None
            if sub.lead is not None:
                lead = await self._lead_exchange(sub.lead)
                if lead is None or self._stops[k].is_set():
                    return
                await self._wait_either(lead.kv_ready.wait(), k)
                if self._stops[k].is_set():
                    return
                lead_status = self._captures[sub.lead].status
                if lead_status is not None and lead_status >= 400:
                    return
                pinned = lead.decode_index

            async def receive() -> Message:
                await self._stops[k].wait()
                return {"type": "http.disconnect"}

            await self.router.serve_one(
                self.endpoint,
                sub.body,
                encode(sub.body),
                self.headers,
                receive,
                capture,
                pinned=pinned,
                on_exchange=lambda ex: self._exchange_known(k, ex),
            )
        finally:
            capture.end()
            self._known[k].set()

    def _exchange_known(self, k: int, ex: Exchange) -> None:
        self._exchanges[k] = ex
        self._known[k].set()

    async def _lead_exchange(self, k: int) -> Exchange | None:
        """The lead `k`'s Exchange, once it exists (None: it ended without one)."""
        await self._known[k].wait()
        return self._exchanges.get(k)

    async def _wait_either(self, waiting: Any, k: int) -> None:
        """Wait for `waiting` or for sub-request `k` to be stopped."""
        first = asyncio.ensure_future(waiting)
        stopped = asyncio.ensure_future(self._stops[k].wait())
        try:
            await asyncio.wait({first, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            first.cancel()
            stopped.cancel()

    # ------------------------------------------------------------------ the answer

    async def _answer(self, send: Send) -> None:
        leads = [k for k, sub in enumerate(self.subs) if sub.lead is None]
        await asyncio.gather(*(self._captures[k].started.wait() for k in leads))
        for k in leads:
            status = self._captures[k].status
            if status is None or status >= 400:
                await self._relay_failure(k, send)
                return
        first = self._captures[leads[0]]
        content_type = dict((h.lower(), v) for h, v in first.headers).get(b"content-type", b"")
        if content_type.startswith(b"text/event-stream"):
            await self._stream(send, first.headers)
        else:
            await self._whole(send, first.headers)

    async def _relay_failure(self, k: int, send: Send) -> None:
        """Sub-request `k` failed: its answer is the client's; the others stop."""
        for j, stop in enumerate(self._stops):
            if j != k:
                stop.set()
        capture = self._captures[k]
        chunks = [chunk async for chunk in self._chunks_of(k)]
        if capture.status is None:  # it ended without an answer (only on shutdown)
            body = error_body(502, "a sub-request of a fanned-out request got no answer")
            status, headers = 502, [(b"content-type", b"application/json")]
            chunks = [body]
        else:
            status, headers = capture.status, capture.headers
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"".join(chunks), "more_body": False})

    async def _chunks_of(self, k: int) -> Any:
        """Sub-request `k`'s body chunks until its end (others' are dropped)."""
        while True:
            j, chunk = await self._queue.get()
            if j != k:
                continue
            if chunk is _END:
                return
            yield chunk

    async def _stream(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        """Every sub-request's events merged, as they come."""
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        merge = StreamMerge(self.subs)
        splitters = [EventSplitter() for _ in self.subs]
        open_ = set(range(len(self.subs)))
        while open_:
            k, chunk = await self._queue.get()
            if chunk is _END:
                open_.discard(k)
                status = self._captures[k].status
                if status is None or status >= 400:  # a follower failed, or none answered
                    why = f"sub-request {k} of a fanned-out request failed (HTTP {status})"
                    await send({"type": "http.response.body", "body": sse_error(why)})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
                continue
            try:
                out = b"".join(merge.on_event(k, p) for p in splitters[k].feed(chunk))
            except StreamError as e:
                await send({"type": "http.response.body", "body": sse_error(repr(e))})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
        end = merge.finish()
        await send({"type": "http.response.body", "body": end, "more_body": False})

    async def _whole(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        """One answer, once every sub-request's is in."""
        parts: list[list[bytes]] = [[] for _ in self.subs]
        open_ = set(range(len(self.subs)))
        while open_:
            k, chunk = await self._queue.get()
            if chunk is _END:
                open_.discard(k)
                status = self._captures[k].status
                if status is None or status >= 400:
                    capture = self._captures[k]
                    body = b"".join(parts[k]) or error_body(502, f"sub-request {k} failed")
                    await send(
                        {
                            "type": "http.response.start",
                            "status": status or 502,
                            "headers": capture.headers or [(b"content-type", b"application/json")],
                        }
                    )
                    await send({"type": "http.response.body", "body": body, "more_body": False})
                    return
            else:
                parts[k].append(chunk)
        try:
            answers = [json.loads(b"".join(p)) for p in parts]
        except ValueError as e:
            await send_error(send, 502, f"a sub-request's answer is not JSON: {e}")
            return
        merged = encode(merge_answers(self.subs, answers))
        kept = [(h, v) for h, v in headers if h.lower() not in (b"content-length",)]
        kept.append((b"content-length", b"%d" % len(merged)))
        await send({"type": "http.response.start", "status": 200, "headers": kept})
        await send({"type": "http.response.body", "body": merged, "more_body": False})
