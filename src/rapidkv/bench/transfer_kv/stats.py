"""`rapidkv bench transfer-kv`: the pure parts (no servers, no threads).

- `Sample`: what was seen of one TransferKV: P's timeline events (its
  `time.monotonic()`, the same clock as ours), the per-(layer, block) moments
  our memory changed, the moment our kvt saw the SendDone.
- `sample_metrics`: arrival -> first byte, arrival -> last byte confirmed, and
  exposed transfer time (last byte - the later of arrival and P's
  `last_chunk_end`), in ms.
- `DelaySampler`: when to send a TransferKV after P's request, so that arrivals
  land in every state (see its docstring).
- `layer0_offsets`, `ready_delays`: when a step's first layer was ready, for
  "first byte after the later of arrival and the step's first layer".
- `summarize_phase`, `choose_cap`, `acceptance`: the report.

Invariants: every time is `time.monotonic()` seconds; every metric is ms;
a sample that failed (no OK reply, no SendDone, a missing event) yields no
metric, and is counted, never dropped silently.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

MODES = ("step", "bypass", "substep")
STATES = ("finished", "last_chunk", "earlier_chunk")
METRICS = ("first_byte_ms", "last_byte_ms", "exposed_ms")


@dataclass
class Sample:
    """One TransferKV sent to P, and what came of it.

    `landed[layer][i]` is the first moment the watched word of destination
    block `blocks[i]` of `layer` differed from the sentinel (NaN: never seen).
    `last_byte` is when our kvt received P's SendDone for the transfer.
    """

    xfer_id: str
    mode: str
    blocks: tuple[int, ...]
    t_request: float  # P's completion request sent
    t_submit: float  # TransferKV handed to the RPC client
    state: str = ""  # P's state_at_arrival ("" until the timeline is read)
    events: dict[str, float] = field(default_factory=dict)
    landed: list[list[float]] = field(default_factory=list)
    last_byte: float | None = None
    send_done_ok: bool = False
    reply_code: str = ""
    tokens_sent: int = 0
    written: bool = False  # every watched word of every block changed
    content_rel_diff: float | None = None  # vs the reference transfer (full blocks)
    step_begin: float | None = None  # begin of the step that computed the last chunk
    # end of that step: P's `last_chunk_end` event, or (P records none for a
    # request that finishes in that step) the end of the step P stamped
    # `last_chunk_begin` with, from P's step timings
    last_chunk_end: float | None = None
    error: str = ""
    # how the sample was drawn and watched
    target: str = ""  # the state the delay aimed at (P's verdict is `state`)
    delay_s: float = 0.0  # P's request -> TransferKV submit, as drawn
    t_end: float = 0.0  # everything about the sample was over
    max_poll_gap_ms: float = 0.0  # longest gap between two reads of our memory
    noisy: bool = False  # overlapped a window where other processes used our cores

    @property
    def first_byte(self) -> float | None:
        times = [t for row in self.landed for t in row if not math.isnan(t)]
        return min(times) if times else None

    @property
    def ok(self) -> bool:
        return (
            not self.error
            and self.reply_code == "OK"
            and self.send_done_ok
            and self.written
            and self.last_byte is not None
            and self.first_byte is not None
            and "transfer_kv" in self.events
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "xfer_id": self.xfer_id,
            "mode": self.mode,
            "state": self.state,
            "ok": self.ok,
            "error": self.error,
            "reply": self.reply_code,
            "tokens_sent": self.tokens_sent,
            "t_request": self.t_request,
            "t_submit": self.t_submit,
            "events": self.events,
            "first_byte": self.first_byte,
            "last_byte": self.last_byte,
            "step_begin": self.step_begin,
            "last_chunk_end": self.last_chunk_end,
            "target": self.target,
            "delay_s": self.delay_s,
            "t_end": self.t_end,
            "max_poll_gap_ms": self.max_poll_gap_ms,
            "noisy": self.noisy,
            "written": self.written,
            "content_rel_diff": self.content_rel_diff,
            "landed": [[None if math.isnan(t) else t for t in row] for row in self.landed],
            "metrics": sample_metrics(self),
        }


def sample_metrics(s: Sample) -> dict[str, float] | None:
    """first byte / last byte / exposed, ms after P's arrival event; None if the
    sample failed (or its last chunk's end is unknown). Exposed is the last
    byte minus the later of arrival and the end of the step that computed the
    last chunk, and 0 when the transfer was confirmed before that step ended
    (fully hidden behind the compute)."""
    if not s.ok or s.last_chunk_end is None:
        return None
    arrival = s.events["transfer_kv"]
    first = s.first_byte
    assert first is not None and s.last_byte is not None  # ok implies both
    ready = max(arrival, s.last_chunk_end)
    return {
        "first_byte_ms": (first - arrival) * 1000,
        "last_byte_ms": (s.last_byte - arrival) * 1000,
        "exposed_ms": max(0.0, (s.last_byte - ready) * 1000),
    }


def last_chunk_end(events: Mapping[str, float], steps: Sequence[Step]) -> float | None:
    """When the step that computed the request's last chunk ended: P's
    `last_chunk_end` event if it recorded one, else the end of the step that
    began at `last_chunk_begin` (P stamps that event with its step's begin)."""
    if "last_chunk_end" in events:
        return events["last_chunk_end"]
    begin = events.get("last_chunk_begin")
    step = step_beginning_at(steps, begin) if begin is not None else None
    return step.end if step is not None else None


def percentiles(values: Iterable[float], digits: int = 3) -> dict[str, float | int]:
    """p50/p99 (linear interpolation, as numpy's default) and n; NaN when empty."""
    from rapidkv.bench.common.stats import tail_summary

    return tail_summary(values, digits)


# ------------------------------------------------------------------ steps


@dataclass(frozen=True)
class Step:
    """One engine step of P (`StepTiming`): built at `begin`, output back at `end`."""

    step_id: int
    begin: float
    end: float
    scheduled_tokens: int

    @property
    def ms(self) -> float:
        return (self.end - self.begin) * 1000


def step_at(steps: Sequence[Step], t: float) -> Step | None:
    """The step in flight at `t` (begin <= t < end), if any; `steps` sorted by begin."""
    lo, hi = 0, len(steps)
    while lo < hi:  # last step with begin <= t
        mid = (lo + hi) // 2
        if steps[mid].begin <= t:
            lo = mid + 1
        else:
            hi = mid
    if lo and t < steps[lo - 1].end:
        return steps[lo - 1]
    return None


def step_beginning_at(steps: Sequence[Step], t: float, tol: float = 1e-6) -> Step | None:
    """The step whose `begin` is `t` (P stamps `last_chunk_begin` with its step's
    begin), if P still remembers it."""
    for s in steps:
        if abs(s.begin - t) <= tol:
            return s
    return None


def busy_step_ms(steps: Iterable[Step], t0: float, t1: float) -> list[float]:
    """Lengths of the steps begun in [t0, t1] that computed tokens."""
    return [s.ms for s in steps if t0 <= s.begin <= t1 and s.scheduled_tokens > 0]


def layer0_offsets(samples: Iterable[Sample], steps: Sequence[Step]) -> list[float]:
    """How long after its step's begin P's first layer was ready, ms: from
    destination blocks written layer by layer (a step task of `step` mode: its
    layers land spread over the step, layer 0 first), the landing of layer 0
    minus the begin of the step it landed in. Includes kvt's layer_done -> send
    latency (~0.1-0.3 ms per `rapidkv bench kvt`)."""
    out = []
    for s in samples:
        if s.mode != "step" or not s.ok or not s.landed:
            continue
        for i in range(len(s.blocks)):
            col = [row[i] for row in s.landed]
            if any(math.isnan(t) for t in col):
                continue
            step = step_at(steps, col[0])
            if step is None:
                continue
            # spread: the last layer landed well after the first (per-layer send)
            if col[-1] - col[0] >= 0.25 * (step.end - step.begin) and col == sorted(col):
                out.append((col[0] - step.begin) * 1000)
    return out


def last_block_landed(s: Sample) -> float | None:
    """When the first layer of the last destination block landed (only the
    last chunk's step computes that block)."""
    times = [row[-1] for row in s.landed if row and not math.isnan(row[-1])]
    return min(times) if times else None


def ready_delays(s: Sample, layer0_ms: float) -> dict[str, tuple[float, float]] | None:
    """For a sample whose TransferKV arrived while P computed its last chunk,
    how long after the later of arrival and the step's first layer its bytes
    landed, ms, for two first bytes: `any_block` (the sample's first byte; when
    earlier chunks exist their blocks go out at once as a full send) and
    `last_block` (the last destination block: only the last chunk's step
    computes it, so this is the substep's own first layer going out). Each as
    (after max(arrival, step begin + layer0_ms), after max(arrival, step
    begin)); the second is an upper bound that counts the first layer's
    compute as delay."""
    if sample_metrics(s) is None or s.step_begin is None:
        return None
    arrival = s.events["transfer_kv"]
    ready = max(arrival, s.step_begin + layer0_ms / 1000)
    bound = max(arrival, s.step_begin)
    first, last_block = s.first_byte, last_block_landed(s)
    if first is None or last_block is None:
        return None
    return {
        name: ((t - ready) * 1000, (t - bound) * 1000)
        for name, t in (("any_block", first), ("last_block", last_block))
    }


# ------------------------------------------------------------------ sampling


class DelaySampler:
    """When to send the TransferKV after P's request was sent, in seconds.

    `uniform`: uniform over [0, 1.5 x the expected prefill time] (P's request
    sent -> end of its last chunk, median of what was observed so far, else the
    initial guess). Otherwise (stratified), aimed at the state that still needs
    samples: uniform over that state's window, from the medians over the
    `RECENT` latest requests of P's `admitted`, `last_chunk_begin` and the last
    chunk's end, after the request was sent (a request may wait behind the
    load's prefills before its first chunk, and P's pace drifts):

    - earlier chunk: the two step lengths before `last_chunk_begin`, not before
      `admitted`;
    - last chunk: [`last_chunk_begin`, last chunk's end];
    - finished: the two step lengths after the last chunk's end.

    Either way the state a sample lands in is P's verdict (`state_at_arrival`),
    not the target; stratifying only spends fewer samples on states that are
    already full. Within a state's window the arrival is uniform.
    """

    def __init__(self, guess_s: float, uniform: bool = False, seed: int = 0) -> None:
        self.guess_s = guess_s
        self.uniform = uniform
        self.rng = random.Random(seed)
        self._offsets: dict[str, list[float]] = {}

    def observe(self, t_request: float, events: Mapping[str, float], lce: float | None) -> None:
        """Learn from one request: P's events, and when its last chunk ended."""
        times = {k: events[k] for k in ("admitted", "last_chunk_begin") if k in events}
        if lce is not None:
            times["last_chunk_end"] = lce
        for name, t in times.items():
            self._offsets.setdefault(name, []).append(t - t_request)

    RECENT = 12  # windows follow the latest requests (P's pace drifts)

    def _median(self, name: str) -> float | None:
        xs = sorted(self._offsets.get(name, [])[-self.RECENT :])
        return xs[len(xs) // 2] if xs else None

    def prefill_s(self) -> float:
        end = self._median("last_chunk_end")
        return end if end is not None else self.guess_s

    def window(self, state: str) -> tuple[float, float]:
        adm, lcb, lce = (
            self._median(n) for n in ("admitted", "last_chunk_begin", "last_chunk_end")
        )
        if self.uniform or adm is None or lcb is None or lce is None or not adm <= lcb <= lce:
            return 0.0, 1.5 * self.prefill_s()
        step = lce - lcb
        if state == "earlier_chunk":
            return max(adm, lcb - 2 * step), lcb
        if state == "last_chunk":
            return lcb, lce
        return lce, lce + 2 * step

    def draw(self, target: str) -> float:
        lo, hi = self.window(target)
        return self.rng.uniform(lo, hi)


def next_target(counts: Mapping[str, int], want: int) -> str | None:
    """The state with the fewest samples below `want` (None: all have enough)."""
    short = [(counts.get(s, 0), i, s) for i, s in enumerate(STATES) if counts.get(s, 0) < want]
    return min(short)[2] if short else None


# ------------------------------------------------------------------ report


def choose_cap(step_ms: float, request_bytes: int, fraction: float) -> float:
    """The link bandwidth (GB/s) at which one request's full transfer takes
    `fraction` of a step of `step_ms`."""
    if step_ms <= 0 or request_bytes <= 0 or fraction <= 0:
        raise ValueError("step_ms, request_bytes and fraction must be positive")
    return request_bytes / (fraction * step_ms / 1000) / 1e9


def summarize_phase(
    all_samples: Sequence[Sample],
    all_steps: Sequence[Step],
    t0: float,
    t1: float,
    noisy: Callable[[float, float], bool] = lambda a, b: False,
) -> dict[str, Any]:
    """The JSON of one phase: step length, per mode and state the three metrics
    (p50/p99/n), the other states' counts, the checks. Samples marked `noisy`
    and steps for which `noisy(begin, end)` holds are left out of every figure
    (counted in `noisy_samples`); the checks cover every sample."""
    samples = [s for s in all_samples if not s.noisy]
    steps = [st for st in all_steps if not noisy(st.begin, st.end)]
    step_ms = busy_step_ms(steps, t0, t1)
    modes: dict[str, Any] = {}
    other: dict[str, dict[str, int]] = {}
    for mode in MODES:
        cells: dict[str, Any] = {}
        for state in STATES:
            ms = [
                m
                for s in samples
                if s.mode == mode and s.state == state
                if (m := sample_metrics(s))
            ]
            cells[state] = {k: percentiles(m[k] for m in ms) for k in METRICS}
        modes[mode] = cells
        for s in samples:
            if s.mode == mode and s.state not in STATES:
                other.setdefault(mode, {}).setdefault(s.state or "unknown", 0)
                other[mode][s.state or "unknown"] += 1
    offsets = layer0_offsets(samples, steps)
    l0 = percentiles(offsets)
    ready: dict[str, Any] = {}
    for mode in MODES:
        delays = [
            d
            for s in samples
            if s.mode == mode and s.state == "last_chunk"
            if (d := ready_delays(s, l0["p50"] if l0["n"] else 0.0)) is not None
        ]
        ready[mode] = {
            which: {
                "estimated": percentiles(d[which][0] for d in delays),
                "upper_bound": percentiles(d[which][1] for d in delays),
            }
            for which in ("any_block", "last_block")
        }
        # the last chunk's own block reached us only after that step ended:
        # sent by a later step (step mode, bypass, or a substep the worker
        # refused because the step had frozen, then rolled back)
        ready[mode]["last_block_after_step_end"] = sum(
            1
            for s in samples
            if s.mode == mode and s.state == "last_chunk" and sample_metrics(s) is not None
            if (lb := last_block_landed(s)) is not None and s.last_chunk_end is not None
            if lb > s.last_chunk_end
        )
    diffs = [s.content_rel_diff for s in all_samples if s.content_rel_diff is not None]
    failed = [s for s in all_samples if not s.ok]
    gaps = [s.max_poll_gap_ms for s in samples if s.ok]
    return {
        "step_ms": percentiles(step_ms),
        "modes": modes,
        "other_states": other,
        "last_chunk_first_byte_after_ready_ms": ready,
        "layer0_offset_ms": l0,
        "samples": len(all_samples),
        "noisy_samples": len(all_samples) - len(samples),
        "max_poll_gap_ms": percentiles(gaps),
        "checks": {
            "failed": len(failed),
            "failed_xfers": [f"{s.xfer_id}: {s.error or s.reply_code}" for s in failed][:20],
            "all_blocks_written": sum(s.written for s in all_samples),
            "content_compared": len(diffs),
            "content_max_rel_diff": max(diffs) if diffs else None,
        },
    }


def acceptance(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The issue's acceptance points, evaluated on a report with `uncapped` and
    `capped` phases: each `{point, value, limit, ok}` (ok None: not measurable)."""

    def cell(phase: str, mode: str, state: str, metric: str, q: str) -> float:
        return report[phase]["modes"][mode][state][metric][q]

    def point(name: str, value: float, limit: str, ok: bool) -> dict[str, Any]:
        if math.isnan(value):
            return {"point": name, "value": None, "limit": limit, "ok": None}
        return {"point": name, "value": round(value, 3), "limit": limit, "ok": bool(ok)}

    out = []
    step_u = report["uncapped"]["step_ms"]["p50"]
    fast_u = max(2.0, 0.05 * step_u)
    for mode in ("bypass", "substep"):
        v = cell("uncapped", mode, "finished", "first_byte_ms", "p99")
        out.append(
            point(
                f"uncapped finished {mode}: p99 arrival->first byte (ms)",
                v,
                f"<= {fast_u:.2f}",
                v <= fast_u,
            )
        )
    v = cell("uncapped", "step", "finished", "first_byte_ms", "p50") / step_u
    out.append(
        point(
            "uncapped finished step: p50 arrival->first byte / step p50",
            v,
            "in [0.3, 0.7]",
            0.3 <= v <= 0.7,
        )
    )
    v = cell("uncapped", "step", "finished", "last_byte_ms", "p50") / cell(
        "uncapped", "bypass", "finished", "last_byte_ms", "p50"
    )
    out.append(
        point("uncapped finished: p50 arrival->last byte, step / bypass", v, ">= 10", v >= 10)
    )
    v = cell("capped", "substep", "last_chunk", "exposed_ms", "p50") / cell(
        "capped", "step", "last_chunk", "exposed_ms", "p50"
    )
    out.append(point("capped last chunk: p50 exposed, substep / step", v, "<= 0.5", v <= 0.5))
    fast_c = max(2.0, 0.05 * report["capped"]["step_ms"]["p50"])
    ready = report["capped"]["last_chunk_first_byte_after_ready_ms"]["substep"]
    for which in ("any_block", "last_block"):
        for q in ("p50", "p99"):
            v = ready[which]["estimated"][q]
            out.append(
                point(
                    f"capped last chunk substep: {q} first byte ({which.replace('_', ' ')}) "
                    "after max(arrival, first layer) (ms)",
                    v,
                    f"<= {fast_c:.2f}",
                    v <= fast_c,
                )
            )
    return out
