"""The router's OpenTelemetry spans (`router.tracing`), against fake vLLM
instances: with the SDK, one request's spans (placement, P, D, a migration)
form one trace under the client's, whose context the upstream requests carry;
``otlp_traces_endpoint`` exports them over OTLP. Skipped without the otel extra."""

from __future__ import annotations

import concurrent.futures
import gzip
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from fake_vllm import FakeVLLM, MakeFake
from test_router_traces import CLIENT, CLIENT_SPAN, COMPLETION, TRACE_ID

from rapidkv.harness import wait_until
from rapidkv.router import Instance, RouterConfig, start_router

pytestmark = pytest.mark.unit

otel = pytest.importorskip("opentelemetry.sdk.trace", reason="the otel extra is not installed")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
)
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)


def parent_of(traceparent: str) -> tuple[str, str]:
    """(trace id, parent span id) of a W3C traceparent."""
    version, trace_id, span_id, flags = traceparent.split("-")
    assert version == "00" and flags == "01"
    return trace_id, span_id


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def by_name(exporter: InMemorySpanExporter) -> dict[str, list[ReadableSpan]]:
    out: dict[str, list[ReadableSpan]] = {}
    for span in exporter.get_finished_spans():
        out.setdefault(span.name, []).append(span)
    return out


def test_with_the_sdk_one_requests_spans_form_one_trace_under_the_clients(
    pd: tuple[FakeVLLM, FakeVLLM],
    spans: tuple[TracerProvider, InMemorySpanExporter],
    http: httpx.Client,
) -> None:
    p, d = pd
    provider, exporter = spans
    config = RouterConfig(prefill=(Instance(p.url),), decode=(Instance(d.url),), port=0)
    with start_router(config.replace(discover=False), tracer_provider=provider) as router:
        resp = http.post(f"{router.url}/v1/completions", json=COMPLETION, headers=CLIENT)
        assert resp.status_code == 200
        wait_until(lambda: "rapidkv.prefill" in by_name(exporter), 10, what="P's span")
    named = by_name(exporter)
    (request,) = named["rapidkv.request"]
    (placement,) = named["rapidkv.placement"]
    (prefill,) = named["rapidkv.prefill"]
    (decode,) = named["rapidkv.decode"]
    # one trace, the client's; the request under the client's span, the rest under it
    assert {format(s.context.trace_id, "032x") for s in named_spans(named)} == {TRACE_ID}
    assert request.parent is not None and format(request.parent.span_id, "016x") == CLIENT_SPAN
    for child in (placement, prefill, decode):
        assert child.parent is not None and child.parent.span_id == request.context.span_id
    assert placement.attributes is not None and placement.attributes["rapidkv.kind"] == "pd"
    assert placement.attributes["rapidkv.decode"] == d.url
    assert decode.attributes is not None and decode.attributes["rapidkv.outcome"] == "ok"
    assert decode.attributes["http.response.status_code"] == 200
    assert request.events[0].attributes is not None
    assert request.events[0].attributes["rapidkv.xfer_id"] == resp.headers["x-rapidkv-xfer-id"]
    # P and D were sent their own span's context, the client's tracestate and id
    (p_seen,), (d_seen,) = p.wait_seen(1), d.wait_seen(1)
    for seen, span in ((p_seen, prefill), (d_seen, decode)):
        assert parent_of(seen.headers["traceparent"]) == (
            TRACE_ID,
            format(span.context.span_id, "016x"),
        )
        assert seen.headers["tracestate"] == CLIENT["tracestate"]
        assert seen.headers["x-request-id"] == "client-req-42"


def named_spans(named: dict[str, list[ReadableSpan]]) -> list[ReadableSpan]:
    return [s for group in named.values() for s in group]


