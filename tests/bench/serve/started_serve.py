"""The one `rapidkv bench serve` run that starts its own servers, shared by
the smoke (test_serve_smoke) and the endpoint test (test_serve_endpoint)
through the session fixture `started_run` (conftest.py): run once, by
whichever of them comes first, so that the suite starts `single` (and the
rapidkv pair) once for both."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from bench_cli import run_bench

SERVED = ("--models", "tiny", "--requests", "4", "--loads", "c1,c4", "--warmup", "1")
"""What the started run serves and how: the endpoint test measures its
endpoints with the same options, for the same table."""


@dataclass(frozen=True)
class StartedRun:
    """`rapidkv bench serve --configs single,rapidkv` with `SERVED` (and the
    default `--pair-block`, 8: rapidkv's c1 is one block paired with
    `single`): the finished process, its wall time in seconds, and its
    outputs (`--json`, `--plot`, `--log-dir`, `--trace`)."""

    proc: subprocess.CompletedProcess[str]
    elapsed: float
    json: Path
    plot: Path
    logs: Path
    trace: Path


def start_run(out: Path) -> StartedRun:
    """The run, its outputs under `out`; not checked here: each test asserts
    what it reads."""
    json, plot, logs, trace = (out / n for n in ("serve.json", "serve.png", "logs", "trace.jsonl"))
    proc, elapsed = run_bench(
        "serve", "--configs", "single,rapidkv", *SERVED,
        "--json", str(json), "--plot", str(plot), "--log-dir", str(logs), "--trace", str(trace),
    )  # fmt: skip
    return StartedRun(proc, elapsed, json, plot, logs, trace)
