"""Bad client input to the router, fuzzed, against fake P and D upstreams.

The router validates little itself (`rewrite.parse_request`, `fanout.plan`):
the body must be a JSON object of at most `max_body_bytes`, name a known
``kv_transfer_params.rapidkv.transfer_kv_mode`` and ask for at most
`MAX_SEQUENCES` sequences. What it refuses gets a JSON 400 (413 for size) and
reaches no instance. Everything else is vLLM's to validate: whatever the types
and values, the router passes the client's fields through (P: a one-token
copy, `rewrite.prefill_body`; D: unchanged but for `kv_transfer_params`; local
dispatch: the client's bytes; a batch or ``n > 1``: one sub-request per
sequence, answers merged) and relays D's answer. Either way the router never
answers 5xx itself, stays up, and leaves nothing running on P.
"""

from __future__ import annotations

import contextlib
import json
import math
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from fake_vllm import FakeVLLM, MakeFake, MakeRouter, Seen, fake_render
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st

from rapidkv.control.codes import Code
from rapidkv.control.messages import AbortReply, Reply, Request
from rapidkv.control.server import RpcServer
from rapidkv.harness import wait_until
from rapidkv.router import Instance, RunningRouter
from rapidkv.router.fanout.plan import MAX_SEQUENCES, Sub, plan
from rapidkv.router.rewrite import MAX_DEPTH, transferable
from rapidkv.router.split import HEAD_KEEPS_OF_CHAT

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]

FUZZ = settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
MODES = ("step", "bypass", "substep")
BLOCK = 4  # the split prefill's block size
BODY_LIMIT = 4096  # max_body_bytes of the router the size tests use
GOOD = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 3}
# what P's one-token copy may differ in from the client's body
REWRITTEN_FOR_P = {
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "stream",
    "stream_options",
    "return_token_ids",
    "kv_transfer_params",
}


# ------------------------------------------------------------------ values


JUNK_STRINGS = ["", "NaN", "nan", "Infinity", "-inf", "1e999", "-1", "null", "true", "\x00",
                "\ud800", "a\udfffb", "💥", "x" * 3000]  # fmt: skip
numbers = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30),
    st.sampled_from([0, 1, -1, 2**31, 2**63, -(2**63), 10**400, 1e308, -1e308, 5e-324, 0.5]),
    st.floats(allow_nan=True, allow_infinity=True),
)
leaf = st.one_of(
    st.none(), st.booleans(), numbers, st.sampled_from(JUNK_STRINGS), st.text(max_size=12)
)
junk = st.recursive(
    leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=10,
)
counts = st.one_of(st.integers(-3, 70), numbers, junk)
# n / best_of values vLLM does not read as more than one sequence
ONE_SEQUENCE = [None, 0, 1, -1, True, False, 1.0, "1", " 1 ", 2.5, "2.5", "two", "", [], {},
                [2], {"n": 2}, -(10**30), math.nan, math.inf, "inf", "NaN"]  # fmt: skip
# ... values it reads as a few (served: one sub-request each) ...
SEVERAL = [2, 3, 2.0, "2", " 3 ", "2.0", "+4", "\t5\n"]
# ... and as more than the router serves in one request (refused)
TOO_MANY = [MAX_SEQUENCES + 1, 10**30, 10**4000, 1e10, "1e10", "1_000"]

