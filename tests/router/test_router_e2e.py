"""The router in front of real vLLM servers: greedy output is a single instance's.

P and D are two plain vLLM instances (the session's shared `single_server` and
`single_server_chunked`, so no extra start-up): with no KV connector, vLLM
ignores `kv_transfer_params` and D computes everything itself. So whatever the
dispatch mode, streaming or not, completions or chat, the tokens that reach the
client must be exactly those a single instance produces; and P must have served
one one-token request per routed request (none in `local` mode).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fake_vllm import MakeRouter

from rapidkv.harness import (
    VLLMServer,
    complete,
    get_metrics,
    metric_sum,
    random_prompts,
    wait_until,
)
from rapidkv.router import RunningRouter

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MAX_TOKENS = 12
LENGTHS = [9, 47, 150]  # the last spans two 128-token blocks
CHATS = [
    "Tell me about the lighthouse keeper and the storm.",
    "Why do rivers bend as they reach the plain?",
]
GREEDY = {"temperature": 0.0, "ignore_eos": True, "return_token_ids": True}


def chat_body(text: str, stream: bool) -> dict[str, Any]:
    messages = [{"role": "user", "content": text}]
    return {"messages": messages, "max_completion_tokens": MAX_TOKENS, "stream": stream, **GREEDY}


def completion_body(prompt: list[int], stream: bool) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "stream": stream, **GREEDY}


def generate(http: httpx.Client, base_url: str, path: str, body: dict[str, Any]) -> list[int]:
    """The generated token ids of one request, streamed or not."""
    if not body["stream"]:
        resp = http.post(base_url + path, json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["token_ids"]
    tokens: list[int] = []
    with http.stream("POST", base_url + path, json=body) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    tokens += choice.get("token_ids") or []
    return tokens


def p_counts(p: VLLMServer) -> tuple[float, float]:
    """(finished requests, generated tokens) on P so far."""
    m = get_metrics(p.base_url)
    return metric_sum(m, "vllm:request_success_total"), metric_sum(
        m, "vllm:generation_tokens_total"
    )


def router_errors(router: RunningRouter) -> float:
    return metric_sum(get_metrics(router.url), "rapidkv_router_upstream_errors_total")


@pytest.mark.parametrize("dispatch", ["dual", "serial", "local"])
def test_greedy_tokens_through_the_router_are_a_single_instances(
    dispatch: str,
    single_server: VLLMServer,
    single_server_chunked: VLLMServer,
    tiny_model: Path,
    make_router: MakeRouter,
    http: httpx.Client,
) -> None:
    p, d = single_server, single_server_chunked
    prompts = random_prompts(tiny_model, LENGTHS, seed=21)
    reference = {
        "completions": [complete(p.base_url, prompt, MAX_TOKENS) for prompt in prompts],
        "chat": [
            generate(http, p.base_url, "/v1/chat/completions", chat_body(t, False)) for t in CHATS
        ],
    }
    outputs = reference["completions"] + reference["chat"]
    assert all(len(ids) == MAX_TOKENS for ids in outputs)
    assert len({tuple(ids) for ids in outputs}) == len(outputs)  # equality will mean something

    router = make_router([p], [d], dispatch=dispatch)
    before = p_counts(p)
    routed = 0
    for stream in (False, True):
        for prompt, want in zip(prompts, reference["completions"], strict=True):
            got = generate(http, router.url, "/v1/completions", completion_body(prompt, stream))
            assert got == want, f"{dispatch} completions stream={stream} len={len(prompt)}"
            routed += 1
        for text, want in zip(CHATS, reference["chat"], strict=True):
            got = generate(http, router.url, "/v1/chat/completions", chat_body(text, stream))
            assert got == want, f"{dispatch} chat stream={stream}: {text!r}"
            routed += 1

    if dispatch == "local":
        assert p_counts(p) == before  # P was never asked
    else:  # one one-token request on P per routed request, all accepted by vLLM
        want = (before[0] + routed, before[1] + routed)
        wait_until(lambda: p_counts(p) == want, 30, what=f"P to finish {routed} requests")
    assert router_errors(router) == 0


def test_openai_client_streams_through_the_router(
    single_server: VLLMServer,
    single_server_chunked: VLLMServer,
    tiny_model: Path,
    make_router: MakeRouter,
    http: httpx.Client,
) -> None:
    p, d = single_server, single_server_chunked
    router = make_router([p], [d])
    assert http.get(f"{router.url}/health").status_code == 200
    prompt = random_prompts(tiny_model, [33], seed=22)[0]
    want_completion = complete(p.base_url, prompt, MAX_TOKENS)
    want_chat = generate(http, p.base_url, "/v1/chat/completions", chat_body(CHATS[0], False))

    client = openai.OpenAI(
        base_url=f"{router.url}/v1", api_key="unused", http_client=httpx.Client(trust_env=False)
    )
    with client:
        model = client.models.list().data[0].id
        assert model == str(tiny_model)  # from D's /v1/models
        extra = {"ignore_eos": True, "return_token_ids": True}
        usage = None
        tokens: list[int] = []
        ids = set()
        for chunk in client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        ):
            ids.add(chunk.id)
            usage = chunk.usage or usage
            for choice in chunk.choices:
                tokens += (choice.model_extra or {}).get("token_ids") or []
        assert tokens == want_completion
        assert usage is not None and usage.completion_tokens == MAX_TOKENS
        assert usage.prompt_tokens == len(prompt)
        assert len(ids) == 1 and ids.pop().startswith("cmpl-")

        chat_tokens: list[int] = []
        text = ""
        for chunk in client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": CHATS[0]}],
            max_completion_tokens=MAX_TOKENS,
            temperature=0.0,
            stream=True,
            extra_body=extra,
        ):
            for choice in chunk.choices:
                text += choice.delta.content or ""
                chat_tokens += (choice.model_extra or {}).get("token_ids") or []
        assert chat_tokens == want_chat
        assert text  # detokenized text came through too
    assert router_errors(router) == 0