def test_a_migration_is_a_span_of_the_request_and_its_requests_carry_it(
    make_fake: MakeFake,
    spans: tuple[TracerProvider, InMemorySpanExporter],
    http: httpx.Client,
) -> None:
    """A stop-and-copy migration from A (holding after its first token) to B
    (answering at once): its span is the request's child, and B's cut-over
    request carries the migration span's context."""
    source, dest = make_fake("A", "decode"), make_fake("B", "prefill")
    provider, exporter = spans
    token = "admin-token-0123456789"
    auth = {"authorization": f"Bearer {token}"}
    control = "127.0.0.1:9"  # nothing answers there: the room check cannot tell, and passes
    config = RouterConfig(
        instances=(Instance(source.url, control), Instance(dest.url, control)),
        dispatch="local",
        admin_token=token,
        discover=False,
        port=0,
    )
    body = {"prompt": [11, 12, 13], "max_tokens": 6, "stream": True}
    body["fake"] = {"decode": "hang_stream"}
    with (
        start_router(config, tracer_provider=provider) as router,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        admin = f"{router.url}/admin"
        drain = {"instance": dest.url, "migrate": False}  # the request goes to A
        assert http.post(f"{admin}/drain", json=drain, headers=auth).status_code == 200
        with http.stream("POST", f"{router.url}/v1/completions", json=body, headers=CLIENT) as r:
            lines = r.iter_lines()
            next(x for x in lines if x.startswith("data: "))  # A's first token: it holds
            (listed,) = http.get(f"{admin}/requests", headers=auth).json()["requests"]
            http.post(f"{admin}/undrain", json={"instance": dest.url}, headers=auth)
            order = {"xfer_id": listed["xfer_id"], "to": dest.url, "precopy": False}
            moved = pool.submit(http.post, f"{admin}/migrate", json=order, headers=auth)
            rest = [x for x in lines if x.startswith("data: ")]
        assert moved.result(30).status_code == 200 and rest[-1] == "data: [DONE]"
        wait_until(lambda: "rapidkv.migration" in by_name(exporter), 10, what="its span")
    named = by_name(exporter)
    (request,) = named["rapidkv.request"]
    (migration,) = named["rapidkv.migration"]
    assert migration.parent is not None and migration.parent.span_id == request.context.span_id
    assert format(migration.context.trace_id, "032x") == TRACE_ID
    assert migration.attributes is not None
    assert (migration.attributes["rapidkv.source"], migration.attributes["rapidkv.target"]) == (
        source.url,
        dest.url,
    )
    (cutover,) = dest.wait_seen(1)
    assert parent_of(cutover.headers["traceparent"])[1] == format(migration.context.span_id, "016x")
    assert cutover.headers["x-request-id"] == "client-req-42"
    assert json.loads(cutover.raw)["kv_transfer_params"]["rapidkv"]["xfer_id"] != listed["xfer_id"]


def test_otlp_traces_endpoint_exports_the_requests_spans_over_otlp(
    pd: tuple[FakeVLLM, FakeVLLM], http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``otlp_traces_endpoint`` (``--otlp-traces-endpoint``): the router's own
    provider sends its spans to an OTLP receiver (OTLP/HTTP here, as
    ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` asks), the last of them at shutdown."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    received: list[tuple[str, bytes]] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            if self.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            received.append((self.path, body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    receiver = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    try:
        p, d = pd
        config = RouterConfig(
            prefill=(Instance(p.url),),
            decode=(Instance(d.url),),
            port=0,
            discover=False,
            otlp_traces_endpoint=f"http://127.0.0.1:{receiver.server_port}/v1/traces",
        )
        with start_router(config) as router:
            resp = http.post(f"{router.url}/v1/completions", json=COMPLETION, headers=CLIENT)
            assert resp.status_code == 200
            p.wait_seen(1)
        # stopped: its provider was shut down, which exports what is left
        exported = [ExportTraceServiceRequest.FromString(body) for _, body in received]
    finally:
        receiver.shutdown()
        receiver.server_close()
    assert {path for path, _ in received} == {"/v1/traces"}
    found = [
        (rs, span)
        for request in exported
        for rs in request.resource_spans
        for ss in rs.scope_spans
        for span in ss.spans
    ]
    names = sorted(span.name for _, span in found)
    assert names == [
        "rapidkv.decode",
        "rapidkv.placement",
        "rapidkv.prefill",
        "rapidkv.request",
    ]
    assert {span.trace_id.hex() for _, span in found} == {TRACE_ID}
    service = {
        a.value.string_value
        for rs, _ in found
        for a in rs.resource.attributes
        if a.key == "service.name"
    }
    assert service == {"rapidkv-router"}
