"""The benchmarks' tests live in folders that mirror src/rapidkv/bench; the
smoke runs of every folder import `bench_cli` from here, so this directory is
put on `sys.path` (pytest's default import mode only adds each test file's own
folder)."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
