"""The request schema, fuzzed, through the router and to one vLLM instance.

Hypothesis draws bodies over the fields vLLM's protocol accepts (completions
and chat: prompts as text, token ids, batches and junk; sampling parameters,
`n`, seeds, stops, logprobs, streaming options, structured output; wrong types,
negative, huge, nested and unknown values) and sends each to the shared pair's
D directly (one vLLM instance: a kv_both connector without
`kv_transfer_params` is plain vLLM) and through a router with its defaults.
Every request through the router must end within `BOUND_S` (the router's
upstream timeout is set below it) with the status class vLLM gives, and the
pair must end with nothing held.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pd_harness import Pair, assert_back_to_baseline

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

BOUND_S = 60.0  # a request through the router ends within this
UPSTREAM_TIMEOUT_S = 30.0  # the router's bound on a silent upstream
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}

leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**20), 10**20),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "NaN", "-1", "\x00", "💥", "x" * 200]),
    st.text(max_size=8),
)
junk = st.recursive(
    leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


def sometimes_junk(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`valid` values, or one time in ten anything at all."""
    return st.integers(0, 9).flatmap(lambda k: junk if k == 0 else valid)


token_ids = st.lists(st.integers(0, 2047), min_size=1, max_size=40)  # the vocabulary: 2,048
texts = st.text(min_size=1, max_size=60)
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "prompt": sometimes_junk(
        st.one_of(
            texts,
            token_ids,
            st.lists(texts, min_size=1, max_size=3),
            st.lists(token_ids, min_size=1, max_size=3),
            st.lists(st.integers(2040, 2100), min_size=1, max_size=4),  # out of vocabulary
        )
    ),
    "messages": sometimes_junk(
        st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["user", "system", "assistant"]),
                    "content": st.text(max_size=40),
                }
            ),
            min_size=1,
            max_size=3,
        )
    ),
    "max_tokens": sometimes_junk(st.one_of(st.integers(1, 24), st.sampled_from([0, -1, 5000]))),
    "max_completion_tokens": sometimes_junk(st.integers(1, 24)),
    "min_tokens": sometimes_junk(st.integers(0, 6)),
    "temperature": sometimes_junk(st.sampled_from([0, 0.0, 1e-6, 0.7, 1.0, 2.0, -1.0])),
    "top_p": sometimes_junk(st.sampled_from([0.0, 0.5, 1.0, 1.5])),
    "top_k": sometimes_junk(st.sampled_from([-1, 0, 1, 5, 10**6])),
    "n": sometimes_junk(st.sampled_from([1, 2, 3, "2", 2.0, 0, -1])),
    "seed": sometimes_junk(st.integers(-(2**63), 2**63)),
    "stop": sometimes_junk(
        st.one_of(st.lists(st.text(max_size=3), max_size=3), st.text(max_size=3))
    ),
    "echo": sometimes_junk(st.booleans()),
    "logprobs": sometimes_junk(st.sampled_from([0, 1, 5, 21, True, False])),
    "top_logprobs": sometimes_junk(st.sampled_from([0, 2, 21])),
    "prompt_logprobs": sometimes_junk(st.sampled_from([0, 1, 2])),
    "stream": sometimes_junk(st.booleans()),
    "stream_options": sometimes_junk(
        st.fixed_dictionaries(
            {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
        )
    ),
    "logit_bias": sometimes_junk(
        st.dictionaries(
            st.sampled_from(["1", "5", "2047", "99999"]), st.integers(-100, 100), max_size=2
        )
    ),
    "presence_penalty": sometimes_junk(st.floats(-3, 3)),
    "frequency_penalty": sometimes_junk(st.floats(-3, 3)),
    "repetition_penalty": sometimes_junk(st.sampled_from([0.0, 1.0, 1.3])),
    "ignore_eos": sometimes_junk(st.booleans()),
    "return_token_ids": sometimes_junk(st.booleans()),
    "response_format": sometimes_junk(
        st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "bogus"}])
    ),
    "user": sometimes_junk(st.text(max_size=10)),
    "suffix": junk,
    "best_of": sometimes_junk(st.sampled_from([1, 2])),
}


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    endpoint = draw(st.sampled_from(list(PATHS)))
    body: dict[str, Any] = {"max_tokens": 4}
    body["prompt" if endpoint == "completions" else "messages"] = draw(
        FIELDS["prompt" if endpoint == "completions" else "messages"]
    )
    for key in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=4, unique=True)):
        body[key] = draw(FIELDS[key])
    extra = draw(st.dictionaries(st.sampled_from(["zz", "foo", "bar"]), junk, max_size=1))
    return endpoint, {**extra, **body}


def _status(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[int, float]:
    t0 = time.monotonic()
    try:
        resp = client.post(url, json=body)
    except httpx.HTTPError as e:
        pytest.fail(f"{url} gave no answer: {e!r} ({body!r:.300})")
    return resp.status_code, time.monotonic() - t0


def _json_safe(value: Any) -> bool:
    """Whether httpx can send it (JSON with no NaN is what vLLM parses)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_json_safe(v) for v in value.values())
    if isinstance(value, list):
        return all(_json_safe(v) for v in value)
    return True


def test_every_request_ends_within_the_bound_with_vllm_s_status_class(
    pd_pair: Pair, tiny_model: Any
) -> None:
    from rapidkv.router.config import Instance, RouterConfig
    from rapidkv.router.server import start_router

    config = RouterConfig(
        prefill=(Instance(pd_pair.p.base_url),),
        decode=(Instance(pd_pair.d.base_url, pd_pair.d_control),),
        port=0,
        upstream_read_timeout_s=UPSTREAM_TIMEOUT_S,
    )
    model = str(tiny_model)
    mismatches: list[str] = []
    classes: Counter[int] = Counter()  # vLLM's status classes: the fuzz reaches both
    with (
        start_router(config) as router,
        httpx.Client(timeout=BOUND_S, trust_env=False) as client,
    ):

        @settings(
            max_examples=150,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(requests(), st.integers(0, 9).map(bool))  # the wrong model: 1 in 10
        def check(case: tuple[str, dict[str, Any]], right_model: bool) -> None:
            endpoint, body = case
            body = {"model": model if right_model else "nope", **body}
            if not _json_safe(body):
                body = {k: v for k, v in body.items() if _json_safe(v)}
            direct, _ = _status(client, pd_pair.d.base_url + PATHS[endpoint], body)
            routed, took = _status(client, router.url + PATHS[endpoint], body)
            event(f"vLLM {direct // 100}xx")
            classes[direct // 100] += 1
            assert took < BOUND_S
            if direct // 100 != routed // 100:
                mismatches.append(f"{endpoint} {body!r:.400}: vLLM {direct}, router {routed}")

        check()
    assert not mismatches, "\n".join(mismatches[:10])
    print(f"vLLM's status classes: {dict(classes)}")
    assert classes[2] >= 15 and classes[4] >= 15, classes  # served and refused, both
    assert_back_to_baseline(pd_pair, within=10.0)
