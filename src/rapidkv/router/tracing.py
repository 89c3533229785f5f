"""Traces across the router: the headers a client's trace follows into P and D,
and the router's own OpenTelemetry spans.

Headers. Every upstream request of a client's request (P's, D's, a split's,
a migration's) carries the client's ``authorization``, W3C ``traceparent``
and ``tracestate``, and ``x-request-id`` as the client sent them
(`upstream_headers`). Without an ``x-request-id`` from the client, the router
sends its ``xfer_id`` as one to P and D, and ids derived from it for a
stitch's continuation and a migration's requests (`request_id`); the router
never needs that header itself: P and D are paired by the ``xfer_id`` in
``kv_transfer_params``, and vLLM makes every engine request's id unique (it
appends random characters to the header's value), so one id on many
requests (P and D, a fan-out's sequences) is what vLLM expects.

Spans (`Tracing`). Where the ``opentelemetry`` package is importable (the
``otel`` extra) and a tracer provider records (the router's own, exporting
to ``RouterConfig.otlp_traces_endpoint``; else the process's global one,
e.g. set up by ``opentelemetry-instrument`` or a test), each completions or
chat request is a span (``rapidkv.request``, kind server) continuing the
client's ``traceparent``, with child spans ``rapidkv.placement`` (from the
request's start to its dispatch: where it runs, and why), ``rapidkv.prefill``
(P's request), ``rapidkv.decode`` (D's, to the end of the client's answer)
and ``rapidkv.migration`` (one per migration carried out). An upstream
request carries its own span's context in ``traceparent``/``tracestate`` (a
vLLM started with ``--otlp-traces-endpoint`` makes its ``llm_request`` span
a child of it). Without the package, or with a provider that does not record
(the API's default), nothing is recorded, the client's trace headers go on
unchanged, and a request costs a few checks (about 6 us with the API and no
SDK, measured on a busy 2-core machine; no-op spans cost 17 us).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from starlette.types import Scope

try:
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    _PROPAGATOR: Any = TraceContextTextMapPropagator()
except ImportError:  # the otel extra is not installed: no spans
    trace = None  # type: ignore[assignment]

# Request headers passed from the client to P and D.
PASSED_ON = (b"authorization", b"accept-encoding", b"traceparent", b"tracestate", b"x-request-id")
TRACE_HEADERS = ("traceparent", "tracestate")
INSTRUMENTATION = "rapidkv.router"


def upstream_headers(scope: Scope) -> dict[str, str]:
    """The headers of a client's request's upstream requests: JSON, no
    compression, and the client's `PASSED_ON` headers as sent."""
    headers = {"content-type": "application/json", "accept-encoding": "identity"}
    for name, value in scope.get("headers", []):
        if name.lower() in PASSED_ON:
            headers[name.lower().decode("latin-1")] = value.decode("latin-1")
    return headers


def request_id(headers: dict[str, str], xfer_id: str, derived: str) -> dict[str, str]:
    """`headers` for a further upstream request of the request `xfer_id`: its
    ``x-request-id`` is `derived` where the router made it up (it was the
    xfer_id), the client's otherwise."""
    if headers.get("x-request-id", xfer_id) != xfer_id:
        return headers
    return {**headers, "x-request-id": derived}


class Call:
    """One upstream call's span (or none): the `headers` to send (the span's
    context in them when it records), `set` attributes, `end` once."""

    __slots__ = ("_span", "headers")

    def __init__(self, headers: dict[str, str], span: Any = None) -> None:
        self.headers = headers
        self._span = span

    def set(self, key: str, value: Any) -> None:
        if self._span is not None and value is not None:
            self._span.set_attribute(key, value)

    def end(self, error: str | None = None) -> None:
        """End the span (an error: its status and description)."""
        span, self._span = self._span, None
        if span is None:
            return
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()


class Tracing:
    """The router's spans (see the module); `provider`: a tracer provider
    (None: the process's global one)."""

    def __init__(self, provider: Any = None) -> None:
        self._tracer = None if trace is None else trace.get_tracer(INSTRUMENTATION, None, provider)
        self._own = provider is not None

    def _on(self) -> bool:
        """Whether spans may record: the package is there, and a provider is
        given or the process set a global one (the API's default records nothing)."""
        if self._tracer is None:
            return False
        return self._own or not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)

    @contextmanager
    def request(self, scope: Scope, endpoint: str) -> Iterator[Call]:
        """The span of one client request, current while it is served (its
        upstream calls' spans are its children)."""
        if not self._on():
            yield Call({})
            return
        carrier = {
            k.decode("latin-1").lower(): v.decode("latin-1")
            for k, v in scope.get("headers", ())
            if k.lower() in (b"traceparent", b"tracestate")
        }
        attributes = {
            "http.request.method": scope.get("method", "POST"),
            "url.path": scope.get("path", ""),
            "rapidkv.endpoint": endpoint,
        }
        with self._tracer.start_as_current_span(
            "rapidkv.request",
            context=_PROPAGATOR.extract(carrier) if carrier else None,
            kind=SpanKind.SERVER,
            attributes=attributes,
        ) as span:
            yield Call({}, span if span.is_recording() else None)

    def call(self, name: str, headers: dict[str, str], **attributes: Any) -> Call:
        """A child span of the current request for an upstream call sent with
        `headers`: `Call.headers` carry its context when it records (else
        they are `headers`, unchanged)."""
        if not self._on():
            return Call(headers)
        span = self._tracer.start_span(name, kind=SpanKind.CLIENT, attributes=_clean(attributes))
        if not span.is_recording():
            return Call(headers)
        out = {k: v for k, v in headers.items() if k not in TRACE_HEADERS}
        _PROPAGATOR.inject(out, context=trace.set_span_in_context(span))
        return Call(out, span)

    def placement(self, started: float, **attributes: Any) -> None:
        """A ``rapidkv.placement`` span, from `started` (`time.monotonic()`) to now."""
        if not self._on():
            return
        start_ns = time.time_ns() - int((time.monotonic() - started) * 1e9)
        span = self._tracer.start_span(
            "rapidkv.placement", start_time=start_ns, attributes=_clean(attributes)
        )
        span.end()

    def event(self, name: str, **attributes: Any) -> None:
        """An event on the current span (a request's: one per sequence it serves)."""
        if self._on():
            span = trace.get_current_span()
            if span.is_recording():
                span.add_event(name, _clean(attributes))


NO_TRACING = Tracing.__new__(Tracing)
NO_TRACING._tracer, NO_TRACING._own = None, False  # records nothing, even with a provider


def _clean(attributes: dict[str, Any]) -> dict[str, Any]:
    """Span attributes: `rapidkv.`-prefixed unless dotted, None left out."""
    return {(k if "." in k else f"rapidkv.{k}"): v for k, v in attributes.items() if v is not None}


def otlp_provider(endpoint: str) -> Any:
    """A tracer provider exporting to the OTLP `endpoint` in batches (gRPC,
    or HTTP with ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``, as
    vLLM's ``--otlp-traces-endpoint``); `ValueError` without the packages."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True)
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as HTTPExporter,
            )

            exporter = HTTPExporter(endpoint=endpoint)
        else:
            raise ValueError(
                f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL {protocol!r}: grpc or http/protobuf"
            )
    except ImportError as e:
        raise ValueError(
            f"otlp_traces_endpoint needs OpenTelemetry's SDK and OTLP exporter "
            f"(pip install 'rapidkv[otel]'): {e}"
        ) from None
    provider = TracerProvider(resource=Resource.create({"service.name": "rapidkv-router"}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider
