"""The simulator next to real runs: predicted goodput against `bench goodput`'s.

`compare(real, fit, ...)` reads a `bench goodput --json` document:

    {"workloads": {"<workload>": {
        "slo": {"ttft_ms": ..., "tpot_ms": ...},          # optional
        "requests_per_rate": N,                            # optional (or "requests",
                                                           #  or meta.requests_per_rate)
        "configs": {"<config>": {
            "goodput_req_s": G,                            # optional: from attainment
            "attainment": {"<rate>": fraction, ...},
            "instances": 2}}}}}                            # optional, default 2

and, for every workload the simulator knows (`workload.WORKLOADS`) and every
configuration it can map to a policy (`policy_for`: ``dp2`` -> ``dp``,
``vllm-nixl*`` -> ``nixl``, ``*adaptive*`` -> ``adaptive`` (``*-unshaped``:
``adaptive-unshaped``, ``*-busy-crossings``: ``adaptive-busy-crossings``,
``*-blind``: ``adaptive-blind``), ``*-nofetch`` -> ``adaptive-nofetch``, ``*-local``
(two replicas behind the router) -> ``dp``, any other ``rapidkv*`` ->
``fixed-pd``, ``single`` -> ``dp`` on one instance, sent directly:
`target_for`), simulates the same rates with the same SLOs
(the real run's when it gives them, else the fit's) on the testbed as it is
(`engine`'s ``shared_core`` for a routed pair: the router and the client on
instance 0's core), takes the goodput of both by `bench goodput`'s own rule
(`rapidkv.bench.goodput.slo.goodput`: the last swept rate before the first
miss, so a simulated pass above a simulated miss counts no more than a real
one does), and reports both with the relative error ``(simulated - measured) / measured``
(`relative_error`). Anything it cannot use is listed in ``skipped`` with
the reason, never fatal. A comparison is `within` tolerance (`TOLERANCE`,
15 %) when every error is defined and at most that in size.

The step rule cannot resolve 15 %: a sweep's steps are coarser (10 to 12
req/s is 20 %), so one rate's attainment landing at 0.87 instead of 0.91
moves a goodput by a whole step. Each configuration therefore also has its
*crossing* (`crossing`: where attainment falls through 90 %, linear between
the last pass and the first miss, as `bench goodput`'s
`goodput_interpolated_req_s`), measured and simulated, with its own error
(`crossing_relative_error`, `crossing_within`, and `crossing_within` over all). On the workloads of
shared prefixes (`shared-prefix`, `multiturn`: prefix caching, every cache
empty at each rate, `bench goodput`'s arrivals and conversations; for
`shared-prefix` the run's `groups` and its `warm_up` at each rate, `as_run`) each
configuration also has the prefix caches' hit share over all its rates,
measured (`prefix_cache_hit_fraction`: of the prompt tokens the servers
counted, the share their caches served) and simulated, and the share of the
router's prompt tokens it fetched (`fetched_fraction`). Where the real
run gives its goodput's bootstrap interval (`goodput_interval_req_s`, from
`bench goodput` since 2026-12-04), each configuration also says whether the
simulated goodput lies inside it (`inside_interval`): the sampling noise of
the real run alone, against which a 15 % error of one sweep step can be told
from a wrong model.

With ``calibrated`` (`bench simulate --compare --calibrate`) each workload
is simulated with the fit calibrated on the run's own ``single_c1``
(`calibrate`: its TTFT and TPOT p50, which the run's SLOs come from), and
the workload's ``calibration`` says how; a workload without one keeps the
fit as given (said in ``skipped``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rapidkv.bench.common.shared_prefix import SharedPrefix
from rapidkv.bench.goodput.slo import goodput
from rapidkv.bench.simulate.calibrate import calibrate
from rapidkv.bench.simulate.fit import Fit
from rapidkv.bench.simulate.goodput import (
    PREFIX_REFERENCE_REQUESTS,
    REFERENCE_REQUESTS,
    reference_slo,
    run_point,
)
from rapidkv.bench.simulate.workload import WORKLOADS, requests
from rapidkv.router.placement import SLO

TOLERANCE = 0.15


@dataclass(frozen=True)
class Target:
    """What the simulator runs for one real configuration."""

    policy: str
    instances: int = 2
    routed: bool = True  # through a router (or a proxy)
    shared_core: bool = True  # the testbed's: router and client on instance 0's core


def target_for(config: str) -> Target | None:
    """The simulated counterpart of a `bench goodput` configuration (None: not modelled)."""
    c = config.lower()
    if c == "single":
        return Target("dp", 1, routed=False, shared_core=False)
    if c.endswith("-nofetch"):  # rapidkv-kv-aware-nofetch
        return Target("adaptive-nofetch")
    if "adaptive" in c:
        for variant in ("unshaped", "busy-crossings", "blind"):
            if c.endswith(f"-{variant}"):
                return Target(f"adaptive-{variant}")
        return Target("adaptive")
    if "nixl" in c:
        return Target("nixl")
    if c.startswith("dp") or c.endswith("-local"):  # rapidkv-local: two replicas
        return Target("dp")
    if c.startswith("rapidkv"):
        return Target("fixed-pd")
    return None


def max_num_seqs_of(real: dict[str, Any]) -> int | None:
    """The ``--max-num-seqs`` a `bench goodput` run gave its servers (the last
    one in ``meta.server_args``, as vLLM's parser takes it), or None."""
    meta = real.get("meta")
    args = meta.get("server_args") if isinstance(meta, dict) else None
    if not isinstance(args, list):
        return None
    found = None
    for arg, value in zip(args, [*args[1:], None], strict=True):
        if arg == "--max-num-seqs":
            text = value
        elif isinstance(arg, str) and arg.startswith("--max-num-seqs="):
            text = arg.partition("=")[2]
        else:
            continue
        found = int(text) if isinstance(text, str) and text.isdigit() and int(text) > 0 else None
    return found


def policy_for(config: str) -> str | None:
    """The simulator's policy for a `bench goodput` configuration (None: not modelled)."""
    target = target_for(config)
    return None if target is None else target.policy


def goodput_rule(attainment: dict[float, float]) -> float:
    """`bench goodput`'s goodput of ``{rate: attainment}``: the last rate before
    the first miss (0 when none passes)."""
    return goodput(attainment).req_s or 0.0


def crossing(attainment: dict[float, float]) -> float:
    """Where attainment crosses 90 %, linearly between the last passing rate
    and the first miss (`slo.goodput`'s `interpolated_req_s`); the step rule's
    goodput where there is no crossing inside the sweep (0 below it, the
    highest rate, a lower bound, above it)."""
    g = goodput(attainment)
    if g.interpolated_req_s is not None:
        return g.interpolated_req_s
    return g.req_s or 0.0


def relative_error(simulated: float, measured: float) -> float | None:
    """``(simulated - measured) / measured``; 0 when both are 0, None when only
    the measured one is (undefined)."""
    if measured == 0:
        return 0.0 if simulated == 0 else None
    return (simulated - measured) / measured


def rates_of(attainment: Any) -> dict[float, float]:
    """``{rate: fraction}`` from a JSON's ``{"<rate>": fraction}`` (others dropped)."""
    out: dict[float, float] = {}
    if not isinstance(attainment, dict):
        return out
    for k, v in attainment.items():
        try:
            rate, frac = float(k), float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(rate) and rate > 0 and math.isfinite(frac):
            out[rate] = frac
    return out


def compare(
    real: Any,
    fit: Fit,
    *,
    seed: int = 0,
    requests_per_instance: int = 50,
    min_requests: int = 400,
    slo_override: tuple[float | None, float | None] = (None, None),
    progress: Callable[[str], None] = lambda _: None,
    tokenizer: str = "auto",
    calibrated: bool = False,
) -> dict[str, Any]:
    """The comparison of the module docstring (`calibrated`: each workload's
    fit calibrated on the run's single c1 where it gives one)."""
    skipped: list[str] = []
    out: dict[str, Any] = {"tolerance": TOLERANCE, "workloads": {}, "skipped": skipped}
    workloads = real.get("workloads") if isinstance(real, dict) else None
    if not isinstance(workloads, dict):
        skipped.append("no 'workloads' object: nothing to compare")
        out["within"] = out["crossing_within"] = False
        out["max_abs_error"] = None
        return out
    errors: list[float | None] = []
    crossing_errors: list[float | None] = []
    for wname, wdata in workloads.items():
        workload = WORKLOADS.get(wname)
        if workload is None or not isinstance(wdata, dict):
            known = ", ".join(WORKLOADS)
            skipped.append(f"workload {wname!r}: not one the simulator knows ({known})")
            continue
        count = _requests_per_rate(real, wdata)
        slo, slo_source = _slo(wdata.get("slo") or real.get("slo"), slo_override)
        caching = bool(getattr(workload, "prefix_caching", False))
        workload = as_run(workload, wdata)
        warm = getattr(workload, "warm_up", 0) if caching else 0
        wfit, calibration = fit, None
        c1 = _single_c1(wdata.get("single_c1"))
        if calibrated and c1 is not None:
            progress(f"compare {wname}: the fit calibrated on the run's single c1")
            calibration = calibrate(
                fit,
                workload,
                *c1,
                count=count or (PREFIX_REFERENCE_REQUESTS if caching else REFERENCE_REQUESTS),
                seed=seed,
                tokenizer=tokenizer,
                warm=warm,
            )
            wfit = calibration.fit
        elif calibrated:
            skipped.append(f"{wname}: no single c1 TTFT and TPOT p50: the fit uncalibrated")
        if slo is None:
            slo, _ = reference_slo(wfit, workload, seed, tokenizer)
            slo = SLO(slo_override[0] or slo.ttft_ms, slo_override[1] or slo.tpot_ms)
            slo_source = "simulated single c1 (the run gave none)"
        wout: dict[str, Any] = {
            "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "source": slo_source},
            "calibration": None if calibration is None else calibration.as_dict(),
            "configs": {},
        }
        configs = wdata.get("configs")
        for cname, cdata in (configs or {}).items() if isinstance(configs, dict) else ():
            target = target_for(cname)
            if target is None or not isinstance(cdata, dict):
                skipped.append(f"{wname}/{cname}: no simulated policy for it")
                continue
            policy = target.policy
            measured_att = rates_of(cdata.get("attainment"))
            if not measured_att:
                skipped.append(f"{wname}/{cname}: no attainment per rate")
                continue
            n = _int(cdata.get("instances")) or target.instances
            measured = _float(cdata.get("goodput_req_s"))
            if measured is None:
                measured = goodput_rule(measured_att)
            interval = _interval(cdata.get("goodput_interval_req_s"))
            measured_count = count or max(min_requests, requests_per_instance * n)
            specs = requests(workload, warm + measured_count, seed, tokenizer)
            points = {}
            for rate in sorted(measured_att):
                progress(f"compare {wname} {cname} ({policy}, {n} instances): {rate:g} req/s")
                points[rate] = run_point(
                    wfit,
                    n,
                    policy,
                    specs,
                    rate,
                    seed,
                    slo,
                    routed=target.routed,
                    shared_core=target.shared_core and n == 2,
                    workload=workload if caching else None,
                    warm_up=warm,
                )
            sim_att = {r: p.attainment for r, p in points.items()}
            simulated = goodput_rule(sim_att)
            err = relative_error(simulated, measured)
            errors.append(err)
            crossings = crossing(measured_att), crossing(sim_att)
            err_crossing = relative_error(crossings[1], crossings[0])
            crossing_errors.append(err_crossing)
            wout["configs"][cname] = {
                "policy": policy,
                "instances": n,
                "requests": len(specs) - warm,
                "warm_up": warm,
                "measured": {
                    "goodput_req_s": measured,
                    "goodput_interval_req_s": interval,
                    "crossing_req_s": crossings[0],
                    "attainment": {f"{r:g}": a for r, a in sorted(measured_att.items())},
                },
                "simulated": {
                    "goodput_req_s": simulated,
                    "crossing_req_s": crossings[1],
                    "attainment": {f"{r:g}": a for r, a in sorted(sim_att.items())},
                    "points": [p.as_dict() for _, p in sorted(points.items())],
                },
                "relative_error": err,
                "within": err is not None and abs(err) <= TOLERANCE,
                "crossing_relative_error": err_crossing,
                "crossing_within": err_crossing is not None and abs(err_crossing) <= TOLERANCE,
                "inside_interval": None
                if interval is None
                else interval[0] <= simulated <= interval[1],
            }
            if caching:
                wout["configs"][cname]["prefix"] = _prefix_figures(cdata, points.values())
        out["workloads"][wname] = wout
    defined = [abs(e) for e in errors if e is not None]
    out["max_abs_error"] = max(defined) if len(defined) == len(errors) and defined else None
    out["within"] = bool(errors) and all(e is not None and abs(e) <= TOLERANCE for e in errors)
    out["crossing_within"] = bool(crossing_errors) and all(
        e is not None and abs(e) <= TOLERANCE for e in crossing_errors
    )
    return out


def table(result: dict[str, Any]) -> str:
    """The comparison as a text table."""
    lines = [
        "workload       config              policy    n  measured  simulated   error"
        "   crossings (90 %)     error  measured 95 %",
    ]
    for wname, w in result.get("workloads", {}).items():
        cal = w.get("calibration")
        if cal:
            m, b = cal["single_c1_measured_ms"], cal["single_c1_simulated_ms"]
            lines.append(
                f"{wname:14s} fit calibrated on the run's single c1 (TTFT / TPOT p50 "
                f"{m['ttft_p50']:.1f} / {m['tpot_p50']:.1f} ms; the fit's "
                f"{b['ttft_p50']:.1f} / {b['tpot_p50']:.1f}): compute x{cal['speed']:.3f}, context "
                f"{cal['context_ms_per_token']:.4f} ms a token"
                + ("" if cal["exact"] else " (TTFT not met)")
            )
        for cname, c in w["configs"].items():
            err = c["relative_error"]
            e = "undefined" if err is None else f"{100 * err:+.1f} %"
            iv = c["measured"].get("goodput_interval_req_s")
            inside = c.get("inside_interval")
            where = "" if iv is None else f"  [{iv[0]:g}, {iv[1]:g}] {'in' if inside else 'out'}"
            cerr = c["crossing_relative_error"]
            ce = "undefined" if cerr is None else f"{100 * cerr:+.1f} %"
            lines.append(
                f"{wname:14s} {cname:19s} {c['policy']:9s} {c['instances']:2d} "
                f"{c['measured']['goodput_req_s']:8.2f}  {c['simulated']['goodput_req_s']:9.2f}"
                f"  {e:>9s}  {c['measured']['crossing_req_s']:7.2f} / "
                f"{c['simulated']['crossing_req_s']:<7.2f} {ce:>9s}{where}"
            )
            if "prefix" in c:
                m, s = c["prefix"]["measured"], c["prefix"]["simulated"]
                lines.append(
                    f"{'':14s} {'':19s} prefix-cache hits {_pct(m['prefix_cache_hit_fraction'])}"
                    f" / {_pct(s['prefix_cache_hit_fraction'])}, router's tokens fetched "
                    f"{_pct(m['fetched_fraction'])} / {_pct(s['fetched_fraction'])}"
                    " (measured / simulated)"
                )
    for s in result.get("skipped", []):
        lines.append(f"skipped: {s}")
    tol = f"{100 * result.get('tolerance', TOLERANCE):.0f} %"
    verdict = "yes" if result.get("within") else "no"
    lines.append(f"every goodput's error within {tol}: {verdict}")
    verdict = "yes" if result.get("crossing_within") else "no"
    lines.append(f"every crossing's error within {tol}: {verdict}")
    return "\n".join(lines)


def _prefix_figures(cdata: dict[str, Any], points: Any) -> dict[str, Any]:
    """The prefix caches' hit share and the router's fetched share over every
    rate, measured (the real run's, None where it has none) and simulated."""
    cached = external = computed = 0
    fetched = placed = 0
    for p in points:
        t = p.prefix
        cached += t["instances"]["cached"]
        external += t["instances"]["external"]
        computed += t["instances"]["computed"]
        fetched += t["placed"]["fetched"]
        placed += sum(t["placed"].values())
    counted = cached + external + computed
    return {
        "measured": {
            "prefix_cache_hit_fraction": _float(cdata.get("prefix_cache_hit_fraction")),
            "fetched_fraction": _float(cdata.get("fetched_fraction")),
        },
        "simulated": {
            "prefix_cache_hit_fraction": cached / counted if counted else None,
            "fetched_fraction": fetched / placed if placed else None,
        },
    }


def _slo(given: Any, override: tuple[float | None, float | None]) -> tuple[SLO | None, str]:
    real = given if isinstance(given, dict) else {}
    ttft = override[0] or _float(real.get("ttft_ms"))
    tpot = override[1] or _float(real.get("tpot_ms"))
    if not (ttft and tpot and ttft > 0 and tpot > 0):
        return None, ""
    if override[0] and override[1]:
        return SLO(ttft, tpot), "options"
    if override[0] or override[1]:
        return SLO(ttft, tpot), "the real run's, and the options where given"
    return SLO(ttft, tpot), "the real run's"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f} %"


