"""A stand-in for a vLLM OpenAI server, for the router's routing tests.

It is a real HTTP server on loopback (a raw ASGI app under uvicorn, on a thread)
that records every request it receives and answers like vLLM: completions and
chat, JSON or server-sent events, ids built from ``X-Request-Id``, `usage`.
What it does with one request is chosen by the request itself, through an extra
body field the router passes on untouched: ``"fake": {"<role>": BEHAVIOUR}``,
where role is this fake's ``role`` ("prefill" / "decode"):

- ``ok`` (default): answer at once;
- ``hang``: answer nothing until `release()` (then answer), recording a client
  disconnect if one comes first;
- ``hang_stream``: send the headers and the first event, then like ``hang``;
- ``late``: send the headers of a streamed answer, then its events on `release()`;
- ``linger``: stream every event, ``data: [DONE]`` included, then hold the
  answer's end (the HTTP body's last chunk) until `release()`;
- ``hang_stream_linger``: like ``hang_stream``, then like ``linger`` but
  holding the end until `release_end()`;
- ``error``: answer 503 with a vLLM-style error body;
- ``cut``: start a streamed answer, then drop the connection mid-way;
- ``cut_after_done``: stream every event, ``data: [DONE]`` included, then drop
  the connection before the answer's end (the HTTP body's last chunk).

`die()` ends the fake as a crashed server ends: every request it holds and
every one that reaches it before its listener closed has its connection
dropped, unanswered (`stop()`, the orderly end, lets the held ones answer).

``POST /tokenize`` answers a text prompt's "token ids" (its characters' code
points), or 500 for a prompt that starts with "untokenizable"; a chat's
messages likewise (`fake_render`). ``POST
/v1/responses`` answers a response id (streamed: in a ``response.created``
event) that ``GET /v1/responses/{id}`` then finds on this fake only.

Every answer's exact bytes are recorded (`sent`), so a test can check that the
router relayed them byte for byte. Order across fakes is recorded with one
process-wide sequence (`Seen.seq`, `Seen.answered_seq`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rapidkv.control.codes import Code
from rapidkv.control.messages import ErrorReply, Request, Stats, StatsRequest
from rapidkv.control.server import RpcServer
from rapidkv.harness import wait_until
from rapidkv.router import RunningRouter, ThreadedServer

_sequence = itertools.count(1)


@dataclass
class Seen:
    """One request a fake received."""

    path: str
    headers: dict[str, str]
    raw: bytes
    body: dict[str, Any]
    seq: int  # process-wide order of arrival
    answered_seq: int | None = None  # ... and of the answer's end
    disconnected: bool = False  # the caller went away before the answer was complete
    sent: bytearray = field(default_factory=bytearray)  # the answer body, exactly
    client: tuple[str, int] | None = None  # the caller's address: one per connection

    @property
    def request_id(self) -> str:
        return self.headers.get("x-request-id", "")

    @property
    def kv_transfer_params(self) -> Any:
        return self.body.get("kv_transfer_params")


MAX_FAKE_TOKENS = 64  # the most tokens a fake answer has, whatever the request asks


def fake_tokens(body: dict[str, Any]) -> list[int]:
    """The 'generated' tokens: a function of the prompt and max_tokens only.

    vLLM validates the request; the fake does not: a budget that is not an int
    counts as 16 tokens, one over `MAX_FAKE_TOKENS` as that many."""
    prompt = body.get("prompt", body.get("messages"))
    seed = sum(json.dumps(prompt, sort_keys=True).encode()) % 997
    n = body.get("max_completion_tokens") or body.get("max_tokens") or 16
    if not isinstance(n, int) or isinstance(n, bool):
        n = 16
    return [(seed + 31 * i) % 1000 for i in range(min(n, MAX_FAKE_TOKENS))]


def fake_render(messages: Any) -> list[int] | None:
    """A chat's "token ids" as the fake renders them: the code points of each
    message's role initial and text content; None (the fake answers 500) for
    what it cannot render, or a first content starting with "untokenizable"."""
    if not isinstance(messages, list) or not messages:
        return None
    text = ""
    for m in messages:
        role, content = (m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None)
        if isinstance(content, list):
            parts = [p.get("text") if isinstance(p, dict) else None for p in content]
            content = "".join(p for p in parts if isinstance(p, str))
        if not isinstance(role, str) or not role or not isinstance(content, str | None):
            return None
        text += role[0] + (content or "")
    return None if text[1:].startswith("untokenizable") else [ord(c) for c in text]


class FakeVLLM:
    """See the module docstring. `url` is its base URL; `stop()` ends it."""

    def __init__(self, name: str, role: str, port: int = 0) -> None:
        self.name = name
        self.role = role
        self.healthy = True
        self.health_delay_s = 0.0  # how long /health takes to answer
        self.health_asked = 0  # /health requests received
        # the control address a connector would report in its full answers'
        # kv_transfer_params (None: no connector, as plain vLLM)
        self.control: str | None = None
        self.max_num_seqs = 4  # what it reports with the control address
        self.seen: list[Seen] = []
        self.responses: set[str] = set()  # ids of the Responses API answers it gave
        self._loop: asyncio.AbstractEventLoop | None = None
        self._gate: asyncio.Event | None = None
        self._end_gate: asyncio.Event | None = None
        self._released = False
        self._end_released = False
        self._dead = False
        self._server = ThreadedServer(self, port=port, lifespan="off", name=f"fake-{name}")
        self.url = self._server.url

    def stop(self) -> None:
        self.release()
        self._server.stop()

    def die(self) -> None:
        """End like a crashed server: held requests and new ones are cut off."""
        self._dead = True
        self.stop()

    # ------------------------------------------------------------ test side

    def release(self) -> None:
        """Let every hanging request (now and later) answer."""
        self._released = True
        if self._loop is not None and self._gate is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._gate.set)

    def release_end(self) -> None:
        """Let every answer held at its end (``hang_stream_linger``) end."""
        self._end_released = True
        if self._loop is not None and self._end_gate is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._end_gate.set)

    def requests(self, path: str | None = None) -> list[Seen]:
        return [s for s in list(self.seen) if path is None or s.path == path]

    def by_id(self, request_id: str) -> Seen | None:
        return next((s for s in list(self.seen) if s.request_id == request_id), None)

    def wait_seen(self, n: int = 1, timeout: float = 10.0) -> list[Seen]:
        """Wait until at least `n` requests arrived; return them all."""
        return wait_until(
            lambda: self.requests() if len(self.seen) >= n else None,
            timeout,
            what=f"{self.name} to receive {n} request(s)",
        )

    def wait_disconnected(self, request_id: str, timeout: float = 10.0) -> Seen:
        return wait_until(
            lambda: (s := self.by_id(request_id)) is not None and s.disconnected and s,
            timeout,
            what=f"{self.name} to see request {request_id} disconnected",
        )

    def wait_answered(self, request_id: str, timeout: float = 10.0) -> Seen:
        return wait_until(
            lambda: (s := self.by_id(request_id)) is not None and s.answered_seq and s,
            timeout,
            what=f"{self.name} to answer request {request_id}",
        )

    # ------------------------------------------------------------ ASGI side

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._gate = asyncio.Event()
            self._end_gate = asyncio.Event()
            if self._released:
                self._gate.set()
            if self._end_released:
                self._end_gate.set()
        path = scope["path"]
        raw = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["method"] == "GET":
            await self._get(path, send)
            return
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        body = json.loads(raw)
        seen = Seen(path, headers, raw, body, next(_sequence), client=scope.get("client"))
        self.seen.append(seen)
        if path == "/tokenize":
            await self._tokenize(seen, send)
            return
        if path == "/v1/responses":
            await self._respond(seen, send)
            return
        behaviour = (body.get("fake") or {}).get(self.role, "ok")
        if self._dead:
            await self._cut(seen, send)
        chat = path == "/v1/chat/completions"
        streaming = body.get("stream") is True
        if behaviour == "error":
            err = {"error": {"message": f"{self.name} failed", "type": "X", "code": 503}}
            await self._answer(seen, send, 503, "application/json", [json.dumps(err).encode()])
            return
        events = _events(seen, chat, self.name) if streaming else None
        if behaviour == "late":
            assert events, "late needs a streaming request"
            await self._start(send, 200, "text/event-stream")
            if not await self._hold(receive):
                seen.disconnected = True
                return
            await self._body(seen, send, events)
            return
        if behaviour == "linger":
            assert events, "linger needs a streaming request"
            await self._start(send, 200, "text/event-stream")
            for event in events:
                await self._chunk(seen, send, event, more=True)
                await asyncio.sleep(0)
            if not await self._hold(receive):
                seen.disconnected = True
                return
            seen.answered_seq = next(_sequence)
            await self._chunk(seen, send, b"", more=False)
            return
        if behaviour in ("hang", "hang_stream", "hang_stream_linger"):
            first = []
            if behaviour != "hang" and events:
                first = [events.pop(0)]
                await self._start(send, 200, "text/event-stream")
                await self._chunk(seen, send, first[0], more=True)
            if not await self._hold(receive):
                seen.disconnected = True
                return
            if self._dead:
                await self._cut(seen, send, started=bool(first))
            if first:
                for event in events:
                    await self._chunk(seen, send, event, more=True)
                if behaviour == "hang_stream_linger":
                    assert self._end_gate is not None
                    await self._end_gate.wait()
                seen.answered_seq = next(_sequence)  # before the end leaves: see _body
                await self._chunk(seen, send, b"", more=False)
                return
        if behaviour == "cut_after_done":
            assert events, "cut_after_done needs a streaming request"
            await self._start(send, 200, "text/event-stream")
            for event in events:
                await self._chunk(seen, send, event, more=True)
            raise ConnectionAbortedError(f"{self.name}: cutting after [DONE] on purpose")
        if behaviour == "cut":
            assert events, "cut needs a streaming request"
            await self._start(send, 200, "text/event-stream")
            await self._chunk(seen, send, events[0], more=True)
            raise ConnectionAbortedError(f"{self.name}: cutting the answer on purpose")
        if events is not None:
            await self._answer(seen, send, 200, "text/event-stream", events)
        else:
            full = _full(seen, chat, self.name)
            if self.control is not None:
                full["kv_transfer_params"] = {
                    "rapidkv": {
                        "control": self.control,
                        "instance_id": self.name,
                        "block_size": 4,
                        "max_num_seqs": self.max_num_seqs,
                    }
                }
            answer = json.dumps(full).encode()
            await self._answer(seen, send, 200, "application/json", [answer])

    async def _cut(self, seen: Seen, send: Any, started: bool = False) -> None:
        """Drop the connection with nothing more answered: uvicorn closes it
        when the app raises after the headers (before them it would answer
        500), so they go first unless `started`."""
        seen.disconnected = True
        if not started:
            await self._start(send, 200, "text/event-stream")
        raise ConnectionAbortedError(f"{self.name}: died")

    async def _tokenize(self, seen: Seen, send: Any) -> None:
        if "messages" in seen.body:
            tokens = fake_render(seen.body["messages"])
        else:
            prompt = seen.body.get("prompt", "")
            tokens = None if prompt.startswith("untokenizable") else [ord(c) for c in prompt]
        if tokens is None:
            await self._answer(seen, send, 500, "application/json", [b'{"error": "no"}'])
            return
        answer = {"count": len(tokens), "max_model_len": 1024, "tokens": tokens}
        await self._answer(seen, send, 200, "application/json", [json.dumps(answer).encode()])

    async def _respond(self, seen: Seen, send: Any) -> None:
        """The Responses API: an id this fake remembers (``GET /v1/responses/{id}``)."""
        response_id = f"resp_{self.name}_{seen.seq}"
        self.responses.add(response_id)
        answer = {"id": response_id, "object": "response", "served_by": self.name}
        if seen.body.get("stream") is True:
            created = {"type": "response.created", "response": answer}
            events = [b"event: response.created\ndata: " + json.dumps(created).encode() + b"\n\n"]
            await self._answer(seen, send, 200, "text/event-stream", events)
        else:
            await self._answer(seen, send, 200, "application/json", [json.dumps(answer).encode()])

    async def _hold(self, receive: Any) -> bool:
        """Wait for release (True) or the caller's disconnect (False)."""
        assert self._gate is not None
        released = asyncio.ensure_future(self._gate.wait())
        gone = asyncio.ensure_future(receive())
        done, pending = await asyncio.wait({released, gone}, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        return released in done

    async def _get(self, path: str, send: Any) -> None:
        if path == "/health":
            self.health_asked += 1
            await asyncio.sleep(self.health_delay_s)
            status = 200 if self.healthy else 503
            await self._start(send, status, "text/plain")
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        elif path == "/v1/models":
            models = {
                "object": "list",
                "data": [{"id": f"model-of-{self.name}", "object": "model"}],
            }
            await self._start(send, 200, "application/json")
            await send({"type": "http.response.body", "body": json.dumps(models).encode()})
        elif path.removeprefix("/v1/responses/") in self.responses:
            answer = {"id": path.removeprefix("/v1/responses/"), "served_by": self.name}
            await self._start(send, 200, "application/json")
            await send({"type": "http.response.body", "body": json.dumps(answer).encode()})
        else:
            await self._start(send, 404, "text/plain")
            await send({"type": "http.response.body", "body": b"not found"})

    async def _start(self, send: Any, status: int, content_type: str) -> None:
        headers = [(b"content-type", content_type.encode()), (b"x-fake-name", self.name.encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})

    async def _chunk(self, seen: Seen, send: Any, data: bytes, *, more: bool) -> None:
        seen.sent += data
        await send({"type": "http.response.body", "body": data, "more_body": more})

    async def _answer(
        self, seen: Seen, send: Any, status: int, content_type: str, chunks: list[bytes]
    ) -> None:
        await self._start(send, status, content_type)
        await self._body(seen, send, chunks)

    async def _body(self, seen: Seen, send: Any, chunks: list[bytes]) -> None:
        for data in chunks:
            await self._chunk(seen, send, data, more=True)
            await asyncio.sleep(0)  # let each event leave as its own chunk
        # numbered before the end leaves: the caller may act on the end (the router
        # sends D its request) before this thread runs again
        seen.answered_seq = next(_sequence)
        await self._chunk(seen, send, b"", more=False)


def _full(seen: Seen, chat: bool, name: str) -> dict[str, Any]:
    tokens = fake_tokens(seen.body)
    text = "".join(f" t{t}" for t in tokens)
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
    else:
        choice = {"index": 0, "text": text}
    choice.update(token_ids=tokens, finish_reason="length")
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{seen.request_id}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": f"model-of-{name}",
        "choices": [choice],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": len(tokens),
            "total_tokens": 3 + len(tokens),
        },
        "served_by": name,
        "kv_transfer_params": None,
    }


