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
    parse_request,
    prefill_body,
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
    body = prefill_body(COMPLETION, "completions", "x1")
    assert body["max_tokens"] == 1
    assert "max_completion_tokens" not in body  # not a completions field
    assert "min_tokens" not in body
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
    body = prefill_body(CHAT, "chat", "x2")
    assert body["max_tokens"] == 1
    assert body["max_completion_tokens"] == 1
    assert body["messages"] == CHAT["messages"]
    assert body["stream"] is False


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
    p = prefill_body(client, "chat", "x5")["kv_transfer_params"]
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


@pytest.mark.parametrize(("param", "value"), [("n", 2), ("n", 8), ("best_of", 3)])
def test_more_than_one_sequence_is_refused(param: str, value: int) -> None:
    with pytest.raises(BadRequest, match=f"{param}={value}") as e:
        parse_request(encode(dict(COMPLETION, **{param: value})))
    assert e.value.param == param


@pytest.mark.parametrize("value", [None, 1, True])
def test_one_sequence_is_accepted(value: object) -> None:
    assert parse_request(encode(dict(COMPLETION, n=value, best_of=value)))["prompt"] == [5, 6, 7]


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
