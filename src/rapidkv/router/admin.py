"""The router's admin routes, off unless it is started with an admin token.

=============================== ===============================================
``GET /admin/requests``         the requests being served: xfer_id, endpoint,
                                prefill and decode instance, placement, age,
                                streamed output events relayed so far
``POST /admin/drain``           ``{"instance": URL}``: no new request goes to
                                that instance; what it serves runs to its end
``POST /admin/undrain``         ``{"instance": URL}``: it gets requests again
=============================== ===============================================

Every admin request must carry ``Authorization: Bearer <token>`` (compared in
constant time); without it, 401. With no token configured the routes do not
exist (404, like any unknown path). Bodies are small JSON objects (at most
`MAX_BODY` bytes); anything else is a 400 naming the problem.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rapidkv.router.proxy import Router
from rapidkv.router.rewrite import error_body

MAX_BODY = 4096


def admin_routes(router: Router, token: str) -> list[Route]:
    """The admin routes of `router`, guarded by `token`."""
    expected = f"Bearer {token}".encode()

    def authorized(request: Request) -> bool:
        given = request.headers.get("authorization", "").encode()
        return hmac.compare_digest(given, expected)

    async def requests(request: Request) -> Response:
        if not authorized(request):
            return _error(401, "admin routes need Authorization: Bearer <admin token>")
        return JSONResponse({"requests": router.requests()})

    def drain_route(draining: bool) -> Any:
        async def handle(request: Request) -> Response:
            if not authorized(request):
                return _error(401, "admin routes need Authorization: Bearer <admin token>")
            raw = await request.body()
            if len(raw) > MAX_BODY:
                return _error(413, f"admin request body larger than {MAX_BODY} bytes")
            try:
                body = json.loads(raw)
            except ValueError as e:
                return _error(400, f"body is not JSON: {e}")
            url = body.get("instance") if isinstance(body, dict) else None
            if not isinstance(url, str):
                return _error(400, 'body must be {"instance": "<instance base URL>"}')
            url = url.rstrip("/")
            if not router.drain(url, draining):
                return _error(404, f"no instance {url!r} in this router's configuration")
            return JSONResponse({"instance": url, "draining": draining})

        return handle

    return [
        Route("/admin/requests", requests, methods=["GET"]),
        Route("/admin/drain", drain_route(True), methods=["POST"]),
        Route("/admin/undrain", drain_route(False), methods=["POST"]),
    ]


def _error(status: int, message: str) -> Response:
    return Response(error_body(status, message), status_code=status, media_type="application/json")
