"""One client request on its way through the router (`Exchange`): where it
runs, how far it got, whether it may migrate; the client's `send` that counts
what is relayed into it (`CountingSend`); and how a failed upstream request of
it is reported (`upstream_error`: counted, logged at warning).

The request path (`proxy`) creates and fills an exchange, the answer's relay
(`answer`) and a migration (`migration.controller`) update it, the admin
routes list them (`Exchange.describe`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.types import Message, Send

from rapidkv.router.config import Instance
from rapidkv.router.metrics import RouterMetrics
from rapidkv.router.migration.relay import MigratingRelay
from rapidkv.router.placement import Decision
from rapidkv.router.rewrite import Endpoint
from rapidkv.router.tracing import NO_TRACING, Tracing

log = logging.getLogger(__name__)

PATHS: dict[Endpoint, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class Exchange:
    """One client request on its way through the router."""

    endpoint: Endpoint
    xfer_id: str
    t_start: float
    upstream_headers: dict[str, str]
    tracing: Tracing = NO_TRACING  # the router's spans (`tracing`)
    prefill: Instance | None = None
    decode: Instance | None = None
    status: int | None = None  # D's status
    placement: str | None = None  # the x-rapidkv-placement header's value
    kind: str | None = None  # the placement kind it runs under (local, pd, split, fetch)
    decision: Decision | None = None  # adaptive placement's, for the request
    output_events: int = 0  # streamed output events relayed (about the tokens)
    estimated_tokens: int = 0  # the prompt's length as placement estimated it
    prompt_ids: list[int] | None = None  # its token ids, when the router knows them
    cached: tuple[int, ...] = ()  # per instance index, the prompt's tokens it holds cached
    output_tokens: int = 0  # the output it asks for, as placement read it
    decode_index: int = -1  # the instance that decodes it (outstanding until `answered`)
    answered: bool = False  # its answer is complete: no longer outstanding on D
    served: bool = False  # its stream reached data: [DONE] without an error event
    placed: bool = False  # the placer follows it and has not learnt that it finished
    # why it cannot be migrated (None: it can, once `relay` exists)
    unmigratable: str | None = "migration is off (no admin token)"
    relay: MigratingRelay | None = None  # a migratable stream's, once streaming
    # set once D has the prompt's KV or computes it (D's first token, P's answer,
    # local dispatch, or the request's end): a fan-out's followers wait for it
    kv_ready: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    @property
    def path(self) -> str:
        return PATHS[self.endpoint]

    def describe(self, now: float) -> dict[str, Any]:
        """Where it runs and how far it got (``GET /admin/requests``)."""
        return {
            "xfer_id": self.xfer_id,
            "endpoint": self.endpoint,
            "prefill": self.prefill.url if self.prefill else None,
            "decode": self.decode.url if self.decode else None,
            "placement": self.placement,
            "age_s": round(now - self.t_start, 3),
            "output_events": self.output_events,
            "tokens": self.relay.generated if self.relay is not None else None,
            "migratable": self.relay is not None,
            "unmigratable": None if self.relay is not None else self.unmigratable,
        }


class CountingSend:
    """The client's `send`, counting the streamed output events relayed through
    it (``data: {`` at an event's start: about one per token) into `ex`, and
    calling `on_answered(ok)` once, before the client can see it, with the
    message that completes the answer: the one that carries a stream's ``data:
    [DONE]`` event (its own bytes, after an event's blank line: never a JSON
    string's), `ok` True, or False if an error event came before it (D's or
    the router's own, `sse.sse_error`); else the body's last message, `ok` None
    (how it went is not in the bytes). D's request is over by then, though
    D's HTTP answer may end later."""

    MARK = b"data: {"
    DONE = b"\n\ndata: [DONE]"
    ERROR = b'data: {"error":'  # an error event (vLLM's and `rewrite.error_body`)
    TAIL = max(len(DONE), len(ERROR)) - 1  # the bytes kept: a mark may begin in them

    def __init__(
        self, send: Send, ex: Exchange, on_answered: Callable[[bool | None], None] | None = None
    ) -> None:
        self._send = send
        self._ex = ex
        self._tail = b""
        self._failed = False  # an error event was relayed
        self._on_answered = on_answered

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.body":
            body = message.get("body", b"")
            data = self._tail + body
            if body:
                # the tail's own marks were counted with the message before
                self._ex.output_events += data.count(self.MARK) - self._tail.count(self.MARK)
                self._failed = self._failed or self.ERROR in data
                self._tail = data[-self.TAIL :]
            done = self.DONE in data
            if (done or not message.get("more_body", False)) and self._on_answered is not None:
                answered, self._on_answered = self._on_answered, None
                answered(not self._failed if done else None)
        await self._send(message)


def upstream_error(
    metrics: RouterMetrics, role: str, inst: Instance, kind: str, ex: Exchange, detail: str
) -> None:
    """`ex`'s request of `role` to `inst` failed (`kind`: ``status``, ``connect``
    or ``stream``; see `metrics`)."""
    metrics.upstream_errors.labels(role, inst.url, kind).inc()
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
