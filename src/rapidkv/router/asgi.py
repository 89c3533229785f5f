"""The router's own ASGI answers and waits, shared by its request handlers."""

from __future__ import annotations

from starlette.types import Receive, Send

from rapidkv.router.rewrite import error_body


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client disconnects (call once the body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def send_error(send: Send, status: int, message: str, param: str | None = None) -> None:
    """A whole OpenAI-format error answer (`rewrite.error_body`)."""
    body = error_body(status, message, param)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
