"""The router's admin routes, off unless it is started with an admin token.

=============================== ===============================================
``GET /admin/requests``         the requests being served: xfer_id, endpoint,
                                prefill and decode instance, placement, age,
                                streamed output events relayed and tokens
                                generated so far, whether it may migrate
``POST /admin/migrate``         ``{"xfer_id": X, "to": URL, "precopy": true}``:
                                move a running streamed request to that
                                instance (``precopy`` false: stop-and-copy);
                                200 with what happened (downtime, tokens), 404
                                for an unknown request or instance, 409 if it
                                was not moved (it runs on where it was)
``POST /admin/drain``           ``{"instance": URL, "migrate": true}``: no new
                                request goes to that instance, and each
                                migratable request it decodes moves to the
                                least busy other decoder (``migrate`` false:
                                they run to their end there); 200 with what
                                moved, what failed to and what stays
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

from rapidkv.router.migration.relay import MigrationError
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

    async def json_body(request: Request) -> dict[str, Any] | Response:
        """The request's JSON object, or the error answer."""
        if not authorized(request):
            return _error(401, "admin routes need Authorization: Bearer <admin token>")
        raw = await request.body()
        if len(raw) > MAX_BODY:
            return _error(413, f"admin request body larger than {MAX_BODY} bytes")
        try:
            body = json.loads(raw)
        except ValueError as e:
            return _error(400, f"body is not JSON: {e}")
        if not isinstance(body, dict):
            return _error(400, "body must be a JSON object")
        return body

    def drain_route(draining: bool) -> Any:
        async def handle(request: Request) -> Response:
            body = await json_body(request)
            if isinstance(body, Response):
                return body
            url = body.get("instance")
            move = body.get("migrate", True)
            if not isinstance(url, str) or not isinstance(move, bool):
                return _error(
                    400, 'body must be {"instance": "<instance base URL>"[, "migrate": bool]}'
                )
            url = url.rstrip("/")
            if draining and move:
                result = await router.migrations.drain_migrating(url)
                if result is None:
                    return _error(404, f"no instance {url!r} in this router's configuration")
                return JSONResponse(result)
            if not router.fleet.drain(url, draining):
                return _error(404, f"no instance {url!r} in this router's configuration")
            return JSONResponse({"instance": url, "draining": draining})

        return handle

    async def migrate(request: Request) -> Response:
        body = await json_body(request)
        if isinstance(body, Response):
            return body
        xfer_id, to, precopy = body.get("xfer_id"), body.get("to"), body.get("precopy", True)
        if not isinstance(xfer_id, str) or not isinstance(to, str) or not isinstance(precopy, bool):
            return _error(
                400,
                'body must be {"xfer_id": "<id>", "to": "<instance base URL>"[, "precopy": bool]}',
            )
        try:
            return JSONResponse(await router.migrations.migrate(xfer_id, to.rstrip("/"), precopy))
        except KeyError as e:
            return _error(404, str(e.args[0]))
        except MigrationError as e:
            return _error(409, f"not migrated: {e}")

    return [
        Route("/admin/requests", requests, methods=["GET"]),
        Route("/admin/migrate", migrate, methods=["POST"]),
        Route("/admin/drain", drain_route(True), methods=["POST"]),
        Route("/admin/undrain", drain_route(False), methods=["POST"]),
    ]


def _error(status: int, message: str) -> Response:
    return Response(error_body(status, message), status_code=status, media_type="application/json")
