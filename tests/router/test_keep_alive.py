"""Idle keep-alive connections are closed by the side that would reuse them.

A request written into a connection just as the other side closes it is reset
before anyone reads it: the client sees a bare `ReadError` and the request is
lost without a trace in any log (seen once in `bench goodput`: 1 request in
about 3,600, a client whose idle expiry, httpx's 5 s, equalled the router's
keep-alive). So the router keeps a client's idle connection longer than
clients keep theirs, and drops its own idle connections to an instance before
vLLM's server (5 s) would.
"""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest
from fake_vllm import MakeFake, MakeRouter

from rapidkv.harness.client import KEEPALIVE_EXPIRY_S, pool_limits
from rapidkv.router import Instance, RouterConfig
from rapidkv.router.upstream import open_session, post_json

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

HTTPX_DEFAULT_EXPIRY_S = 5.0  # httpx.Limits().keepalive_expiry
VLLM_KEEP_ALIVE_S = 5.0  # vllm.envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE's default


def _get(sock: socket.socket, host: str, path: str) -> bytes:
    """One HTTP/1.1 GET on `sock` (kept alive); the answer's status line, or b''
    when the connection was closed or reset instead."""
    try:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return b""
            data += chunk
        return data.split(b"\r\n", 1)[0]
    except ConnectionError:
        return b""


def test_an_idle_client_connection_outlives_an_httpx_client_s_own_expiry(
    make_fake: MakeFake, make_router: MakeRouter
) -> None:
    router = make_router([make_fake("p", "prefill")], [make_fake("d", "decode")])
    assert router.config.keep_alive_s > HTTPX_DEFAULT_EXPIRY_S
    host = f"127.0.0.1:{router.port}"
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
        assert _get(sock, host, "/v1/models").endswith(b"200 OK")
        time.sleep(HTTPX_DEFAULT_EXPIRY_S + 0.5)
        # a client that still holds the connection may use it: the router has not closed it
        assert _get(sock, host, "/v1/models").endswith(b"200 OK")


def test_a_router_with_a_short_keep_alive_closes_an_idle_client_connection(
    make_fake: MakeFake, make_router: MakeRouter
) -> None:
    """The setting is what closes it (the test above would pass if nothing ever did)."""
    router = make_router([make_fake("p", "prefill")], [make_fake("d", "decode")], keep_alive_s=0.3)
    host = f"127.0.0.1:{router.port}"
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
        assert _get(sock, host, "/v1/models").endswith(b"200 OK")
        time.sleep(1.0)
        assert _get(sock, host, "/v1/models") == b""


def test_the_router_drops_an_idle_upstream_connection_before_vllm_would(
    make_fake: MakeFake,
) -> None:
    """Two requests to one instance: on one connection when close together, on
    two when more than `upstream_keep_alive_s` apart (seen from the instance:
    the caller's port)."""
    fake = make_fake("d", "decode")
    config = RouterConfig(decode=(Instance(fake.url),), dispatch="local")
    assert config.upstream_keep_alive_s < VLLM_KEEP_ALIVE_S
    config = config.replace(upstream_keep_alive_s=0.4)
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}

    async def run() -> list[tuple[str, int] | None]:
        async with open_session(config) as http:
            url = f"{fake.url}/v1/completions"
            for pause in (0.05, 0.8, 0.0):
                status, _ = await post_json(http, url, body, 10.0)
                assert status == 200
                await asyncio.sleep(pause)
        return [s.client for s in fake.seen]

    first, second, third = asyncio.run(run())
    assert first is not None
    assert second == first  # 50 ms apart: reused
    assert third != second  # 800 ms apart: the router had closed it


def test_test_clients_drop_idle_connections_before_vllm_would(make_fake: MakeFake) -> None:
    """A client made with `pool_limits` opens a new connection after
    `KEEPALIVE_EXPIRY_S` idle, before vLLM's 5 s would close the old one."""
    assert KEEPALIVE_EXPIRY_S < VLLM_KEEP_ALIVE_S
    fake = make_fake("d", "decode")
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}

    async def run() -> list[tuple[str, int] | None]:
        async with httpx.AsyncClient(limits=pool_limits(1), trust_env=False) as client:
            for pause in (0.05, KEEPALIVE_EXPIRY_S + 0.3, 0.0):
                resp = await client.post(f"{fake.url}/v1/completions", json=body)
                assert resp.status_code == 200
                await asyncio.sleep(pause)
        return [s.client for s in fake.seen]

    first, second, third = asyncio.run(run())
    assert first is not None and second == first  # reused within the expiry
    assert third != second  # closed by the client after it