def _interval(v: Any) -> tuple[float, float] | None:
    """A JSON `[low, high]` of goodputs, or None."""
    if not isinstance(v, list) or len(v) != 2:
        return None
    low, high = _float(v[0]), _float(v[1])
    return None if low is None or high is None or low > high else (low, high)


def as_run(workload: Any, wdata: dict[str, Any]) -> Any:
    """`workload` as the real run had it: a `SharedPrefix` with the run's
    groups and warm-up at each rate (a run that names no warm-up had none)."""
    if not isinstance(workload, SharedPrefix):
        return workload
    groups = _int(wdata.get("groups")) or workload.groups
    warm_up = wdata.get("warm_up")
    warm_up = warm_up if isinstance(warm_up, int) and not isinstance(warm_up, bool) else 0
    return dataclasses.replace(workload, groups=groups, warm_up=max(warm_up, 0))


def _requests_per_rate(real: dict[str, Any], wdata: dict[str, Any]) -> int | None:
    """The real run's requests per rate, wherever it says (None: not said)."""
    meta = real.get("meta") if isinstance(real.get("meta"), dict) else {}
    for v in (
        wdata.get("requests_per_rate"),
        wdata.get("requests"),
        meta.get("requests_per_rate"),
        real.get("requests_per_rate"),
        real.get("requests"),
    ):
        if _int(v):
            return _int(v)
    return None


def _single_c1(v: Any) -> tuple[float, float] | None:
    """A run's ``single_c1`` as (TTFT p50, TPOT p50), ms; None without both."""
    if not isinstance(v, dict):
        return None
    ttft = v.get("ttft_ms") if isinstance(v.get("ttft_ms"), dict) else {}
    tpot = v.get("tpot_ms") if isinstance(v.get("tpot_ms"), dict) else {}
    pair = _float(ttft.get("p50")), _float(tpot.get("p50"))
    return None if None in pair or min(pair) <= 0 else pair  # type: ignore[return-value]


def _float(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


def _int(v: Any) -> int | None:
    f = _float(v)
    return int(f) if f is not None and f >= 1 else None
