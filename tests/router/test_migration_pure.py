"""The pure parts of live migration: what the destination is sent
(`migration.bodies`) and the client's stream across upstreams (`migration.splice`)."""

from __future__ import annotations

import copy

import pytest

from rapidkv.router.migration.assemble import Assembler
from rapidkv.router.migration.bodies import (
    cutover_body,
    local_body,
    migratable,
    precopy_body,
    remaining_budget,
    streamed,
)
from rapidkv.router.migration.splice import StreamSplice
from rapidkv.router.stitch import StreamError

pytestmark = pytest.mark.unit

COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 10, "stream": True, "temperature": 0}
CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_completion_tokens": 8,
    "stream": True,
    "temperature": 0,
    "stream_options": {"include_usage": True},
}


# ---------------------------------------------------------------- bodies


@pytest.mark.parametrize(
    ("body", "endpoint", "why"),
    [
        (COMPLETION, "completions", None),
        (CHAT, "chat", None),
        (dict(COMPLETION, stream=False), "completions", None),  # assembled from a stream
        ({**COMPLETION, "stream": None, "logprobs": 2}, "completions", "not streamed, with"),
        (dict(COMPLETION, logprobs=2), "completions", None),
        (dict(COMPLETION, echo=True), "completions", "uses echo"),
        (dict(COMPLETION, prompt=["a", "b"]), "completions", "not a single prompt"),
        (dict(COMPLETION, prompt=[1, 2, 3]), "completions", None),
        (dict(CHAT, tools=[{"type": "function"}]), "chat", "uses tools"),
        (dict(CHAT, logprobs=True, response_format={"type": "json"}), "chat", "uses"),
    ],
)
def test_what_may_migrate(body: dict, endpoint: str, why: str | None) -> None:
    got = migratable(body, endpoint)  # type: ignore[arg-type]
    if why is None:
        assert got is None
    else:
        assert got is not None and got.startswith(why)


def test_a_cutover_continues_from_the_tokens_with_what_is_left_of_the_budgets() -> None:
    client = dict(COMPLETION, min_tokens=4, kv_transfer_params={"rapidkv": {"x": 1}}, stop=["z"])
    before = copy.deepcopy(client)
    out = cutover_body(client, "completions", [1, 2, 3, 7, 8], 2, "X-m0c", "h:1", "X")
    assert client == before  # never mutated
    assert out["prompt"] == [1, 2, 3, 7, 8]
    assert out["max_tokens"] == 8 and out["min_tokens"] == 2
    assert out["stream"] is True and out["return_token_ids"] is True
    assert out["stop"] == ["z"] and out["temperature"] == 0
    assert out["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "rapidkv": {
            "xfer_id": "X-m0c",
            "role": "decode",
            "prefill_control": "h:1",
            "migrate_from": "X",
        },
    }
    # past min_tokens: none left
    assert cutover_body(client, "completions", [1], 6, "i", "h:1", "X")["min_tokens"] == 0


def test_a_chat_cutover_is_a_completions_request_with_the_shared_sampling_parameters() -> None:
    out = cutover_body(CHAT, "chat", [5, 6, 7], 3, "X-m0c", "h:1", "X")
    assert "messages" not in out and "max_completion_tokens" not in out
    assert out["max_tokens"] == 5  # max_completion_tokens 8 - 3
    assert out["stream_options"] == {"include_usage": True}
    assert out["temperature"] == 0 and out["model"] == "m"
    # no budget given: none set (vLLM's default, the model's length, bounds both)
    no_budget = {k: v for k, v in CHAT.items() if k != "max_completion_tokens"}
    assert "max_tokens" not in cutover_body(no_budget, "chat", [1], 3, "i", "h:1", "X")
    assert remaining_budget(no_budget, "chat", 3) is None
    assert remaining_budget(dict(CHAT, max_tokens=3), "chat", 1) == 7  # the newer name first


def test_a_precopy_asks_for_one_token_unstreamed() -> None:
    out = precopy_body(
        dict(COMPLETION, min_tokens=3, stop=["x"]), "completions", [1, 2], "p", "h:1", "X"
    )
    assert out["max_tokens"] == 1 and out["stream"] is False
    assert "stream_options" not in out and "min_tokens" not in out and "stop" not in out
    assert out["kv_transfer_params"]["rapidkv"]["migrate_from"] == "X"


def test_a_local_request_is_tagged_as_a_migration_source() -> None:
    out = local_body(dict(COMPLETION, kv_transfer_params={"other": 1}), "X")
    assert out["kv_transfer_params"] == {"rapidkv": {"xfer_id": "X", "role": "local"}}
    assert out["return_token_ids"] is True


# ---------------------------------------------------------------- splice


