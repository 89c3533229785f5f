"""Split prefill in the router (against fake vLLM upstreams): when P and D are
idle, P gets a block-aligned head of the prompt and D is told its size; in
every other case the request goes out as a whole-prompt dual dispatch."""

from __future__ import annotations

import httpx
import pytest
from fake_vllm import FakeVLLM, MakeRouter, Seen

from rapidkv.harness import get_metrics, metric_sum, wait_until
from rapidkv.router import Instance, RunningRouter
from rapidkv.router.fleet.discovery import block_size_from_answer
from rapidkv.router.split import split_point, splittable

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

PROMPT = list(range(100, 110))  # 10 tokens
BLOCK = 4
BODY = {"model": "m", "prompt": PROMPT, "max_tokens": 5, "temperature": 0.0}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def router_for(make_router: MakeRouter, p: FakeVLLM, d: FakeVLLM, **config) -> RunningRouter:
    config.setdefault("split_min_tokens", 0)  # 10-token prompts: every part is short
    return make_router([Instance(p.url, "127.0.0.1:7001", block_size=BLOCK)], [d], **config)


def completions(seen: list[Seen]) -> list[Seen]:
    return [s for s in seen if s.path == "/v1/completions"]


def splits(router: RunningRouter) -> float:
    return metric_sum(get_metrics(router.url), "rapidkv_router_split_prefills_total")


def assert_split(
    router: RunningRouter, resp: httpx.Response, p_seen: Seen, d_seen: Seen, head: list[int]
) -> None:
    """The request was split: P got a one-token, unstreamed completion of
    `head`, D the head's size, and the client D's answer alone (no stitch)."""
    assert p_seen.body["prompt"] == head
    assert p_seen.body["max_tokens"] == 1 and p_seen.body["stream"] is False
    assert p_seen.kv_transfer_params["rapidkv"]["role"] == "prefill"
    assert d_seen.kv_transfer_params["rapidkv"]["split_tokens"] == len(head)
    assert resp.content == bytes(d_seen.sent)
    assert splits(router) == 1


@pytest.mark.parametrize(
    ("tokens", "block", "fraction", "head"),
    [
        (10, 4, 0.55, 4),  # 9 * 0.55 = 4.95 -> one block
        (510, 128, 0.55, 256),
        (600, 128, 0.55, 384),  # rounds up: 329.5 -> 2.6 blocks -> 3
        (900, 128, 0.55, 512),
        (129, 128, 0.55, 128),  # rounds up to the one whole block that leaves D a token
        (128, 128, 0.55, 0),  # no block leaves D a token
        (300, 128, 0.3, 128),
        (130, 128, 0.1, 0),  # rounds to no block
    ],
)
def test_the_head_is_whole_blocks_near_the_fraction_leaving_d_a_token(
    tokens: int, block: int, fraction: float, head: int
) -> None:
    assert split_point(tokens, block, fraction) == head


@pytest.mark.parametrize(
    ("tokens", "block", "head"),
    [
        (129, 128, 0),  # a 1-token tail: not worth D's wait for the head
        (159, 128, 0),  # tail 31
        (160, 128, 128),  # tail 32
        (40, 16, 0),  # 22 * 0.55 -> one block of 16: a head under 32 tokens
        (80, 16, 48),  # 79 * 0.55 = 43.45 -> 3 blocks, tail 32
        (510, 128, 256),
    ],
)
def test_no_split_leaves_either_side_under_the_minimum(tokens: int, block: int, head: int) -> None:
    assert split_point(tokens, block, 0.55, min_part=32) == head


def test_the_router_refuses_a_negative_minimum() -> None:
    from rapidkv.router.config import SPLIT_MIN_TOKENS, RouterConfig

    p, d = (Instance("http://p:1"),), (Instance("http://d:1"),)
    assert RouterConfig(prefill=p, decode=d).split_min_tokens == SPLIT_MIN_TOKENS == 32
    with pytest.raises(ValueError, match="split_min_tokens"):
        RouterConfig(prefill=p, decode=d, split_min_tokens=-1)


