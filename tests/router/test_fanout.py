"""The fan-out's pure cores: which requests become several sub-requests
(`fanout.plan`), and how their answers merge into vLLM's one (`fanout.merge`)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rapidkv.router.fanout.merge import StreamMerge, merge_answers
from rapidkv.router.fanout.plan import plan
from rapidkv.router.rewrite import one_sequence

pytestmark = pytest.mark.unit


def test_a_batch_of_prompts_is_one_sub_request_per_prompt_in_order() -> None:
    body = {"model": "m", "prompt": ["a", "b", "c"], "max_tokens": 3, "seed": 7}
    subs = plan(body, "completions")
    assert subs is not None
    assert [s.body["prompt"] for s in subs] == ["a", "b", "c"]
    assert [s.index for s in subs] == [0, 1, 2]
    assert [s.lead for s in subs] == [None, None, None]  # every prompt crosses on its own
    assert all(s.body["seed"] == 7 for s in subs)  # one vLLM seeds each prompt alike
    assert body["prompt"] == ["a", "b", "c"]  # not mutated


def test_n_sequences_follow_their_prompt_s_lead_with_vllm_s_child_seeds() -> None:
    body = {"prompt": [[1, 2], [3, 4]], "n": "2", "temperature": 0.8, "seed": 10}
    subs = plan(body, "completions")
    assert subs is not None
    assert [(s.body["prompt"], s.index, s.lead, s.body["seed"]) for s in subs] == [
        ([1, 2], 0, None, 10),
        ([1, 2], 1, 0, 11),  # parallel_sampling: child i samples with seed + i
        ([3, 4], 2, None, 10),
        ([3, 4], 3, 2, 11),
    ]
    assert all(s.body["n"] == 1 for s in subs)


def test_chat_with_n_fans_out_without_touching_the_messages() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 3}
    subs = plan(body, "chat")
    assert subs is not None and len(subs) == 3
    assert all(s.body["messages"] is body["messages"] and "seed" not in s.body for s in subs)


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        ("completions", {"prompt": "one"}),  # the ordinary path
        ("completions", {"prompt": [1, 2, 3], "n": 1}),
        ("chat", {"messages": [], "n": 1}),
        ("completions", {"prompt": "x", "n": 2, "temperature": 0}),  # vLLM refuses greedy n > 1
        ("chat", {"messages": [], "n": 3, "temperature": "0.0"}),
        ("completions", {"prompt": "x", "n": 0}),  # vLLM's to refuse
        ("completions", {"prompt": "x", "n": "two"}),
        ("completions", {"prompt": "x", "n": 2, "best_of": 3}),
        ("completions", {"prompt": "x", "n": 2, "use_beam_search": True}),
        ("completions", {"prompt": []}),
        ("completions", {"prompt": ["a", [1, 2]]}),  # mixed: vLLM refuses it
        ("completions", {"prompt": [[1], []]}),
    ],
)
def test_what_does_not_fan_out(endpoint: str, body: dict[str, Any]) -> None:
    assert plan(body, endpoint) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "x", "n": 2, "temperature": 0},
        {"prompt": ["a", [1, 2]]},
        {"prompt": "x", "best_of": 2},
    ],
)
def test_what_neither_fans_out_nor_is_one_sequence_goes_to_one_instance_whole(
    body: dict[str, Any],
) -> None:
    assert plan(body, "completions") is None and not one_sequence(body, "completions")


def _answer(index: int, text: str, prompt: int, completion: int, **extra: Any) -> dict[str, Any]:
    return {
        "id": f"cmpl-{text}",
        "object": "text_completion",
        "created": 100 + index,
        "model": "m",
        "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": None,
        },
        **extra,
    }


def test_whole_answers_merge_as_vllm_numbers_choices_and_counts_usage() -> None:
    subs = plan({"prompt": ["a", "b"], "n": 2, "temperature": 1.0}, "completions")
    assert subs is not None
    answers = [
        _answer(0, "a0", 5, 3, metrics={"x": 1}),
        _answer(1, "a1", 5, 4),
        _answer(2, "b0", 7, 2),
        _answer(3, "b1", 7, 1),
    ]
    merged = merge_answers(subs, answers)
    assert merged["id"] == "cmpl-a0" and merged["created"] == 100
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [
        (0, "a0"),
        (1, "a1"),
        (2, "b0"),
        (3, "b1"),
    ]
    # each prompt's tokens once, every sequence's completion tokens
    assert merged["usage"]["prompt_tokens"] == 12
    assert merged["usage"]["completion_tokens"] == 10
    assert merged["usage"]["total_tokens"] == 22
    assert "metrics" not in merged  # not one stream's: vLLM leaves them out


def _events(merge: StreamMerge, k: int, raw: bytes) -> list[dict[str, Any] | None]:
    out = merge.on_event(k, json.loads(raw) if raw != b"[DONE]" else None)
    return [
        None if e == b"[DONE]" else json.loads(e)
        for e in (x.removeprefix(b"data: ") for x in out.split(b"\n\n") if x)
    ]


@given(st.permutations([(k, e) for k in range(3) for e in range(3)]))
def test_streams_merge_with_one_id_global_indexes_one_usage_chunk_and_one_done(
    order: list[tuple[int, int]],
) -> None:
    """Whatever order the sub-requests' events come in (each stream's own in order)."""
    subs = plan({"messages": [], "n": 3, "stream": True}, "chat")
    assert subs is not None
    streams = {
        k: [
            {"id": f"c{k}", "created": k, "choices": [{"index": 0, "delta": {"content": f"x{k}"}}]},
            {"id": f"c{k}", "created": k, "choices": [], "usage": {
                "prompt_tokens": 4, "completion_tokens": k + 1, "total_tokens": k + 5}},
            None,
        ]
        for k in range(3)
    }  # fmt: skip
    # each stream's events in order: the e-th occurrence of k gets its e-th event
    seen = dict.fromkeys(range(3), 0)
    merge = StreamMerge(subs)
    got: list[Any] = []
    for k, _ in order:
        event = streams[k][seen[k]]
        seen[k] += 1
        got += _events(merge, k, b"[DONE]" if event is None else json.dumps(event).encode())
    assert len(got) == 3  # the content events; usage and [DONE] wait for the end
    assert {e["id"] for e in got} == {got[0]["id"]} and {e["created"] for e in got} == {
        got[0]["created"]
    }
    assert sorted(e["choices"][0]["index"] for e in got) == [0, 1, 2]
    for e in got:  # each choice's own content under its index
        assert e["choices"][0]["delta"]["content"] == f"x{e['choices'][0]['index']}"
    end = merge.finish().split(b"\n\n")
    usage = json.loads(end[0].removeprefix(b"data: "))
    assert usage["choices"] == [] and usage["id"] == got[0]["id"]
    assert usage["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}
    assert end[1:] == [b"data: [DONE]", b""]


def test_a_stream_without_usage_chunks_ends_with_done_alone() -> None:
    subs = plan({"prompt": ["a", "b"], "stream": True}, "completions")
    assert subs is not None
    merge = StreamMerge(subs)
    assert merge.on_event(0, None) == b"" and merge.on_event(1, None) == b""
    assert merge.finish() == b"data: [DONE]\n\n"
    error = {"error": {"message": "boom", "code": 500}}
    assert json.loads(merge.on_event(1, error).removeprefix(b"data: ")) == error
