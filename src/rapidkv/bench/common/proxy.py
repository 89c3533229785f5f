"""The conventional serial P/D proxy for vLLM's NixlConnector (pull and push).

    python -m rapidkv.bench.common.proxy --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

What vLLM's own toy proxy (`tests/v1/kv_connector/nixl_integration/
toy_proxy_server.py`, not installed) does, for `POST /v1/completions` only:

1. P gets the client's body with `max_tokens=1`, `stream=false`, no
   `min_tokens`/`stream_options`, and `kv_transfer_params = {do_remote_decode:
   true, do_remote_prefill: false, remote_*: null}`; its answer is awaited.
2. D gets the client's body with P's returned `kv_transfer_params`; D's answer
   (streamed or not) is relayed to the client as it arrives.

Both requests carry the same `X-Request-Id`: the push connector pairs P's and
D's requests by it. `GET /health` is 200 when P and D both answer 200.
Written on the same stack as the rapidkv router (Starlette, uvicorn, aiohttp) so
that the two relays cost about the same.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

NIXL_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """What P is sent (step 1 of the module docstring)."""
    out = {k: v for k, v in body.items() if k not in ("min_tokens", "stream_options")}
    out.update(max_tokens=1, stream=False, kv_transfer_params=dict(NIXL_PREFILL_PARAMS))
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def build_app(prefill_url: str, decode_url: str) -> Any:
    import aiohttp
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    from rapidkv.router.upstream import UPSTREAM_ERRORS, get

    state: dict[str, aiohttp.ClientSession] = {}

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1024),
            timeout=aiohttp.ClientTimeout(total=None, sock_read=600.0),
            auto_decompress=False,
            trust_env=False,
        ) as http:
            state["http"] = http
            yield

    async def completions(request: Request) -> Response:
        http = state["http"]
        body = json.loads(await request.body())
        headers = {"X-Request-Id": uuid.uuid4().hex}
        url = f"{prefill_url}/v1/completions"
        async with http.post(url, json=prefill_body(body), headers=headers) as p:
            answer = await p.read()
        if p.status != 200:
            return Response(answer, status_code=p.status, media_type="application/json")
        d_body = dict(body, kv_transfer_params=json.loads(answer).get("kv_transfer_params"))
        upstream = await http.post(f"{decode_url}/v1/completions", json=d_body, headers=headers)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.content.iter_any():
                    yield chunk
            finally:
                upstream.release()

        return StreamingResponse(
            relay(),
            status_code=upstream.status,
            media_type=upstream.headers.get("content-type"),
        )

    async def health(request: Request) -> Response:
        async def ok(url: str) -> bool:
            try:
                return (await get(state["http"], f"{url}/health", 2.0))[0] == 200
            except UPSTREAM_ERRORS:
                return False

        healthy = await asyncio.gather(ok(prefill_url), ok(decode_url))
        return JSONResponse(
            {"prefill": healthy[0], "decode": healthy[1]}, 200 if all(healthy) else 503
        )

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
        ],
        lifespan=lifespan,
    )


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m rapidkv.bench.common.proxy")
    parser.add_argument("--prefill", required=True, help="P's base URL")
    parser.add_argument("--decode", required=True, help="D's base URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    app = build_app(args.prefill.rstrip("/"), args.decode.rstrip("/"))
    uvicorn.run(
        app, host=args.host, port=args.port, log_level="warning", access_log=False, lifespan="on"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
