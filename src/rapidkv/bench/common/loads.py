"""The loads every served benchmark sends, and the client that sends them.

A load sends every prompt of the set once, as a streaming completion (greedy,
`ignore_eos`, so each request yields exactly `max_tokens` tokens) that asks for
`stream_options: {"include_usage": true}`, as vLLM's benchmark client and the
OpenAI SDK do (`include_usage=False`: without `stream_options`):

- `cN`: closed loop, at most N requests in flight (`c1`: one after another);
- `poissonR`: open loop, requests sent at Poisson arrival times of R per second
  (`arrivals.poisson_arrivals`, seeded), whatever is still in flight.

`run_load` also takes one `max_tokens` per prompt, an open loop's arrival
times given outright (`bench goodput`: its own seeded arrivals, the same
pattern at every rate), and conversations: a prompt that `follows` is sent
only once the request before it has its whole answer, and a think time after
it (`think_s`; in an open loop only the others arrive at their times).

Each request records when each token arrived (client side), the response's
rapidkv `xfer_id` header when a rapidkv router served it (and its
`x-rapidkv-placement` header where it placed it), and any error
(counted, never retried). A request that has no complete answer within
`timeout_s` fails, and the requests of its load not yet sent are not sent (each
recorded as an error): a wedged server costs one timeout, not one per prompt.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rapidkv.bench.common.arrivals import poisson_arrivals
from rapidkv.bench.common.stats import RequestResult

XFER_HEADER = "x-rapidkv-xfer-id"
PLACEMENT_HEADER = "x-rapidkv-placement"
TIMEOUT = "timeout: no complete answer within the request timeout"
SKIPPED = "not sent: this load stopped after a timeout of the request for prompt"


@dataclass(frozen=True)
class Load:
    name: str
    concurrency: int | None = None  # closed loop
    rate: float | None = None  # open loop, requests per second

    @classmethod
    def parse(cls, text: str) -> Load:
        """`c4` (concurrency 4) or `poisson8` / `poisson2.5` (rate, req/s)."""
        text = text.strip()
        if m := re.fullmatch(r"c(\d+)", text):
            if int(m[1]) < 1:
                raise ValueError(f"load {text!r}: concurrency must be >= 1")
            return cls(text, concurrency=int(m[1]))
        if m := re.fullmatch(r"poisson(\d+(?:\.\d+)?)", text):
            if float(m[1]) <= 0:
                raise ValueError(f"load {text!r}: rate must be > 0")
            return cls(text, rate=float(m[1]))
        raise ValueError(f"load {text!r}: expected cN (concurrency) or poissonR (req/s)")


def run_load(
    url: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int | Sequence[int],
    load: Load,
    *,
    params: dict[str, Any] | None = None,
    seed: int = 0,
    timeout_s: float = 120.0,
    on_done: Callable[[], None] = lambda: None,
    cpus: set[int] | None = None,
    arrivals: Sequence[float] | None = None,
    include_usage: bool = True,
    follows: Sequence[bool] | None = None,
    think_s: float | Sequence[float] = 0.0,
) -> tuple[list[RequestResult], float]:
    """Send every prompt under `load`; results in prompt order and the wall time
    from the first request sent to the last response complete. With `cpus`, the
    calling thread (the client's event loop) runs only there meanwhile.

    `max_tokens` is one for all prompts or one per prompt; `arrivals` (an open
    loop only: seconds after the start, one per prompt) replaces the arrival
    times drawn from `load.rate` and `seed`. `include_usage`: each request asks
    for `stream_options: {"include_usage": true}`.

    `follows` (one per prompt; a conversation's later turns): a prompt that
    follows is sent once the request before it has its whole answer (failed
    or not) and `think_s` more seconds (one for all, or one per prompt: a
    following prompt's), and only then waits for a place in a closed loop; in
    an open loop only the others arrive at their times (the given `arrivals`
    of following prompts are not read: `arrivals.session_arrivals` makes them
    nan)."""
    n = len(prompts)
    if not isinstance(max_tokens, int) and len(max_tokens) != n:
        raise ValueError("give one max_tokens per prompt")
    if arrivals is not None and (load.concurrency is not None or len(arrivals) != n):
        raise ValueError("arrivals: an open loop's, one per prompt")
    if follows is not None and (len(follows) != n or (follows and follows[0])):
        raise ValueError("follows: one per prompt, the first following none")
    thinks = [float(think_s)] * n if isinstance(think_s, int | float) else list(think_s)
    if len(thinks) != n or not all(t >= 0 for t in thinks):
        raise ValueError("think_s: >= 0 s, one for all prompts or one per prompt")
    run = _run(
        url, prompts, max_tokens, load, params, seed, timeout_s, on_done, arrivals, include_usage,
        follows, thinks,
    )  # fmt: skip
    if cpus is None:
        return asyncio.run(run)
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)  # pid 0: this thread only
    try:
        return asyncio.run(run)
    finally:
        os.sched_setaffinity(0, previous)


async def _run(
    url: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int | Sequence[int],
    load: Load,
    params: dict[str, Any] | None,
    seed: int,
    timeout_s: float,
    on_done: Callable[[], None],
    given_arrivals: Sequence[float] | None = None,
    include_usage: bool = True,
    follows: Sequence[bool] | None = None,
    thinks: Sequence[float] = (),
) -> tuple[list[RequestResult], float]:
    import httpx

    from rapidkv.harness.client import acomplete_stream, pool_limits

    limits = pool_limits(load.concurrency or len(prompts) or 1)
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s, trust_env=False) as client:
        timed_out: list[int] = []  # prompts whose request ran past timeout_s

        async def one(i: int) -> RequestResult:
            sent = time.time()
            if timed_out:
                on_done()
                return RequestResult(i, (), (), math.nan, sent, error=f"{SKIPPED} {timed_out[0]}")
            t0 = time.monotonic()
            try:
                s = await asyncio.wait_for(
                    acomplete_stream(
                        client,
                        url,
                        prompts[i],
                        max_tokens if isinstance(max_tokens, int) else max_tokens[i],
                        timeout=timeout_s,
                        kv_transfer_params=params,
                        include_usage=include_usage,
                    ),
                    timeout_s,
                )
            except TimeoutError:
                timed_out.append(i)
                error = f"{TIMEOUT} ({timeout_s:.0f}s)"
                return RequestResult(i, (), (), math.nan, sent, error=error)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"[:300]
                return RequestResult(i, (), (), math.nan, sent, error=error)
            finally:
                on_done()
            e2e = (time.monotonic() - t0) * 1000
            return RequestResult(
                i,
                tuple(s.token_ids),
                s.token_ms,
                e2e,
                sent,
                s.headers.get(XFER_HEADER),
                sent_mono=t0,
                placement=s.headers.get(PLACEMENT_HEADER),
            )

        answered = [asyncio.Event() for _ in prompts]
        chained = follows or [False] * len(prompts)

        async def after_previous(i: int) -> None:
            if chained[i]:
                await answered[i - 1].wait()
                if thinks and thinks[i] > 0:
                    await asyncio.sleep(thinks[i])

        async def sent(i: int) -> RequestResult:
            try:
                return await one(i)
            finally:
                answered[i].set()

        t_start = time.monotonic()
        if load.concurrency is not None:
            sem = asyncio.Semaphore(load.concurrency)

            async def gated(i: int) -> RequestResult:
                await after_previous(i)
                async with sem:
                    return await sent(i)

            results = await asyncio.gather(*(gated(i) for i in range(len(prompts))))
        else:
            if given_arrivals is not None:
                arrivals = list(given_arrivals)
            else:
                assert load.rate is not None
                starts = iter(poisson_arrivals(chained.count(False), load.rate, seed))
                arrivals = [math.nan if c else next(starts) for c in chained]

            async def timed(i: int) -> RequestResult:
                if chained[i]:
                    await after_previous(i)
                else:
                    await asyncio.sleep(max(0.0, t_start + arrivals[i] - time.monotonic()))
                return await sent(i)

            results = await asyncio.gather(*(timed(i) for i in range(len(prompts))))
        return list(results), time.monotonic() - t_start


def warm_up(
    url: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    config: Any,  # groups.Config
    timeout_s: float,
    on_done: Callable[[], None] = lambda: None,
    include_usage: bool = True,
    follows: Sequence[bool] | None = None,
) -> list[RequestResult]:
    """`prompts` once each on `config`'s front at `url`, one at a time, unmeasured."""
    from rapidkv.bench.common.groups import helper_cpus

    results, _ = run_load(
        url,
        prompts,
        max_tokens,
        Load("warmup", concurrency=1),
        params=config.params,
        timeout_s=timeout_s,
        on_done=on_done,
        cpus=helper_cpus(config.group),
        include_usage=include_usage,
        follows=follows,
    )
    return results
