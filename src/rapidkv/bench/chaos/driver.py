"""`rapidkv bench chaos`: one request through the router, with its abort, and the loop.

Each request is a completions request for token ids (greedy, `ignore_eos`,
`return_token_ids`: `harness.client.completion_body`), on a connection of its
own (closing it is how the client gives up: the router sees the disconnect). A
streamed one asks for `stream_options: {"include_usage": true}` (unless
`include_usage=False`), as vLLM's benchmark client and the OpenAI SDK do: its
last event before `[DONE]` then has no choices and carries `usage` (kept in
`Outcome.usage`; neither a token nor an error).
Its outcome (`Outcome.kind`):

- `completed`: HTTP 200 and every token equal to the `single` instance's;
- `mismatch`: HTTP 200, the answer complete, and the tokens differ;
- `aborted`: the client gave up on it (its plan) before the answer was over;
- `failed_clear`: an error the client can read: an HTTP error status with an
  OpenAI-style JSON error body, or, in a stream, an SSE `data: {"error": ...}`
  event (then `[DONE]`);
- `failed_unclear`: anything else that is not an answer: a stream that ends
  without `[DONE]` and without an error event, a non-streamed body cut short or
  not JSON, an error status without a JSON error, a connection that fails
  before any status;
- `hung`: no end within the per-request timeout.

Client behaviour while the router has no decode instance up: after a 503 the
client sends one request at a time, `backoff_s` after the last 503, until one
gets an answer that is not a 503 (as a client honouring `Retry-After` would):
an outage costs about one request a second, not a stream of instant refusals.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rapidkv.bench.chaos.workload import Abort, Plan, Timing, abort_point
from rapidkv.bench.common.loads import XFER_HEADER

KINDS = ("completed", "mismatch", "aborted", "failed_clear", "failed_unclear", "hung")


@dataclass
class Outcome:
    index: int
    kind: str
    stream: bool
    abort_phase: str | None  # what the plan aimed at (None: not aborted by plan)
    status: int | None = None
    error: str | None = None  # the error as the client got it (failures)
    tokens: int = 0  # tokens received
    seen: str = "nothing"  # what the client had when it ended: nothing | status | tokens
    xfer_id: str | None = None
    sent_s: float = 0.0  # after the run began
    e2e_s: float = math.nan
    ttft_s: float | None = None
    first_diff: int | None = None  # mismatch: first position that differs
    finish_reason: str | None = None  # the answer's (an HTTP 200)
    abort_after_s: float | None = None
    abort_after_tokens: int | None = None
    got: list[int] | None = None  # mismatch: the tokens received
    expected: list[int] | None = None  # mismatch: the reference's
    usage: dict[str, Any] | None = None  # a stream's usage event (include_usage)

    def row(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class _State:
    status: int | None = None
    xfer_id: str | None = None
    body: bytes = b""
    tokens: list[int] = field(default_factory=list)
    t_first: float | None = None
    t_last: float | None = None
    done: bool = False  # [DONE] arrived
    finish_reason: str | None = None  # the last one a stream's events gave
    error_event: Any = None  # the SSE error event's payload
    usage: dict[str, Any] | None = None  # the usage event's (choices empty)


class _GiveUp(Exception):
    """The client's planned abort after k tokens."""


async def _exchange(
    session: Any, url: str, body: dict[str, Any], stream: bool, abort: Abort | None, st: _State
) -> None:
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        st.status = resp.status
        st.xfer_id = resp.headers.get(XFER_HEADER)
        if resp.status != 200 or not stream:
            st.body = await resp.read()
            return
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                st.done = True
                continue
            event = json.loads(data)
            if "error" in event:
                st.error_event = event
                continue
            if event.get("usage") is not None:
                st.usage = event["usage"]
            if not event.get("choices"):  # the usage event: no token, no finish_reason
                continue
            choice = event["choices"][0]
            ids = choice.get("token_ids") or []
            st.finish_reason = choice.get("finish_reason") or st.finish_reason
            if ids:
                now = time.monotonic()
                st.t_first = st.t_first or now
                st.t_last = now
                st.tokens.extend(int(t) for t in ids)
            if abort is not None and abort.after_tokens and len(st.tokens) >= abort.after_tokens:
                raise _GiveUp


