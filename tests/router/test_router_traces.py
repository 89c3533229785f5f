"""A client's trace headers through the router (`router.tracing`), against
fake vLLM instances: its ``traceparent``, ``tracestate`` and ``x-request-id``
reach P and D unchanged (no tracer provider: nothing of the router's in them),
and the router's own request id goes out only when the client sent none.
Its spans, with OpenTelemetry's SDK: test_router_spans.py."""

from __future__ import annotations

import httpx
import pytest
from fake_vllm import FakeVLLM, MakeRouter

from rapidkv.router.tracing import request_id, upstream_headers

pytestmark = pytest.mark.unit

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
CLIENT = {
    "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01",
    "tracestate": "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7",
    "x-request-id": "client-req-42",
}
COMPLETION = {"prompt": [1, 2, 3], "max_tokens": 3}


def test_without_a_tracer_the_clients_trace_headers_and_request_id_reach_p_and_d_unchanged(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = make_router([p], [d])
    resp = http.post(f"{router.url}/v1/completions", json=COMPLETION, headers=CLIENT)
    assert resp.status_code == 200
    xfer_id = resp.headers["x-rapidkv-xfer-id"]
    (p_seen,), (d_seen,) = p.wait_seen(1), d.wait_seen(1)
    for seen in (p_seen, d_seen):
        assert {k: seen.headers.get(k) for k in CLIENT} == CLIENT
        assert seen.kv_transfer_params["rapidkv"]["xfer_id"] == xfer_id  # paired by it
    assert resp.json()["id"] == "cmpl-client-req-42"  # vLLM's ids follow the client's
    # without one from the client, P and D get the router's (one id for both)
    http.post(f"{router.url}/v1/completions", json=COMPLETION)
    p_seen, d_seen = p.wait_seen(2)[1], d.wait_seen(2)[1]
    assert p_seen.request_id == d_seen.request_id == d_seen.kv_transfer_params["rapidkv"]["xfer_id"]
    assert "traceparent" not in d_seen.headers


def test_a_fan_out_passes_the_clients_headers_to_every_sequence(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = make_router([p], [d])
    body = {"prompt": [[1, 2], [3, 4]], "max_tokens": 2}
    assert http.post(f"{router.url}/v1/completions", json=body, headers=CLIENT).is_success
    seen = d.wait_seen(2)
    assert [s.headers["x-request-id"] for s in seen] == ["client-req-42"] * 2
    assert len({s.kv_transfer_params["rapidkv"]["xfer_id"] for s in seen}) == 2


def test_upstream_headers_keep_the_clients_and_request_id_derives_only_the_routers() -> None:
    scope = {
        "headers": [
            (b"Traceparent", CLIENT["traceparent"].encode()),
            (b"x-request-id", b"client-req-42"),
            (b"cookie", b"secret"),
            (b"authorization", b"Bearer k"),
        ]
    }
    headers = upstream_headers(scope)
    assert headers == {
        "content-type": "application/json",
        "accept-encoding": "identity",
        "traceparent": CLIENT["traceparent"],
        "x-request-id": "client-req-42",
        "authorization": "Bearer k",
    }
    assert request_id(headers, "x1", "x1-cont") is headers  # the client's id stays
    own = dict(headers, **{"x-request-id": "x1"})
    assert request_id(own, "x1", "x1-cont")["x-request-id"] == "x1-cont"
