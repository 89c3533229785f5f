"""Command-line options every benchmark takes the same way, and its log folder."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

DTYPES = {"float32": "float32", "bf16": "bfloat16"}
"""`--dtype` choices, as vLLM spells them."""


def add_dtype(parser: argparse.ArgumentParser, what: str = "model dtype") -> None:
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="float32", help=f"{what} (%(default)s)"
    )


def add_server_args(parser: argparse.ArgumentParser, who: str = "every server") -> None:
    parser.add_argument(
        "--server-args",
        default="",
        help=f"extra vLLM arguments for {who}, one string: --server-args='--flag value'",
    )


def add_include_usage(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-include-usage",
        dest="include_usage",
        action="store_false",
        help="stream without stream_options (default: every streamed request asks for "
        '{"include_usage": true}, as vLLM\'s benchmark client and the OpenAI SDK do)',
    )


def add_output(
    parser: argparse.ArgumentParser, *, plot: bool = True, trace: str | None = None
) -> None:
    """`--json`, `--plot` (unless `plot` is False), `--trace` (helped by `trace`
    when given) and `--log-dir`."""
    add = parser.add_argument
    add("--json", default=None, metavar="PATH", help="write the JSON here (- = stdout)")
    if plot:
        add("--plot", type=Path, default=None, metavar="PATH", help="write a PNG here")
    if trace:
        add("--trace", type=Path, default=None, metavar="PATH", help=trace)
    add("--log-dir", type=Path, default=None, help="server logs (default: a tmp dir)")


def log_dir(args: argparse.Namespace, benchmark: str) -> Path:
    """`--log-dir`, or a fresh temporary folder named after the benchmark."""
    given: Path | None = getattr(args, "log_dir", None)
    return given or Path(tempfile.mkdtemp(prefix=f"rapidkv-bench-{benchmark}-"))
