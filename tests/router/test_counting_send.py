"""`exchange.CountingSend`: the output events relayed, and the one call that
says the answer is complete, whatever the cuts between the messages."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rapidkv.router.exchange import CountingSend, Exchange
from rapidkv.router.sse import sse_error

pytestmark = pytest.mark.unit

TOKENS = [b"data: " + json.dumps({"choices": [{"text": t}]}).encode() + b"\n\n" for t in "abc"]
# a token whose text holds the DONE event's bytes, as a JSON string holds them
TRICKY = b"data: " + json.dumps({"choices": [{"text": "\n\ndata: [DONE]"}]}).encode() + b"\n\n"
STREAM = b"".join(TOKENS) + TRICKY + b"data: [DONE]\n\n"


def relay(pieces: list[bytes], last_ends: bool) -> tuple[Exchange, list[str]]:
    """`pieces` sent as body messages (the last with more_body False when
    `last_ends`, then an empty end otherwise); what the client saw when."""
    ex = Exchange("completions", "x", 0.0, {})
    seen: list[str] = []

    async def client(message: dict) -> None:
        seen.append("body" if message.get("body") else "end")

    counted = CountingSend(client, ex, lambda ok: seen.append(f"answered {ok}"))

    async def go() -> None:
        for i, piece in enumerate(pieces):
            more = not (last_ends and i == len(pieces) - 1)
            await counted({"type": "http.response.body", "body": piece, "more_body": more})
        if not last_ends:
            await counted({"type": "http.response.body", "body": b"", "more_body": False})

    asyncio.run(go())
    return ex, seen


def cut(data: bytes, at: list[int]) -> list[bytes]:
    bounds = [0, *sorted(set(at)), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]


@given(st.lists(st.integers(1, len(STREAM) - 1), max_size=12))
def test_every_event_is_counted_once_and_done_is_seen_with_its_last_byte(at: list[int]) -> None:
    pieces = cut(STREAM, at)
    ex, seen = relay(pieces, last_ends=False)
    assert ex.output_events == 4
    assert [m for m in seen if m.startswith("answered")] == ["answered True"]
    done = b"\n\ndata: [DONE]"
    assert STREAM.count(done) == 1  # the JSON string's newlines are escaped
    end = STREAM.index(done) + len(done)
    done_at = next(i for i in range(len(pieces)) if len(b"".join(pieces[: i + 1])) >= end)
    # told before the message that completes `\n\ndata: [DONE]` reaches the client
    assert seen.index("answered True") == done_at
    assert seen[-1] == "end"


def test_a_json_string_holding_the_done_bytes_does_not_end_the_answer() -> None:
    ex, seen = relay([*TOKENS, TRICKY], last_ends=False)
    assert seen == ["body"] * 4 + ["answered None", "end"]
    assert ex.output_events == 4


def test_an_unstreamed_answer_is_complete_with_its_last_message() -> None:
    ex, seen = relay([b'{"choices": [', b"]}"], last_ends=True)
    assert seen == ["body", "answered None", "body"] and ex.output_events == 0


@pytest.mark.parametrize(
    "error",
    [
        sse_error("decode instance broke off"),  # the router's own ending
        # D's own error event (vLLM's json.dumps spacing), then its [DONE]
        b'data: {"error": {"message": "boom", "code": 500}}\n\ndata: [DONE]\n\n',
    ],
)
def test_a_stream_ended_by_an_error_event_is_complete_but_not_ok(error: bytes) -> None:
    ex, seen = relay([*TOKENS, error], last_ends=False)
    assert seen == ["body"] * 3 + ["answered False", "body", "end"]
    assert ex.output_events == 4  # the error event is one too
