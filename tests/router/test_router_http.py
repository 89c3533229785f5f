"""The router over real loopback HTTP, against fake vLLM upstreams (`fake_vllm`).

These prove routing behaviour that does not need a model: what P and D are sent,
when, which instance gets it, what the client gets back byte for byte, and what
happens when a client, P or D goes away.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from fake_vllm import FakeVLLM, MakeFake, MakeRouter, Seen, StatsServer

from rapidkv.control.codes import Code
from rapidkv.control.messages import (
    Abort,
    AbortReason,
    AbortReply,
    ErrorReply,
    Request,
)
from rapidkv.control.server import RpcServer
from rapidkv.harness import free_port, get_metrics, metric_sum, wait_until
from rapidkv.harness.client import open_request
from rapidkv.router import Instance, RunningRouter

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

PROMPT = [11, 12, 13, 14]
COMPLETION = {"model": "m", "prompt": PROMPT, "max_tokens": 5, "temperature": 0.0}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4}


def the_one(fake: FakeVLLM) -> Seen:
    seen = fake.wait_seen(1)
    assert len(seen) == 1, f"{fake.name} got {len(seen)} requests"
    return seen[0]


def metric(router: RunningRouter, name: str, **labels: str) -> float:
    return metric_sum(get_metrics(router.url), name, **labels)


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


# ------------------------------------------------------------------ the contract


def test_dual_sends_p_and_d_the_contract_under_one_request_id(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = make_router([Instance(p.url, "127.0.0.1:7001")], [d])
    body = dict(
        COMPLETION, min_tokens=2, kv_transfer_params={"rapidkv": {"transfer_kv_mode": "step"}}
    )
    resp = http.post(f"{router.url}/v1/completions", json=body)
    assert resp.status_code == 200

    p_seen, d_seen = the_one(p), the_one(d)
    xfer = resp.headers["x-rapidkv-xfer-id"]
    assert len(xfer) == 32
    assert p_seen.request_id == d_seen.request_id == xfer
    assert p_seen.path == d_seen.path == "/v1/completions"

    assert p_seen.body["max_tokens"] == 1
    assert p_seen.body["min_tokens"] == 1
    assert p_seen.body["stream"] is False  # not stitchable: no temperature given
    assert p_seen.kv_transfer_params == {"rapidkv": {"xfer_id": xfer, "role": "prefill"}}
    assert p_seen.body["prompt"] == PROMPT

    assert d_seen.kv_transfer_params == {
        "do_remote_prefill": True,
        "rapidkv": {
            "xfer_id": xfer,
            "role": "decode",
            "prefill_control": "127.0.0.1:7001",
            "prefill_url": p.url,
            "transfer_kv_mode": "step",
        },
    }
    assert {k: v for k, v in d_seen.body.items() if k != "kv_transfer_params"} == {
        k: v for k, v in body.items() if k != "kv_transfer_params"
    }
    # D's answer, byte for byte: ids and usage come from D.
    assert resp.content == bytes(d_seen.sent)
    assert resp.json()["id"] == f"cmpl-{xfer}"
    assert resp.headers["x-fake-name"] == "D0"


def test_streamed_chat_is_relayed_byte_for_byte_and_p_gets_a_one_token_request(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = make_router([p], [d])
    body = dict(CHAT, stream=True, stream_options={"include_usage": True})
    with http.stream("POST", f"{router.url}/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        received = resp.read()
    d_seen, p_seen = the_one(d), the_one(p)
    assert received == bytes(d_seen.sent)
    assert received.endswith(b"data: [DONE]\n\n")
    assert b'"usage"' in received
    assert d_seen.body["stream"] is True
    assert d_seen.body["stream_options"] == {"include_usage": True}
    assert p_seen.body["max_tokens"] == p_seen.body["max_completion_tokens"] == 1
    assert p_seen.body["stream"] is False
    assert "stream_options" not in p_seen.body
    assert p_seen.body["messages"] == CHAT["messages"]
    assert d_seen.kv_transfer_params["rapidkv"]["prefill_control"] is None


def test_dual_answers_without_waiting_for_p(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = make_router([p], [d])
    resp = http.post(
        f"{router.url}/v1/completions", json=dict(COMPLETION, fake={"prefill": "hang"})
    )
    assert resp.status_code == 200
    p_seen = the_one(p)
    assert p_seen.answered_seq is None  # P is still working: D did not wait for it
    assert router.router.fleet.outstanding("prefill") == [1]
    p.release()
    p.wait_answered(p_seen.request_id)
    wait_until(lambda: router.router.fleet.outstanding("prefill") == [0], 10, what="P released")


def test_serial_sends_d_only_after_p_answered(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = make_router([p], [d], dispatch="serial")
    result: dict[str, httpx.Response] = {}
    body = dict(COMPLETION, fake={"prefill": "hang"})
    client = threading.Thread(
        target=lambda: result.update(r=http.post(f"{router.url}/v1/completions", json=body))
    )
    client.start()
    p_seen = the_one(p)
    assert d.requests() == []  # P has not answered: D must not have been asked
    p.release()
    client.join(30)
    assert result["r"].status_code == 200
    d_seen = the_one(d)
    assert p_seen.answered_seq is not None and d_seen.seq > p_seen.answered_seq
    assert d_seen.request_id == p_seen.request_id
    assert d_seen.kv_transfer_params["do_remote_prefill"] is True


def test_local_sends_the_client_bytes_to_d_only(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = make_router([p], [d], dispatch="local")
    raw = b'{ "prompt": [1, 2],  "max_tokens": 3, "n": 1 }'
    resp = http.post(
        f"{router.url}/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert resp.status_code == 200
    d_seen = the_one(d)
    assert d_seen.raw == raw
    assert "kv_transfer_params" not in d_seen.body
    assert resp.content == bytes(d_seen.sent)
    assert p.requests() == []


def test_local_needs_no_prefill_instance(make_fake: MakeFake, make_router: MakeRouter) -> None:
    d = make_fake("D0", "decode")
    router = make_router([], [d], dispatch="local")
    with httpx.Client(trust_env=False) as http:
        assert http.post(f"{router.url}/v1/chat/completions", json=CHAT).status_code == 200
        assert http.get(f"{router.url}/health").status_code == 200


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("path", "body", "requests"),
    [
        ("/v1/completions", dict(COMPLETION, n=2, temperature=1.0), 2),  # fans out
        ("/v1/chat/completions", dict(CHAT, n=3), 3),
        ("/v1/completions", dict(COMPLETION, best_of=2), 1),  # D whole: vLLM's to answer
        ("/v1/completions", dict(COMPLETION, n=2), 1),  # greedy: vLLM refuses it
    ],
)
def test_several_sequences_are_served_not_refused(
    pd: tuple[FakeVLLM, FakeVLLM],
    make_router: MakeRouter,
    http: httpx.Client,
    path: str,
    body: dict[str, Any],
    requests: int,
) -> None:
    p, d = pd
    router = make_router([p], [d])
    resp = http.post(router.url + path, json=body)
    assert resp.status_code == 200, resp.text
    assert len(d.requests(path)) == requests
    assert all(s.body.get("n", 1) == 1 for s in d.requests(path)) or requests == 1
    if requests == 1:
        assert p.requests() == [] and d.requests(path)[0].body == body


def test_malformed_json_unknown_routes_and_wrong_methods_get_json_errors(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = make_router([p], [d])
    bad = http.post(f"{router.url}/v1/completions", content=b'{"prompt": [1,')
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    missing = http.post(f"{router.url}/v1/no-such-route", json={})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    wrong = http.get(f"{router.url}/v1/chat/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == 405
    assert p.requests() == [] and d.requests() == []


def test_a_body_over_the_limit_is_refused_413_before_it_is_read(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    """A declared size over `max_body_bytes` is answered at once, with the body
    never sent; an undeclared (chunked) one is cut off once it passes the limit."""
    p, d = pd
    router = make_router([p], [d], max_body_bytes=1000)
    host, port = urlsplit(router.url).hostname, urlsplit(router.url).port
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 30000000\r\n\r\n"
        )
        answer = b""  # within the 5 s timeout: nothing of the body was sent
        while b"}}" not in answer and (more := sock.recv(65536)):
            answer += more
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"larger than 1000 bytes" in body

    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        yield b"x" * 2000
        yield b'"}'

    chunked = http.post(f"{router.url}/v1/completions", content=chunks())
    assert chunked.status_code == 413
    small = http.post(f"{router.url}/v1/completions", json=COMPLETION)
    assert small.status_code == 200
    assert metric(router, "rapidkv_router_requests_total", outcome="bad_request") == 2
    assert len(d.requests()) == 1 and len(p.requests()) <= 1


# ------------------------------------------------------------------ failures upstream


@pytest.mark.parametrize("failure", ["error", "unreachable"])
def test_a_failed_prefill_does_not_fail_the_client(
    make_fake: MakeFake, make_router: MakeRouter, http: httpx.Client, failure: str
) -> None:
    d = make_fake("D0", "decode")
    p_url = dead_url() if failure == "unreachable" else make_fake("P0", "prefill").url
    router = make_router([p_url], [d])
    resp = http.post(
        f"{router.url}/v1/completions", json=dict(COMPLETION, fake={"prefill": "error"})
    )
    assert resp.status_code == 200
    assert resp.content == bytes(the_one(d).sent)
    kind = "connect" if failure == "unreachable" else "status"
    wait_until(
        lambda: (
            metric(router, "rapidkv_router_upstream_errors_total", role="prefill", kind=kind) == 1
        ),
        10,
        what="the prefill failure to be counted",
    )
    assert metric(router, "rapidkv_router_requests_total", outcome="ok") == 1
    placed = "rapidkv_router_placed_requests_total"
    assert metric(router, placed, placement="pd", outcome="ok") == 1 == metric(router, placed)


def test_a_decode_error_is_relayed_as_is(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = make_router([p], [d])
    resp = http.post(
        f"{router.url}/v1/completions", json=dict(COMPLETION, fake={"decode": "error"})
    )
    assert resp.status_code == 503
    assert resp.content == bytes(the_one(d).sent)
    assert resp.json()["error"]["message"] == "D0 failed"
    assert metric(router, "rapidkv_router_requests_total", outcome="upstream_error") == 1
    assert metric(router, "rapidkv_router_upstream_errors_total", role="decode", kind="status") == 1


def test_an_unreachable_decode_gives_502(
    make_fake: MakeFake, make_router: MakeRouter, http: httpx.Client
) -> None:
    router = make_router([make_fake("P0", "prefill")], [dead_url()])
    resp = http.post(f"{router.url}/v1/completions", json=COMPLETION)
    assert resp.status_code == 502
    assert resp.json()["error"]["type"] == "BadGatewayError"
    assert metric(router, "rapidkv_router_requests_total", outcome="unreachable") == 1


@pytest.mark.parametrize("dispatch", ["dual", "local"])
def test_a_decode_stream_that_breaks_off_ends_with_an_error_event(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client, dispatch: str
) -> None:
    """The client reads what D sent, then an error event and [DONE], at once:
    no silent cut, no hang."""
    p, d = pd
    router = make_router([p], [d], dispatch=dispatch)
    body = dict(COMPLETION, stream=True, fake={"decode": "cut"})
    t0 = time.monotonic()
    with http.stream("POST", f"{router.url}/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert time.monotonic() - t0 < 2.0
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: ") :])["error"]
    assert error["code"] == 502 and "broke off" in error["message"]
    relayed = [json.loads(line[6:]) for line in lines[:-2]]
    assert relayed and all("choices" in event for event in relayed)
    wait_until(
        lambda: metric(router, "rapidkv_router_requests_total", outcome="stream_error") == 1,
        10,
        what="the broken stream to be counted",
    )
    assert metric(router, "rapidkv_router_upstream_errors_total", role="decode", kind="stream") == 1


@pytest.mark.parametrize(
    ("dispatch", "admin_token"),
    [("dual", None), ("local", None), ("local", "migratable-admin-token")],
)
def test_a_decode_stream_that_breaks_after_its_done_is_served_as_it_came(
    pd: tuple[FakeVLLM, FakeVLLM],
    make_router: MakeRouter,
    recorder: AbortRecorder,
    http: httpx.Client,
    dispatch: str,
    admin_token: str | None,
) -> None:
    """D drops the connection after ``data: [DONE]``, before the body's end:
    the client has the whole answer, so it gets it as it came (no error event
    after its [DONE]), the request is served (outcome ok, P not told to abort)
    and D's break is still counted where operators look. With admin routes
    the stream is relayed as a migratable one, event by event."""
    p, d = pd
    router = make_router(
        [Instance(p.url, recorder.server.address)],
        [d],
        dispatch=dispatch,
        secret=b"router-test-secret",
        admin_token=admin_token,
    )
    body = dict(COMPLETION, stream=True, fake={"decode": "cut_after_done"})
    with http.stream("POST", f"{router.url}/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        raw = b"".join(resp.iter_raw())
    d_sent = next(seen for seen in d.seen if seen.path == "/v1/completions").sent
    # every event D sent (dual: the first one P's, stitched), then [DONE] once
    assert raw.count(b"data: ") == d_sent.count(b"data: ") and b'"error"' not in raw
    assert raw.endswith(b"\n\ndata: [DONE]\n\n") and raw.count(b"[DONE]") == 1
    wait_until(
        lambda: metric(router, "rapidkv_router_requests_total", outcome="ok") == 1,
        10,
        what="the request to be counted served",
    )
    assert metric(router, "rapidkv_router_requests_total", outcome="stream_error") == 0
    assert metric(router, "rapidkv_router_upstream_errors_total", role="decode", kind="stream") == 1
    assert recorder.aborts == []
    assert router.router.fleet.outstanding("decode") == [0]


# ------------------------------------------------------------------ instance health


def test_with_no_decode_up_requests_get_503_at_once_and_p_gets_nothing(
    make_fake: MakeFake, make_router: MakeRouter, http: httpx.Client
) -> None:
    """The first request finds D gone (502) and marks it down; later ones get a
    503 naming why, without waiting and without reaching P. When D answers its
    /health again (a new server on the same address) it is used again."""
    p, d = make_fake("P0", "prefill"), make_fake("D0", "decode")
    port = urlsplit(d.url).port
    router = make_router([p], [d], probe_interval_s=0.2)
    d.stop()
    assert http.post(f"{router.url}/v1/completions", json=COMPLETION).status_code == 502
    assert metric(router, "rapidkv_router_instance_up", role="decode") == 0
    p_requests = len(p.requests())
    t0 = time.monotonic()
    refused = http.post(f"{router.url}/v1/completions", json=COMPLETION)
    assert time.monotonic() - t0 < 1.0
    assert refused.status_code == 503
    error = refused.json()["error"]
    assert error["type"] == "ServiceUnavailableError" and d.url in error["message"]
    assert len(p.requests()) == p_requests, "P was asked for a request no D could serve"
    assert metric(router, "rapidkv_router_requests_total", outcome="unavailable") == 1
    # by placement: the first was placed (P and D chosen), the second never was
    placed = "rapidkv_router_placed_requests_total"
    assert metric(router, placed, placement="pd", outcome="unreachable") == 1
    assert metric(router, placed, placement="none", outcome="unavailable") == 1
    health = http.get(f"{router.url}/health").json()
    assert health["decode"][0]["dispatching"] is False

    back = make_fake("D0-again", "decode", port)
    wait_until(
        lambda: metric(router, "rapidkv_router_instance_up", role="decode") == 1,
        10,
        what="D to be probed up again",
    )
    assert http.post(f"{router.url}/v1/completions", json=COMPLETION).status_code == 200
    assert len(back.requests("/v1/completions")) == 1


@pytest.mark.parametrize("dispatch", ["dual", "serial"])
def test_with_no_prefill_up_d_serves_requests_alone(
    make_fake: MakeFake, make_router: MakeRouter, http: httpx.Client, dispatch: str
) -> None:
    """P gone: the request that finds out is served by D (which recomputes), and
    later ones go to D alone, as in local dispatch, counted."""
    d = make_fake("D0", "decode")
    router = make_router([dead_url()], [d], dispatch=dispatch)
    assert http.post(f"{router.url}/v1/completions", json=COMPLETION).status_code == 200
    assert metric(router, "rapidkv_router_instance_up", role="prefill") == 0
    alone = http.post(f"{router.url}/v1/completions", json=COMPLETION)
    assert alone.status_code == 200
    assert metric(router, "rapidkv_router_without_prefill_total") == 1
    first, last = d.requests("/v1/completions")
    assert first.kv_transfer_params["do_remote_prefill"] is True  # sent before P was found gone
    assert last.body == COMPLETION, "D alone should get the client's request as it is"
    assert router.router.fleet.outstanding("prefill") == [0]


# ------------------------------------------------------------------ instance choice


def test_instances_are_chosen_by_least_outstanding_with_ties_in_turn(
    make_fake: MakeFake, make_router: MakeRouter, http: httpx.Client
) -> None:
    ps = [make_fake(f"P{i}", "prefill") for i in range(2)]
    ds = [make_fake(f"D{i}", "decode") for i in range(2)]
    # serial: each P request is over before its D request starts, so P choice is
    # deterministic too.
    router = make_router(ps, ds, dispatch="serial")
    url = f"{router.url}/v1/completions"

    long = threading.Thread(
        target=http.post, args=(url,), kwargs={"json": dict(COMPLETION, fake={"decode": "hang"})}
    )
    long.start()
    ds[0].wait_seen(1)  # the first request holds D0
    assert metric(router, "rapidkv_router_outstanding", role="decode", upstream=ds[0].url) == 1

    served = [http.post(url, json=COMPLETION).json()["served_by"] for _ in range(3)]
    assert served == ["D1", "D1", "D1"]  # D0 is busy: D1 has fewer outstanding
    ds[0].release()
    long.join(30)
    assert metric(router, "rapidkv_router_outstanding", role="decode", upstream=ds[0].url) == 0

    served = [http.post(url, json=COMPLETION).json()["served_by"] for _ in range(4)]
    assert served == ["D0", "D1", "D0", "D1"]  # equal loads: in turn
    assert [len(p.requests()) for p in ps] == [4, 4]  # P choices alternated throughout


# ------------------------------------------------------------------ client disconnect


class AbortRecorder:
    """A control-plane server standing in for P's connector: records Aborts."""

    def __init__(self, secret: bytes | None) -> None:
        self.aborts: list[Abort] = []
        self.server = RpcServer(self.handle, secret=secret)
        self.server.start()

    async def handle(self, request: Request) -> AbortReply | ErrorReply:
        if isinstance(request, Abort):
            self.aborts.append(request)
            return AbortReply(xfer_id=request.xfer_id, code=Code.OK)
        return ErrorReply(Code.ERROR, "unexpected")


@pytest.fixture
def recorder() -> Iterator[AbortRecorder]:
    rec = AbortRecorder(secret=b"router-test-secret")
    yield rec
    rec.server.stop()


def abandon(url: str, path: str, body: dict[str, Any], read_first: bool) -> socket.socket:
    """Send a request on a raw socket (optionally read the answer's first bytes)."""
    sock = open_request(url, path, body)
    if read_first:
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    return sock


@pytest.mark.parametrize(
    ("dispatch", "stream", "behaviour"),
    [
        ("dual", True, {"prefill": "hang", "decode": "hang_stream"}),  # gone mid-stream
        ("dual", False, {"prefill": "hang", "decode": "hang"}),  # gone while D computes
        ("serial", False, {"prefill": "hang"}),  # gone while P computes: D never asked
    ],
)
def test_client_disconnect_cancels_both_upstreams_and_aborts_p(
    pd: tuple[FakeVLLM, FakeVLLM],
    make_router: MakeRouter,
    recorder: AbortRecorder,
    dispatch: str,
    stream: bool,
    behaviour: dict[str, str],
) -> None:
    p, d = pd
    router = make_router(
        [Instance(p.url, recorder.server.address)],
        [d],
        dispatch=dispatch,
        secret=b"router-test-secret",
    )
    body = dict(COMPLETION, stream=stream, fake=behaviour)
    waits_for_d = "decode" in behaviour
    sock = abandon(router.url, "/v1/completions", body, read_first=stream)
    xfer = the_one(p).request_id
    if waits_for_d:
        the_one(d)
    sock.close()

    p.wait_disconnected(xfer)
    if waits_for_d:
        d.wait_disconnected(xfer)
    else:
        assert d.requests() == []
    wait_until(lambda: recorder.aborts, 10, what="P's connector to get an Abort")
    assert recorder.aborts == [Abort(xfer_id=xfer, reason=AbortReason.CLIENT_ABORT)]
    wait_until(
        lambda: metric(router, "rapidkv_router_control_aborts_total", outcome="ok") == 1,
        10,
        what="the abort to be counted",
    )
    assert metric(router, "rapidkv_router_requests_total", outcome="client_abort") == 1
    assert router.router.fleet.outstanding("prefill") == [0]
    assert router.router.fleet.outstanding("decode") == [0]
    assert metric(router, "rapidkv_router_requests_in_flight") == 0


