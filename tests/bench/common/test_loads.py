"""`bench/common/loads.py`: load names, and loads run against a fake vLLM
(timeouts, usage events, the client's CPUs)."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from rapidkv.bench.common.loads import Load
from rapidkv.bench.serve.options import Options


@pytest.mark.unit
def test_load_names_parse_into_closed_and_open_loops() -> None:
    assert Load.parse("c4") == Load("c4", concurrency=4)
    assert Load.parse("poisson8") == Load("poisson8", rate=8.0)
    assert Load.parse("poisson2.5").rate == 2.5
    for bad in ("c0", "poisson0", "x3", "c", ""):
        with pytest.raises(ValueError):
            Load.parse(bad)


def _fake_vllm(stall_on: int, seen: list[dict] | None = None):
    """An ASGI app streaming two tokens per completion (then a usage event when
    asked for, as vLLM does); it never answers a prompt starting with
    `stall_on`; each request's body is appended to `seen`."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        if seen is not None:
            seen.append(body)

        async def events():
            if body["prompt"][0] == stall_on:
                await asyncio.sleep(30)
            for t in (7, 8):
                yield f"data: {json.dumps({'choices': [{'token_ids': [t]}]})}\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


@pytest.mark.unit
def test_a_load_stops_sending_after_a_request_times_out() -> None:
    from rapidkv.bench.common.loads import SKIPPED, TIMEOUT, run_load
    from rapidkv.router.server import ThreadedServer

    prompts = [[1], [2], [3], [4]]
    with ThreadedServer(_fake_vllm(stall_on=2)) as server:
        results, wall = run_load(server.url, prompts, 2, Load.parse("c1"), timeout_s=0.5)
    assert [r.token_ids for r in results[:1]] == [(7, 8)] and results[0].error is None
    assert results[1].error.startswith(TIMEOUT)
    assert all(r.error.startswith(SKIPPED) for r in results[2:])
    assert 0.5 <= wall < 5


@pytest.mark.unit
def test_a_load_asks_for_usage_unless_told_not_to() -> None:
    """Every streamed request carries `stream_options: {"include_usage": true}`
    by default (`--no-include-usage` turns it off); the usage event adds no token."""
    from rapidkv.bench.common.loads import run_load
    from rapidkv.bench.serve import register
    from rapidkv.router.server import ThreadedServer

    seen: list[dict] = []
    with ThreadedServer(_fake_vllm(stall_on=9, seen=seen)) as server:
        with_usage, _ = run_load(server.url, [[1], [2]], 2, Load.parse("c1"))
        without, _ = run_load(server.url, [[3]], 2, Load.parse("c1"), include_usage=False)
    assert [b.get("stream_options") for b in seen] == [{"include_usage": True}] * 2 + [None]
    assert [r.token_ids for r in with_usage + without] == [(7, 8)] * 3
    assert all(len(r.token_ms) == 2 and r.error is None for r in with_usage + without)

    parser = argparse.ArgumentParser()
    register(parser)
    assert Options.from_args(parser.parse_args([])).include_usage is True
    assert Options.from_args(parser.parse_args(["--no-include-usage"])).include_usage is False


def test_a_load_runs_its_client_on_the_cpus_given_and_gives_them_back() -> None:
    import os

    from rapidkv.bench.common.loads import run_load
    from rapidkv.router.server import ThreadedServer

    before = os.sched_getaffinity(0)
    seen: list[set[int]] = []
    with ThreadedServer(_fake_vllm(stall_on=9)) as server:
        results, _ = run_load(
            server.url,
            [[1], [2]],
            2,
            Load.parse("c1"),
            on_done=lambda: seen.append(os.sched_getaffinity(0)),
            cpus={0},
        )
    assert [r.error for r in results] == [None, None]
    assert seen == [{0}, {0}]  # on_done runs in the client's event loop
    assert os.sched_getaffinity(0) == before
