"""The benchmarks' shared output helpers: strict JSON and table cells."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rapidkv.bench.common.output import fmt, to_json


def test_to_json_is_strict_json() -> None:
    doc = {"a": [math.nan, 1.0, math.inf, -math.inf], "b": (2,), "c": {3}, 4: Path("/x")}
    text = to_json(doc)
    assert json.loads(text) == {"a": [None, 1.0, None, None], "b": [2], "c": [3], "4": "/x"}
    assert "NaN" not in text and "Infinity" not in text


def test_fmt() -> None:
    assert fmt(None) == fmt(math.nan) == "-"
    assert fmt(3) == "3" and fmt(2.345) == "2.3" and fmt(2.345, 2) == "2.35"


def test_the_json_output_is_strict_json_with_null_for_missing_figures() -> None:
    text = to_json({"p50": math.nan, "n": 3, "ids": (1, 2), "inf": math.inf, "dir": Path("/x")})
    assert json.loads(text) == {"p50": None, "n": 3, "ids": [1, 2], "inf": None, "dir": "/x"}
