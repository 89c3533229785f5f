"""The frame of every benchmark's run: options checked, the command line
recorded, the report printed and written, the plot drawn, the logs named."""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar

from rapidkv.bench.common.output import table_stream, write_json

T = TypeVar("T")


def parse_options(
    from_args: Callable[[argparse.Namespace], T], args: argparse.Namespace, benchmark: str
) -> T | None:
    """The benchmark's options from `args`, or None after printing why not
    (the caller then exits 2, as argparse does for a bad option)."""
    try:
        return from_args(args)
    except ValueError as e:
        print(f"rapidkv bench {benchmark}: error: {e}", file=sys.stderr)
        return None


def command_line(benchmark: str) -> str | None:
    """The `rapidkv bench NAME ...` command this process runs (None when it was
    started otherwise, e.g. from a test)."""
    if sys.argv[1:3] != ["bench", benchmark]:
        return None
    return shlex.join(["rapidkv", "bench", benchmark, *sys.argv[3:]])


def finish(
    report: dict[str, Any],
    args: argparse.Namespace,
    print_report: Callable[[dict[str, Any], IO[str]], None],
    log_dir: Path | None,
    plot: Callable[[Path], Any] | None = None,
) -> int:
    """The table (on stderr when `--json -` takes stdout), the JSON, the plot
    (`plot(path)` when `--plot` is given), where the logs are; the exit status:
    0 when the report is `ok`, else 1."""
    print_report(report, table_stream(args.json))
    write_json(report, args.json)
    path = getattr(args, "plot", None)
    if plot is not None and path:
        plot(path)
        print(f"plot: {path}", file=sys.stderr)
    if log_dir is not None:
        print(f"server logs: {log_dir}", file=sys.stderr)
    return 0 if report["ok"] else 1


def open_link(
    stack: contextlib.ExitStack, rate: str | None, progress: Any, benchmark: str
) -> tuple[Any, dict[str, Any] | None]:
    """`--netns-link RATE` (`harness.netns.bench_link`): the link and its
    description, `(None, None)` without a rate; where the namespaces cannot be
    made, why, and the command exits 2 (SystemExit: what the stack holds is
    unwound on the way out)."""
    from rapidkv.harness.netns import NetnsUnavailable, bench_link

    try:
        return bench_link(stack, rate, progress)
    except NetnsUnavailable as e:
        print(f"rapidkv bench {benchmark}: --netns-link: {e}", file=sys.stderr)
        raise SystemExit(2) from None
