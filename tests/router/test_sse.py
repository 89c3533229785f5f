"""Router-side TTFT: the first event of a stream that carries generated output."""

from __future__ import annotations

import json

import pytest

from rapidkv.router.sse import MAX_BUFFER, FirstTokenDetector

pytestmark = pytest.mark.unit


def event(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


ROLE_ONLY = event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
CHAT_TOKEN = event({"choices": [{"index": 0, "delta": {"content": "hi"}}]})
COMPLETION_TOKEN = event({"choices": [{"index": 0, "text": " a", "token_ids": [5]}]})


def test_a_completion_token_event_is_the_first_output() -> None:
    d = FirstTokenDetector()
    assert d.feed(COMPLETION_TOKEN)
    assert not d.feed(COMPLETION_TOKEN)  # only once


def test_the_chat_role_chunk_is_not_a_token() -> None:
    d = FirstTokenDetector()
    assert not d.feed(ROLE_ONLY)
    assert d.feed(CHAT_TOKEN)


def test_an_event_split_across_chunks_counts_when_it_completes() -> None:
    d = FirstTokenDetector()
    data = ROLE_ONLY + COMPLETION_TOKEN.replace(b"\n", b"\r\n")
    cut = len(ROLE_ONLY) + 10
    assert not d.feed(data[:cut])
    assert not d.feed(data[cut:-1])
    assert d.feed(data[-1:])


def test_an_empty_text_token_with_token_ids_counts() -> None:
    assert FirstTokenDetector().feed(event({"choices": [{"text": "", "token_ids": [3]}]}))


def test_done_usage_and_garbage_are_not_tokens() -> None:
    d = FirstTokenDetector()
    assert not d.feed(event({"choices": [], "usage": {"completion_tokens": 0}}))
    assert not d.feed(b"data: {not json\n\n: comment\n\ndata: [DONE]\n\n")


def test_a_stream_that_is_not_sse_costs_bounded_memory() -> None:
    d = FirstTokenDetector()
    assert not d.feed(b"x" * (MAX_BUFFER + 1))
    assert d.done
    assert not d.feed(COMPLETION_TOKEN)  # gave up for good
