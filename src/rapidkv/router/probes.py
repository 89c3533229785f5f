"""The router's probes: ``/livez``, ``/readyz`` and ``/health``.

=============== ====================================================================
``GET /livez``  200 whenever the process serves HTTP (backends ignored; also while
                it shuts down): a liveness probe
``GET /readyz`` 200 when a request would be served now: not shutting down and some
                instance that may decode is up and not draining (with no prefill
                instance up the router serves on decode instances alone); else 503.
                Answers from what the router knows (no upstream request): a
                readiness probe. JSON: ``ready``, ``reason`` (when not), and the
                instances that may ``decode`` and ``prefill`` now
``GET /health`` asks every instance in the fleet when it is asked for its
                ``/health`` now (one that joins meanwhile is in the next
                report): 200 while at least one instance that may decode
                answers 200 (the router serves), else
                503; ``status`` is ``ok``, ``degraded`` (no prefill instance
                answers in dual or serial dispatch, so decode instances compute
                the prompts; or a decode instance's transfers are ``degraded``)
                or ``unavailable``, with ``reasons``; per instance whether it
                answered, whether the router dispatches to it (``dispatching``:
                false while it is down or draining) and, per decode instance,
                whether its transfers work (``transfers``: ok / degraded / unknown)
=============== ====================================================================
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rapidkv.router.config import ROLES, Instance
from rapidkv.router.proxy import Router
from rapidkv.router.shutdown import ShutdownState
from rapidkv.router.upstream import UPSTREAM_ERRORS, get


def probe_routes(router: Router, shutdown: ShutdownState) -> list[Route]:
    """The three probes' routes (see the module)."""
    config = router.config
    fleet = router.fleet

    async def livez(request: Request) -> Response:
        return JSONResponse({"live": True})

    async def readyz(request: Request) -> Response:
        decode, prefill = fleet.up("decode"), fleet.up("prefill")
        body: dict[str, Any] = {"ready": False}
        if shutdown.closing:
            body["reason"] = "the router is shutting down"
        elif not decode:
            body["reason"] = f"no decode instance is up and not draining: {fleet.down_reasons()}"
        else:
            body["ready"] = True
        urls = [[fleet.member(i).instance.url for i in pool] for pool in (decode, prefill)]
        body.update(decode=urls[0], prefill=urls[1])
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    async def health(request: Request) -> Response:
        # the fleet as it is now: members may join or leave while the probes run
        members = fleet.members
        pools = {role: fleet.pool(role) for role in ROLES}
        listed = sorted({i for pool in pools.values() for i in pool})
        answers = await asyncio.gather(
            *(
                _check_health(fleet.http, members[i].instance, config.health_timeout_s)
                for i in listed
            )
        )
        results = dict(zip(listed, answers, strict=True))
        checks: dict[str, list[dict[str, Any]]] = {}
        for role in ROLES:  # an instance that may play both roles is listed under both
            checks[role] = []
            for index in pools[role]:
                result = dict(
                    results[index],
                    dispatching=fleet.available(index),
                    draining=fleet.is_draining(index),
                )
                if members[index].label == "both":
                    result["role"] = "both"
                if role == "decode":
                    result["transfers"] = fleet.transfers(index)
                checks[role].append(result)
        serving = any(c["healthy"] for c in checks["decode"])
        reasons = []
        if not serving:
            reasons.append("no decode instance answers /health")
        elif config.dispatch != "local" and not any(c["healthy"] for c in checks["prefill"]):
            reasons.append("no prefill instance answers /health: decode instances compute prompts")
        degraded = [c["url"] for c in checks["decode"] if c["transfers"] == "degraded"]
        if degraded:
            reasons.append(f"transfers degraded to {', '.join(degraded)}")
        status = "unavailable" if not serving else "degraded" if reasons else "ok"
        body = {"status": status, "reasons": reasons, "dispatch": config.dispatch, **checks}
        return JSONResponse(body, status_code=200 if serving else 503)

    return [
        Route("/livez", livez, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]


async def _check_health(
    http: aiohttp.ClientSession, inst: Instance, timeout: float
) -> dict[str, Any]:
    try:
        status, _, _ = await get(http, f"{inst.url}/health", timeout)
    except UPSTREAM_ERRORS as e:
        return {"url": inst.url, "healthy": False, "detail": repr(e)}
    return {"url": inst.url, "healthy": status == 200, "detail": f"HTTP {status}"}
