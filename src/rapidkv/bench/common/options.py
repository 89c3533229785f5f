"""Command-line options every benchmark takes the same way, and its log folder."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

DTYPES = {"float32": "float32", "bf16": "bfloat16"}
"""`--dtype` choices, as vLLM spells them."""
MODELS = ("tiny", "small", "smollm2-135m")
"""Models by name: the random-weight test models and the real one, built on first use."""
MODEL_DTYPES = {"smollm2-135m": "bf16"}
"""The `--dtype` a model is served in unless one is given (SmolLM2's weights are
published in bf16); float32 for the others (the test models, checkpoint
directories: the token-exact oracle's dtype)."""


def model_dtype(model: str, dtype: str | None) -> str:
    """vLLM's spelling of the dtype `model` is served in: `dtype` (a `--dtype`
    choice) when given, else the model's own (`MODEL_DTYPES`)."""
    return DTYPES[dtype or MODEL_DTYPES.get(model, "float32")]


def check_known(names: Sequence[str], known: Iterable[str], what: str) -> None:
    """ValueError naming the first of `names` that is not `known` (a `what`)."""
    known = list(known)
    for name in names:
        if name not in known:
            raise ValueError(f"unknown {what} {name!r} (known: {', '.join(known)})")


def check_model(model: str) -> None:
    """ValueError unless `model` is a model by name or a checkpoint's directory."""
    if model not in MODELS and not (Path(model) / "config.json").is_file():
        raise ValueError(
            f"unknown model {model!r} (known: {', '.join(MODELS)}, or a checkpoint's "
            "directory, holding its config.json)"
        )


def model_dir(model: str, dtype: str) -> Path:
    """The checkpoint of `model` (by name: built on first use; else the directory given)."""
    from rapidkv.models import ensure_model
    from rapidkv.models.smollm2 import NAME as SMOLLM2
    from rapidkv.models.smollm2 import ensure_smollm2

    if model == SMOLLM2:
        return ensure_smollm2(dtype)
    if model in MODELS:
        return ensure_model(model, dtype=dtype)
    return Path(model)


def add_model(parser: argparse.ArgumentParser, default: str = "tiny") -> None:
    """`--model` and `--dataset` (prompts of the lengths the benchmark draws)."""
    parser.add_argument(
        "--model",
        default=default,
        help=f"{', '.join(MODELS)} (built on first use: the random-weight test models, "
        "SmolLM2-135M-Instruct from its package) or a checkpoint's directory (%(default)s)",
    )
    parser.add_argument(
        "--dataset",
        choices=("random", "sharegpt"),
        default="random",
        help="the prompts, of the lengths the benchmark draws: random token ids, or "
        "ShareGPT's conversations as text, cut to each length (%(default)s)",
    )


def add_numbers(
    parser: argparse.ArgumentParser,
    kind: type,
    rows: tuple[tuple[str, float | int | None, str], ...],
) -> None:
    """One `kind`-typed option per `(flag, default, help)` row."""
    for flag, default, text in rows:
        parser.add_argument(flag, type=kind, default=default, help=text)


def add_dtype(parser: argparse.ArgumentParser, what: str = "model dtype") -> None:
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help=f"{what} (default: the model's own: bf16 for smollm2-135m, else float32)",
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


def add_served_options(
    parser: argparse.ArgumentParser,
    *,
    model: bool = True,
    include_usage: bool = True,
    plot: bool = True,
    trace: str | None = None,
    servers: str = "every server",
) -> None:
    """The options of a benchmark that serves a model: `--model` and
    `--dataset` (unless the benchmark has its own), `--dtype`, `--server-args`
    (helped as extra arguments for `servers`), `--no-include-usage`, and the
    outputs (`add_output`)."""
    if model:
        add_model(parser)
    add_dtype(parser)
    add_server_args(parser, servers)
    if include_usage:
        add_include_usage(parser)
    add_output(parser, plot=plot, trace=trace)


def from_namespace(cls: type[T], args: argparse.Namespace, **computed: Any) -> T:
    """An options dataclass `cls`: the `computed` fields as given, every other
    field copied from the attribute of `args` of the same name (a field neither
    computed nor in `args` keeps its default)."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    copied = {n: getattr(args, n) for n in names - computed.keys() if hasattr(args, n)}
    return cls(**copied, **computed)


def served_fields(args: argparse.Namespace) -> dict[str, Any]:
    """What `add_served_options` parsed, as an options class's fields: `dtype`
    (vLLM's spelling; the model's own unless given), `server_args` (split as a
    shell does), `model` and `dataset` where given."""
    out: dict[str, Any] = {
        "dtype": model_dtype(getattr(args, "model", ""), args.dtype),
        "server_args": tuple(shlex.split(args.server_args)),
    }
    for key in ("model", "dataset"):
        if hasattr(args, key):
            out[key] = getattr(args, key)
    return out
