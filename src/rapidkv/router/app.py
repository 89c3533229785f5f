"""The router's HTTP application (Starlette): its routes and their answers.

=========================== ================================================
``POST /v1/completions``    routed through P and D (`proxy.Router.serve`)
``POST /v1/chat/completions`` likewise
``GET /v1/models``          relayed from the first decode instance that answers
``/v1/responses``, ...      served on one instance (`passthrough`)
``GET /livez``, ``/readyz`` liveness and readiness probes (`probes`)
``GET /health``             the instances' health, asked now (`probes`): 200
                            while the router serves (an instance that may
                            decode answers), with the detail
``GET /metrics``            the router's Prometheus metrics
``/admin/...``              with an admin token only (`admin`): running
                            requests, migrate one, drain and undrain an
                            instance
anything else               404 (405 for a known path with the wrong method),
                            as an OpenAI-format JSON error
=========================== ================================================

Every HTTP request goes through the `shutdown.ShutdownGate` (counted; refused
with 503 once the router is shutting down: ``app.state.shutdown``).

The upstream HTTP client (the fleet's) lives on the serving loop: it is
opened at lifespan startup and closed (with background prefill requests
cancelled) at shutdown; a router given ``--etcd`` follows the fleet's
membership from then on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from rapidkv.membership.watcher import Members, MembershipWatcher
from rapidkv.router.admin import admin_routes
from rapidkv.router.config import RouterConfig
from rapidkv.router.fleet.fleet import Fleet
from rapidkv.router.passthrough import Passthrough
from rapidkv.router.probes import probe_routes
from rapidkv.router.proxy import Router
from rapidkv.router.rewrite import Endpoint, error_body
from rapidkv.router.shutdown import ShutdownGate, ShutdownState
from rapidkv.router.tracing import otlp_provider
from rapidkv.router.upstream import UPSTREAM_ERRORS, get


class _ProxyEndpoint:
    """ASGI endpoint routing one OpenAI endpoint (`Route` calls it with raw ASGI)."""

    def __init__(self, router: Router, endpoint: Endpoint) -> None:
        self.router = router
        self.endpoint = endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.router.serve(self.endpoint, scope, receive, send)


def build_app(config: RouterConfig, *, tracer_provider: Any = None) -> Starlette:
    """The ASGI app of a router with `config` (its `Router` is
    ``app.state.router``, its `ShutdownState` ``app.state.shutdown``); its
    spans go to `tracer_provider`, else to ``config.otlp_traces_endpoint``
    (a provider of its own, flushed at shutdown), else to the process's
    global provider (`tracing`)."""
    own_provider = None
    if tracer_provider is None and config.otlp_traces_endpoint is not None:
        own_provider = tracer_provider = otlp_provider(config.otlp_traces_endpoint)
    router = Router(config, tracer_provider)
    shutdown = ShutdownState(lambda: router.background)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await router.start()
        router.fleet.discover_all()
        watcher = _follow_etcd(router.fleet, config) if config.etcd else None
        try:
            yield
        finally:
            if watcher is not None:
                await asyncio.to_thread(watcher.stop)
            await router.close()
            if own_provider is not None:
                await asyncio.to_thread(own_provider.shutdown)  # the last spans exported

    async def models(request: Request) -> Response:
        failures = []
        fleet = router.fleet
        for inst in (fleet.member(i).instance for i in fleet.pool("decode")):
            url, timeout = f"{inst.url}/v1/models", config.health_timeout_s
            try:
                status, raw, content_type = await get(fleet.http, url, timeout, _auth(request))
            except UPSTREAM_ERRORS as e:
                failures.append(f"{inst.url}: {e!r}")
                continue
            if status == 200:
                return Response(raw, media_type=content_type or None)
            failures.append(f"{inst.url}: HTTP {status}")
        message = "no decode instance listed its models: " + "; ".join(failures)
        return _error(503, message)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        response = _error(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}")
        response.headers.update(exc.headers or {})
        return response

    app = Starlette(
        routes=[
            Route("/v1/completions", _ProxyEndpoint(router, "completions"), methods=["POST"]),
            Route("/v1/chat/completions", _ProxyEndpoint(router, "chat"), methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            *Passthrough(router.fleet).routes(),
            *probe_routes(router, shutdown),
            Route("/metrics", metrics, methods=["GET"]),
            *(admin_routes(router, config.admin_token) if config.admin_token else ()),
        ],
        middleware=[Middleware(ShutdownGate, state=shutdown)],
        exception_handlers={HTTPException: http_error},
        lifespan=lifespan,
    )
    app.state.router = router
    app.state.shutdown = shutdown
    return app


def _follow_etcd(fleet: Fleet, config: RouterConfig) -> MembershipWatcher:
    """Start following the fleet's members in etcd: every membership the
    watcher's thread reads is handed to `fleet.follow` on the serving loop."""
    loop = asyncio.get_running_loop()

    def changed(members: Members) -> None:
        loop.call_soon_threadsafe(fleet.follow, members)

    watcher = MembershipWatcher(config.etcd, config.etcd_prefix, changed)
    watcher.start()
    return watcher


def _auth(request: Request) -> dict[str, str]:
    value = request.headers.get("authorization")
    return {"authorization": value} if value else {}


def _error(status: int, message: str) -> Response:
    return Response(error_body(status, message), status_code=status, media_type="application/json")
