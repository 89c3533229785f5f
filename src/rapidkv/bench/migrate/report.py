"""`rapidkv bench migrate`: from the client's token times and the router's
answers to per-migration rows (`migration_rows`), and from the rows to the
report, its acceptance and its table (`build_report`, `print_report`). Pure:
no server, no clock.

What the destination loads (`expected_loads`; `tests/e2e/test_migration.py`
asserts the same against vLLM's counter): the pre-copy is a request for the
`n` tokens the stream had, so it loads `n - 1` (it computes the last); the
cut-over, for the `m` = prompt + `tokens_at_cutover` tokens, loads `m - 1`
less the full blocks the pre-copy left in the destination's prefix cache
(`n // block` blocks); stop-and-copy loads all `m - 1` at the cut-over. The
source sends whole blocks (`wire_blocks`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import IO, Any

MODES = ("precopy", "stop_and_copy")
TRANSFER_DETAIL = ("to_source_ms", "source_to_send_ms", "send_to_landed_ms")
"""The transfer stage split by the source's events: the destination's TransferKV
sent -> the source has it; -> its blocks posted on the bypass channel; -> the
destination's workers report them in place (seen at a step of its scheduler)."""
BREAKDOWN = ("until_admitted_ms", "admitted_to_transfer_kv_ms", "transfer_ms", "to_first_token_ms")
"""Where a client's downtime went, in order (the destination connector's timeline):
the source's last token -> the destination admitted the cut-over request; ->
its TransferKV sent; -> its KV in place; -> its first token at the client."""
DOWNTIME_STEPS = 3  # the acceptance: downtime p50 <= 3 decode steps + the delta's transfer
FLAT_RATIO = 1.5  # ... and at the longest length <= 1.5 x at the shortest