@pytest.mark.parametrize(
    ("body", "endpoint", "ok"),
    [
        (BODY, "completions", True),
        (dict(BODY, prompt="some text"), "completions", True),
        (dict(BODY, prompt=["a", "b"]), "completions", False),  # several prompts
        (dict(BODY, prompt=[[1, 2], [3]]), "completions", False),
        (dict(BODY, echo=True), "completions", False),
        (dict(BODY, prompt_logprobs=1), "completions", False),
        (dict(BODY, truncate_prompt_tokens=5), "completions", False),
        (CHAT, "chat", True),
        (dict(CHAT, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]),
         "chat", True),
        (dict(CHAT, messages=[{"role": "assistant", "content": None, "tool_calls": []}]),
         "chat", True),
        (dict(CHAT, messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]),
         "chat", False),  # an image's features: not in a head of token ids
        (dict(CHAT, messages=[]), "chat", False),
        (dict(CHAT, messages="hi"), "chat", False),
        (dict(CHAT, echo=True), "chat", False),
        (dict(CHAT, documents=[{"title": "t", "text": "x"}]), "chat", False),
        (dict(CHAT, reasoning_effort="low"), "chat", False),
        (dict(CHAT, messages=[{"role": "user", "content": "hi"},
                              {"role": "assistant", "content": "yo", "reasoning_content": "r"},
                              {"role": "user", "content": "and?"}]), "chat", False),
        (dict(CHAT, prompt_logprobs=1), "chat", False),
    ],
)  # fmt: skip
def test_only_single_prompts_and_text_chats_without_prompt_outputs_split(
    body: dict, endpoint: str, ok: bool
) -> None:
    assert splittable(body, endpoint) is ok


def test_the_discovery_answer_may_carry_the_block_size() -> None:
    assert block_size_from_answer({"kv_transfer_params": {"rapidkv": {"block_size": 16}}}) == 16
    for bad in (None, 0, -4, True, "16"):
        answer = {"kv_transfer_params": {"rapidkv": {"block_size": bad}}}
        assert block_size_from_answer(answer) is None


