"""The router's half of the kv_transfer_params contract, as pure request rewriting."""

from __future__ import annotations

import copy
import json

import pytest

from rapidkv.router.config import Instance
from rapidkv.router.rewrite import (
    BadRequest,
    decode_body,
    encode,
    error_body,
    new_xfer_id,
    one_sequence,
    parse_request,
    prefill_body,
    stitchable,
    transferable,
)

pytestmark = pytest.mark.unit

P = Instance("http://127.0.0.1:9001", "127.0.0.1:7001")
COMPLETION = {
    "model": "m",
    "prompt": [5, 6, 7],
    "max_tokens": 32,
    "min_tokens": 8,
    "temperature": 0.0,
    "stream": True,
    "stream_options": {"include_usage": True},
    "return_token_ids": True,
}
CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hello"}],
    "max_completion_tokens": 32,
    "stream": False,
}


def test_xfer_ids_are_fresh_uuid4_hex() -> None:
    ids = {new_xfer_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(len(x) == 32 and int(x, 16) >= 0 for x in ids)


def test_prefill_completion_is_one_token_non_streaming_with_prefill_params() -> None:
    original = copy.deepcopy(COMPLETION)
    body = prefill_body(COMPLETION, "completions", "x1", first_token=False)
    assert body["max_tokens"] == 1
    assert "max_completion_tokens" not in body  # not a completions field
    assert body["min_tokens"] == 1  # its one token obeys min_tokens as the client's would
    assert body["stream"] is False
    assert "stream_options" not in body  # vLLM refuses them without streaming
    assert body["kv_transfer_params"] == {"rapidkv": {"xfer_id": "x1", "role": "prefill"}}
    assert {k: v for k, v in body.items() if k in ("model", "prompt", "temperature")} == {
        "model": "m",
        "prompt": [5, 6, 7],
        "temperature": 0.0,
    }
    assert body["return_token_ids"] is True
    assert original == COMPLETION  # the client's body is never mutated


def test_prefill_chat_caps_both_token_limits() -> None:
    body = prefill_body(CHAT, "chat", "x2", first_token=False)
    assert body["max_tokens"] == 1
    assert body["max_completion_tokens"] == 1
    assert body["messages"] == CHAT["messages"]
    assert body["stream"] is False


def test_prefill_without_min_tokens_gets_none() -> None:
    body = {k: v for k, v in COMPLETION.items() if k != "min_tokens"}
    assert "min_tokens" not in prefill_body(body, "completions", "x", first_token=False)
    zero = prefill_body(dict(body, min_tokens=0), "completions", "x", first_token=False)
    assert "min_tokens" not in zero


def test_prefill_and_decode_streaming_their_first_tokens_ask_for_token_ids() -> None:
    client = {k: v for k, v in COMPLETION.items() if k != "return_token_ids"}
    p = prefill_body(client, "completions", "x6", first_token=True)
    assert p["stream"] is True and p["return_token_ids"] is True and p["max_tokens"] == 1
    assert "stream_options" not in p  # no usage chunk from P
    d = decode_body(client, "x6", P, first_token=True)
    assert d["return_token_ids"] is True
    assert "return_token_ids" not in decode_body(client, "x6", P)


STITCHABLE = {"model": "m", "prompt": "hi", "max_tokens": 4, "temperature": 0, "stream": True}


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"prompt": [1, 2, 3]},
        {"max_tokens": None},
        {"max_tokens": 1},
        {"logprobs": 2},
        {"stop": []},
        {"echo": False},
        {"temperature": 0.0},
        {"stop_token_ids": [7]},
    ],
)
def test_streamed_greedy_single_prompt_completions_are_stitchable(change: dict) -> None:
    body = {k: v for k, v in {**STITCHABLE, **change}.items() if v is not None}
    assert stitchable(body, "completions")


@pytest.mark.parametrize(
    "change",
    [
        {"stream": False},
        {"stream": None},
        {"temperature": None},  # the server's default: not known to be greedy
        {"temperature": 0.7},
        {"temperature": "0"},
        {"stop": ["\n"]},
        {"stop": "x"},
        {"echo": True},
        {"prompt_logprobs": 1},
        {"suffix": "s"},
        {"prompt": ["a", "b"]},  # several prompts: several choices
        {"prompt": [[1, 2], [3]]},
        {"prompt": []},
        {"max_tokens": 0},
        {"max_tokens": True},
    ],
)
def test_other_completions_are_not_stitchable(change: dict) -> None:
    body = {k: v for k, v in {**STITCHABLE, **change}.items() if v is not None}
    assert not stitchable(body, "completions")


