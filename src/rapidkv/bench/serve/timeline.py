"""Where a rapidkv request's time to first token goes, from a `--trace` file.

    python -m rapidkv.bench.serve.timeline requests.jsonl

Each trace row of a rapidkv configuration carries, besides the client's token
arrival times, the connectors' events for its `xfer_id` (`prefill_ms`,
`decode_ms`: milliseconds after the client sent the request, on the machine's
one monotonic clock). Per configuration and load this prints the median of each
stage of the request's path to its first token:

| stage | from -> to |
|---|---|
| `to_p` | client sent -> P's engine admitted the request (router, HTTP, queue) |
| `p_prefill` | P admitted -> the step computing the prompt's last chunk returned |
| `handoff` | that step returned -> D's scheduler saw the KV complete |
| `d_first` | D saw the KV -> the client got the first token (D computes the |
|  | last prompt token, samples, streams it back through the router) |
| `to_d` | client sent -> D's engine admitted the request (runs beside `to_p`) |

and `ttft` itself; for `single`, only `ttft`. The stages add up to the TTFT of
the request whose stages they are; their medians need not add up exactly.

Then, per configuration, load and rapidkv role, where its engine steps' time
goes (the `kind: steps` rows: the connector's `StepTiming`s during the load),
medians in ms, decode-only steps (every scheduled request computes one token)
apart from steps that compute prompt tokens:

| column | what |
|---|---|
| `wall` | the scheduler built the step -> its output came back |
| `forward` | the workers' model forward (metadata bound -> last layer saved), |
|  | the connector's per-layer hooks included |
| `wait` | of `forward`, waiting for a split prefill's head (per layer) |
| `hooks` | the connector's other worker hooks (bind, per-layer saves, ack, |
|  | finished transfers) |
| `rest` | `wall - forward - hooks`: scheduling, sampling, the engine's IPC |
| `itl` | the client's inter-token gaps of the load (decode rows only): its |
|  | excess over `wall` is the API server's and the router's relay |
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rapidkv.control.messages import StepTiming

STAGES = ("to_p", "p_prefill", "handoff", "d_first", "to_d", "ttft")
STEP_FIELDS: tuple[str, ...] = StepTiming.__struct_fields__
STEP_COLUMNS = ("tokens", "wall", "forward", "wait", "hooks", "rest", "itl")


def stages(row: dict[str, Any]) -> dict[str, float]:
    """The stages of one trace row (those its events allow)."""
    out: dict[str, float] = {}
    if row.get("token_ms"):
        out["ttft"] = row["token_ms"][0]
    p, d = row.get("prefill_ms") or {}, row.get("decode_ms") or {}
    if "admitted" in p:
        out["to_p"] = p["admitted"]
        if "last_chunk_end" in p:
            out["p_prefill"] = p["last_chunk_end"] - p["admitted"]
            if "d_kv_received" in d:
                out["handoff"] = d["d_kv_received"] - p["last_chunk_end"]
    if "d_kv_received" in d and "ttft" in out:
        out["d_first"] = out["ttft"] - d["d_kv_received"]
    if "d_admitted" in d:
        out["to_d"] = d["d_admitted"]
    return out


def summarize(rows: Iterable[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per `config/load`, the median of each stage (and `n`, the rows). `single`'s
    blocks paired with a configuration X are their own key, `single~X/load`."""
    samples: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if row.get("error"):
            continue
        config = row["config"]
        if row.get("paired_with"):
            config = f"{config}~{row['paired_with']}"
        key = f"{config}/{row['load']}"
        samples[key]["n"].append(1.0)
        for stage, ms in stages(row).items():
            samples[key][stage].append(ms)
    return {
        key: {
            stage: (float(len(v)) if stage == "n" else statistics.median(v))
            for stage, v in by_stage.items()
        }
        for key, by_stage in samples.items()
    }


def step_breakdown(rows: Iterable[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per `config/load/role/kind` (kind ``decode`` or ``prompt``), the median
    of each of `STEP_COLUMNS` over the steps of the `kind: steps` rows, and
    `n`, the steps; `itl`: the median inter-token gap of the load's requests."""
    rows = list(rows)
    itl: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        if row.get("kind") is None and not row.get("error") and not row.get("paired_with"):
            t = row.get("token_ms") or []
            itl[f"{row['config']}/{row['load']}"] += [b - a for a, b in itertools.pairwise(t)]
    samples: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if row.get("kind") != "steps":
            continue
        for values in row["steps"]:
            step = dict(zip(row["fields"], values, strict=True))
            if not step["scheduled_tokens"]:
                continue  # an empty step (nothing scheduled)
            decode = step["scheduled_tokens"] == step["requests"]
            key = f"{row['config']}/{row['load']}/{row['role']}/{'decode' if decode else 'prompt'}"
            wall = (step["end"] - step["begin"]) * 1000
            cells = samples[key]
            cells["tokens"].append(step["scheduled_tokens"])
            cells["wall"].append(wall)
            cells["forward"].append(step["forward"] * 1000)
            cells["wait"].append(step["layer_wait"] * 1000)
            cells["hooks"].append(step["hooks"] * 1000)
            cells["rest"].append(wall - (step["forward"] + step["hooks"]) * 1000)
    out: dict[str, dict[str, float]] = {}
    for key, cells in samples.items():
        out[key] = {c: statistics.median(v) for c, v in cells.items()}
        out[key]["n"] = float(len(cells["wall"]))
        gaps = itl.get(key.rsplit("/", 2)[0])
        if key.endswith("/decode") and gaps:
            out[key]["itl"] = statistics.median(gaps)
    return out


def table(summary: dict[str, dict[str, float]], columns: tuple[str, ...] = STAGES) -> str:
    w = max([28, *(len(key) + 1 for key in summary)])
    head = f"{'config/load':<{w}}{'n':>5}" + "".join(f"{s:>11}" for s in columns)
    lines = [head, "-" * len(head)]
    for key in sorted(summary):
        row = summary[key]
        cells = "".join(f"{row[s]:>11.1f}" if s in row else f"{'-':>11}" for s in columns)
        lines.append(f"{key:<{w}}{int(row.get('n', 0)):>5}{cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m rapidkv.bench.serve.timeline TRACE.jsonl", file=sys.stderr)
        return 2
    rows = [json.loads(line) for line in Path(args[0]).read_text().splitlines() if line.strip()]
    requests = [row for row in rows if row.get("kind") is None]
    print("median ms per stage (see the module docstring)")
    print(table(summarize(requests)))
    steps = step_breakdown(rows)
    if steps:
        print("\nmedian ms per engine step, by config/load/role/kind (see the module docstring)")
        print(table(steps, STEP_COLUMNS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