def completion_event(
    ids: list[int], text: str, *, prompt: list[int] | None = None, **extra
) -> dict:
    choice: dict = {"index": 0, "text": text, "token_ids": ids, "finish_reason": None}
    if prompt is not None:
        choice["prompt_token_ids"] = prompt
    choice.update(extra)
    return {
        "id": "cmpl-src",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [choice],
    }


def test_the_source_stream_is_relayed_without_the_ids_the_client_did_not_ask_for() -> None:
    s = StreamSplice("completions", keep_token_ids=False)
    out = s.feed(completion_event([7], "a", prompt=[1, 2, 3]))
    assert out == {
        "id": "cmpl-src",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": "a", "finish_reason": None}],
    }
    s.feed(completion_event([8, 9], "bc"))
    assert s.tokens == [1, 2, 3, 7, 8, 9]
    assert s.feed(None) is None


def test_a_continuation_looks_like_the_source_and_counts_usage_from_the_original_prompt() -> None:
    s = StreamSplice("completions", keep_token_ids=True)
    s.feed(completion_event([7], "a", prompt=[1, 2, 3]))
    s.switch()
    cont = completion_event([8], "b", prompt=[1, 2, 3, 7])
    cont["id"], cont["created"] = "cmpl-dst", 99
    out = s.feed(cont)
    assert out["id"] == "cmpl-src" and out["created"] == 1
    assert out["choices"] == [{"index": 0, "text": "b", "token_ids": [8], "finish_reason": None}]
    usage = {
        "id": "cmpl-dst",
        "choices": [],
        "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7},
    }
    out = s.feed(usage)
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert s.tokens == [1, 2, 3, 7, 8]
    # a second migration continues from everything sent so far
    s.switch()
    assert s.offset == 2


def test_a_chat_continuation_becomes_chat_chunks() -> None:
    s = StreamSplice("chat", keep_token_ids=False)
    role = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 5,
        "model": "m",
        "prompt_token_ids": [1, 2],
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        ],
    }
    assert "prompt_token_ids" not in (s.feed(role))
    first = dict(
        role,
        choices=[{"index": 0, "delta": {"content": "x"}, "token_ids": [9], "finish_reason": None}],
    )
    del first["prompt_token_ids"]
    s.feed(first)
    assert s.tokens == [1, 2, 9]
    s.switch()
    out = s.feed(completion_event([10], "y", prompt=[1, 2, 9], finish_reason="stop"))
    assert out["id"] == "chatcmpl-1" and out["object"] == "chat.completion.chunk"
    assert out["choices"] == [
        {"index": 0, "delta": {"content": "y"}, "logprobs": None, "finish_reason": "stop"}
    ]
    assert s.finished and s.generated == [9, 10]


def test_no_continuation_without_the_prompts_token_ids() -> None:
    s = StreamSplice("completions", keep_token_ids=False)
    s.feed(completion_event([7], "a"))
    with pytest.raises(StreamError):
        s.tokens  # noqa: B018


# ---------------------------------------------------------------- assembled answers


def test_a_request_not_streamed_is_streamed_from_its_instances_with_usage() -> None:
    body = dict(COMPLETION, stream=False)
    assert streamed(body) == dict(body, stream=True, stream_options={"include_usage": True})
    assert streamed(COMPLETION) is COMPLETION  # the client's stream as it asked


def test_a_completion_is_assembled_from_its_events() -> None:
    a = Assembler("completions", keep_token_ids=False)
    a.feed(completion_event([7], "he"))
    a.feed(completion_event([8], "llo", finish_reason="length"))
    a.feed({"id": "cmpl-src", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
    assert a.answer() == {
        "id": "cmpl-src",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": "hello",
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "routed_experts": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }  # every key of vLLM's whole answer


def test_a_chat_answer_is_assembled_with_the_token_ids_the_client_asked_for() -> None:
    a = Assembler("chat", keep_token_ids=True)
    head = {"id": "c1", "created": 2, "model": "m", "prompt_token_ids": [1, 2]}
    a.feed(dict(head, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}}]))
    a.feed(dict(head, choices=[{"index": 0, "delta": {"content": "hi"}, "token_ids": [5]}]))
    a.feed(
        dict(
            head,
            choices=[
                {"index": 0, "delta": {"content": "!"}, "token_ids": [6], "finish_reason": "stop"}
            ],
        )
    )
    out = a.answer()
    assert out["object"] == "chat.completion" and out["prompt_token_ids"] == [1, 2]
    message = out["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"] == "hi!"
    assert {k for k, v in message.items() if v is not None} == {"role", "content"}
    assert out["choices"][0]["token_ids"] == [5, 6] and out["choices"][0]["finish_reason"] == "stop"