def test_idle_p_and_d_split_a_token_id_prompt(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = router_for(make_router, p, d)
    resp = http.post(f"{router.url}/v1/completions", json=dict(BODY, stream=True))
    assert resp.status_code == 200
    (p_seen,), (d_seen,) = completions(p.wait_seen(1)), completions(d.wait_seen(1))
    assert not p.requests("/tokenize"), "token ids need no tokenizing"
    assert d_seen.body["prompt"] == PROMPT  # D's own prompt: all of it
    assert_split(router, resp, p_seen, d_seen, PROMPT[:4])


def test_a_text_prompt_is_tokenized_by_p_first(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = router_for(make_router, p, d)
    body = dict(BODY, prompt="abcdefghij", add_special_tokens=False)
    auth = {"authorization": "Bearer k"}  # P may need the client's key for /tokenize too
    assert http.post(f"{router.url}/v1/completions", json=body, headers=auth).status_code == 200
    (ask,) = p.wait_seen(2)[:1]
    assert ask.path == "/tokenize"
    assert ask.body == {"prompt": "abcdefghij", "model": "m", "add_special_tokens": False}
    assert ask.headers["authorization"] == "Bearer k"
    (p_seen,), (d_seen,) = completions(p.wait_seen(2)), completions(d.wait_seen(1))
    assert p_seen.body["prompt"] == [ord(c) for c in "abcd"]
    assert d_seen.body["prompt"] == "abcdefghij"
    assert d_seen.kv_transfer_params["rapidkv"]["split_tokens"] == 4


def test_an_untokenizable_prompt_goes_out_whole(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = router_for(make_router, p, d)
    body = dict(BODY, prompt="untokenizable text")
    assert http.post(f"{router.url}/v1/completions", json=body).status_code == 200
    (p_seen,), (d_seen,) = completions(p.wait_seen(2)), completions(d.wait_seen(1))
    assert p_seen.body["prompt"] == "untokenizable text"
    assert "split_tokens" not in d_seen.kv_transfer_params["rapidkv"]
    assert splits(router) == 0


@pytest.mark.parametrize(
    ("body", "config", "block"),
    [
        (dict(BODY, prompt=PROMPT[:4]), {}, BLOCK),  # no block leaves D a token
        (BODY, {"split_min_tokens": 32}, BLOCK),  # head 4 and tail 6: under the minimum
        (CHAT, {}, BLOCK),  # 3 tokens as P renders them: no block leaves D a token
        (BODY, {"split_prefill": False}, BLOCK),
        (dict(BODY, kv_transfer_params={"rapidkv": {"transfer_kv_mode": "step"}}), {}, BLOCK),
        (dict(BODY, kv_transfer_params={"rapidkv": {"transfer_kv_mode": "bypass"}}), {}, BLOCK),
        (BODY, {}, None),  # P's block size unknown
    ],
)
def test_otherwise_the_whole_prompt_goes_to_p(
    pd: tuple[FakeVLLM, FakeVLLM],
    make_router: MakeRouter,
    http: httpx.Client,
    body: dict,
    config: dict,
    block: int | None,
) -> None:
    p, d = pd
    config = {"split_min_tokens": 0, **config}  # each case refused for its own reason
    router = make_router([Instance(p.url, "127.0.0.1:7001", block_size=block)], [d], **config)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    assert http.post(router.url + path, json=body).status_code == 200
    wait_until(lambda: p.requests(path), 10, what="P's request")
    p_seen, d_seen = p.requests(path)[0], d.wait_seen(1)[0]
    assert p_seen.body.get("prompt") == body.get("prompt")
    assert "split_tokens" not in d_seen.kv_transfer_params["rapidkv"]
    assert splits(router) == 0


def test_no_split_while_d_has_a_request_in_flight(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = router_for(make_router, p, d)
    with httpx.Client(timeout=60, trust_env=False) as other:
        held = dict(BODY, stream=True, fake={"decode": "hang_stream"})
        with other.stream("POST", f"{router.url}/v1/completions", json=held) as first:
            wait_until(lambda: len(completions(d.seen)) == 1, 10, what="D to hold a request")
            wait_until(lambda: len(completions(p.seen)) == 1, 10, what="P to get the first")
            assert http.post(f"{router.url}/v1/completions", json=BODY).status_code == 200
            second = completions(d.wait_seen(2))[1]
            assert "split_tokens" not in second.kv_transfer_params["rapidkv"]
            assert completions(p.wait_seen(2))[1].body["prompt"] == PROMPT
            d.release()
            assert first.status_code == 200
            first.read()
    assert splits(router) == 1  # the first one, sent while everything was idle


def test_a_request_whose_answer_ended_is_no_longer_in_flight(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    """One client after another, each sending as soon as it read the last
    one's ``data: [DONE]``: D finished that request, though its HTTP answer
    has not ended yet (D's API server lags its engine), so the next request
    is split too, and D counts one request in flight, not two. (P's answer
    to the first, a fake's, may reach the router after D's [DONE]: the
    second waits for it, as a real P's head is done before D's last token.)"""
    p, d = pd
    router = router_for(make_router, p, d)
    with httpx.Client(timeout=60, trust_env=False) as other:
        lingering = dict(BODY, stream=True, fake={"decode": "linger"})
        with other.stream("POST", f"{router.url}/v1/completions", json=lingering) as first:
            assert first.status_code == 200
            lines = first.iter_lines()
            assert next(line for line in lines if line.startswith("data: [DONE]"))
            wait_until(
                lambda: router.router.fleet.outstanding("prefill") == [0],
                10,
                what="P's answer to the first",
            )
            assert http.post(f"{router.url}/v1/completions", json=BODY).status_code == 200
            second = completions(d.wait_seen(2))[1]
            assert second.kv_transfer_params["rapidkv"]["split_tokens"] == 4
            assert completions(p.wait_seen(2))[1].body["prompt"] == PROMPT[:4]
            on_d = metric_sum(get_metrics(router.url), "rapidkv_router_outstanding", role="decode")
            assert on_d == 0  # the first's answer is complete, the second's over
            d.release()
            assert not "".join(lines)  # nothing after [DONE] but its end
    assert splits(router) == 2


@pytest.mark.parametrize("prompt", [["abc", "defg"], [PROMPT, PROMPT[:6]], [PROMPT]])
@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_of_prompts_is_one_transfer_per_prompt(
    pd: tuple[FakeVLLM, FakeVLLM],
    make_router: MakeRouter,
    http: httpx.Client,
    prompt: list,
    stream: bool,
) -> None:
    """vLLM makes one engine request per prompt of a batch, all with the same
    kv_transfer_params: no one transfer could serve them (D waited for KV that
    never came: the client hung). The router sends each prompt as a request of
    its own, each with its own transfer (`fanout`), and merges the answers."""
    p, d = pd
    router = router_for(make_router, p, d)
    body = dict(BODY, prompt=prompt, stream=stream)
    resp = http.post(f"{router.url}/v1/completions", json=body)
    assert resp.status_code == 200
    d_seen = completions(d.wait_seen(len(prompt)))
    assert sorted(s.body["prompt"] for s in d_seen) == sorted(prompt)
    assert len({s.kv_transfer_params["rapidkv"]["xfer_id"] for s in d_seen}) == len(prompt)
    wait_until(lambda: len(completions(p.requests())) == len(prompt), 10, what="P's requests")
    if not stream:
        assert [c["index"] for c in resp.json()["choices"]] == list(range(len(prompt)))
    else:
        assert resp.content.endswith(b"data: [DONE]\n\n")


def test_a_chat_is_rendered_by_p_and_its_head_sent_as_a_completion_of_those_ids(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    """P tokenizes the chat as its chat endpoint would render it (its
    messages, tools and template options; the client's key too); P is sent the
    head of those ids at /v1/completions with only the fields that locate its
    cache; D the chat as the client sent it, with the head's size."""
    p, d = pd
    router = router_for(make_router, p, d)
    body = dict(
        CHAT,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        cache_salt="tenant-1",
        temperature=0.0,
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        tool_choice="auto",
        stream=True,
        stream_options={"include_usage": True},
    )
    auth = {"authorization": "Bearer k"}
    resp = http.post(f"{router.url}/v1/chat/completions", json=body, headers=auth)
    assert resp.status_code == 200
    seen = p.wait_seen(2)
    ask, head = seen[0], seen[1]
    assert ask.path == "/tokenize"
    assert ask.body == {k: body[k] for k in ("model", "messages", "tools")}
    assert ask.headers["authorization"] == "Bearer k"
    ids = [ord(c) for c in "sbe briefuhi"]  # the fake's rendering: 12 tokens, 2 blocks P's
    assert head.path == "/v1/completions"
    assert {k: head.body[k] for k in ("model", "cache_salt")} == {
        "model": "m",
        "cache_salt": "tenant-1",
    }
    assert not {"messages", "tools", "temperature", "stream_options"} & set(head.body)
    (d_seen,) = d.wait_seen(1)
    assert d_seen.path == "/v1/chat/completions"
    assert d_seen.body["messages"] == body["messages"] and d_seen.body["tools"] == body["tools"]
    assert_split(router, resp, head, d_seen, ids[:8])


def test_a_chat_p_cannot_render_goes_whole(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = router_for(make_router, p, d)
    body = dict(CHAT, messages=[{"role": "user", "content": "untokenizable, this"}])
    assert http.post(f"{router.url}/v1/chat/completions", json=body).status_code == 200
    chats = lambda f: [s for s in f.wait_seen(1) if s.path == "/v1/chat/completions"]  # noqa: E731
    wait_until(lambda: chats(p) and chats(d), 10, what="P's and D's chat requests")
    (p_seen,), (d_seen,) = chats(p), chats(d)
    assert p_seen.body["messages"] == body["messages"] and p_seen.body["max_tokens"] == 1
    assert "split_tokens" not in d_seen.kv_transfer_params["rapidkv"]
    assert splits(router) == 0
