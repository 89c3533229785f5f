"""The pure core of first-token stitching: every interleaving of P's first token
with D's events gives the client each of D's tokens once, in order."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rapidkv.router.stitch import (
    EventSplitter,
    FirstTokenStitch,
    StreamError,
    continuation_body,
    sse,
)

pytestmark = pytest.mark.unit


def event(tokens: list[int], *, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choice = {
        "index": 0,
        "text": "".join(f"<{t}>" for t in tokens),
        "token_ids": tokens,
        "finish_reason": finish,
        "stop_reason": None,
        **extra,
    }
    return {"id": "cmpl-d", "object": "text_completion", "choices": [choice]}


def parse(out: list[bytes]) -> list[dict[str, Any] | None]:
    return EventSplitter().feed(b"".join(out))


def d_events(tokens: list[int], sizes: list[int]) -> list[dict[str, Any]]:
    """D's stream: `tokens` in events of the given sizes, the last one finishing."""
    out, i = [], 0
    for size in sizes:
        if i >= len(tokens):
            break
        out.append(event(tokens[i : i + size]))
        i += size
    if i < len(tokens):
        out.append(event(tokens[i:]))
    out[-1]["choices"][0]["finish_reason"] = "length"
    return out


@settings(max_examples=400)
@given(
    tokens=st.lists(st.integers(0, 50), min_size=1, max_size=8),
    sizes=st.lists(st.integers(1, 3), max_size=8),
    p_at=st.integers(0, 4),
    p_gives=st.booleans(),
    keep=st.booleans(),
    same_id=st.booleans(),
)
def test_any_interleaving_gives_d_tokens_once_in_order(
    tokens: list[int], sizes: list[int], p_at: int, p_gives: bool, keep: bool, same_id: bool
) -> None:
    """As the router relays: once `passthrough` says so, D's events go unchanged."""
    stitch = FirstTokenStitch(keep_token_ids=keep)
    stream = d_events(tokens, sizes)
    p_event = event(tokens[:1], finish="length", prompt_token_ids=[9, 9])
    p_event["id"] = "cmpl-d" if same_id else "cmpl-p"
    sent: list[bytes] = []
    raw = False
    for i, ev in enumerate([*stream, None]):
        if raw:
            sent.append(sse(ev))
            continue
        if i == p_at and p_gives:
            sent += stitch.on_prefill(p_event)
        sent += stitch.on_decode(ev)
        raw = stitch.passthrough
    received = parse(sent)
    assert received[-1] is None and None not in received[:-1]
    body = [e for e in received if e is not None]
    text = "".join(e["choices"][0]["text"] for e in body)
    assert text == "".join(f"<{t}>" for t in tokens)
    finishes = [e["choices"][0]["finish_reason"] for e in body]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    if keep:
        assert [t for e in body for t in e["choices"][0]["token_ids"]] == tokens
    else:
        assert all("token_ids" not in e["choices"][0] for e in body)
    assert stitch.state in ("matched", "decode_first")
    assert stitch.state == "matched" or not (p_gives and p_at == 0)
    if stitch.state == "matched":
        assert {e["id"] for e in body} == {p_event["id"]}  # one stream id, P's (opened it)
    assert stitch.passthrough == (keep and (stitch.state == "decode_first" or same_id))


def test_different_first_tokens_stop_the_relay() -> None:
    stitch = FirstTokenStitch(keep_token_ids=True)
    assert parse(stitch.on_prefill(event([3], prompt_token_ids=[1, 2])))[0]["choices"][0][
        "token_ids"
    ] == [3]
    assert stitch.on_decode(event([4, 5])) == []
    assert stitch.state == "mismatched"
    assert stitch.on_decode(event([6])) == [] and stitch.on_decode(None) == []
    cont = continuation_body({"prompt": "x", "max_tokens": 5, "min_tokens": 2}, stitch)
    assert cont is not None
    assert cont["prompt"] == [1, 2, 3] and cont["max_tokens"] == 4 and cont["min_tokens"] == 1


def test_same_tokens_with_different_text_are_a_mismatch() -> None:
    stitch = FirstTokenStitch(keep_token_ids=True)
    stitch.on_prefill(event([3]))
    d = event([3, 4])
    d["choices"][0]["text"] = "other"
    assert stitch.on_decode(d) == [] and stitch.state == "mismatched"


def test_logprobs_of_the_dropped_token_are_dropped() -> None:
    stitch = FirstTokenStitch(keep_token_ids=True)
    stitch.on_prefill(event([3]))
    logprobs = {"tokens": ["a", "b"], "token_logprobs": [-0.1, -0.2], "text_offset": [0, 3]}
    (rest,) = parse(stitch.on_decode(event([3, 4], logprobs=logprobs)))
    assert rest["choices"][0]["token_ids"] == [4]
    assert rest["choices"][0]["logprobs"]["token_logprobs"] == [-0.2]
    assert rest["choices"][0]["text"] == "<4>"


def test_a_lone_matching_event_is_not_resent_empty() -> None:
    stitch = FirstTokenStitch(keep_token_ids=True)
    stitch.on_prefill(event([3]))
    assert stitch.on_decode(event([3])) == []
    assert stitch.state == "matched"


def test_events_before_any_output_pass_through() -> None:
    stitch = FirstTokenStitch(keep_token_ids=True)
    usage_only = {"id": "x", "choices": [], "usage": {"prompt_tokens": 1}}
    assert parse(stitch.on_decode(usage_only)) == [usage_only]
    assert stitch.state == "waiting"


def test_p_without_tokens_changes_nothing() -> None:
    stitch = FirstTokenStitch(keep_token_ids=True)
    assert stitch.on_prefill(event([], finish="abort")) == []
    assert stitch.state == "waiting"


def test_nothing_to_continue_when_the_budget_is_spent() -> None:
    stitch = FirstTokenStitch(keep_token_ids=False)
    stitch.on_prefill(event([3], prompt_token_ids=[1]))
    assert continuation_body({"prompt": [1], "max_tokens": 1}, stitch) is None
    end = parse(stitch.finish_after_prefill())
    assert end[-1] is None and end[0]["choices"][0]["finish_reason"] == "length"


def test_no_prompt_token_ids_from_p_is_a_stream_error() -> None:
    stitch = FirstTokenStitch(keep_token_ids=True)
    stitch.on_prefill(event([3]))  # no prompt_token_ids in P's event
    with pytest.raises(StreamError, match="prompt_token_ids"):
        continuation_body({"prompt": "x", "max_tokens": 5}, stitch)


def test_splitter_handles_split_events_crlf_comments_and_done() -> None:
    raw = b": keep-alive\n\n" + sse({"a": 1}).replace(b"\n", b"\r\n") + sse(None)
    splitter = EventSplitter()
    out = [e for i in range(len(raw)) for e in splitter.feed(raw[i : i + 1])]
    assert out == [{"a": 1}, None]


@pytest.mark.parametrize("bad", [b"data: {nope\n\n", b"data: [1]\n\n"])
def test_splitter_refuses_what_vllm_does_not_send(bad: bytes) -> None:
    with pytest.raises(StreamError):
        EventSplitter().feed(bad)


def test_splitter_bounds_an_unfinished_event() -> None:
    splitter = EventSplitter()
    with pytest.raises(StreamError, match="longer"):
        splitter.feed(b"data: " + json.dumps("x" * (1 << 20)).encode())
