"""HTTP helpers for vLLM's OpenAI API, shared by tests and benchmarks.

Requests are greedy (`temperature=0`) with `ignore_eos=True` by default, so a
request of `max_tokens=n` yields exactly n tokens; prompts are token ids; the
generated token ids come back through vLLM 0.32's `return_token_ids`.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 120.0
KEEPALIVE_EXPIRY_S = 2.0
"""How long a client here keeps an idle connection: less than vLLM's server
keeps one (5 s, `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`). httpx's default (5 s) equals
it, and a request written just as the server closes the connection is reset
(`ReadError`) before anyone reads it."""


def pool_limits(max_connections: int) -> httpx.Limits:
    """An `httpx.AsyncClient`'s pool: `max_connections`, idle ones closed after
    `KEEPALIVE_EXPIRY_S` (by this side: see there)."""
    return httpx.Limits(max_connections=max_connections, keepalive_expiry=KEEPALIVE_EXPIRY_S)


@dataclass(frozen=True)
class Completion:
    """One choice of a /v1/completions response, with client-side timing."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    kv_transfer_params: dict[str, Any] | None
    raw: dict[str, Any]
    t_start: float  # time.monotonic() when the request was sent
    t_end: float  # ... and when the response was complete


def completion_body(
    prompt_ids: Sequence[int],
    max_tokens: int,
    *,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    model: str | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The JSON body of a completions request for a token-id prompt."""
    body: dict[str, Any] = {
        "prompt": [int(t) for t in prompt_ids],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "ignore_eos": ignore_eos,
        "return_token_ids": True,
        "stream": False,
    }
    if model is not None:
        body["model"] = model
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    body.update(extra)
    return body


def _parse(data: dict[str, Any], t_start: float) -> Completion:
    choice = data["choices"][0]
    ids = choice.get("token_ids")
    if ids is None:
        raise ValueError(f"response carries no token_ids (is return_token_ids supported?): {data}")
    return Completion(
        token_ids=[int(t) for t in ids],
        text=choice.get("text", ""),
        finish_reason=choice.get("finish_reason"),
        kv_transfer_params=data.get("kv_transfer_params"),
        raw=data,
        t_start=t_start,
        t_end=time.monotonic(),
    )


def _check(resp: httpx.Response) -> dict[str, Any]:
    if resp.status_code != 200:
        raise httpx.HTTPStatusError(
            f"{resp.request.url} -> {resp.status_code}: {resp.text[:2000]}",
            request=resp.request,
            response=resp,
        )
    return resp.json()


def complete_full(
    base_url: str,
    prompt_ids: Sequence[int],
    max_tokens: int,
    *,
    client: httpx.Client | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    **kwargs: Any,
) -> Completion:
    """POST /v1/completions; raises `httpx.HTTPStatusError` on a non-200 answer."""
    body = completion_body(prompt_ids, max_tokens, **kwargs)
    t0 = time.monotonic()
    if client is None:
        with httpx.Client(timeout=timeout) as c:
            data = _check(c.post(f"{base_url}/v1/completions", json=body))
    else:
        data = _check(client.post(f"{base_url}/v1/completions", json=body, timeout=timeout))
    return _parse(data, t0)


def complete(base_url: str, prompt_ids: Sequence[int], max_tokens: int, **kwargs: Any) -> list[int]:
    """The generated token ids (greedy, exactly `max_tokens` of them by default)."""
    return complete_full(base_url, prompt_ids, max_tokens, **kwargs).token_ids


async def acomplete_full(
    client: httpx.AsyncClient,
    base_url: str,
    prompt_ids: Sequence[int],
    max_tokens: int,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    **kwargs: Any,
) -> Completion:
    """Async `complete_full` on a caller-owned `httpx.AsyncClient`."""
    body = completion_body(prompt_ids, max_tokens, **kwargs)
    t0 = time.monotonic()
    resp = await client.post(f"{base_url}/v1/completions", json=body, timeout=timeout)
    return _parse(_check(resp), t0)


def complete_many_full(
    base_url: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int | Sequence[int],
    *,
    concurrency: int = 1,
    **kwargs: Any,
) -> list[Completion]:
    """Send every prompt, at most `concurrency` in flight; results in prompt order.
    `max_tokens`: one for all prompts, or one per prompt."""
    if isinstance(max_tokens, int):
        return _for_each(
            prompts,
            concurrency,
            lambda client, p: acomplete_full(client, base_url, p, max_tokens, **kwargs),
        )
    if len(max_tokens) != len(prompts):
        raise ValueError("give one max_tokens per prompt")
    indexed = [(i,) for i in range(len(prompts))]  # items of `_for_each`, in prompt order
    return _for_each(
        indexed,
        concurrency,
        lambda client, i: acomplete_full(
            client, base_url, prompts[i[0]], max_tokens[i[0]], **kwargs
        ),
    )


def _for_each(
    prompts: Sequence[Sequence[int]],
    concurrency: int,
    call: Callable[[httpx.AsyncClient, Sequence[int]], Awaitable[T]],
) -> list[T]:
    """`call(client, prompt)` for every prompt, at most `concurrency` at once, on one
    client with that many connections (each call sets its own timeout); results in
    prompt order."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")

    async def run() -> list[T]:
        sem = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(limits=pool_limits(concurrency)) as client:

            async def one(p: Sequence[int]) -> T:
                async with sem:
                    return await call(client, p)

            return list(await asyncio.gather(*(one(p) for p in prompts)))

    return asyncio.run(run())


