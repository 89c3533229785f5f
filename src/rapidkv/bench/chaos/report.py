"""`rapidkv bench chaos`: the summary, its JSON and the exit status.

The run fails (exit status 1) on any hung request, leaked block, mismatch or
unclear failure, on an instance that did not start again or never served a
request with a real transfer after its restart, and on anything still running,
queued or held (vLLM's running/waiting, live transfers, parked TransferKVs, D
requests waiting for KV; the router's requests in flight and upstream requests
outstanding) after the quiesce. `acceptance` adds the issue's bound on `recovery_s`
(5 s after each restart, beyond the instance's own start-up); it is reported,
and `--strict-recovery` makes it fatal too.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from typing import IO, Any

from rapidkv.bench.chaos.driver import KINDS, Outcome

RECOVERY_BOUND_S = 5.0

_URL = re.compile(r"https?://[\w.\-]+(:\d+)?")
_HEX = re.compile(r"\b[0-9a-f]{12,}\b")
_NUM = re.compile(r"(?<!HTTP )\b\d+(\.\d+)?")  # an HTTP status stays


def normalize(message: str) -> str:
    """An error message with what differs between occurrences (URLs, ids,
    numbers but HTTP statuses) replaced, so that equal errors count together."""
    text = _URL.sub("URL", message)
    text = _HEX.sub("ID", text)
    text = _NUM.sub("N", text)
    return text[:300]


def error_table(outcomes: Sequence[Outcome], kind: str) -> dict[str, Any]:
    errors = Counter(normalize(o.error or "") for o in outcomes if o.kind == kind)
    examples: dict[str, str] = {}
    for o in outcomes:
        if o.kind == kind:
            examples.setdefault(normalize(o.error or ""), (o.error or "")[:500])
    return {
        "count": sum(errors.values()),
        "errors": [
            {"error": e, "count": n, "example": examples[e]} for e, n in errors.most_common()
        ],
    }


def build_report(
    outcomes: Sequence[Outcome],
    *,
    options: dict[str, Any],
    restarts: Sequence[Any],  # faults.Restart
    incarnations: dict[str, list[Any]],  # role -> [faults.Incarnation]
    quiesce: dict[str, Any],
    warmup: Sequence[Outcome],
    timing: dict[str, float],
    extra: dict[str, Any],
) -> dict[str, Any]:
    kinds = Counter(o.kind for o in outcomes)
    aborted = [o for o in outcomes if o.kind == "aborted"]
    by_phase: dict[str, dict[str, int]] = {}
    for o in aborted:
        seen = by_phase.setdefault(o.abort_phase or "?", {})
        seen[o.seen] = seen.get(o.seen, 0) + 1
    planned_not_aborted = sum(1 for o in outcomes if o.abort_phase and o.kind != "aborted")
    mismatches = [o for o in outcomes + list(warmup) if o.kind == "mismatch"]

    finals = {role: q.pop("stats", {}) for role, q in quiesce["instances"].items()}
    leaked: dict[str, float | None] = {}
    for role, q in quiesce["instances"].items():
        base = incarnations[role][-1].baseline_free_blocks
        free = q.get("free_blocks")
        leaked[role] = None if base is None or free is None else base - free
    counters = {role: summed_counters(incs, finals[role]) for role, incs in incarnations.items()}
    recovery = {r.role: r.recovery_s for r in restarts}

    problems = []
    if kinds["hung"]:
        problems.append(f"{kinds['hung']} hung request(s)")
    if mismatches:
        problems.append(f"{len(mismatches)} mismatch(es)")
    if kinds["failed_unclear"]:
        problems.append(f"{kinds['failed_unclear']} unclear failure(s)")
    for role, n in leaked.items():
        if n is None or n > 0:
            problems.append(f"{role}: {'unknown' if n is None else int(n)} leaked block(s)")
    for role, q in quiesce["instances"].items():
        for key in (
            "running",
            "waiting",
            "transfers_live",
            "parked_now",
            "waiting_for_kv",
            "held_blocks",
            "held_requests",
        ):
            if q.get(key):
                problems.append(f"{role}: {key} {q[key]:g} after the quiesce")
    if not quiesce.get("idle", False):
        problems.append(f"not idle within the quiesce timeout ({quiesce.get('timeout_s')}s)")
    router = quiesce.get("router", {})
    if "error" in router:
        problems.append(f"router: not readable after the run: {router['error']}")
    elif router.get("in_flight") or any(router.get("outstanding", {}).values()):
        problems.append(
            f"router: {router['in_flight']:g} requests in flight, outstanding upstream "
            f"{router['outstanding']} after the quiesce"
        )
    for role, q in quiesce["instances"].items():
        if "error" in q:
            problems.append(f"{role}: not readable after the run: {q['error']}")
    for r in restarts:
        if r.error or r.recovery_s is None:
            problems.append(f"{r.role} restart: {r.error or 'recovery not measured'}")
    for w in warmup:
        if w.kind not in ("completed", "mismatch"):
            problems.append(f"warm-up request failed: {w.kind} {w.error}")

    recovery_ok = all(
        r.recovery_s is not None and r.recovery_s <= RECOVERY_BOUND_S for r in restarts
    )
    clear = error_table(outcomes, "failed_clear")
    return {
        "bench": "chaos",
        **extra,
        "options": options,
        "requests": len(outcomes),
        "completed": kinds["completed"],
        "aborted": kinds["aborted"],
        "aborted_by_phase": by_phase,  # phase aimed at -> what the client had seen
        "abort_planned_but_finished_first": planned_not_aborted,
        "failed_clear": clear["count"],
        "failed_clear_errors": clear["errors"],
        "failed_unclear": kinds["failed_unclear"],
        "failed_unclear_errors": error_table(outcomes, "failed_unclear")["errors"],
        "hung": kinds["hung"],
        "hung_requests": [o.row() for o in outcomes if o.kind == "hung"][:20],
        "mismatches": len(mismatches),
        "mismatch_examples": [o.row() for o in mismatches][:20],
        "leaked_blocks": leaked,
        "quiesce": quiesce,
        "recovery_s": recovery,
        "restarts": [r.row() for r in restarts],
        "recompute_fallbacks": counters.get("decode", {}).get("recompute_fallbacks", 0.0),
        "counters": counters,
        "streamed": sum(1 for o in outcomes if o.stream),
        "timing": timing,
        "acceptance": {
            "recovery_bound_s": RECOVERY_BOUND_S,
            "recovery_within_bound": recovery_ok,
            "met": not problems and recovery_ok,
        },
        "problems": problems,
        "ok": not problems,
    }


COUNTERS = (
    "transfers_ok",
    "transfers_failed",
    "debug_injected_failures",
    "recompute_fallbacks",
    "rehandshakes",
    "peers_forgotten",
    "split_prefills",
    "split_loads_ok",
    "split_loads_failed",
    "aborts_client_abort",
    "aborts_decode_failed",
    "aborts_prefill_failed",
    "aborts_timeout",
    "finished_expired",
    "park_expired",
    "preempted_transfers",
    "transfers_failed_peer_gone",
    "unknown_peer_replies",
    "busy_replies",
)


def summed_counters(incarnations: Sequence[Any], last: dict[str, float]) -> dict[str, float]:
    """The connector's counters over every process of an instance: each killed
    one's as read just before its kill, the last one's after the quiesce."""
    out: dict[str, float] = {}
    finals = [inc.final for inc in incarnations[:-1]] + [last]
    for stats in finals:
        for name in COUNTERS:
            if name in stats:
                out[name] = out.get(name, 0.0) + stats[name]
    out["processes"] = float(len(incarnations))
    return out


def print_report(report: dict[str, Any], out: IO[str]) -> None:
    w = out.write
    w(f"rapidkv bench chaos: {report['requests']} requests, CPU {report.get('cpu')}\n")
    w(
        f"  completed {report['completed']}  aborted {report['aborted']}  "
        f"failed_clear {report['failed_clear']}  failed_unclear {report['failed_unclear']}  "
        f"hung {report['hung']}  mismatches {report['mismatches']}\n"
    )
    for e in report["failed_clear_errors"]:
        w(f"    clear x{e['count']}: {e['error']}\n")
    for e in report["failed_unclear_errors"]:
        w(f"    UNCLEAR x{e['count']}: {e['example']}\n")
    phases = ", ".join(
        f"{p}: {sum(s.values())} ({', '.join(f'{k} {v}' for k, v in sorted(s.items()))})"
        for p, s in sorted(report["aborted_by_phase"].items())
    )
    w(f"  aborted by phase: {phases or '-'}\n")
    w(f"  leaked blocks: {report['leaked_blocks']}  (quiesce {report['quiesce']['took_s']:.1f}s)\n")
    for r in report["restarts"]:
        rec = r.get("recovery_s")
        recovery = "-" if rec is None else f"{rec:.2f}s"
        error = f"  {r['error']}" if r.get("error") else ""
        w(
            f"  {r['role']} killed at request {r['at_request']}: start-up "
            f"{r.get('startup_s', math.nan):.1f}s, recovery {recovery}{error}\n"
        )
    c = report["counters"]
    w(
        f"  P: transfers ok {c['prefill'].get('transfers_ok', 0):g}, failed "
        f"{c['prefill'].get('transfers_failed', 0):g} (injected "
        f"{c['prefill'].get('debug_injected_failures', 0):g}); D: recompute fallbacks "
        f"{report['recompute_fallbacks']:g}, rehandshakes {c['decode'].get('rehandshakes', 0):g}\n"
    )
    for p in report["problems"]:
        w(f"  PROBLEM: {p}\n")
    verdict = "OK" if report["ok"] else "FAILED"
    bound = "within" if report["acceptance"]["recovery_within_bound"] else "NOT within"
    w(f"result: {verdict} (recovery {bound} {RECOVERY_BOUND_S:g}s)\n")


__all__ = ["KINDS", "build_report", "normalize", "print_report"]