# the client's own kv_transfer_params.rapidkv: a valid mode, and junk the router drops
OURS = {"transfer_kv_mode": st.sampled_from([None, *MODES]), "xfer_id": junk, "role": junk}
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.one_of(st.just("m"), junk),
    "prompt": st.one_of(
        st.text(max_size=30),
        st.lists(st.integers(0, 50_000), max_size=24),
        st.lists(st.text(max_size=5), max_size=3),
        st.lists(st.lists(st.integers(-5, 100), max_size=4), max_size=3),
        junk,
    ),
    "messages": st.one_of(
        st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "x"]), "content": junk}
            ),
            max_size=3,
        ),
        junk,
    ),
    "max_tokens": counts,
    "max_completion_tokens": counts,
    "min_tokens": counts,
    "temperature": st.one_of(st.sampled_from([0, 0.0, 1e-6, 1e-5, 1.0, -1.0]), numbers, junk),
    "top_p": st.one_of(numbers, junk),
    "top_k": st.one_of(numbers, junk),
    "stream": st.one_of(st.booleans(), junk),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), junk),
    "stop": st.one_of(st.lists(st.text(max_size=3), max_size=2), junk),
    "echo": st.one_of(st.booleans(), junk),
    "suffix": junk,
    "logprobs": st.one_of(numbers, junk),
    "prompt_logprobs": st.one_of(numbers, junk),
    "seed": st.one_of(numbers, junk),
    "logit_bias": junk,
    "user": junk,
    "tools": junk,
    "response_format": junk,
    "add_special_tokens": junk,
    "truncate_prompt_tokens": st.one_of(numbers, junk),
    "return_token_ids": st.one_of(st.booleans(), junk),
    "kv_transfer_params": st.one_of(
        junk,
        st.fixed_dictionaries(
            {"rapidkv": st.fixed_dictionaries({}, optional=OURS)},
            optional={"do_remote_prefill": junk, "remote_host": junk},
        ),
    ),
    "n": st.sampled_from(ONE_SEQUENCE + SEVERAL),
    "best_of": st.sampled_from(ONE_SEQUENCE),
}
# a well-formed request of each endpoint (streamed and greedy often enough that
# P's first token may open the stream, or the prompt is split) ...
PROMPTS = st.one_of(
    st.text(max_size=30),
    st.text(min_size=8, max_size=30),
    st.lists(st.integers(0, 50_000), max_size=24),
)
WELL_FORMED = {
    "completions": st.fixed_dictionaries(
        {
            "model": st.just("m"),
            "prompt": PROMPTS,
            "stream": st.booleans(),
            "temperature": st.sampled_from([0, 0.0, 0.7]),
        },
        optional={
            "max_tokens": st.integers(0, 40),
            "return_token_ids": st.booleans(),
            "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        },
    ),
    "chat": st.fixed_dictionaries(
        {"model": st.just("m"), "messages": FIELDS["messages"], "stream": st.booleans()},
        optional={
            "max_completion_tokens": st.integers(0, 40),
            "temperature": st.sampled_from([0, 0.7]),
        },
    ),
}
extra_fields = st.dictionaries(
    st.text(max_size=10).filter(lambda k: k not in FIELDS and k != "fake"), junk, max_size=2
)


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """An endpoint and a body: a well-formed one with up to four fields dropped or
    replaced by anything (of the wrong type, huge, negative, NaN, nested junk),
    and unknown fields added."""
    endpoint = draw(st.sampled_from(list(PATHS)))
    body = draw(WELL_FORMED[endpoint])
    for key in draw(st.lists(st.sampled_from(sorted({*FIELDS, *body})), max_size=4, unique=True)):
        if key in body and draw(st.booleans()):
            del body[key]
        else:
            body[key] = draw(FIELDS[key])
    return endpoint, {**draw(extra_fields), **body}


bodies = requests().map(lambda case: case[1])
endpoints = st.sampled_from(list(PATHS))


def mode_of(body: dict[str, Any]) -> Any:
    params = body.get("kv_transfer_params")
    ours = params.get("rapidkv") if isinstance(params, dict) else None
    return ours.get("transfer_kv_mode") if isinstance(ours, dict) else None


def to_json(body: Any, ascii_only: bool) -> bytes:
    """`body` as a client would send it: UTF-8, or all-ASCII with escapes (lone
    surrogates can only be sent escaped)."""
    try:
        return json.dumps(body, ensure_ascii=ascii_only).encode()
    except UnicodeEncodeError:
        return json.dumps(body).encode()


def same(a: Any, b: Any) -> bool:
    """Equal as JSON (NaN equals NaN)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def without(body: dict[str, Any], keys: set[str]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in keys}


# ------------------------------------------------------------------ the setup


class AbortRecorder:
    """P's control plane: records what the router sends it (Aborts)."""

    def __init__(self) -> None:
        self.calls: list[Request] = []
        self.server = RpcServer(self)
        self.server.start()

    async def __call__(self, msg: Request) -> Reply:
        self.calls.append(msg)
        return AbortReply(xfer_id=getattr(msg, "xfer_id", "x"), code=Code.OK)


@dataclass
class Setup:
    dispatch: str
    router: RunningRouter
    p: FakeVLLM | None  # None in local dispatch
    d: FakeVLLM
    control: AbortRecorder | None
    http: httpx.Client

    def post(self, endpoint: str, content: bytes) -> httpx.Response:
        return self.http.post(self.router.url + PATHS[endpoint], content=content)

    def metric(self, name: str) -> float:
        return self.router.router.metrics.registry.get_sample_value(name) or 0.0

    def refused(self) -> float:
        return sum(
            self.router.router.metrics.registry.get_sample_value(
                "rapidkv_router_requests_total",
                {"endpoint": e, "dispatch": self.router.config.dispatch, "outcome": "bad_request"},
            )
            or 0.0
            for e in PATHS
        )

    def counted_refused(self, n: float) -> None:
        """`n` requests counted refused (counted just after the answer left)."""
        wait_until(lambda: self.refused() == n, 10, interval=0.002, what="the count")
        assert self.refused() == n

    def settled(self) -> None:
        """Nothing outstanding on any instance, nothing in flight, every request P
        got answered (none left running), and P's connector told nothing."""
        wait_until(
            lambda: (
                self.router.router.fleet.outstanding("prefill") in ([], [0])
                and self.router.router.fleet.outstanding("decode") == [0]
                and self.metric("rapidkv_router_requests_in_flight") == 0
            ),
            10,
            interval=0.002,
            what="the router to settle",
        )
        if self.p is not None:
            assert all(s.answered_seq and not s.disconnected for s in self.p.requests())
        assert self.control is None or self.control.calls == []

    def serves_a_good_request(self) -> None:
        resp = self.post("completions", json.dumps(GOOD).encode())
        assert resp.status_code == 200 and resp.headers["x-fake-name"] == "D0", resp.text
        self.settled()


@pytest.fixture(params=["dual", "dual-split", "serial", "local"])
def setup(
    request: pytest.FixtureRequest,
    make_fake: MakeFake,
    make_router: MakeRouter,
    http: httpx.Client,
) -> Iterator[Setup]:
    """A router of each dispatch (dual-split: P's control address and block size
    are known, and no minimum part, so any single prompt a block long is
    split), with fake P and D."""
    dispatch = request.param
    d = make_fake("D0", "decode")
    if dispatch == "local":
        router = make_router([], [d], dispatch="local")
        yield Setup(dispatch, router, None, d, None, http)
        return
    p = make_fake("P0", "prefill")
    control = AbortRecorder() if dispatch == "dual-split" else None
    prefill = Instance(p.url, control.server.address, BLOCK) if control else Instance(p.url)
    router = make_router(
        [prefill], [d], dispatch=dispatch.removesuffix("-split"), split_min_tokens=0
    )
    yield Setup(dispatch, router, p, d, control, http)
    if control is not None:
        control.server.stop()


def error_of(resp: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI-format error body of a router's own answer `status`."""
    assert resp.status_code == status, (resp.status_code, resp.text[:300])
    assert resp.headers["content-type"] == "application/json"
    assert "x-fake-name" not in resp.headers  # the router's own answer
    error = resp.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] == status
    return error  # type: ignore[no-any-return]


# ------------------------------------------------------------------ passed through


@FUZZ
@given(requests(), st.booleans())
# a lone surrogate in a string (sent \u-escaped): the router's re-encoding raised
@example(("completions", {"prompt": "\ud800 lone surrogate", "max_tokens": 2}), True)
@example(("chat", {"messages": [{"role": "user", "content": "a\udfff"}]}), False)
@example(("completions", {"prompt": "abcdefghij", "max_tokens": 10**400, "n": "1"}), False)
@example(("completions", {"prompt": [1, 2, 3, 4, 5, 6], "temperature": 0, "stream": True}), False)
def test_any_other_body_is_passed_through_and_d_answers(
    setup: Setup, case: tuple[str, dict[str, Any]], ascii_only: bool
) -> None:
    """Any JSON object the router does not refuse is routed: D gets the client's
    fields unchanged, P a one-token copy of them, and the client D's answer. A
    completion whose prompt is not one prompt (a batch, or no valid prompt) goes
    to D alone, its bytes untouched: no transfer could serve it; so does one
    whose prompt logprobs make vLLM compute the prompt on D anyway."""
    endpoint, body = case
    assume(mode_of(body) in (None, *MODES))
    raw = to_json(body, ascii_only)
    p_before = len(setup.p.requests()) if setup.p else 0
    d_before = len(setup.d.requests())
    resp = setup.post(endpoint, raw)
    assert resp.status_code == 200, resp.text[:300]
    subs = plan(body, endpoint)  # type: ignore[arg-type]
    if subs is not None:
        check_fanned_out(setup, endpoint, body, subs, resp, p_before, d_before)
        return
    assert resp.headers["x-fake-name"] == "D0"
    xfer = resp.headers["x-rapidkv-xfer-id"]
    seen = setup.d.by_id(xfer)
    assert seen is not None and seen.path == PATHS[endpoint]
    setup.settled()
    if setup.dispatch == "local" or not transferable(body, endpoint):  # type: ignore[arg-type]
        assert seen.raw == raw  # the client's bytes, untouched
        if setup.p is not None:
            assert not [s for s in setup.p.requests()[p_before:] if s.path == PATHS[endpoint]]
        return
    check_decode(seen, body, xfer)
    assert setup.p is not None
    mine = [s for s in setup.p.requests()[p_before:] if s.path != "/tokenize"]
    assert [s.request_id for s in mine] == [xfer]
    check_prefill(mine[0], body, xfer, seen, endpoint)
    if seen.body.get("stream") is not True:
        assert resp.content == bytes(seen.sent)  # D's answer, byte for byte
    else:
        assert resp.content.endswith(b"data: [DONE]\n\n") and b'"error"' not in resp.content


def check_fanned_out(
    setup: Setup,
    endpoint: str,
    body: dict[str, Any],
    subs: list[Sub],
    resp: httpx.Response,
    p_before: int,
    d_before: int,
) -> None:
    """A batch or n > 1: D got one request per sequence (n = 1, the prompt's
    own), P one per prompt at most, and the client one answer whose choices
    are numbered as vLLM numbers them."""
    event(f"fanned out into {len(subs)}")
    setup.settled()
    seen = [s for s in setup.d.requests()[d_before:] if s.path == PATHS[endpoint]]
    assert len(seen) == len(subs)
    for s in seen:
        assert s.body.get("n", 1) == 1
        if endpoint == "completions":
            assert any(same(s.body["prompt"], sub.body["prompt"]) for sub in subs)
    if setup.p is not None:
        p_seen = [s for s in setup.p.requests()[p_before:] if s.path == PATHS[endpoint]]
        assert len(p_seen) <= len([s for s in subs if s.lead is None])
    if body.get("stream") is True:
        assert resp.content.endswith(b"data: [DONE]\n\n") and b'"error"' not in resp.content
        indexes = {
            c["index"]
            for line in resp.content.split(b"\n\n")
            if line.startswith(b"data: {")
            for c in json.loads(line[6:])["choices"]
        }
        assert indexes == {sub.index for sub in subs}
        assert resp.content.count(b"data: [DONE]") == 1
    else:
        answer = resp.json()
        assert [c["index"] for c in answer["choices"]] == [sub.index for sub in subs]


def check_decode(seen: Seen, body: dict[str, Any], xfer: str) -> None:
    """D's body: the client's, but for `kv_transfer_params` (and token ids asked
    for when P's first token may open the stream, or the prompt is split)."""
    assert same(
        without(seen.body, {"kv_transfer_params", "return_token_ids"}),
        without(body, {"kv_transfer_params", "return_token_ids"}),
    )
    if not same(seen.body.get("return_token_ids"), body.get("return_token_ids")):
        assert seen.body["return_token_ids"] is True
    ours = seen.kv_transfer_params["rapidkv"]
    assert seen.kv_transfer_params["do_remote_prefill"] is True
    assert ours["xfer_id"] == xfer and ours["role"] == "decode"
    assert ours.get("transfer_kv_mode") == mode_of(body)


def check_prefill(
    p_seen: Seen, body: dict[str, Any], xfer: str, d_seen: Seen, endpoint: str
) -> None:
    """P's body: a one-token, unstreamed (or token-id streamed) copy of the
    client's; for a split prefill, of the head of the prompt's ids."""
    split = d_seen.kv_transfer_params["rapidkv"].get("split_tokens")
    event(f"P: {'split' if split else 'streamed' if p_seen.body['stream'] else 'whole prompt'}")
    ignore = REWRITTEN_FOR_P | ({"prompt"} if split else set())
    if split and endpoint == "chat":  # the head of P's rendering, as a completion
        assert p_seen.path == "/v1/completions"
        kept = {k: body[k] for k in HEAD_KEEPS_OF_CHAT if k in body}
        assert same(without(p_seen.body, ignore), kept)
    else:
        assert same(without(p_seen.body, ignore), without(body, ignore))
    assert p_seen.body["max_tokens"] == 1
    if endpoint == "chat" and not split:
        assert p_seen.body["max_completion_tokens"] == 1
    assert p_seen.body.get("min_tokens", 1) == 1
    assert isinstance(p_seen.body["stream"], bool) and "stream_options" not in p_seen.body
    assert p_seen.kv_transfer_params == {"rapidkv": {"xfer_id": xfer, "role": "prefill"}}
    if split:
        if endpoint == "chat":
            ids = fake_render(body["messages"])
            assert ids is not None
        else:
            prompt = body["prompt"]
            ids = [ord(c) for c in prompt] if isinstance(prompt, str) else prompt
        assert split % BLOCK == 0 and 0 < split < len(ids)
        assert p_seen.body["prompt"] == ids[:split]


# ------------------------------------------------------------------ refused


not_json = st.one_of(
    st.binary(max_size=64),
    st.sampled_from(
        [
            b"",
            b'{"prompt": [1,',
            b'{"prompt": "\xff\xfe"}',  # not UTF-8
            b'{"prompt": "\xed\xa0\x80"}',  # a surrogate, UTF-8 encoded: not UTF-8
            b'{"max_tokens": nan}',
            b'{"a": 1} {"b": 2}',
            b"\xef\xbb\xbf\xef\xbb\xbf{}",
        ]
    ),
)
not_an_object = junk.filter(lambda v: not isinstance(v, dict))
too_many = st.one_of(st.sampled_from(TOO_MANY), st.integers(min_value=MAX_SEQUENCES + 1))


@FUZZ
@given(
    endpoints,
    st.one_of(
        not_json.map(lambda raw: ("json", raw)),
        st.builds(lambda v, a: ("json", to_json(v, a)), not_an_object, st.booleans()),
        st.builds(
            lambda v, endpoint, prompt: (
                "n",
                to_json({"prompt": prompt, "messages": [], "n": v, "temperature": 1.0}, True),
            ),
            too_many,
            endpoints,
            PROMPTS.filter(bool),
        ),
        st.builds(
            lambda mode, body: (
                "kv_transfer_params",
                to_json(
                    {**body, "kv_transfer_params": {"rapidkv": {"transfer_kv_mode": mode}}}, True
                ),
            ),
            junk.filter(lambda m: m is not None and m not in MODES),
            bodies,
        ),
    ),
)
@example("completions", ("json", b"[" * 100_000 + b"]" * 100_000))  # RecursionError: was 500
@example("chat", ("json", b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"))
@example("completions", ("json", b'{"max_tokens": 1' + b"0" * 5000 + b"}"))  # int(): was 500
@example("chat", ("json", b'{"tools": ' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}"))
@example("completions", ("n", b'{"prompt": "x", "n": "1e10"}'))  # vLLM reads it as 10**10
@example("completions", ("prompt", b'{"prompt": ' + json.dumps(["x"] * 257).encode() + b"}"))
def test_what_the_router_validates_gets_a_json_400_and_reaches_no_instance(
    setup: Setup, endpoint: str, case: tuple[str, bytes]
) -> None:
    why, raw = case
    if why == "json":
        with contextlib.suppress(ValueError, RecursionError):
            assume(not isinstance(json.loads(raw), dict))  # an object is routed, not refused
    p_before = len(setup.p.requests()) if setup.p else 0
    d_before, refused = len(setup.d.requests()), setup.refused()
    error = error_of(setup.post(endpoint, raw), 400)
    assert error["type"] == "BadRequestError"
    assert error["param"] == (None if why == "json" else why)
    assert len(setup.d.requests()) == d_before
    assert (len(setup.p.requests()) if setup.p else 0) == p_before
    setup.counted_refused(refused + 1)
    setup.serves_a_good_request()


def test_no_nesting_depth_fails_the_router(
    make_fake: MakeFake, make_router: MakeRouter, http: httpx.Client
) -> None:
    """Up to `MAX_DEPTH` levels a body is routed, deeper it is refused: never a
    5xx. (A body that parsed could fail to encode one call deeper: 971 levels
    did, on Python 3.11, before the limit.)"""
    p, d = make_fake("P0", "prefill"), make_fake("D0", "decode")
    router = make_router([p], [d])
    depths = sorted({*range(MAX_DEPTH - 3, MAX_DEPTH + 3), *range(260, 900, 97), *range(900, 1001)})
    for depth in depths:  # the body is one level, "junk" the rest
        raw = b'{"prompt": "x", "junk": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"
        resp = http.post(router.url + PATHS["completions"], content=raw)
        if depth <= MAX_DEPTH:
            assert resp.status_code == 200 and resp.headers["x-fake-name"] == "D0", depth
        else:
            message = error_of(resp, 400)["message"]  # the limit, or the parser's own
            assert "nested deeper than" in message or "recursion depth" in message, depth


@pytest.fixture
def small(make_fake: MakeFake, make_router: MakeRouter, http: httpx.Client) -> Setup:
    p, d = make_fake("P0", "prefill"), make_fake("D0", "decode")
    router = make_router([p], [d], max_body_bytes=BODY_LIMIT)
    return Setup("dual", router, p, d, None, http)


@FUZZ
@given(
    st.integers(min_value=BODY_LIMIT + 1, max_value=50 * BODY_LIMIT),
    st.sampled_from(["declared", "chunked"]),
    endpoints,
)
@example(BODY_LIMIT + 1, "declared", "chat")
@example(BODY_LIMIT + 1, "chunked", "completions")
def test_a_body_over_the_limit_gets_a_json_413_and_reaches_no_instance(
    small: Setup, size: int, how: str, endpoint: str
) -> None:
    """Declared too large: refused before a byte of it is read; sent chunked:
    refused once it passes the limit."""
    assert small.p is not None
    refused, seen = small.refused(), (len(small.d.requests()), len(small.p.requests()))
    body = b'{"prompt": "' + b"x" * (size - 14) + b'"}'
    assert len(body) == size
    if how == "declared":
        status, error = declared_too_large(small.router.url + PATHS[endpoint], size)
        assert status == 413 and error["code"] == 413
    else:
        resp = small.http.post(
            small.router.url + PATHS[endpoint],
            content=(body[i : i + 1000] for i in range(0, size, 1000)),
        )
        error = error_of(resp, 413)
    assert error["type"] == "RequestTooLargeError" and f"{BODY_LIMIT} bytes" in error["message"]
    assert (len(small.d.requests()), len(small.p.requests())) == seen
    small.counted_refused(refused + 1)
    small.serves_a_good_request()


def declared_too_large(url: str, size: int) -> tuple[int, dict[str, Any]]:
    """POST headers declaring `size` bytes and send none of them: the answer."""
    parts = urlsplit(url)
    assert parts.hostname is not None
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(
            f"POST {parts.path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n\r\n".encode()
        )
        answer = b""
        while b"}}" not in answer and (more := sock.recv(65536)):
            answer += more
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_a_large_body_under_the_limit_is_routed_whole(
    make_fake: MakeFake, make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = make_fake("P0", "prefill"), make_fake("D0", "decode")
    router = make_router([p], [d], max_body_bytes=4 << 20)
    body = {"prompt": list(range(300_000)), "max_tokens": 2, "junk": "y" * (1 << 20)}
    resp = http.post(router.url + PATHS["completions"], json=body)
    assert resp.status_code == 200
    assert d.wait_seen(1)[0].body["junk"] == body["junk"]
    assert p.wait_seen(1)[0].body["prompt"] == body["prompt"]