def _events(seen: Seen, chat: bool, name: str) -> list[bytes]:
    tokens = fake_tokens(seen.body)
    base = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{seen.request_id}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "model": f"model-of-{name}",
        "served_by": name,
    }
    out = []
    if chat:  # vLLM's chat stream opens with a role-only chunk
        out.append(
            {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        )
    for i, t in enumerate(tokens):
        last = i == len(tokens) - 1
        if chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": f" t{t}"}}
        else:
            choice = {"index": 0, "text": f" t{t}"}
        choice.update(token_ids=[t], finish_reason="length" if last else None)
        if i == 0 and seen.body.get("return_token_ids") and not chat:
            prompt = seen.body.get("prompt")
            choice["prompt_token_ids"] = prompt if isinstance(prompt, list) else [1, 2]
        out.append({**base, "choices": [choice]})
    options = seen.body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        usage = {
            "prompt_tokens": 3,
            "completion_tokens": len(tokens),
            "total_tokens": 3 + len(tokens),
        }
        out.append({**base, "choices": [], "usage": usage})
    return [b"data: " + json.dumps(e).encode() + b"\n\n" for e in out] + [b"data: [DONE]\n\n"]


# Fixture factories' types (tests import them from here, not from `conftest`,
# whose module name is shared with tests/conftest.py).
MakeFake = Callable[..., FakeVLLM]
MakeRouter = Callable[..., RunningRouter]


class StatsServer:
    """A control-plane server standing in for D's connector: answers Stats with
    the counters the test sets."""

    def __init__(self, secret: bytes | None) -> None:
        self.counters: dict[str, float] = {"transfer_kv_ok": 0, "recompute_fallbacks": 0}
        self.asked = 0
        self.server = RpcServer(self.handle, secret=secret)
        self.server.start()

    async def handle(self, request: Request) -> Stats | ErrorReply:
        if isinstance(request, StatsRequest):
            self.asked += 1
            return Stats(counters=dict(self.counters))
        return ErrorReply(Code.ERROR, "unexpected")
