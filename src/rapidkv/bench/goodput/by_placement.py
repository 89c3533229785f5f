"""`rapidkv bench goodput`: one rate's requests by where an adaptive router
placed them, and its predictions against what the client measured. Pure: no I/O.

Each request a rapidkv router served carries its ``x-rapidkv-placement``
header: the kind (``local``, ``pd``, ``split``, ``fetch``), the reason, and,
from an adaptive router (`placement.Decision.header_value`), the prompt
tokens its prefix index said the decoding instance (``hit``) and a fetch's
or a PD's prefill instance (``prefill_hit``) hold cached (absent: 0), and
the TTFT and TPOT the policy predicted (a fixed router predicts nothing: its
ratios are nan). Per kind: how many, the shares meeting each SLO, the
measured p50s, the mean hits, and the median of measured over predicted for
each of TTFT and TPOT (1: the policy saw it right; above 1: it was
optimistic, and placed requests where they missed). Failed requests, and
those without the header, are left out.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from rapidkv.bench.goodput.slo import SLO, Outcome, attainment
from rapidkv.router.placement.policy import parse_header


def _number(fields: dict[str, str], key: str) -> float:
    try:
        return float(fields[key])
    except (KeyError, ValueError):
        return math.nan


def _median_ratio(measured: Sequence[float], predicted: Sequence[float]) -> float:
    ratios = [m / p for m, p in zip(measured, predicted, strict=True) if math.isfinite(m) and p > 0]
    return statistics.median(ratios) if ratios else math.nan


def _mean_tokens(rows: Sequence[dict[str, str]], key: str) -> float:
    values = [_number(f, key) if key in f else 0.0 for f in rows]
    finite = [v for v in values if math.isfinite(v)]
    return statistics.fmean(finite) if finite else math.nan


def _p50(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


def by_placement(
    headers: Sequence[str | None], outcomes: Sequence[Outcome], slo: SLO | None
) -> dict[str, dict[str, Any]]:
    """Per placement kind, over the requests whose header is known (`headers`
    and `outcomes` in the same order): see the module docstring."""
    groups: dict[str, list[tuple[dict[str, str], Outcome]]] = {}
    for header, outcome in zip(headers, outcomes, strict=True):
        if header is None or outcome.error:
            continue
        fields = parse_header(header)
        groups.setdefault(fields.get("kind", "?"), []).append((fields, outcome))
    out: dict[str, dict[str, Any]] = {}
    for kind, rows in sorted(groups.items()):
        got = [o for _, o in rows]
        ttft = [o.ttft_ms for o in got]
        tpot = [o.tpot_ms for o in got]
        row: dict[str, Any] = (
            dict(attainment(got, slo)) if slo is not None else {"requests": len(got)}
        )
        row.update(
            ttft_p50_ms=_p50(ttft),
            tpot_p50_ms=_p50(tpot),
            hit_tokens_mean=_mean_tokens([f for f, _ in rows], "hit"),
            prefill_hit_tokens_mean=_mean_tokens([f for f, _ in rows], "prefill_hit"),
            ttft_measured_over_predicted=_median_ratio(
                ttft, [_number(f, "ttft_ms") for f, _ in rows]
            ),
            tpot_measured_over_predicted=_median_ratio(
                tpot, [_number(f, "tpot_ms") for f, _ in rows]
            ),
        )
        out[kind] = row
    return out
