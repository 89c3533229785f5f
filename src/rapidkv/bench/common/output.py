"""A benchmark's outputs: strict JSON, where it goes, numbers in tables, figures."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any


def to_json(obj: Any, indent: int | None = None) -> str:
    """Strict JSON: nan and infinities become null, tuples and sets lists, paths strings."""
    return json.dumps(_clean(obj), indent=indent, allow_nan=False)


def _clean(o: Any) -> Any:
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple, set, frozenset)):
        return [_clean(v) for v in o]
    if isinstance(o, Path):
        return str(o)
    return o


def write_json(report: Any, dest: str | None) -> None:
    """`--json`: to the file `dest`, to stdout for `-`, nowhere for None."""
    if dest == "-":
        print(to_json(report, indent=1))
    elif dest:
        Path(dest).write_text(to_json(report, indent=1) + "\n")


def table_stream(dest: str | None) -> Any:
    """Where the summary table goes: stderr when the JSON takes stdout."""
    return sys.stderr if dest == "-" else sys.stdout


def fmt(v: Any, digits: int = 1) -> str:
    """A table's cell: `-` for None or nan, ints as they are, floats to `digits`."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, int):
        return str(v)
    return f"{v:.{digits}f}"


def save_figure(fig: Any, path: Path, title: str | None) -> Path:
    """Title, lay out, write (creating the folder) and close a benchmark figure."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