def test_chat_is_not_stitchable() -> None:
    chat = {"model": "m", "messages": [], "temperature": 0, "stream": True}
    assert not stitchable(chat, "chat")


def test_decode_keeps_the_client_request_and_names_the_prefill_instance() -> None:
    body = decode_body(COMPLETION, "x3", P)
    assert body["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "rapidkv": {
            "xfer_id": "x3",
            "role": "decode",
            "prefill_control": "127.0.0.1:7001",
            "prefill_url": "http://127.0.0.1:9001",
        },
    }
    assert {k: v for k, v in body.items() if k != "kv_transfer_params"} == COMPLETION


def test_decode_without_a_control_address_sends_null() -> None:
    body = decode_body(CHAT, "x4", Instance("http://h:1"))
    assert body["kv_transfer_params"]["rapidkv"]["prefill_control"] is None
    assert json.loads(encode(body))["kv_transfer_params"]["rapidkv"]["prefill_control"] is None


def test_client_transfer_kv_mode_is_kept_for_decode_and_other_client_params_dropped() -> None:
    client = dict(
        CHAT,
        kv_transfer_params={
            "do_remote_decode": True,
            "remote_host": "evil",
            "rapidkv": {"transfer_kv_mode": "bypass", "xfer_id": "forged"},
        },
    )
    parse_request(encode(client))  # accepted
    d = decode_body(client, "x5", P)["kv_transfer_params"]
    assert d["rapidkv"]["transfer_kv_mode"] == "bypass"
    assert d["rapidkv"]["xfer_id"] == "x5"
    assert set(d) == {"do_remote_prefill", "rapidkv"}
    p = prefill_body(client, "chat", "x5", first_token=False)["kv_transfer_params"]
    assert p == {"rapidkv": {"xfer_id": "x5", "role": "prefill"}}


@pytest.mark.parametrize("mode", ["step", "bypass", "substep"])
def test_every_transfer_kv_mode_is_accepted(mode: str) -> None:
    body = dict(COMPLETION, kv_transfer_params={"rapidkv": {"transfer_kv_mode": mode}})
    assert (
        decode_body(parse_request(encode(body)), "x", P)["kv_transfer_params"]["rapidkv"][
            "transfer_kv_mode"
        ]
        == mode
    )


def test_unknown_transfer_kv_mode_is_refused() -> None:
    body = dict(COMPLETION, kv_transfer_params={"rapidkv": {"transfer_kv_mode": "fast"}})
    with pytest.raises(BadRequest, match="transfer_kv_mode") as e:
        parse_request(encode(body))
    assert e.value.param == "kv_transfer_params"


@pytest.mark.parametrize(("param", "value"), [("n", 2), ("n", "8"), ("best_of", 3)])
def test_several_sequences_are_not_refused_but_are_not_one_transfer(
    param: str, value: object
) -> None:
    body = parse_request(encode(dict(COMPLETION, **{param: value})))
    assert not one_sequence(body, "completions") and not transferable(body, "completions")


@pytest.mark.parametrize("value", [None, 1, True])
def test_one_sequence_is_accepted(value: object) -> None:
    body = parse_request(encode(dict(COMPLETION, n=value)))
    assert body["prompt"] == [5, 6, 7] and one_sequence(body, "completions")


@pytest.mark.parametrize(
    "extra",
    [{"prompt_logprobs": 0}, {"prompt_logprobs": 3}, {"echo": True, "logprobs": 0}],
)
def test_prompt_logprobs_are_computed_on_d_alone(extra: dict[str, object]) -> None:
    """vLLM computes the prompt again for them, whatever KV a connector loads."""
    body = dict(COMPLETION, **extra)
    assert one_sequence(body, "completions") and not transferable(body, "completions")
    assert transferable(dict(COMPLETION, echo=True), "completions")


@pytest.mark.parametrize("raw", [b"{", b"", b"\xff\xfe", b"not json"])
def test_malformed_json_is_refused(raw: bytes) -> None:
    with pytest.raises(BadRequest, match="not valid JSON"):
        parse_request(raw)


@pytest.mark.parametrize("raw", [b"[]", b"3", b'"prompt"', b"null"])
def test_a_body_that_is_not_an_object_is_refused(raw: bytes) -> None:
    with pytest.raises(BadRequest, match="JSON object"):
        parse_request(raw)


def test_errors_have_openai_format() -> None:
    err = json.loads(error_body(400, "n=2 is not supported", "n"))
    assert err == {
        "error": {
            "message": "n=2 is not supported",
            "type": "BadRequestError",
            "param": "n",
            "code": 400,
        }
    }
    assert json.loads(error_body(502, "down"))["error"]["type"] == "BadGatewayError"
