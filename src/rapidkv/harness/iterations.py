"""Engine steps as vLLM logs them with `--enable-logging-iteration-details`.

vLLM's `iteration_tokens_total` histogram is not per engine step (a request's
prompt is counted once, at the step that finishes its prefill), so the only
outside view of how a step was composed is this log line, one per step:

    Iteration(12): 1 context requests, 256 context tokens, 3 generation requests,
    3 generation tokens, iteration elapsed time: 4.21 ms, ...

"Context" tokens are prompt tokens being prefilled (a chunk of a chunked
prefill counts as context). Lines are written by the API server process after the
step's outputs are processed, so they can trail the HTTP response: wait for the
condition you need rather than reading once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

FLAG = "--enable-logging-iteration-details"

_LINE = re.compile(
    r"Iteration\((?P<index>\d+)\): (?P<ctx_reqs>\d+) context requests, "
    r"(?P<ctx_tokens>\d+) context tokens, (?P<gen_reqs>\d+) generation requests, "
    r"(?P<gen_tokens>\d+) generation tokens, iteration elapsed time: (?P<ms>[\d.]+) ms"
)


@dataclass(frozen=True)
class Iteration:
    """One engine step."""

    index: int
    context_requests: int
    context_tokens: int
    generation_requests: int
    generation_tokens: int
    elapsed_ms: float


def parse_iterations(text: str) -> list[Iteration]:
    """Every iteration line in `text`, in order (dummy steps included)."""
    return [
        Iteration(
            index=int(m["index"]),
            context_requests=int(m["ctx_reqs"]),
            context_tokens=int(m["ctx_tokens"]),
            generation_requests=int(m["gen_reqs"]),
            generation_tokens=int(m["gen_tokens"]),
            elapsed_ms=float(m["ms"]),
        )
        for m in _LINE.finditer(text)
    ]


def read_iterations(log_path: Path) -> list[Iteration]:
    """Every iteration logged so far in a server log (all launches appended to it)."""
    try:
        return parse_iterations(Path(log_path).read_text(errors="replace"))
    except FileNotFoundError:
        return []
