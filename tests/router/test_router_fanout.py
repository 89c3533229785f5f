"""Requests that are several engine requests on vLLM, through the router with
fake P and D: a batch of prompts and n > 1 fan out into one sub-request per
sequence (`fanout`); and the routes served on one instance (`passthrough`)."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest
from fake_vllm import FakeVLLM, MakeFake, MakeRouter

from rapidkv.harness import wait_until

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def settled(router: Any) -> None:
    wait_until(
        lambda: (
            not any(router.router.fleet.outstanding("decode"))
            and not any(router.router.fleet.outstanding("prefill"))
        ),
        10,
        what=f"nothing outstanding: {router.router.fleet.outstanding('decode')}",
    )


def events(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]


def test_a_batch_is_one_pd_request_per_prompt_merged_in_order(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = make_router([p], [d])
    body = {"model": "m", "prompt": ["first", "second"], "max_tokens": 3, "temperature": 0}
    resp = http.post(router.url + "/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    seen = d.requests("/v1/completions")
    assert sorted(s.body["prompt"] for s in seen) == ["first", "second"]
    by_prompt = {s.body["prompt"]: s for s in seen}
    # each prompt its own transfer: P computed both, D loads each
    assert len({s.kv_transfer_params["rapidkv"]["xfer_id"] for s in seen}) == 2
    assert all(s.kv_transfer_params["do_remote_prefill"] for s in seen)
    # P's requests run in the background (dual dispatch): one may reach P after
    # the client's answer; both do, and no more
    settled(router)
    assert len(p.requests("/v1/completions")) == 2
    # the choices in prompt order, each the answer to its own prompt
    assert (
        answer["choices"][0]["token_ids"]
        == json.loads(bytes(by_prompt["first"].sent))["choices"][0]["token_ids"]
    )
    assert answer["usage"]["prompt_tokens"] == 6 and answer["usage"]["completion_tokens"] == 6
    settled(router)


def test_n_followers_wait_for_the_lead_s_kv_and_decode_on_its_instance(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    """n = 3 with sampling: the lead goes PD; the two others go to the lead's D,
    locally, only once the lead's prompt KV is there (here: P answered)."""
    p, d = pd
    router = make_router([p], [d])
    body = {
        "model": "m",
        "prompt": "abc",
        "max_tokens": 2,
        "n": 3,
        "temperature": 1.0,
        "seed": 40,
        "stream": True,
        "stream_options": {"include_usage": True},
        "fake": {"prefill": "hang", "decode": "hang"},
    }
    out: dict[str, httpx.Response] = {}
    client = threading.Thread(
        target=lambda: out.setdefault("r", http.post(router.url + "/v1/completions", json=body))
    )
    client.start()
    [lead] = d.wait_seen(1)
    p.wait_seen(1)
    assert lead.kv_transfer_params["do_remote_prefill"] is True
    assert lead.body["seed"] == 40 and lead.body["n"] == 1
    with pytest.raises(TimeoutError):  # nothing follows while P holds the prompt's KV
        d.wait_seen(2, timeout=0.5)
    p.release()
    followers = d.wait_seen(3)[1:]
    assert sorted(f.body["seed"] for f in followers) == [41, 42]  # vLLM's child seeds
    assert all("kv_transfer_params" not in f.body for f in followers)  # local: bytes as planned
    d.release()
    client.join(30)
    resp = out["r"]
    assert resp.status_code == 200
    chunks = events(resp.content)
    assert {c["choices"][0]["index"] for c in chunks if c["choices"]} == {0, 1, 2}
    assert len({c["id"] for c in chunks}) == 1  # one stream, one id
    [usage] = [c["usage"] for c in chunks if not c["choices"]]
    assert usage == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    assert resp.content.endswith(b"data: [DONE]\n\n") and resp.content.count(b"[DONE]") == 1
    settled(router)


def test_a_failed_lead_is_the_client_s_answer_and_stops_the_rest(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = make_router([p], [d], dispatch="local")
    body = {"prompt": ["a", "b", "c"], "max_tokens": 2, "stream": True, "fake": {"decode": "error"}}
    resp = http.post(router.url + "/v1/completions", json=body)
    assert resp.status_code == 503
    assert resp.json()["error"]["message"] == "D0 failed"  # D's own error, once
    settled(router)


def test_a_client_that_leaves_stops_every_sub_request(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter
) -> None:
    p, d = pd
    router = make_router([p], [d], dispatch="local")
    body = {"prompt": ["a", "b"], "max_tokens": 2, "fake": {"decode": "hang"}}
    with httpx.Client(timeout=0.5, trust_env=False) as client, pytest.raises(httpx.ReadTimeout):
        client.post(router.url + "/v1/completions", json=body)
    seen = d.wait_seen(2)
    for s in seen:
        d.wait_disconnected(s.request_id)
    settled(router)


def test_more_sequences_than_the_router_serves_are_refused_naming_the_field(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = make_router([p], [d])
    resp = http.post(
        router.url + "/v1/chat/completions", json={"messages": [], "n": 1000, "temperature": 1}
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "n"
    assert d.requests() == []


def test_greedy_n_goes_to_one_instance_whole_for_vllm_to_answer(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = make_router([p], [d])
    raw = b'{"prompt": "x", "n": 3, "temperature": 0, "max_tokens": 2}'
    resp = http.post(router.url + "/v1/completions", content=raw)
    assert resp.status_code == 200 and resp.headers["x-fake-name"] == "D0"
    [seen] = d.requests()
    assert seen.raw == raw and p.requests() == []
    settled(router)


def test_responses_are_served_where_their_state_lives(
    make_fake: MakeFake, make_router: MakeRouter, http: httpx.Client
) -> None:
    """A response is made on one instance; reading it, or continuing from it,
    goes back there."""
    d0, d1 = make_fake("D0", "decode"), make_fake("D1", "decode")
    router = make_router([], [d0, d1], dispatch="local")
    made = {}
    for stream in (False, True, False):
        resp = http.post(router.url + "/v1/responses", json={"input": "hi", "stream": stream})
        assert resp.status_code == 200
        if stream:
            data = resp.content.split(b"data: ", 1)[1]
            response_id = json.loads(data)["response"]["id"]
        else:
            response_id = resp.json()["id"]
        made[response_id] = response_id.split("_")[1]
    assert set(made.values()) == {"D0", "D1"}  # spread, least outstanding in turn
    for response_id, name in made.items():
        for _ in range(2):
            got = http.get(f"{router.url}/v1/responses/{response_id}")
            assert got.status_code == 200 and got.json()["served_by"] == name
        follow = http.post(
            router.url + "/v1/responses",
            json={"input": "more", "previous_response_id": response_id},
        )
        assert follow.json()["served_by"] == name
    assert http.get(f"{router.url}/v1/responses/resp_unknown").status_code == 404
    tokens = http.post(router.url + "/tokenize", json={"prompt": "ab"})
    assert tokens.status_code == 200 and tokens.json()["tokens"] == [97, 98]
    settled(router)
