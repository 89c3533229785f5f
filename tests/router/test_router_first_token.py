"""P's first token stitched in front of D's stream, over HTTP against fake instances.

The fakes' tokens depend only on the prompt and max_tokens (`fake_tokens`), so
P's one token is D's first, as with real greedy engines. The real-vLLM check of
the same (token-for-token equal to a single instance) is in tests/e2e.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fake_vllm import FakeVLLM, MakeRouter, fake_tokens

from rapidkv.harness import get_metrics, metric_sum

pytestmark = pytest.mark.unit

PROMPT = [11, 12, 13, 14]
STREAMED = {"model": "m", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}


def events(raw_lines: Iterator[str]) -> Iterator[dict[str, Any] | None]:
    for line in raw_lines:
        if line.startswith("data: "):
            yield None if line == "data: [DONE]" else json.loads(line[6:])


def choice(event: dict[str, Any]) -> dict[str, Any]:
    return event["choices"][0]


def first_token_count(router: Any, source: str) -> float:
    return metric_sum(get_metrics(router.url), "rapidkv_router_first_token_total", source=source)


def test_p_first_token_opens_the_stream_and_d_follows_without_it(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = make_router([p], [d])
    body = dict(STREAMED, fake={"decode": "late"}, return_token_ids=True)
    with http.stream("POST", f"{router.url}/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        stream = events(resp.iter_lines())
        opening = next(stream)
        # D has sent nothing yet: the first token is P's
        assert opening is not None and opening["served_by"] == "P0"
        assert choice(opening)["finish_reason"] is None  # P's request ended; the client's did not
        assert choice(opening)["prompt_token_ids"] == PROMPT
        d.release()
        rest = list(stream)
    assert rest[-1] is None and all(e is not None for e in rest[:-1])
    tail = [e for e in rest if e is not None]
    assert {e["served_by"] for e in tail} == {"D0"}
    tokens = [t for e in [opening, *tail] for t in choice(e)["token_ids"]]
    assert tokens == fake_tokens(dict(STREAMED))  # every token once, in order
    text = "".join(choice(e)["text"] for e in [opening, *tail])
    assert text == "".join(f" t{t}" for t in tokens)
    assert choice(tail[-1])["finish_reason"] == "length"
    assert {e["id"] for e in [opening, *tail]} == {opening["id"]}
    assert all("prompt_token_ids" not in choice(e) for e in tail)

    (p_seen,) = p.requests()
    assert p_seen.body["stream"] is True and p_seen.body["return_token_ids"] is True
    assert d.requests()[0].body["return_token_ids"] is True
    assert first_token_count(router, "prefill") == 1
    assert first_token_count(router, "decode") == 0


def test_token_ids_the_client_did_not_ask_for_are_removed(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = make_router([p], [d])
    with http.stream("POST", f"{router.url}/v1/completions", json=STREAMED) as resp:
        received = [e for e in events(resp.iter_lines()) if e is not None]
    assert all("token_ids" not in choice(e) for e in received)
    assert all("prompt_token_ids" not in choice(e) for e in received)
    text = "".join(choice(e)["text"] for e in received)
    assert text == "".join(f" t{t}" for t in fake_tokens(dict(STREAMED)))


def test_when_d_is_first_p_token_is_dropped(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = make_router([p], [d])
    body = dict(STREAMED, fake={"prefill": "hang"}, return_token_ids=True)
    with http.stream("POST", f"{router.url}/v1/completions", json=body) as resp:
        received = list(events(resp.iter_lines()))
    p.release()
    assert received[-1] is None
    tokens = [t for e in received if e is not None for t in choice(e)["token_ids"]]
    assert tokens == fake_tokens(dict(STREAMED))
    assert {e["served_by"] for e in received if e is not None} == {"D0"}
    assert first_token_count(router, "decode") == 1


def test_a_failed_prefill_leaves_d_stream_whole(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = make_router([p], [d])
    body = dict(STREAMED, fake={"prefill": "error", "decode": "late"}, return_token_ids=True)
    with http.stream("POST", f"{router.url}/v1/completions", json=body) as resp:
        p.wait_answered(p.wait_seen(1)[0].request_id)
        d.release()
        received = list(events(resp.iter_lines()))
    tokens = [t for e in received if e is not None for t in choice(e)["token_ids"]]
    assert tokens == fake_tokens(dict(STREAMED))
    assert first_token_count(router, "decode") == 1


def test_a_different_first_token_on_d_continues_from_prompt_plus_p_token(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = make_router([p], [d], debug_first_token_mismatch=True)
    body = dict(
        STREAMED,
        fake={"decode": "late"},
        return_token_ids=True,
        stream_options={"include_usage": True},
    )
    with http.stream("POST", f"{router.url}/v1/completions", json=body) as resp:
        stream = events(resp.iter_lines())
        opening = next(stream)
        assert opening is not None and opening["served_by"] == "P0"
        d.release()
        rest = list(stream)
    p_token = choice(opening)["token_ids"]
    first, cont = d.requests()
    assert first.kv_transfer_params["rapidkv"]["role"] == "decode"
    assert cont.path == "/v1/completions"
    assert cont.request_id == f"{first.request_id}-cont"
    assert cont.body["prompt"] == PROMPT + p_token
    assert cont.body["max_tokens"] == STREAMED["max_tokens"] - 1
    assert "kv_transfer_params" not in cont.body
    tail = [e for e in rest if e is not None]
    assert {e["served_by"] for e in tail} == {"D0"}
    assert rest[-1] is None
    # the client's stream: P's token, then exactly the continuation's tokens
    tokens = [t for e in [opening, *tail] if e["choices"] for t in choice(e)["token_ids"]]
    assert tokens == p_token + fake_tokens(cont.body)
    usage = tail[-1]["usage"]  # reported for the client's request, not the continuation's
    assert usage["completion_tokens"] == STREAMED["max_tokens"]
    assert usage["prompt_tokens"] == 3 - 1  # the fake's count for the continuation, less P's token
    assert first_token_count(router, "continuation") == 1


def test_a_one_token_request_ends_after_p_token_on_a_mismatch(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = make_router([p], [d], debug_first_token_mismatch=True)
    body = dict(STREAMED, max_tokens=1, fake={"decode": "late"}, return_token_ids=True)
    with http.stream("POST", f"{router.url}/v1/completions", json=body) as resp:
        stream = events(resp.iter_lines())
        opening = next(stream)
        d.release()
        rest = list(stream)
    assert opening is not None and choice(opening)["token_ids"] == fake_tokens(body)
    assert rest[-1] is None
    assert [choice(e)["finish_reason"] for e in rest if e is not None] == ["length"]
    assert len(d.requests()) == 1  # nothing to continue


def test_stitching_can_be_turned_off(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = make_router([p], [d], prefill_first_token=False)
    with http.stream("POST", f"{router.url}/v1/completions", json=STREAMED) as resp:
        received = resp.read()
    (d_seen,) = d.requests()
    assert received == bytes(d_seen.sent)  # relayed byte for byte
    assert p.wait_seen(1)[0].body["stream"] is False
