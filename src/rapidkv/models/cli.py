"""`rapidkv model build|path`: build or locate the locally generated test models."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from rapidkv.models.spec import DTYPES, SIZES


def register(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """Add the `build` and `path` actions to `parser`; return the runner."""
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    build = sub.add_parser("build", help="build a model (or reuse it) and print its directory")
    path = sub.add_parser("path", help="print where the cached model lives (builds nothing)")
    for p in (build, path):
        p.add_argument("--size", choices=sorted(SIZES), default="tiny")
        p.add_argument("--dtype", choices=DTYPES, default="float32")
        p.add_argument(
            "--cache-dir",
            type=Path,
            default=None,
            help="cache root (default $RAPIDKV_CACHE/models or ~/.cache/rapidkv/models)",
        )
    build.add_argument("--out", type=Path, default=None, help="build into DIR instead of the cache")
    return run


def run(args: argparse.Namespace) -> int:
    """Print the model directory; for `build`, make sure it exists first."""
    from rapidkv.models.build import build_into, ensure_model, model_path
    from rapidkv.models.spec import get_spec

    if args.action == "path":
        print(model_path(args.size, args.dtype, args.cache_dir))
    elif args.out is not None:
        print(build_into(get_spec(args.size, args.dtype), args.out))
    else:
        print(ensure_model(args.size, args.dtype, args.cache_dir))
    return 0
