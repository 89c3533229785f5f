"""`rapidkv bench chaos`: the requests, and when the client gives up on some.

Every request has its own prompt (token ids, length uniform in [min_len,
max_len]), its own `max_tokens` (uniform in [min_tokens, max_tokens]), is
streamed or not (a coin of bias `stream_share`), and is aborted by the client
with probability `abort_share`, at one of the phases below, drawn evenly. All
of it is drawn from the seed; only the abort *delays* are worked out when the
request is sent, from how long requests take at that point of the run
(`Timing`: the run's own completed streams, so the phases stay where they are
meant to be under the run's load):

- `sent`: right after the request is sent (0-5 ms): before P starts on it;
- `prefill`: while P computes the prompt (5 ms to 0.8 x the expected TTFT);
- `transfer`: about when the prompt's KV crosses to D (0.8-1.3 x the TTFT);
- `decode`: while D decodes: a stream after k of its tokens (k in [1,
  max_tokens - 1]), a non-streamed request between 10 % and 90 % of its
  expected decode time.

The phases are what the client aims at: on a loaded pair, with injected send
delays, a given delay lands somewhat earlier or later. Each outcome records
what the client had seen when it gave up (`driver.Outcome.seen`).
"""

from __future__ import annotations

import random
import statistics
from collections import deque
from dataclasses import dataclass

PHASES = ("sent", "prefill", "transfer", "decode")


@dataclass(frozen=True)
class Plan:
    index: int
    prompt_len: int
    max_tokens: int
    stream: bool
    abort: str | None  # one of PHASES, or None: never aborted by the client
    u: float  # where in its phase's window the abort falls, 0..1


@dataclass(frozen=True)
class Abort:
    """When a request is given up on: `after_s` after it was sent, or (streams)
    once `after_tokens` tokens arrived; either may be None."""

    after_s: float | None = None
    after_tokens: int | None = None


def make_plans(
    n: int,
    *,
    seed: int,
    min_len: int,
    max_len: int,
    min_tokens: int,
    max_tokens: int,
    stream_share: float,
    abort_share: float,
) -> list[Plan]:
    rng = random.Random(seed)
    plans = []
    for i in range(n):
        aborted = rng.random() < abort_share
        plans.append(
            Plan(
                index=i,
                prompt_len=rng.randint(min_len, max_len),
                max_tokens=rng.randint(min_tokens, max_tokens),
                stream=rng.random() < stream_share,
                abort=rng.choice(PHASES) if aborted else None,
                u=rng.random(),
            )
        )
    return plans


class Timing:
    """What a request is expected to take, from the last `window` completed
    streams: TTFT as a + b x prompt length (least squares), the mean gap
    between tokens (median). Starts from a guess for the tiny model on 2 cores."""

    def __init__(self, window: int = 64) -> None:
        self._ttft: deque[tuple[int, float]] = deque(maxlen=window)
        self._tpot: deque[float] = deque(maxlen=window)

    def add(self, prompt_len: int, ttft_s: float, tpot_s: float | None) -> None:
        self._ttft.append((prompt_len, ttft_s))
        if tpot_s is not None:
            self._tpot.append(tpot_s)

    def ttft(self, prompt_len: int) -> float:
        if len(self._ttft) < 4:
            return 0.02 + 0.0002 * prompt_len
        xs = [float(x) for x, _ in self._ttft]
        ys = [y for _, y in self._ttft]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        var = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
        b = max(b, 0.0)
        return max(0.005, my + b * (prompt_len - mx))

    def tpot(self) -> float:
        return statistics.median(self._tpot) if self._tpot else 0.02

    def snapshot(self) -> dict[str, float]:
        return {
            "ttft_s_at_100": self.ttft(100),
            "ttft_s_at_900": self.ttft(900),
            "tpot_s": self.tpot(),
        }


def abort_point(plan: Plan, timing: Timing) -> Abort | None:
    """When to give up on `plan`'s request, sent now (None: never)."""
    if plan.abort is None:
        return None
    ttft = timing.ttft(plan.prompt_len)
    if plan.abort == "sent":
        return Abort(after_s=0.005 * plan.u)
    if plan.abort == "prefill":
        return Abort(after_s=0.005 + plan.u * max(0.0, 0.8 * ttft - 0.005))
    if plan.abort == "transfer":
        return Abort(after_s=(0.8 + 0.5 * plan.u) * ttft)
    if plan.stream:  # decode
        return Abort(after_tokens=1 + int(plan.u * (plan.max_tokens - 1)))
    decode = (plan.max_tokens - 1) * timing.tpot()
    return Abort(after_s=ttft + (0.1 + 0.8 * plan.u) * decode)