def test_a_client_that_leaves_once_it_read_done_was_served_and_p_is_not_aborted(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, recorder: AbortRecorder
) -> None:
    """The client closes its connection as soon as it read ``data: [DONE]``,
    while D's HTTP answer has yet to end: the request was served (outcome
    ok), and P's connector gets no Abort."""
    p, d = pd
    router = make_router(
        [Instance(p.url, recorder.server.address)], [d], secret=b"router-test-secret"
    )
    body = dict(COMPLETION, stream=True, fake={"decode": "linger"})
    sock = open_request(router.url, "/v1/completions", body)
    got = b""
    while b"data: [DONE]" not in got:
        chunk = sock.recv(65536)
        assert chunk, got
        got += chunk
    xfer = the_one(d).request_id
    sock.close()
    d.wait_disconnected(xfer)  # the router stopped reading D's answer
    wait_until(lambda: metric(router, "rapidkv_router_requests_in_flight") == 0, 10, what="its end")
    assert metric(router, "rapidkv_router_requests_total", outcome="ok") == 1
    assert metric(router, "rapidkv_router_requests_total", outcome="client_abort") == 0
    assert recorder.aborts == []
    assert router.router.fleet.outstanding("decode") == [0]


@pytest.mark.parametrize("dispatch", ["dual", "serial"])
def test_a_failed_prefill_is_aborted_on_p_so_d_need_not_wait_for_its_transfer(
    make_fake: MakeFake,
    make_router: MakeRouter,
    recorder: AbortRecorder,
    http: httpx.Client,
    dispatch: str,
) -> None:
    p, d = make_fake("P0", "prefill"), make_fake("D0", "decode")
    router = make_router(
        [Instance(p.url, recorder.server.address)],
        [d],
        dispatch=dispatch,
        secret=b"router-test-secret",
    )
    body = dict(COMPLETION, fake={"prefill": "error"})
    assert http.post(f"{router.url}/v1/completions", json=body).status_code == 200
    xfer = the_one(d).request_id
    wait_until(lambda: recorder.aborts, 10, what="P's connector to get an Abort")
    assert recorder.aborts == [Abort(xfer_id=xfer, reason=AbortReason.PREFILL_FAILED)]
    assert http.post(f"{router.url}/v1/completions", json=COMPLETION).status_code == 200
    wait_until(lambda: len(p.seen) == 2 and p.seen[1].answered_seq, 10, what="P's 2nd answer")
    wait_until(
        lambda: router.router.fleet.outstanding("prefill") == [0], 10, what="P's request to end"
    )
    # a prefill that worked is not aborted: the one Abort above is all P got
    assert metric(router, "rapidkv_router_control_aborts_total", outcome="ok") == 1
    assert len(recorder.aborts) == 1


