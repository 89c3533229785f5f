"""The router's HTTP application (Starlette): its routes and their answers.

=========================== ================================================
``POST /v1/completions``    routed through P and D (`proxy.Router.serve`)
``POST /v1/chat/completions`` likewise
``GET /v1/models``          relayed from the first decode instance that answers
``/v1/responses``, ...      served on one instance (`passthrough`)
``GET /health``             200 when at least one P (unless dispatch is
                            ``local``) and one D answer ``/health`` with 200,
                            else 503; the JSON body says which did, and
                            whether the router dispatches to each
                            (``dispatching``: false while it is down) and,
                            per decode instance, whether its transfers work
                            (``transfers``: ok / degraded / unknown; status
                            ``degraded`` while one is)
``GET /metrics``            the router's Prometheus metrics
``/admin/...``              with an admin token only (`admin`): running
                            requests, migrate one, drain and undrain an
                            instance
anything else               404 (405 for a known path with the wrong method),
                            as an OpenAI-format JSON error
=========================== ================================================

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

import aiohttp
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from rapidkv.membership.watcher import Members, MembershipWatcher
from rapidkv.router.admin import admin_routes
from rapidkv.router.config import ROLES, Instance, RouterConfig
from rapidkv.router.fleet.fleet import Fleet
from rapidkv.router.passthrough import Passthrough
from rapidkv.router.proxy import Router
from rapidkv.router.rewrite import Endpoint, error_body
from rapidkv.router.upstream import UPSTREAM_ERRORS, get


class _ProxyEndpoint:
    """ASGI endpoint routing one OpenAI endpoint (`Route` calls it with raw ASGI)."""

    def __init__(self, router: Router, endpoint: Endpoint) -> None:
        self.router = router
        self.endpoint = endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.router.serve(self.endpoint, scope, receive, send)


def build_app(config: RouterConfig) -> Starlette:
    """The ASGI app of a router with `config` (its `Router` is ``app.state.router``)."""
    router = Router(config)

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

    async def health(request: Request) -> Response:
        timeout = config.health_timeout_s
        fleet = router.fleet
        members = fleet.members
        listed = sorted({i for role in ROLES for i in fleet.pool(role)})
        results = dict(
            zip(
                listed,
                await asyncio.gather(
                    *(_check_health(fleet.http, members[i].instance, timeout) for i in listed)
                ),
                strict=True,
            )
        )
        checks: dict[str, list[dict[str, Any]]] = {}
        for role in ROLES:  # an instance that may play both roles is listed under both
            checks[role] = []
            for index in fleet.pool(role):
                result = dict(
                    results[index],
                    dispatching=fleet.is_up(index) and not fleet.is_draining(index),
                    draining=fleet.is_draining(index),
                )
                if members[index].label == "both":
                    result["role"] = "both"
                if role == "decode":
                    result["transfers"] = fleet.transfers(index)
                checks[role].append(result)
        needed = ["decode"] if config.dispatch == "local" else ["prefill", "decode"]
        ok = all(any(c["healthy"] for c in checks[role]) for role in needed)
        degraded = any(c["transfers"] == "degraded" for c in checks["decode"])
        status = "unavailable" if not ok else "degraded" if degraded else "ok"
        body = {"status": status, "dispatch": config.dispatch, **checks}
        return JSONResponse(body, status_code=200 if ok else 503)

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
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            *(admin_routes(router, config.admin_token) if config.admin_token else ()),
        ],
        exception_handlers={HTTPException: http_error},
        lifespan=lifespan,
    )
    app.state.router = router
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


async def _check_health(
    http: aiohttp.ClientSession, inst: Instance, timeout: float
) -> dict[str, Any]:
    try:
        status, _, _ = await get(http, f"{inst.url}/health", timeout)
    except UPSTREAM_ERRORS as e:
        return {"url": inst.url, "healthy": False, "detail": repr(e)}
    return {"url": inst.url, "healthy": status == 200, "detail": f"HTTP {status}"}


def _auth(request: Request) -> dict[str, str]:
    value = request.headers.get("authorization")
    return {"authorization": value} if value else {}


def _error(status: int, message: str) -> Response:
    return Response(error_body(status, message), status_code=status, media_type="application/json")
