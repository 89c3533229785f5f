"""The router's graceful shutdown: on SIGTERM (or SIGINT) it stops taking
requests, lets the running ones finish within a grace, then exits.

- `ShutdownState`: whether the router is closing (and since when), how many
  HTTP requests it is serving, and how many P requests run on after their
  client's answer (dual dispatch: a P slower than D);
- `ShutdownGate`: the ASGI middleware that counts them and, once closing,
  refuses every new request but ``/livez`` and ``/metrics`` with 503, an
  OpenAI-format error and ``Connection: close`` (``/readyz`` answers its own
  503: `probes`);
- `DrainingServer`: uvicorn's server, whose first stop signal starts closing
  instead of exiting: the listening socket stays open (a request that still
  arrives gets the 503, not a refused connection) until nothing runs or
  `RouterConfig.shutdown_grace_s` has passed (P's requests that outlive their
  client's answer count as running); then uvicorn's own shutdown closes the
  socket and idle connections, cancels what still runs (half a second on), and
  the app's lifespan ends (background prefill requests cancelled).
  A second signal exits at once, as uvicorn's first would.

Running requests are not migrated elsewhere: a migration moves a request
between instances behind this router (`migration`), and the client's
connection ends here whatever the instance.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from rapidkv.router.rewrite import error_body

log = logging.getLogger(__name__)

# served while closing: the process is alive, and its metrics are read to the end
SERVED_WHILE_CLOSING = frozenset({"/livez", "/metrics", "/readyz"})
UVICORN_GRACE_S = 0.5  # uvicorn's wait for connections, once ours is over


class ShutdownState:
    """Whether the router is closing, and how many requests it serves;
    `background`: how many upstream requests run on without a client's."""

    def __init__(self, background: Callable[[], int] = lambda: 0) -> None:
        self.background = background
        self.closing_since: float | None = None  # time.monotonic() of the stop signal
        self.running = 0  # HTTP requests being served (refused ones excepted)
        self.running_at_close = 0  # ... when it started closing

    @property
    def closing(self) -> bool:
        return self.closing_since is not None

    def close(self) -> None:
        """Start closing (idempotent: the first call's time stays)."""
        if self.closing_since is None:
            self.closing_since = time.monotonic()
            self.running_at_close = self.running

    def over(self, grace_s: float) -> bool:
        """Closing, and nothing runs or the grace has passed."""
        if self.closing_since is None:
            return False
        idle = self.running == 0 and self.background() == 0
        return idle or time.monotonic() - self.closing_since >= grace_s


class ShutdownGate:
    """ASGI middleware: counts the requests served, refuses new ones while closing."""

    def __init__(self, app: ASGIApp, state: ShutdownState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.state.closing and scope["path"] not in SERVED_WHILE_CLOSING:
            await refuse(send)
            return
        self.state.running += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.running -= 1


async def refuse(send: Send) -> None:
    """Answer 503: the router is shutting down; the connection closes after it."""
    body = error_body(503, "the router is shutting down: send the request to another router")
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class DrainingServer(uvicorn.Server):
    """uvicorn's server, closing through `state` for `grace_s` on the first
    stop signal (see the module)."""

    def __init__(self, config: uvicorn.Config, state: ShutdownState, grace_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.grace_s = grace_s
        self._announced = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.state.closing:  # a second signal: uvicorn's own (exit now)
            self.should_exit = True
            super().handle_exit(sig, frame)
            return
        self._captured_signals.append(sig)  # re-raised once served (uvicorn's rule)
        self.state.close()

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        state = self.state
        if not state.closing:
            return False
        if not self._announced:
            self._announced = True
            log.info(
                "closing: new requests are refused; %d running got up to %gs to finish",
                state.running_at_close,
                self.grace_s,
            )
        if not state.over(self.grace_s):
            return False
        if state.running or state.background():
            log.warning(
                "grace over: %d request(s) still running are cancelled (and %d P request(s) "
                "outliving their answer)",
                state.running,
                state.background(),
            )
        return True