def expected_loads(
    prompt_len: int, tokens_at_cutover: int, precopy_tokens: int | None, block: int
) -> tuple[int, int]:
    """Tokens the destination loads (pre-copy, cut-over); `precopy_tokens`
    None: stop-and-copy."""
    m = prompt_len + tokens_at_cutover
    if precopy_tokens is None:
        return 0, m - 1
    n = precopy_tokens
    return n - 1, (m - 1) - (n // block) * block


def wire_blocks(
    prompt_len: int, tokens_at_cutover: int, precopy_tokens: int | None, block: int
) -> tuple[int, int]:
    """Blocks the source sends (pre-copy, cut-over): whole blocks, from the
    first the destination does not hold to the one with the last token loaded."""
    m = prompt_len + tokens_at_cutover
    if precopy_tokens is None:
        return 0, -(-(m - 1) // block)
    n = precopy_tokens
    return -(-(n - 1) // block), -(-(m - 1) // block) - n // block


def _gaps_ms(times: Sequence[float], first: int, end: int) -> list[float]:
    """Gaps before tokens `first` .. `end - 1` (token i's arrival minus i-1's), ms."""
    first = max(first, 1)
    end = min(end, len(times))
    return [(times[i] - times[i - 1]) * 1000 for i in range(first, end)]


def _ms(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else (b - a) * 1000


def migration_rows(
    times: Sequence[float],
    orders: Sequence[dict[str, Any]],
    *,
    prompt_len: int,
    block: int,
    bytes_per_token: int,
    loaded_by_instance: Sequence[float],
    timelines: dict[str, dict[str, float]],
    gap_tokens: int,
) -> list[dict[str, Any]]:
    """One row per migration ordered during a stream.

    `times`: each token's arrival at the client (monotonic s); `orders`: in
    order, each with `k`, `from`, `to`, `dest` (index), `ordered_at` (tokens
    the client had), `t_order`, `status`, `answer` (the router's, on 200),
    `error`, `reset_ms`; `loaded_by_instance`: external KV tokens each
    instance's vLLM counted during the stream; `timelines`: connector events
    by transfer id (the answer's `precopy_xfer_id` and `cutover_xfer_id`),
    same clock as `times`."""
    rows = []
    dests = [o["dest"] for o in orders if o.get("answer")]
    for i, o in enumerate(orders):
        a = o.get("answer")
        row: dict[str, Any] = {
            "k": o["k"],
            "from": o["from"],
            "to": o["to"],
            "ordered_at": o["ordered_at"],
            "reset_ms": o.get("reset_ms"),
            "ok": o.get("status") == 200 and a is not None,
            "error": o.get("error"),
        }
        rows.append(row)
        if not row["ok"]:
            row["error"] = row["error"] or f"HTTP {o.get('status')}"
            continue
        assert a is not None
        g = int(a["tokens_at_cutover"])
        pre = a.get("precopy_tokens") if a.get("precopy") else None
        row.update(
            tokens_at_cutover=g,
            precopy_tokens=pre,
            router_downtime_ms=a.get("downtime_ms"),
            cutover_ms=a.get("cutover_ms"),
            precopy_ms=a.get("precopy_ms"),
            total_ms=a.get("total_ms"),
        )
        t_last = times[g - 1] if 1 <= g <= len(times) else None
        t_first = times[g] if g < len(times) else None
        row["client_downtime_ms"] = _ms(t_last, t_first)
        row["order_to_cutover_ms"] = _ms(o["t_order"], t_first)
        later = orders[i + 1]["ordered_at"] if i + 1 < len(orders) else len(times)
        # the destination's decode: from its second decode on, up to the next order
        row["dest_gaps_ms"] = _gaps_ms(times, g + 2, min(g + gap_tokens, later))
        row["dest_step_ms"] = (
            statistics.median(row["dest_gaps_ms"]) if row["dest_gaps_ms"] else None
        )
        # the source while the pre-copy ran (after the order, before the cut-over)
        row["source_gaps_ms"] = _gaps_ms(times, o["ordered_at"] + 1, g) if pre else []
        before, at = expected_loads(prompt_len, g, pre, block)
        wire = wire_blocks(prompt_len, g, pre, block)
        row.update(
            tokens_before_cutover=before,
            tokens_at_cutover_loaded=at,
            bytes_before_cutover=before * bytes_per_token,
            bytes_at_cutover=at * bytes_per_token,
            wire_blocks=list(wire),
        )
        # vLLM's counter per instance over the stream: each destination once
        measured = loaded_by_instance[o["dest"]] if dests.count(o["dest"]) == 1 else None
        row["measured_tokens_loaded"] = measured
        row["kv_check"] = None if measured is None else measured == before + at
        cut = timelines.get(a.get("cutover_xfer_id", ""), {})
        admitted, sent, received = (
            cut.get("d_admitted"),
            cut.get("d_transfer_kv_sent"),
            cut.get("d_kv_received"),
        )
        row["breakdown_ms"] = {
            "until_admitted_ms": _ms(t_last, admitted),
            "admitted_to_transfer_kv_ms": _ms(admitted, sent),
            "transfer_ms": _ms(sent, received),
            "to_first_token_ms": _ms(received, t_first),
        }
        row["delta_transfer_ms"] = row["breakdown_ms"]["transfer_ms"]
        # the transfer's stages on the source (its events under the same id)
        got, posted = cut.get("transfer_kv"), cut.get("bypass_sent")
        row["transfer_detail_ms"] = {
            "to_source_ms": _ms(sent, got),
            "source_to_send_ms": _ms(got, posted),
            "send_to_landed_ms": _ms(posted, received),
        }
        precopy = timelines.get(a.get("precopy_xfer_id", ""), {})
        row["precopy_transfer_ms"] = (
            _ms(precopy.get("d_transfer_kv_sent"), precopy.get("d_kv_received")) if pre else None
        )
    return rows


# ------------------------------------------------------------------ summaries


def summarize(values: Sequence[float | None]) -> dict[str, float]:
    from rapidkv.bench.common.stats import summarize as stats

    return stats([v for v in values if v is not None])


def _p50(values: Sequence[float | None]) -> float | None:
    s = summarize(values)
    return s["p50"] if s["n"] else None


def _mode_summary(rows: list[dict[str, Any]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if r["ok"]]

    def col(key: str) -> dict[str, float]:
        return summarize([r.get(key) for r in ok])

    checked = [r for r in ok if r["kv_check"] is not None]
    return {
        "migrations": len(rows),
        "ok": len(ok),
        "failed": len(rows) - len(ok),
        "client_downtime_ms": col("client_downtime_ms"),
        "router_downtime_ms": col("router_downtime_ms"),
        "cutover_ms": col("cutover_ms"),
        "precopy_ms": col("precopy_ms"),
        "total_ms": col("total_ms"),
        "order_to_cutover_ms": col("order_to_cutover_ms"),
        "tokens_at_cutover": col("tokens_at_cutover"),
        "precopy_tokens": col("precopy_tokens"),
        "bytes_before_cutover": col("bytes_before_cutover"),
        "bytes_at_cutover": col("bytes_at_cutover"),
        "delta_transfer_ms": col("delta_transfer_ms"),
        "precopy_transfer_ms": col("precopy_transfer_ms"),
        "dest_decode_step_ms": summarize([g for r in ok for g in r["dest_gaps_ms"]]),
        "source_step_during_precopy_ms": summarize([g for r in ok for g in r["source_gaps_ms"]]),
        "breakdown_ms_p50": {k: _p50([r["breakdown_ms"][k] for r in ok]) for k in BREAKDOWN},
        "transfer_detail_ms_p50": {
            k: _p50([r["transfer_detail_ms"][k] for r in ok]) for k in TRANSFER_DETAIL
        },
        "kv_check": {
            "checked": len(checked),
            "mismatches": sum(1 for r in checked if not r["kv_check"]),
        },
        "runs": len(runs),
        "hard_mismatches": sum(1 for r in runs if r.get("outcome") == "mismatch"),
    }


def _median_int(s: dict[str, float]) -> int | None:
    return round(s["p50"]) if s["n"] else None


def paired_downtime_ratio(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """p50 of the pre-copy's client-side downtime over stop-and-copy's, and
    its 95 % bootstrap interval with the rounds as paired blocks (both modes
    of a round moved the same prompt, back to back): `ratio`, `ci95`,
    `rounds`; None figures without a round that has both."""
    import statistics

    from rapidkv.bench.common.stats import paired_ratio_interval

    by_round: dict[int, tuple[list[float], list[float]]] = {}
    for r in rows:
        pre, sac = by_round.setdefault(r["round"], ([], []))
        (pre if r["mode"] == "precopy" else sac).append(r["client_downtime_ms"])
    blocks = [(a, b) for a, b in by_round.values() if a and b]
    if not blocks:
        return {"ratio": None, "ci95": None, "rounds": 0}
    a = [v for block in blocks for v in block[0]]
    b = [v for block in blocks for v in block[1]]
    lo, hi = paired_ratio_interval(blocks)
    return {
        "ratio": statistics.median(a) / statistics.median(b),
        "ci95": [lo, hi],
        "rounds": len(blocks),
    }


def build_report(result: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """The JSON report from `run.Bench.run`'s result and the run's `meta`."""
    rows = list(result["rows"])
    runs = [r for r in result["runs"] if not r["warmup"]]
    lengths = sorted({r["length"] for r in runs})
    out_lengths: dict[str, Any] = {}
    for n in lengths:
        modes = {}
        for mode in MODES:
            mode_rows = [r for r in rows if r["length"] == n and r["mode"] == mode]
            mode_runs = [r for r in runs if r["length"] == n and r.get("mode") == mode]
            if mode_rows or mode_runs:
                modes[mode] = _mode_summary(mode_rows, mode_runs)
        ok_rows = [r for r in rows if r["length"] == n and r["ok"]]
        refs = [r for r in runs if r["length"] == n and r["mode"] == "reference"]
        nan = summarize([])
        pre = modes.get("precopy", {})
        sac = modes.get("stop_and_copy", {})
        out_lengths[str(n)] = {
            "downtime_ms": pre.get("client_downtime_ms", nan),
            "router_downtime_ms": pre.get("router_downtime_ms", nan),
            "stop_and_copy_downtime_ms": sac.get("client_downtime_ms", nan),
            "stop_and_copy_router_downtime_ms": sac.get("router_downtime_ms", nan),
            "bytes_before_cutover": _median_int(pre.get("bytes_before_cutover", nan)),
            "bytes_at_cutover": _median_int(pre.get("bytes_at_cutover", nan)),
            "stop_and_copy_bytes_at_cutover": _median_int(sac.get("bytes_at_cutover", nan)),
            "decode_step_ms": summarize([g for r in ok_rows for g in r["dest_gaps_ms"]]),
            "unmigrated_decode_step_ms": summarize([g for r in refs for g in r["gaps_ms"]]),
            "delta_transfer_ms": pre.get("delta_transfer_ms", nan),
            "stop_and_copy_transfer_ms": sac.get("delta_transfer_ms", nan),
            "precopy_over_stop_and_copy": paired_downtime_ratio(
                [r for r in ok_rows if r.get("client_downtime_ms") is not None]
            ),
            "modes": modes,
            "references": len(refs),
            "hard_mismatches": sum(
                1 for r in runs if r["length"] == n and r["outcome"] == "mismatch"
            ),
        }
    ok_rows = [r for r in rows if r["ok"]]
    warm = result["warmup"]
    failed = [r for r in rows if not r["ok"]] + [r for r in warm if not r["ok"]]
    bad_runs = [r for r in result["runs"] if r["outcome"] not in ("match", "reference")]
    errors = [
        f"{r['length']} tokens, {r.get('mode')}, round {r['round']}"
        f"{' (warm-up)' if r['warmup'] else ''}: {r['outcome']}: {r.get('error')}"
        for r in bad_runs
    ] + [
        f"{r['length']} tokens, {r['mode']}, round {r['round']}, migration {r['k']}: {r['error']}"
        for r in failed
    ]
    checked = [r for r in ok_rows + warm if r.get("kv_check") is not None]
    all_migrations = [r for r in ok_rows + warm if r["ok"]]
    block_bytes = result["block"] * result["bytes_per_token"]
    expected_wire = sum(sum(r["wire_blocks"]) for r in all_migrations) * block_bytes
    sent = result.get("bytes_sent") or {}
    report: dict[str, Any] = {
        "meta": meta,
        "lengths": out_lengths,
        "decode_step_ms": summarize([g for r in ok_rows for g in r["dest_gaps_ms"]]),
        "unmigrated_decode_step_ms": summarize(
            [g for r in runs if r["mode"] == "reference" for g in r["gaps_ms"]]
        ),
        "migrations": {
            "ok": len(ok_rows),
            "failed": sum(1 for r in rows if not r["ok"]),
            "warmup_ok": sum(1 for r in warm if r["ok"]),
            "warmup_failed": sum(1 for r in warm if not r["ok"]),
        },
        "hard_mismatches": sum(1 for r in result["runs"] if r["outcome"] == "mismatch"),
        "incomplete_runs": sum(1 for r in bad_runs if r["outcome"] != "mismatch"),
        "kv_check": {
            "checked": len(checked),
            "mismatches": sum(1 for r in checked if not r["kv_check"]),
        },
        "bytes_sent": {
            "measured": sum(sent.values()) if sent else None,
            "expected_whole_blocks": expected_wire,
            "by_instance": sent,
        },
        "errors": errors,
    }
    report["acceptance"] = acceptance(out_lengths)
    report["ok"] = not errors
    report["runs"] = [{k: v for k, v in r.items() if k != "gaps_ms"} for r in result["runs"]]
    report["samples"] = [{k: v for k, v in r.items()} for r in rows]
    report["warmup_samples"] = warm
    return report


def acceptance(lengths: dict[str, Any]) -> dict[str, Any]:
    """The issue's checks on the pre-copy's client-side downtime p50: within
    3 destination decode steps + the delta's transfer at every length; at the
    longest no more than 1.5x at the shortest; below stop-and-copy's at the
    longest. A check that cannot be evaluated is None (and `met` too)."""
    out: dict[str, Any] = {"per_length": {}}
    keys = sorted(lengths, key=int)
    for n in keys:
        e = lengths[n]
        down, step, delta = (
            e["downtime_ms"]["p50"] if e["downtime_ms"]["n"] else None,
            e["decode_step_ms"]["p50"] if e["decode_step_ms"]["n"] else None,
            e["delta_transfer_ms"]["p50"] if e["delta_transfer_ms"]["n"] else None,
        )
        bound = None if step is None or delta is None else DOWNTIME_STEPS * step + delta
        out["per_length"][n] = {
            "downtime_ms_p50": down,
            "decode_step_ms_p50": step,
            "delta_transfer_ms_p50": delta,
            "bound_ms": bound,
            "met": None if down is None or bound is None else down <= bound,
        }
    checks = [v["met"] for v in out["per_length"].values()]
    out["within_decode_steps"] = None if None in checks or not checks else all(checks)
    shortest, longest = (keys[0], keys[-1]) if keys else (None, None)
    p50 = {n: out["per_length"][n]["downtime_ms_p50"] for n in keys}
    ratio = None
    if len(keys) > 1 and p50[longest] is not None and p50[shortest]:
        ratio = p50[longest] / p50[shortest]
    out["flat"] = {
        "shortest": shortest,
        "longest": longest,
        "ratio": ratio,
        "bound": FLAT_RATIO,
        "met": None if ratio is None else ratio <= FLAT_RATIO,
    }
    sac = None
    if longest is not None and lengths[longest]["stop_and_copy_downtime_ms"]["n"]:
        sac = lengths[longest]["stop_and_copy_downtime_ms"]["p50"]
    paired = lengths[longest].get("precopy_over_stop_and_copy") if longest else None
    ci = (paired or {}).get("ci95")
    out["beats_stop_and_copy"] = {
        "length": longest,
        "precopy_ms_p50": p50.get(longest) if longest else None,
        "stop_and_copy_ms_p50": sac,
        "ratio": (paired or {}).get("ratio"),
        "ci95": ci,
        # the interval holds 1: the difference is within this run's spread
        "within_spread": None if ci is None else ci[0] <= 1.0 <= ci[1],
        "met": None if sac is None or p50.get(longest) is None else p50[longest] < sac,
    }
    verdicts = [out["within_decode_steps"], out["flat"]["met"], out["beats_stop_and_copy"]["met"]]
    out["met"] = None if None in verdicts else all(verdicts)
    return out


# ------------------------------------------------------------------ printing


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:.{digits}f}"


def _s(s: dict[str, float], key: str = "p50", digits: int = 1) -> str:
    return _f(s[key], digits) if s.get("n") else "-"


def _verdict(met: bool | None) -> str:
    return "not evaluated" if met is None else ("PASS" if met else "FAIL")


def print_report(report: dict[str, Any], out: IO[str]) -> None:
    meta = report["meta"]
    w = out.write
    w(
        f"rapidkv bench migrate: {meta.get('cpu') or 'unknown CPU'}, {meta.get('cores')} cores, "
        f"git {meta.get('git')}, {meta['rounds']} rounds, {meta['max_tokens']} output tokens, "
        f"{meta['kv_bytes_per_token']} B of KV per token\n"
    )
    link = meta.get("netns_link")
    if link:
        w(
            f"A in {link['a']['netns']}, B in {link['b']['netns']}, the KV across "
            f"{link['qdisc']}; one TCP stream across it: {link['tcp']['gbps']} GB/s\n"
        )
    cut = {k: v for k, v in meta["lengths_requested"].items() if int(k) != v}
    if cut:
        w(
            "lengths cut to fit max_model_len "
            f"{meta['max_model_len']} with {meta['max_tokens']} output tokens: "
            + ", ".join(f"{k} -> {v}" for k, v in cut.items())
            + "\n"
        )
    w("times in ms; downtime = the client's last token from the source to its first from the\n")
    w("destination (router: the router's own measure); KiB of KV loaded before / at the cut-over\n")
    head = (
        "| length | mode | downtime p50 | p99 | router p50 | p99 | cut-over p50 | pre-copy p50 "
        "| KiB before | KiB at | transfer p50 | dest step p50 | ok / failed | mismatches |\n"
    )
    w(head)
    w("|" + "---|" * (head.count("|") - 1) + "\n")
    for n, e in report["lengths"].items():
        for mode, m in e["modes"].items():
            kib_before = m["bytes_before_cutover"]
            kib_at = m["bytes_at_cutover"]
            w(
                f"| {n} | {mode} | {_s(m['client_downtime_ms'])} | "
                f"{_s(m['client_downtime_ms'], 'p99')} | {_s(m['router_downtime_ms'])} | "
                f"{_s(m['router_downtime_ms'], 'p99')} | {_s(m['cutover_ms'])} | "
                f"{_s(m['precopy_ms'])} | "
                f"{_f(kib_before['p50'] / 1024 if kib_before['n'] else None, 0)} | "
                f"{_f(kib_at['p50'] / 1024 if kib_at['n'] else None, 0)} | "
                f"{_s(m['delta_transfer_ms'], digits=2)} | "
                f"{_s(m['dest_decode_step_ms'], digits=2)} | "
                f"{m['ok']} / {m['failed']} | {m['hard_mismatches']} |\n"
            )
    w(
        f"decode step p50 (the destinations' gaps after their cut-overs): "
        f"{_s(report['decode_step_ms'], digits=2)} ms; unmigrated: "
        f"{_s(report['unmigrated_decode_step_ms'], digits=2)} ms\n"
    )
    for n, e in report["lengths"].items():
        pre = e["modes"].get("precopy")
        if pre:
            b = pre["breakdown_ms_p50"]
            w(
                f"{n} tokens, pre-copy downtime p50 by stage: "
                + ", ".join(f"{k.removesuffix('_ms')} {_f(b[k], 2)}" for k in BREAKDOWN)
                + " (transfer: "
                + ", ".join(
                    f"{k.removesuffix('_ms')} {_f(pre['transfer_detail_ms_p50'][k], 2)}"
                    for k in TRANSFER_DETAIL
                )
                + f"); source step during the pre-copy p50 "
                f"{_s(pre['source_step_during_precopy_ms'], digits=2)}\n"
            )
    kv = report["kv_check"]
    w(
        f"KV loaded, against the destinations' vLLM counter: {kv['checked']} migrations "
        f"checked, {kv['mismatches']} differ"
        + (" (WARNING: the byte figures are not what was loaded)" if kv["mismatches"] else "")
        + "\n"
    )
    sent = report["bytes_sent"]
    if sent["measured"] is not None:
        w(
            f"the sources' bytes_sent: {sent['measured']:.0f}; whole blocks expected from the "
            f"migrations (warm-up included): {sent['expected_whole_blocks']}\n"
        )
    acc = report["acceptance"]
    w("acceptance (pre-copy, client-side downtime p50):\n")
    for n, a in acc["per_length"].items():
        w(
            f"  {n} tokens: {_f(a['downtime_ms_p50'])} <= {DOWNTIME_STEPS} x "
            f"{_f(a['decode_step_ms_p50'], 2)} (decode step) + {_f(a['delta_transfer_ms_p50'], 2)} "
            f"(delta's transfer) = {_f(a['bound_ms'])}: {_verdict(a['met'])}\n"
        )
    flat = acc["flat"]
    w(
        f"  longest ({flat['longest']}) / shortest ({flat['shortest']}): {_f(flat['ratio'], 2)} "
        f"<= {FLAT_RATIO}: {_verdict(flat['met'])}\n"
    )
    sac = acc["beats_stop_and_copy"]
    ci = sac.get("ci95")
    paired = (
        f" (paired ratio {_f(sac['ratio'], 3)}, 95 % CI {_f(ci[0], 3)}-{_f(ci[1], 3)}"
        f"{': within the spread' if sac['within_spread'] else ''})"
        if ci
        else ""
    )
    w(
        f"  at {sac['length']} tokens, pre-copy {_f(sac['precopy_ms_p50'])} < stop-and-copy "
        f"{_f(sac['stop_and_copy_ms_p50'])}{paired}: {_verdict(sac['met'])}\n"
    )
    w(f"  met: {acc['met']}\n")
    mig = report["migrations"]
    w(
        f"migrations: {mig['ok']} ok, {mig['failed']} failed (warm-up {mig['warmup_ok']} ok, "
        f"{mig['warmup_failed']} failed); hard mismatches {report['hard_mismatches']}; "
        f"incomplete runs {report['incomplete_runs']}\n"
    )
    for e in report["errors"][:20]:
        w(f"  error: {e}\n")
    w(f"result: {'OK' if report['ok'] else 'FAILED'}\n")