def _json_error(raw: bytes) -> str | None:
    """The message of an OpenAI-style error body (`{"error": {"message": ...}}`)."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return err["message"]
    if isinstance(err, str):
        return err
    return None


def _compare(out: Outcome, tokens: Sequence[int], expected: Sequence[int]) -> None:
    out.tokens = len(tokens)
    if list(tokens) == list(expected):
        out.kind = "completed"
        return
    out.kind = "mismatch"
    out.got, out.expected = list(tokens), list(expected)
    out.first_diff = next(
        (i for i, (a, b) in enumerate(zip(tokens, expected, strict=False)) if a != b),
        min(len(tokens), len(expected)),
    )
    out.error = (
        f"got {len(tokens)} tokens, expected {len(expected)}; first difference at "
        f"{out.first_diff}; finish_reason {out.finish_reason}"
    )


async def run_one(
    session: Any,
    url: str,
    prompt: Sequence[int],
    plan: Plan,
    expected: Sequence[int],
    abort: Abort | None,
    timeout_s: float,
    t_run: float,
    *,
    include_usage: bool = True,
) -> Outcome:
    """Send one request and classify what came back (see the module docstring)."""
    import aiohttp

    from rapidkv.harness.client import completion_body

    extra: dict[str, Any] = {}
    if plan.stream and include_usage:
        extra["stream_options"] = {"include_usage": True}
    body = completion_body(prompt, plan.max_tokens, stream=plan.stream, **extra)
    out = Outcome(plan.index, "failed_unclear", plan.stream, plan.abort)
    if abort is not None:
        out.abort_after_s, out.abort_after_tokens = abort.after_s, abort.after_tokens
    st = _State()
    t0 = time.monotonic()
    out.sent_s = t0 - t_run
    hung_at = t0 + timeout_s
    abort_at = t0 + abort.after_s if abort is not None and abort.after_s is not None else math.inf
    loop = asyncio.get_running_loop()
    ended = "answer"
    try:
        # loop.time() is time.monotonic() on the default loop
        async with asyncio.timeout_at(loop.time() + (min(hung_at, abort_at) - t0)):
            await _exchange(session, url, body, plan.stream, abort, st)
    except TimeoutError:
        ended = "abort" if abort_at <= hung_at and time.monotonic() >= abort_at - 0.001 else "hung"
    except _GiveUp:
        ended = "abort"
    except (aiohttp.ClientError, ValueError, KeyError, IndexError, TypeError) as e:
        ended = "error"
        out.error = f"{type(e).__name__}: {e}"
    t1 = time.monotonic()
    out.e2e_s = t1 - t0
    out.status, out.xfer_id, out.usage = st.status, st.xfer_id, st.usage
    out.seen = "tokens" if st.tokens else ("status" if st.status is not None else "nothing")
    out.tokens = len(st.tokens)
    if st.t_first is not None:
        out.ttft_s = st.t_first - t0
    if ended == "abort":
        out.kind = "aborted"
        return out
    if ended == "hung":
        out.kind = "hung"
        out.error = f"no end within {timeout_s:.0f}s (seen: {out.seen}, {out.tokens} tokens)"
        return out
    if ended == "error":
        out.kind = "failed_unclear"
        if plan.stream and st.error_event is not None:  # the error event came, then the cut
            out.kind = "failed_clear"
            out.error = _event_message(st.error_event)
        return out
    if st.status != 200:
        message = _json_error(st.body)
        out.kind = "failed_clear" if message is not None else "failed_unclear"
        out.error = (
            f"HTTP {st.status}: {message}"
            if message is not None
            else f"HTTP {st.status} without a JSON error: {st.body[:200]!r}"
        )
        return out
    if plan.stream:
        if st.error_event is not None:
            out.kind = "failed_clear"
            out.error = _event_message(st.error_event)
        elif not st.done:
            out.kind = "failed_unclear"
            out.error = f"stream ended without [DONE] or an error event after {out.tokens} tokens"
        else:
            out.finish_reason = st.finish_reason
            _compare(out, st.tokens, expected)
        return out
    try:
        data = json.loads(st.body)
        ids = data["choices"][0]["token_ids"]
        out.finish_reason = data["choices"][0].get("finish_reason")
    except (ValueError, KeyError, IndexError, TypeError):
        message = _json_error(st.body)
        out.kind = "failed_clear" if message is not None else "failed_unclear"
        out.error = message or f"HTTP 200 whose body is no completion: {st.body[:200]!r}"
        return out
    _compare(out, [int(t) for t in ids], expected)
    return out


def _event_message(event: Any) -> str:
    err = event.get("error") if isinstance(event, dict) else None
    if isinstance(err, dict):
        return f"stream error event: {err.get('message')}"
    return f"stream error event: {err}"


Hook = Callable[[int], Awaitable[None]]


async def drive(
    url: str,
    plans: Sequence[Plan],
    prompts: Sequence[Sequence[int]],
    expected: Sequence[Sequence[int]],
    *,
    concurrency: int,
    timeout_s: float,
    before: Hook | None = None,
    on_done: Callable[[Outcome], None] = lambda o: None,
    backoff_s: float = 1.0,
    timing: Timing | None = None,
    include_usage: bool = True,
) -> tuple[list[Outcome], Timing]:
    """Every plan's request, at most `concurrency` in flight, in plan order;
    `before(i)` is awaited before request i is sent (the fault schedule);
    `timing` (the abort delays' estimates) learns from the completed streams;
    `include_usage`: streams ask for `stream_options: {"include_usage": true}`."""
    import aiohttp

    timing = timing if timing is not None else Timing()
    results: list[Outcome | None] = [None] * len(plans)
    next_index = [0]
    hold_until = [0.0]  # after a 503: not before then
    degraded = [False]  # a 503 was the last answer: one request at a time
    probe = asyncio.Lock()
    t_run = time.monotonic()
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    client_timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(connector=connector, timeout=client_timeout) as session:

        async def send(i: int) -> Outcome:
            plan = plans[i]
            out = await run_one(
                session,
                url,
                prompts[i],
                plan,
                expected[i],
                abort_point(plan, timing),
                timeout_s,
                t_run,
                include_usage=include_usage,
            )
            if out.status == 503:
                degraded[0] = True
                hold_until[0] = time.monotonic() + backoff_s
            elif out.status is not None:
                degraded[0] = False
            if out.kind == "completed" and plan.stream and out.ttft_s is not None:
                tpot = None
                if out.tokens > 1:
                    tpot = (out.e2e_s - out.ttft_s) / (out.tokens - 1)
                timing.add(plan.prompt_len, out.ttft_s, tpot)
            return out

        async def worker() -> None:
            while next_index[0] < len(plans):
                i = next_index[0]
                next_index[0] += 1
                if before is not None:
                    await before(i)
                if degraded[0]:
                    async with probe:
                        while (wait := hold_until[0] - time.monotonic()) > 0:
                            await asyncio.sleep(wait)
                        out = await send(i)
                else:
                    out = await send(i)
                results[i] = out
                with contextlib.suppress(Exception):
                    on_done(out)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [r for r in results if r is not None], timing