@pytest.mark.parametrize("failure", ["error", "unreachable", "cut"])
def test_a_failed_decode_stops_the_prefill_and_aborts_it_on_p(
    make_fake: MakeFake, make_router: MakeRouter, recorder: AbortRecorder, failure: str
) -> None:
    """D refuses (an error status), cannot be reached, or breaks off its stream:
    P's request is stopped if it still runs and P's connector gets an Abort
    (decode_failed), so that P frees the blocks it holds now, not after a TTL."""
    p = make_fake("P0", "prefill")
    d = make_fake("D0", "decode") if failure != "unreachable" else None
    router = make_router(
        [Instance(p.url, recorder.server.address)],
        [d if d is not None else dead_url()],
        secret=b"router-test-secret",
    )
    fake = {"prefill": "hang", "decode": failure} if d is not None else {"prefill": "hang"}
    body = dict(COMPLETION, stream=failure == "cut", fake=fake)
    with httpx.Client(timeout=30) as client:
        resp = client.post(f"{router.url}/v1/completions", json=body)
    assert resp.status_code == {"error": 503, "unreachable": 502, "cut": 200}[failure]
    xfer = the_one(p).request_id
    p.wait_disconnected(xfer)  # P's hanging request was stopped
    wait_until(lambda: recorder.aborts, 10, what="P's connector to get an Abort")
    assert recorder.aborts == [Abort(xfer_id=xfer, reason=AbortReason.DECODE_FAILED)]
    wait_until(
        lambda: router.router.fleet.outstanding("prefill") == [0], 10, what="P to be released"
    )


