"""The demo's requests, served on each side in turn (`served_in_blocks`)."""

from __future__ import annotations

import asyncio
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rapidkv.demo.workload import Turn


@dataclass
class Side:
    """One way of serving (through P + D, or one instance): what it answered."""

    label: str
    url: str
    answers: list[list[int]] = field(default_factory=list)
    questions: list[str | None] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    warmups: int = 0

    def p50(self, what: str) -> float:
        values = [v for v in getattr(self, what) if not math.isnan(v)]
        return statistics.median(values) if values else math.nan


def served_in_blocks(
    turns: Sequence[Turn],
    sides: Sequence[Side],
    max_tokens: int,
    concurrency: int,
    ignore_eos: bool,
) -> None:
    """Each side warmed up once (its first call), then `turns` in blocks of
    `concurrency`, every block on each side, which side goes first alternating."""
    for side in sides:
        if side.warmups == 0:
            _stream(side.url, [turns[0]], max_tokens, 1, ignore_eos, "warm-up " + side.label)
            side.warmups = 1
    for b, lo in enumerate(range(0, len(turns), concurrency)):
        block = turns[lo : lo + concurrency]
        for side in sides if b % 2 == 0 else list(sides)[::-1]:
            for turn, r in zip(
                block, _stream(side.url, block, max_tokens, concurrency, ignore_eos, side.label),
                strict=True,
            ):  # fmt: skip
                side.answers.append(list(r.token_ids))
                side.questions.append(turn.question)
                side.ttft_ms.append(r.ttft_ms)
                side.tpot_ms.append(r.tpot_ms)


def _stream(
    url: str,
    turns: Sequence[Turn],
    max_tokens: int,
    concurrency: int,
    ignore_eos: bool,
    label: str,
) -> list[Any]:
    import httpx

    from rapidkv.harness.client import acomplete_stream

    async def main() -> list[Any]:
        sem = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient() as client:

            async def one(turn: Turn) -> Any:
                async with sem:
                    return await acomplete_stream(
                        client, url, turn.prompt_ids, max_tokens, ignore_eos=ignore_eos
                    )

            return list(await asyncio.gather(*(one(t) for t in turns)))

    print(f"  {label}: {len(turns)} request(s)", file=sys.stderr)
    return asyncio.run(main())
