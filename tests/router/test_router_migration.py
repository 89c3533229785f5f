"""Live migration's failure paths through the router, against fake vLLM
upstreams (`fake_vllm`): what the client and the admin caller get when the
source dies mid-migration, and that nothing is left open on either instance.
(The paths that need a model, a connector and the KV are in
tests/e2e/test_migration.py.)"""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest
from fake_vllm import FakeVLLM, MakeFake, MakeRouter

from rapidkv.harness import wait_until
from rapidkv.router import Instance, RunningRouter

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

TOKEN = "admin-token-0123456789"
AUTH = {"authorization": f"Bearer {TOKEN}"}
CONTROL = "127.0.0.1:9"  # a control address for the fakes (nothing asks it: no connector)
BODY = {"model": "m", "prompt": [11, 12, 13, 14], "max_tokens": 20, "stream": True}


def _two_instances(
    make_fake: MakeFake, make_router: MakeRouter, http: httpx.Client, dest_role: str
) -> tuple[FakeVLLM, FakeVLLM, RunningRouter]:
    """Fakes A (the source: requests go there, B drained meanwhile) and B
    (`dest_role`: the `fake` behaviour it takes from a body) under a router
    in local dispatch with admin routes."""
    source, dest = make_fake("A", "decode"), make_fake("B", dest_role)
    router = make_router(
        [],
        [],
        instances=[Instance(source.url, CONTROL), Instance(dest.url, CONTROL)],
        dispatch="local",
        admin_token=TOKEN,
    )
    drain = {"instance": dest.url, "migrate": False}
    assert http.post(f"{router.url}/admin/drain", json=drain, headers=AUTH).status_code == 200
    return source, dest, router


def _order_migration(
    pool: concurrent.futures.Executor,
    http: httpx.Client,
    router: RunningRouter,
    source: FakeVLLM,
    dest: FakeVLLM,
    **order: object,
) -> concurrent.futures.Future[httpx.Response]:
    """The one request running (on `source`, migratable) ordered to move to
    `dest`, undrained first; the order's answer, to come from `pool` once the
    migration is over (`order`: more of its fields)."""
    admin = f"{router.url}/admin"
    (listed,) = http.get(f"{admin}/requests", headers=AUTH).json()["requests"]
    assert listed["decode"] == source.url and listed["migratable"] is True
    http.post(f"{admin}/undrain", json={"instance": dest.url}, headers=AUTH)
    migrate = {"xfer_id": listed["xfer_id"], "to": dest.url, **order}
    return pool.submit(http.post, f"{admin}/migrate", json=migrate, headers=AUTH)


def test_a_source_dying_during_the_precopy_ends_the_stream_with_an_error_and_frees_the_dest(
    make_fake: MakeFake, make_router: MakeRouter, http: httpx.Client
) -> None:
    """The source streams its first token and holds; a migration to B is
    ordered and B's pre-copy hangs; the source dies. The client's stream ends
    at once with an error event (no hang), the migration is answered 409, B's pre-copy is
    closed, and the router lists nothing running."""
    source, dest, router = _two_instances(make_fake, make_router, http, "decode")
    admin = f"{router.url}/admin"
    # the source holds after its first token, B's pre-copy (not streamed) hangs
    body = dict(BODY, fake={"decode": "hang_stream"})
    events: list[dict] = []
    with (
        concurrent.futures.ThreadPoolExecutor(1) as pool,
        http.stream("POST", f"{router.url}/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                break  # the source's first token: it holds now
        moved = _order_migration(pool, http, router, source, dest)
        (precopy,) = dest.wait_seen(1)
        assert precopy.body["max_tokens"] == 1 and precopy.body["stream"] is False
        source.die()
        rest = [line for line in lines if line.startswith("data: ")]
        answer = moved.result(30)
    # the router's end of a broken stream: one error event, then [DONE]
    assert rest[-1] == "data: [DONE]", rest
    errors = [json.loads(line[6:]) for line in rest[:-1]]
    assert len(errors) == 1 and "error" in errors[0], rest
    error = errors[0]["error"]
    assert error["code"] == 502 and f"{source.url} broke off" in error["message"], error
    assert answer.status_code == 409, answer.text
    assert "ended first" in answer.json()["error"]["message"]
    dest.wait_disconnected(precopy.request_id)
    wait_until(
        lambda: http.get(f"{admin}/requests", headers=AUTH).json()["requests"] == [],
        10,
        what="the request gone from the router's list",
    )


def test_a_source_dying_during_the_cutover_leaves_the_stream_to_the_destination(
    make_fake: MakeFake, make_router: MakeRouter, http: httpx.Client
) -> None:
    """A stop-and-copy migration: the source holds after its first token, B
    has answered the cut-over's headers but not its first token when the
    source dies. The source's break waits in its queue; B's first token
    completes the cut-over and the client gets B's tokens to the end, then
    [DONE], no error; the migration is answered 200."""
    source, dest, router = _two_instances(make_fake, make_router, http, "prefill")
    # the source holds after its first token; B's cut-over waits for release()
    body = dict(BODY, fake={"decode": "hang_stream", "prefill": "late"})
    with (
        concurrent.futures.ThreadPoolExecutor(1) as pool,
        http.stream("POST", f"{router.url}/v1/completions", json=body) as resp,
    ):
        lines = resp.iter_lines()
        first = next(json.loads(x[6:]) for x in lines if x.startswith("data: "))
        moved = _order_migration(pool, http, router, source, dest, precopy=False)
        (cutover,) = dest.wait_seen(1)
        assert cutover.body["stream"] is True and cutover.body["max_tokens"] == 19
        source.die()
        dest.release()  # B's first token (and the rest) after the source's death
        rest = [x for x in lines if x.startswith("data: ")]
        answer = moved.result(30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["from"] == source.url and answer.json()["to"] == dest.url
    assert rest[-1] == "data: [DONE]"
    events = [json.loads(x[6:]) for x in rest[:-1]]
    assert not [e for e in events if "error" in e], events
    texts = [c["text"] for e in [first, *events] for c in e["choices"]]
    assert len(texts) == 1 + 19  # the source's token, then B's: what was left of the budget


def test_a_precopy_done_after_the_stream_finished_is_refused_and_counts_stay_right(
    make_fake: MakeFake, make_router: MakeRouter, http: httpx.Client
) -> None:
    """A migration is ordered while the source holds after its first token;
    B's pre-copy hangs; the source then sends the rest of its answer and
    ``data: [DONE]``, its HTTP end lingering; then B's pre-copy completes. The
    request has finished: the order is refused (409), nothing is cut over,
    the client's stream ends after its [DONE] with nothing more, and no
    instance keeps a request counted outstanding."""
    source, dest, router = _two_instances(make_fake, make_router, http, "decode")
    admin = f"{router.url}/admin"
    body = dict(BODY, fake={"decode": "hang_stream_linger"})
    with (
        concurrent.futures.ThreadPoolExecutor(1) as pool,
        http.stream("POST", f"{router.url}/v1/completions", json=body) as resp,
    ):
        lines = resp.iter_lines()
        assert next(x for x in lines if x.startswith("data: "))  # the source holds
        moved = _order_migration(pool, http, router, source, dest)
        (precopy,) = dest.wait_seen(1)
        assert precopy.body["stream"] is False
        source.release()  # the rest and [DONE]; the end lingers
        rest = []
        for line in lines:
            if line.startswith("data: "):
                rest.append(line)
            if line == "data: [DONE]":
                break
        assert router.router.fleet.outstanding("decode") == [0, 0]
        dest.release()  # the pre-copy completes after the request finished
        answer = moved.result(30)
        assert answer.status_code == 409, answer.text
        assert "finished" in answer.json()["error"]["message"]
        source.release_end()
        assert not [x for x in lines if x.startswith("data: ")]
    assert not [e for e in rest[:-1] if "error" in json.loads(e[6:])], rest
    assert len(dest.requests()) == 1  # the pre-copy alone: no cut-over
    assert router.router.fleet.outstanding("decode") == [0, 0]
    wait_until(
        lambda: http.get(f"{admin}/requests", headers=AUTH).json()["requests"] == [],
        10,
        what="the request gone from the router's list",
    )