def test_an_unreachable_control_address_makes_the_abort_fail_harmlessly(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = make_router([Instance(p.url, f"127.0.0.1:{free_port()}")], [d])
    body = dict(COMPLETION, stream=True, fake={"prefill": "hang", "decode": "hang_stream"})
    sock = abandon(router.url, "/v1/completions", body, read_first=True)
    xfer = the_one(d).request_id
    sock.close()
    d.wait_disconnected(xfer)
    wait_until(
        lambda: metric(router, "rapidkv_router_control_aborts_total", outcome="failed") == 1,
        15,
        what="the failed abort to be counted",
    )
    resp = http.post(f"{router.url}/v1/completions", json=COMPLETION)  # still serving
    assert resp.status_code == 200


# ------------------------------------------------------------------ health, models, metrics


def test_health_needs_one_answering_p_and_one_answering_d(
    make_fake: MakeFake, make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = make_fake("P0", "prefill"), make_fake("D0", "decode")
    router = make_router([dead_url(), p], [d])
    ok = http.get(f"{router.url}/health")
    assert ok.status_code == 200
    report = ok.json()
    assert [c["healthy"] for c in report["prefill"]] == [False, True]
    assert report["decode"] == [
        {
            "url": d.url,
            "healthy": True,
            "detail": "HTTP 200",
            "dispatching": True,
            "draining": False,
            "transfers": "unknown",  # no control address: not watched
        }
    ]

    d.healthy = False
    down = http.get(f"{router.url}/health")
    assert down.status_code == 503
    assert down.json()["status"] == "unavailable"
    assert down.json()["decode"][0]["detail"] == "HTTP 503"


def test_a_decode_whose_every_transfer_falls_back_shows_as_degraded(
    make_fake: MakeFake, make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = make_fake("P0", "prefill"), make_fake("D0", "decode")
    stats = StatsServer(secret=b"s")
    try:
        router = make_router(
            [p],
            [Instance(d.url, stats.server.address)],
            secret=b"s",
            transfer_check_interval_s=0.05,
        )

        def state() -> tuple[str, str, float]:
            report = http.get(f"{router.url}/health").json()
            degraded = metric(router, "rapidkv_router_transfers_degraded", upstream=d.url)
            return report["status"], report["decode"][0]["transfers"], degraded

        wait_until(lambda: stats.asked >= 2, 5, what="two readings")  # idle: nothing to judge
        assert state() == ("ok", "unknown", 0)
        stats.counters = {"transfer_kv_ok": 0, "recompute_fallbacks": 5}
        wait_until(lambda: state() == ("degraded", "degraded", 1), 5, what="degraded")
        assert http.get(f"{router.url}/health").status_code == 200  # it serves, recomputing
        stats.counters = {"transfer_kv_ok": 1, "recompute_fallbacks": 8}
        wait_until(lambda: state() == ("ok", "ok", 0), 5, what="transferring again")
    finally:
        stats.server.stop()


def test_a_prefill_whose_control_address_cannot_be_discovered_is_not_sent_the_prompt(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    """P's answer to the discovery probe names no control address (no connector,
    or one too slow to answer): D computes the prompt whatever P does, so P is
    sent only the probe, not the prompt it would compute and hold for a
    TransferKV that never comes; the request is counted as served without a
    prefill instance."""
    p, d = pd  # the fake P's answers carry no control address
    router = make_router([p], [d], discover=True, split_prefill=False)
    for _ in range(2):
        resp = http.post(f"{router.url}/v1/completions", json=COMPLETION)
        assert resp.status_code == 200, resp.text
    asked = [r.kv_transfer_params for r in p.requests("/v1/completions")]
    assert asked and all(x == {"rapidkv": {"discover": True}} for x in asked), asked
    to_d = d.requests("/v1/completions")
    assert len(to_d) == 2, to_d
    for r in to_d:  # asked as one instance: no KV to load
        params = r.kv_transfer_params or {}
        assert not params.get("do_remote_prefill"), params
        assert params.get("rapidkv", {}).get("role") in (None, "local"), params
    assert metric(router, "rapidkv_router_without_prefill_total") == 2


def test_a_prefill_that_answers_from_another_control_address_is_followed(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    """P restarted with its control plane elsewhere: its next answer says so,
    and the requests after it send D there."""
    p, d = pd
    p.control = "127.0.0.1:7001"
    router = make_router([p], [d], discover=True, split_prefill=False)

    def prefill_control_d_got() -> str:
        resp = http.post(f"{router.url}/v1/completions", json=COMPLETION)
        assert resp.status_code == 200
        return d.requests()[-1].kv_transfer_params["rapidkv"]["prefill_control"]

    assert prefill_control_d_got() == "127.0.0.1:7001"
    p.control = "127.0.0.1:7002"
    assert prefill_control_d_got() == "127.0.0.1:7001"  # D was asked with P, at once
    wait_until(lambda: prefill_control_d_got() == "127.0.0.1:7002", 5, what="the new address")


def test_models_come_from_the_first_decode_that_answers(
    make_fake: MakeFake, make_router: MakeRouter, http: httpx.Client
) -> None:
    d1 = make_fake("D1", "decode")
    router = make_router([dead_url()], [dead_url(), d1])
    resp = http.get(f"{router.url}/v1/models")
    assert resp.status_code == 200
    assert [m["id"] for m in resp.json()["data"]] == ["model-of-D1"]


def test_metrics_count_and_time_requests(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = make_router([p], [d])
    with http.stream(
        "POST", f"{router.url}/v1/completions", json=dict(COMPLETION, stream=True)
    ) as r:
        r.read()
    http.post(f"{router.url}/v1/chat/completions", json=CHAT)
    m = get_metrics(router.url)
    ok = {"dispatch": "dual", "outcome": "ok"}
    assert metric_sum(m, "rapidkv_router_requests_total", endpoint="completions", **ok) == 1
    assert metric_sum(m, "rapidkv_router_requests_total", endpoint="chat", **ok) == 1
    assert metric_sum(m, "rapidkv_router_ttft_seconds_count", endpoint="completions") == 1
    assert metric_sum(m, "rapidkv_router_ttft_seconds_count", endpoint="chat") == 0  # not streamed
    assert metric_sum(m, "rapidkv_router_e2e_seconds_count") == 2
    assert metric_sum(m, "rapidkv_router_requests_in_flight") == 0
    assert metric_sum(m, "rapidkv_router_outstanding", role="decode") == 0


# ------------------------------------------------------------------ a fleet of instances


def test_instances_of_a_fleet_take_either_role_and_never_both_for_one_request(
    make_fake: MakeFake, make_router: MakeRouter, http: httpx.Client
) -> None:
    """Two `--instance`s: each request is decoded on one and prefilled on the
    other, and with equal loads the decoder alternates."""
    a = [make_fake(f"A{i}", "decode") for i in range(2)]
    router = make_router([], [], instances=a, split_prefill=False)
    url = f"{router.url}/v1/completions"
    served = []
    for _ in range(4):
        resp = http.post(url, json=COMPLETION)
        assert resp.status_code == 200
        xfer = resp.headers["x-rapidkv-xfer-id"]
        decoder = resp.json()["served_by"]
        served.append(decoder)
        other = a[1] if decoder == "A0" else a[0]
        mine = a[0] if decoder == "A0" else a[1]
        assert mine.by_id(xfer).kv_transfer_params["rapidkv"]["role"] == "decode"
        wait_until(lambda: other.by_id(xfer) is not None, 10, what="the prefill part")  # noqa: B023
        assert other.by_id(xfer).kv_transfer_params["rapidkv"]["role"] == "prefill"
        # equal loads before the next: the prefill part may still be in flight
        # when the client has its answer (dual dispatch)
        wait_until(
            lambda: router.router.fleet.outstanding("prefill") == [0, 0], 10, what="P released"
        )
    assert served == ["A0", "A1", "A0", "A1"]
    assert router.router.fleet.outstanding("decode") == [0, 0]
    health = http.get(f"{router.url}/health").json()
    assert [c["role"] for c in health["prefill"] + health["decode"]] == ["both"] * 4
    assert metric(router, "rapidkv_router_outstanding", role="both") == 0


def test_a_fleet_of_one_serves_every_request_locally(
    make_fake: MakeFake, make_router: MakeRouter, http: httpx.Client
) -> None:
    a = make_fake("A0", "decode")
    router = make_router([], [], instances=[a])
    resp = http.post(f"{router.url}/v1/completions", json=COMPLETION)
    assert resp.status_code == 200
    seen = the_one(a)
    assert seen.body == COMPLETION  # the client's request, untouched
    assert metric(router, "rapidkv_router_without_prefill_total") == 0


def test_adaptive_placement_keeps_a_short_prompt_local_and_says_so(
    make_fake: MakeFake, make_router: MakeRouter, http: httpx.Client
) -> None:
    """An idle fleet of two: a short prompt does not cross. The answer's
    x-rapidkv-placement header and the placements metric say where it ran."""
    a = [make_fake(f"A{i}", "decode") for i in range(2)]
    router = make_router([], [], instances=a, placement="adaptive")
    resp = http.post(f"{router.url}/v1/completions", json=COMPLETION)
    assert resp.status_code == 200
    placement = dict(kv.split("=") for kv in resp.headers["x-rapidkv-placement"].split(";"))
    assert placement["kind"] == "local" and placement["prefill"] == placement["decode"]
    served = a[int(placement["decode"])]
    assert the_one(served).body == COMPLETION  # untouched: no P part
    assert served.name == resp.json()["served_by"]
    assert not a[1 - int(placement["decode"])].requests()
    assert metric(router, "rapidkv_router_placements_total", kind="local") == 1
    assert metric(router, "rapidkv_router_placements_total", kind="pd") == 0
    placed = "rapidkv_router_placed_requests_total"
    assert metric(router, placed, placement="local", outcome="ok") == 1 == metric(router, placed)
    # its learned costs, one line per instance (no stream: nothing learned, the priors')
    for fake in a:
        step = {"upstream": fake.url, "term": "intercept"}
        assert metric(router, "rapidkv_router_model_step_seconds", **step) > 0
        assert (
            metric(router, "rapidkv_router_model_prefill_seconds", upstream=fake.url, term="slope")
            > 0
        )


def test_the_placer_forgets_a_request_once_its_answer_is_complete(
    make_fake: MakeFake, make_router: MakeRouter
) -> None:
    """A stream whose ``data: [DONE]`` was relayed, while D's HTTP answer has
    yet to end: adaptive placement no longer counts it running (nor the fleet
    outstanding), so the next request is placed on an idle fleet."""
    a = [make_fake(f"A{i}", "decode") for i in range(2)]
    router = make_router([], [], instances=a, placement="adaptive")
    placer = router.router._placer
    assert placer is not None
    body = dict(COMPLETION, stream=True, fake={"decode": "linger"})
    with (
        httpx.Client(timeout=60, trust_env=False) as client,
        client.stream("POST", f"{router.url}/v1/completions", json=body) as resp,
    ):
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: [DONE]"))
        assert placer.fleet.in_flight == 0
        assert router.router.fleet.outstanding("decode") == [0, 0]
        for fake in a:
            fake.release()
        assert not "".join(lines)
    wait_until(lambda: metric(router, "rapidkv_router_requests_in_flight") == 0, 10, what="its end")
    assert metric(router, "rapidkv_router_placed_requests_total", outcome="ok") == 1


def test_adaptive_placement_asks_every_instance_its_block_size_and_max_num_seqs(
    make_fake: MakeFake, make_router: MakeRouter, http: httpx.Client
) -> None:
    """Even with their control addresses configured, an adaptive router probes
    each instance: a split needs the block size, and an engine with
    max_num_seqs requests running queues the next."""
    a = [make_fake(f"A{i}", "decode") for i in range(2)]
    for i, fake in enumerate(a):
        fake.control = f"127.0.0.1:{7100 + i}"
        fake.max_num_seqs = 4 + i
    configured = [Instance(fake.url, f"127.0.0.1:{7200 + i}") for i, fake in enumerate(a)]
    router = make_router([], [], instances=configured, placement="adaptive", discover=True)
    seqs = "rapidkv_router_instance_max_num_seqs"
    wait_until(
        lambda: [metric(router, seqs, upstream=fake.url) for fake in a] == [4, 5],
        10,
        what="both instances probed",
    )
    assert all(
        fake.requests()[0].kv_transfer_params == {"rapidkv": {"discover": True}} for fake in a
    )
    resp = http.post(f"{router.url}/v1/completions", json=COMPLETION)
    assert resp.status_code == 200


def test_an_adaptive_router_probes_an_instance_again_when_it_comes_back(
    make_fake: MakeFake, make_router: MakeRouter, http: httpx.Client
) -> None:
    """An instance that went down and answers /health again may be a new
    engine: the adaptive router asks it again for its max_num_seqs (and block
    size) before placing anything on it, even with its control address given."""
    a, b = make_fake("A", "decode"), make_fake("B", "decode")
    for fake in (a, b):
        fake.control = "127.0.0.1:7300"
    listed = [Instance(fake.url, control=fake.control) for fake in (a, b)]
    router = make_router(
        [], [], instances=listed, placement="adaptive", discover=True, probe_interval_s=0.2
    )
    seqs = "rapidkv_router_instance_max_num_seqs"
    wait_until(lambda: metric(router, seqs, upstream=a.url) == 4, 10, what="A probed")
    port = urlsplit(a.url).port
    a.stop()

    def a_down() -> bool:  # a request placed on A (the first of equals) finds it gone
        http.post(f"{router.url}/v1/completions", json=COMPLETION)
        return metric(router, "rapidkv_router_instance_up", role="both", upstream=a.url) == 0

    wait_until(a_down, 10, what="A marked down")
    assert metric(router, "rapidkv_router_instance_up", role="both", upstream=a.url) == 0
    again = make_fake("A-again", "decode", port)
    again.control = "127.0.0.1:7301"
    again.max_num_seqs = 9
    wait_until(lambda: metric(router, seqs, upstream=a.url) == 9, 10, what="A probed again")
    assert metric(router, "rapidkv_router_instance_up", role="both", upstream=a.url) == 1


def test_fixed_placement_names_the_instances_in_the_header(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = make_router([p], [d], split_prefill=False)
    resp = http.post(f"{router.url}/v1/completions", json=COMPLETION)
    assert resp.headers["x-rapidkv-placement"] == "kind=pd;prefill=0;decode=1;reason=fixed"
    assert metric(router, "rapidkv_router_placements_total", kind="pd", reason="fixed") == 1


# ------------------------------------------------------------------ admin routes

TOKEN = "admin-token-0123456789"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def test_admin_routes_exist_only_with_a_token_and_require_it(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    without = make_router([p], [d])
    assert http.get(f"{without.url}/admin/requests", headers=AUTH).status_code == 404
    router = make_router([p], [d], admin_token=TOKEN)
    url = f"{router.url}/admin/requests"
    assert http.get(url).status_code == 401
    assert http.get(url, headers={"authorization": "Bearer wrong"}).status_code == 401
    drain = f"{router.url}/admin/drain"
    assert http.post(drain, json={"instance": d.url}).status_code == 401
    assert http.get(url, headers=AUTH).json() == {"requests": []}
    for bad, status in ((b"{", 400), (b'{"instance": 3}', 400), (b"x" * 5000, 413)):
        assert http.post(drain, content=bad, headers=AUTH).status_code == status
    missing = http.post(drain, json={"instance": "http://nowhere:1"}, headers=AUTH)
    assert missing.status_code == 404 and "nowhere" in missing.json()["error"]["message"]
    fleet = router.router.fleet
    assert not fleet.is_draining(fleet.pool("decode")[0])  # nothing changed


def test_admin_requests_lists_what_runs_where(
    pd: tuple[FakeVLLM, FakeVLLM], make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = pd
    router = make_router([p], [d], admin_token=TOKEN, split_prefill=False)
    body = dict(COMPLETION, stream=True, fake={"decode": "hang_stream"})
    with open_request(router.url, "/v1/completions", body):
        (seen,) = d.wait_seen(1)
        running = wait_until(
            lambda: http.get(f"{router.url}/admin/requests", headers=AUTH).json()["requests"],
            10,
            what="the request listed",
        )
        assert [(r["xfer_id"], r["prefill"], r["decode"]) for r in running] == [
            (seen.request_id, p.url, d.url)
        ]
        assert running[0]["placement"] == "kind=pd;prefill=0;decode=1;reason=fixed"
        d.release()
    wait_until(
        lambda: http.get(f"{router.url}/admin/requests", headers=AUTH).json()["requests"] == [],
        10,
        what="the request gone from the list",
    )


def decoder(resp: httpx.Response) -> int:
    """The decode instance's index an answer names in its placement header."""
    parts = dict(kv.split("=") for kv in resp.headers["x-rapidkv-placement"].split(";"))
    return int(parts["decode"])


def test_a_drained_instance_gets_no_new_request_until_undrained(
    make_fake: MakeFake, make_router: MakeRouter, http: httpx.Client
) -> None:
    p = make_fake("P0", "prefill")
    ds = [make_fake(f"D{i}", "decode") for i in range(2)]
    router = make_router([p], ds, admin_token=TOKEN, split_prefill=False)
    url = f"{router.url}/v1/completions"
    resp = http.post(f"{router.url}/admin/drain", json={"instance": ds[0].url + "/"}, headers=AUTH)
    # nothing ran there: nothing to move
    assert resp.json() == {
        "instance": ds[0].url,
        "draining": True,
        "migrated": [],
        "failed": {},
        "staying": {},
    }
    # with an admin token a non-streamed answer is assembled from a stream (it
    # may migrate): where it ran is in the placement header
    assert [decoder(http.post(url, json=COMPLETION)) for _ in range(3)] == [2] * 3  # D1
    health = http.get(f"{router.url}/health").json()
    assert [(c["draining"], c["dispatching"]) for c in health["decode"]] == [
        (True, False),
        (False, True),
    ]
    assert metric(router, "rapidkv_router_instance_draining", upstream=ds[0].url) == 1
    http.post(f"{router.url}/admin/drain", json={"instance": ds[1].url}, headers=AUTH)
    refused = http.post(url, json=COMPLETION)
    assert refused.status_code == 503 and "draining" in refused.json()["error"]["message"]
    assert len(p.requests()) == 3  # P was not asked for the refused one
    for d in ds:
        http.post(f"{router.url}/admin/undrain", json={"instance": d.url}, headers=AUTH)
    served = {decoder(http.post(url, json=COMPLETION)) for _ in range(2)}
    assert served == {1, 2}  # D0 and D1 (P0 is member 0)
    assert metric(router, "rapidkv_router_instance_draining", upstream=ds[0].url) == 0