def complete_many(
    base_url: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    concurrency: int = 1,
    **kwargs: Any,
) -> list[list[int]]:
    """Token ids for every prompt (see `complete_many_full`)."""
    results = complete_many_full(base_url, prompts, max_tokens, concurrency=concurrency, **kwargs)
    return [c.token_ids for c in results]


# ------------------------------------------------------------------ metrics

MetricKey = tuple[str, frozenset[tuple[str, str]]]


def get_metrics(base_url: str, *, timeout: float = 10.0) -> dict[MetricKey, float]:
    """Scrape `/metrics`: {(sample name, frozenset(labels)): value}."""
    resp = httpx.get(f"{base_url}/metrics", timeout=timeout)
    resp.raise_for_status()
    out: dict[MetricKey, float] = {}
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = float(sample.value)
    return out


def metric_sum(metrics: dict[MetricKey, float], name: str, **labels: str) -> float:
    """Sum of samples called `name` whose labels include `labels` (0.0 if none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in metrics.items() if n == name and want <= ls)


@dataclass(frozen=True)
class Streamed:
    """A streamed /v1/completions choice: its token ids and client-side timing."""

    token_ids: list[int]
    ttft_ms: float  # request sent -> first token received
    tpot_ms: float  # mean gap between later tokens (nan with fewer than 2 tokens)
    token_ms: tuple[float, ...] = ()  # request sent -> each token received
    headers: Mapping[str, str] = field(default_factory=dict)  # the response's headers
    usage: Mapping[str, Any] | None = None  # the final chunk's, when include_usage was asked
    chunk_ms: tuple[float, ...] = ()  # request sent -> each data event received (usage too)


async def acomplete_stream(
    client: httpx.AsyncClient,
    base_url: str,
    prompt_ids: Sequence[int],
    max_tokens: int,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    include_usage: bool = True,
    **kwargs: Any,
) -> Streamed:
    """A streaming completion (greedy, token ids returned per chunk). With
    `include_usage` (default, what vLLM's benchmark client and the OpenAI SDK
    send) the request asks for ``stream_options: {"include_usage": true}`` and
    the final chunk's usage is kept."""
    if include_usage:
        kwargs.setdefault("stream_options", {"include_usage": True})
    body = completion_body(prompt_ids, max_tokens, stream=True, **kwargs)
    t0 = time.monotonic()
    times: list[float] = []
    chunks: list[float] = []
    tokens: list[int] = []
    usage = None
    async with client.stream(
        "POST", f"{base_url}/v1/completions", json=body, timeout=timeout
    ) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise RuntimeError(f"{base_url}: HTTP {resp.status_code}: {resp.text[:500]}")
        headers = dict(resp.headers)
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.monotonic()
            chunks.append(now)
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"{base_url}: error event in the stream: {event['error']}")
            if event.get("usage"):
                usage = event["usage"]
            choices = event.get("choices") or []  # the usage chunk has none
            new = choices[0].get("token_ids") or [] if choices else []
            tokens.extend(new)
            times.extend([now] * len(new))
    ttft = (times[0] - t0) * 1000 if times else float("nan")
    tpot = (times[-1] - times[0]) * 1000 / (len(times) - 1) if len(times) > 1 else float("nan")
    return Streamed(
        tokens,
        ttft,
        tpot,
        tuple((t - t0) * 1000 for t in times),
        headers,
        usage,
        tuple((t - t0) * 1000 for t in chunks),
    )


def stream_many(
    base_url: str, prompts: Sequence[Sequence[int]], max_tokens: int, *, concurrency: int = 1
) -> list[Streamed]:
    """Stream every prompt, at most `concurrency` in flight; results in prompt order."""
    return _for_each(
        prompts, concurrency, lambda client, p: acomplete_stream(client, base_url, p, max_tokens)
    )


def open_request(url: str, path: str, body: dict[str, Any], timeout: float = 30.0) -> socket.socket:
    """POST `body` as JSON on a raw socket and return it unread: the caller
    reads what it wants of the answer and closes the socket, as a client that
    goes away at a chosen moment does."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout)
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock
