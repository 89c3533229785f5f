"""`rapidkv bench chaos`: its pure parts (plans, abort points, how an answer is
classified, error normalization, the verdict), and a short run of the command
itself (P and D each killed and restarted, injected transfer failures)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from bench_cli import run_bench

from rapidkv.bench.chaos.driver import run_one
from rapidkv.bench.chaos.report import build_report, normalize
from rapidkv.bench.chaos.workload import PHASES, Plan, Timing, abort_point, make_plans

# ---------------------------------------------------------------- plans


@pytest.mark.unit
def test_plans_are_seeded_and_mix_lengths_streams_and_every_abort_phase() -> None:
    kw = dict(
        seed=3,
        min_len=5,
        max_len=900,
        min_tokens=4,
        max_tokens=48,
        stream_share=0.5,
        abort_share=0.2,
    )
    plans = make_plans(500, **kw)
    assert plans == make_plans(500, **kw)
    assert all(5 <= p.prompt_len <= 900 and 4 <= p.max_tokens <= 48 for p in plans)
    assert 200 < sum(p.stream for p in plans) < 300
    aborted = [p for p in plans if p.abort]
    assert 70 < len(aborted) < 130
    assert {p.abort for p in aborted} == set(PHASES)
    assert {(p.abort, p.stream) for p in aborted} == {(a, s) for a in PHASES for s in (0, 1)}


@pytest.mark.unit
def test_abort_points_fall_in_their_phase_of_the_expected_timing() -> None:
    timing = Timing()
    for n in range(10):  # TTFT 50 ms + 0.1 ms per prompt token; 10 ms between tokens
        timing.add(100 * n + 10, 0.05 + 0.0001 * (100 * n + 10), 0.01)
    assert timing.ttft(500) == pytest.approx(0.1)
    assert timing.tpot() == pytest.approx(0.01)

    def point(phase: str, stream: bool, u: float) -> object:
        return abort_point(Plan(0, 500, 21, stream, phase, u), timing)

    assert point("sent", False, 0.99).after_s <= 0.005
    assert 0.005 <= point("prefill", True, 0.0).after_s < point("prefill", True, 0.99).after_s
    assert point("prefill", True, 0.99).after_s <= 0.08
    assert 0.08 <= point("transfer", False, 0.0).after_s < point("transfer", False, 0.99).after_s
    assert point("transfer", False, 0.99).after_s <= 0.13
    assert point("decode", True, 0.0).after_tokens == 1
    assert point("decode", True, 0.999).after_tokens == 20  # never the whole answer
    assert point("decode", False, 0.0).after_s == pytest.approx(0.1 + 0.1 * 0.2)
    assert abort_point(Plan(0, 500, 21, True, None, 0.5), timing) is None


# ---------------------------------------------------------------- classification


def _fake_router(seen: list[dict] | None = None):
    """An ASGI app answering each prompt's first token with a canned behaviour;
    each request's body is appended to `seen`. A stream that asks for
    `stream_options.include_usage` ends with a usage event, as vLLM's does."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    def event(payload: object) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    async def completions(request: Request) -> Response:
        body = await request.json()
        if seen is not None:
            seen.append(body)
        how = body["prompt"][0]
        usage = (body.get("stream_options") or {}).get("include_usage")
        if how == 1:  # fine, streamed or not
            if not body["stream"]:
                return JSONResponse({"choices": [{"token_ids": [7, 8, 9]}]})

            async def ok():
                for t in (7, 8, 9):
                    yield event({"choices": [{"token_ids": [t]}]})
                    await asyncio.sleep(0.01)
                if usage:
                    numbers = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
                    yield event({"choices": [], "usage": numbers})
                yield "data: [DONE]\n\n"

            return StreamingResponse(ok(), media_type="text/event-stream")
        if how == 2:  # a stream whose decode died: an error event

            async def broken():
                yield event({"choices": [{"token_ids": [7]}]})
                yield event({"error": {"message": "decode instance broke off", "code": 502}})
                yield "data: [DONE]\n\n"

            return StreamingResponse(broken(), media_type="text/event-stream")
        if how == 3:  # a stream cut with no word

            async def cut():
                yield event({"choices": [{"token_ids": [7]}]})

            return StreamingResponse(cut(), media_type="text/event-stream")
        if how == 4:
            return JSONResponse({"error": {"message": "no decode instance is up"}}, 503)
        if how == 5:
            return Response("Internal Server Error", 500)
        await asyncio.sleep(30)  # how == 6: never answers
        return Response("late")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


@pytest.mark.unit
def test_every_answer_is_classified_as_the_bench_documents() -> None:
    import aiohttp

    from rapidkv.bench.chaos.workload import Abort
    from rapidkv.router.server import ThreadedServer

    cases = [  # (first prompt id, stream, expected tokens, abort, kind)
        (1, True, [7, 8, 9], None, "completed"),
        (1, False, [7, 8, 9], None, "completed"),
        (1, True, [7, 8, 0], None, "mismatch"),
        (1, False, [7, 8], None, "mismatch"),
        (1, True, [7, 8, 9], Abort(after_tokens=2), "aborted"),
        (6, False, [7], Abort(after_s=0.2), "aborted"),
        (2, True, [7, 8], None, "failed_clear"),
        (4, False, [7], None, "failed_clear"),
        (3, True, [7], None, "failed_unclear"),
        (5, False, [7], None, "failed_unclear"),
        (6, True, [7], None, "hung"),
    ]

    async def main(url: str) -> list:
        async with aiohttp.ClientSession() as session:
            return [
                await run_one(
                    session,
                    url,
                    [how, 100],
                    Plan(i, 2, 3, stream, "decode" if abort else None, 0.5),
                    expected,
                    abort,
                    1.0,
                    time.monotonic(),
                )
                for i, (how, stream, expected, abort, _) in enumerate(cases)
            ]

    with ThreadedServer(_fake_router()) as server:
        outcomes = asyncio.run(main(server.url))
    assert [o.kind for o in outcomes] == [c[-1] for c in cases]
    assert outcomes[2].first_diff == 2 and outcomes[3].first_diff == 2
    assert outcomes[4].tokens == 2 and outcomes[4].seen == "tokens"
    assert outcomes[5].seen == "nothing"
    assert "decode instance broke off" in outcomes[6].error
    assert outcomes[7].error == "HTTP 503: no decode instance is up"
    assert "without [DONE]" in outcomes[8].error
    assert outcomes[10].e2e_s == pytest.approx(1.0, abs=0.5)


@pytest.mark.unit
def test_streams_ask_for_usage_whose_event_is_neither_a_token_nor_an_error() -> None:
    """A streamed request carries `stream_options: {"include_usage": true}`
    unless told not to, a non-streamed one never; the usage event at the end
    (no choices) is kept, the answer is complete and counted right."""
    import aiohttp

    from rapidkv.router.server import ThreadedServer

    cases = [(True, True), (True, False), (False, True)]  # (stream, include_usage)

    async def main(url: str) -> list:
        async with aiohttp.ClientSession() as session:
            return [
                await run_one(
                    session,
                    url,
                    [1, 100],
                    Plan(i, 2, 3, stream, None, 0.0),
                    [7, 8, 9],
                    None,
                    5.0,
                    time.monotonic(),
                    include_usage=usage,
                )
                for i, (stream, usage) in enumerate(cases)
            ]

    seen: list[dict] = []
    with ThreadedServer(_fake_router(seen)) as server:
        outcomes = asyncio.run(main(server.url))
    assert seen[0]["stream_options"] == {"include_usage": True}
    assert "stream_options" not in seen[1] and "stream_options" not in seen[2]
    assert [o.kind for o in outcomes] == ["completed"] * 3
    assert [o.tokens for o in outcomes] == [3, 3, 3] and outcomes[0].error is None
    assert outcomes[0].usage == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert outcomes[1].usage is None and outcomes[2].usage is None

    import argparse

    from rapidkv.bench.chaos import register
    from rapidkv.bench.chaos.run import Options

    parser = argparse.ArgumentParser()
    register(parser)
    assert Options.from_args(parser.parse_args([])).include_usage is True
    assert Options.from_args(parser.parse_args(["--no-include-usage"])).include_usage is False


@pytest.mark.unit
def test_after_a_503_the_client_sends_one_request_per_backoff_until_it_is_answered() -> None:
    from rapidkv.bench.chaos.driver import drive
    from rapidkv.router.server import ThreadedServer

    hows = [4] * 7 + [1] * 4  # 503 until D is "up" again
    plans = [Plan(i, 2, 3, False, None, 0.0) for i in range(len(hows))]
    with ThreadedServer(_fake_router()) as server:
        outcomes, _ = asyncio.run(
            drive(
                server.url,
                plans,
                [[h, 100] for h in hows],
                [[7, 8, 9]] * len(hows),
                concurrency=4,
                timeout_s=5.0,
                backoff_s=0.2,
            )
        )
    assert [o.kind for o in outcomes] == ["failed_clear"] * 7 + ["completed"] * 4
    sent = [o.sent_s for o in outcomes]
    assert max(sent[:4]) - min(sent[:4]) < 0.1  # not degraded yet: all at once
    gaps = [b - a for a, b in itertools.pairwise(sent[3:8])]
    assert all(g >= 0.19 for g in gaps), gaps  # then one at a time, a backoff apart
    assert max(sent[8:]) - sent[7] < 0.15  # answered: at full concurrency again


@pytest.mark.unit
def test_errors_that_differ_only_by_address_id_or_number_count_together() -> None:
    a = "decode instance http://127.0.0.1:41235 did not answer: refused (xfer 0123456789abcdef01)"
    b = "decode instance http://127.0.0.1:5001 did not answer: refused (xfer fedcba9876543210aa)"
    assert normalize(a) == normalize(b) == "decode instance URL did not answer: refused (xfer ID)"
    assert normalize("HTTP 503: 2 down, 1.5s") == "HTTP 503: N down, Ns"


def _outcome(kind: str, error: str | None = None):
    from rapidkv.bench.chaos.driver import Outcome

    return Outcome(0, kind, False, None, error=error)


def _report(outcomes, free=(100.0, 100.0), recovery=(1.0, 2.0), idle=True):
    inc = SimpleNamespace(baseline_free_blocks=100.0, final={"transfers_ok": 5.0})
    quiesce = {
        "idle": idle,
        "timeout_s": 90.0,
        "took_s": 0.1,
        "instances": {
            role: {"free_blocks": f, "running": 0.0, "stats": {"transfers_ok": 1.0}}
            for role, f in zip(("prefill", "decode"), free, strict=True)
        },
    }
    restarts = [
        SimpleNamespace(role=role, recovery_s=s, error=None, row=dict)
        for role, s in zip(("prefill", "decode"), recovery, strict=True)
    ]
    return build_report(
        outcomes,
        options={},
        restarts=restarts,
        incarnations={"prefill": [inc, inc], "decode": [inc]},
        quiesce=quiesce,
        warmup=[],
        timing={},
        extra={},
    )


@pytest.mark.unit
def test_the_verdict_fails_on_hung_leak_mismatch_or_unclear_failure_only() -> None:
    fine = [_outcome("completed"), _outcome("aborted"), _outcome("failed_clear", "HTTP 503: x")]
    r = _report(fine)
    assert r["ok"] and r["acceptance"]["met"] and r["failed_clear"] == 1
    assert r["leaked_blocks"] == {"prefill": 0.0, "decode": 0.0}
    assert r["counters"]["prefill"]["transfers_ok"] == 6.0  # the killed process's, then the last
    assert r["counters"]["decode"]["transfers_ok"] == 1.0
    for bad in ("hung", "mismatch", "failed_unclear"):
        assert not _report([*fine, _outcome(bad, "x")])["ok"], bad
    assert not _report(fine, free=(100.0, 99.0))["ok"]
    assert not _report(fine, idle=False)["ok"]  # the quiesce timed out
    slow = _report(fine, recovery=(1.0, 6.0))
    assert slow["ok"] and not slow["acceptance"]["met"]
    assert not _report(fine, recovery=(1.0, None))["ok"]


# ---------------------------------------------------------------- smoke


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_bench_chaos_survives_restarts_aborts_and_injected_failures(tmp_path: Path) -> None:
    """40 requests at concurrency 4 with client aborts, 30 % of the transfers
    failed on purpose, P and then D killed and restarted: nothing hangs, leaks,
    mismatches or fails unclearly, both recoveries are measured, and the
    injected failures were recomputed by D. (Which transfers fail is a hash of
    their random ids: of the ~28 a run settles on P, none failing has a chance
    of 0.7^28, 5e-5; at a fifth it would be 0.8^28, 0.2 %.)"""
    out = tmp_path / "chaos.json"
    proc, elapsed = run_bench(
        "chaos",
        "--requests",
        "40",
        "--concurrency",
        "4",
        "--fail-rate",
        "0.3",
        "--json",
        str(out),
        "--log-dir",
        str(tmp_path / "logs"),
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["ok"] is True and r["problems"] == []
    assert (r["hung"], r["mismatches"], r["failed_unclear"]) == (0, 0, 0)
    assert r["leaked_blocks"] == {"prefill": 0, "decode": 0}
    assert r["requests"] == 40 and r["completed"] > 0
    assert r["completed"] + r["aborted"] + r["failed_clear"] == 40
    assert set(r["recovery_s"]) == {"prefill", "decode"}
    assert all(s is not None and s > 0 for s in r["recovery_s"].values())
    p, d = r["counters"]["prefill"], r["counters"]["decode"]
    assert p["processes"] == d["processes"] == 2
    injected = p.get("debug_injected_failures", 0)  # a counter appears once incremented
    assert injected > 0 and p["transfers_failed"] >= injected, (p, proc.stdout[-3000:])
    assert r["recompute_fallbacks"] > 0
    assert r["cpu"] and "result: OK" in proc.stdout
    print(f"bench chaos smoke: {elapsed:.0f}s")
