"""`rapidkv bench chaos`'s report (`chaos/report.py`): error normalization
and the verdict."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rapidkv.bench.chaos.report import build_report, normalize


@pytest.mark.unit
def test_errors_that_differ_only_by_address_id_or_number_count_together() -> None:
    a = "decode instance http://127.0.0.1:41235 did not answer: refused (xfer 0123456789abcdef01)"
    b = "decode instance http://127.0.0.1:5001 did not answer: refused (xfer fedcba9876543210aa)"
    assert normalize(a) == normalize(b) == "decode instance URL did not answer: refused (xfer ID)"
    assert normalize("HTTP 503: 2 down, 1.5s") == "HTTP 503: N down, Ns"


def _outcome(kind: str, error: str | None = None):
    from rapidkv.bench.chaos.driver import Outcome

    return Outcome(0, kind, False, None, error=error)


def _report(outcomes, free=(100.0, 100.0), recovery=(1.0, 2.0), idle=True):
    inc = SimpleNamespace(baseline_free_blocks=100.0, final={"transfers_ok": 5.0})
    quiesce = {
        "idle": idle,
        "timeout_s": 90.0,
        "took_s": 0.1,
        "instances": {
            role: {"free_blocks": f, "running": 0.0, "stats": {"transfers_ok": 1.0}}
            for role, f in zip(("prefill", "decode"), free, strict=True)
        },
    }
    restarts = [
        SimpleNamespace(role=role, recovery_s=s, error=None, row=dict)
        for role, s in zip(("prefill", "decode"), recovery, strict=True)
    ]
    return build_report(
        outcomes,
        options={},
        restarts=restarts,
        incarnations={"prefill": [inc, inc], "decode": [inc]},
        quiesce=quiesce,
        warmup=[],
        timing={},
        extra={},
    )


@pytest.mark.unit
def test_the_verdict_fails_on_hung_leak_mismatch_or_unclear_failure_only() -> None:
    fine = [_outcome("completed"), _outcome("aborted"), _outcome("failed_clear", "HTTP 503: x")]
    r = _report(fine)
    assert r["ok"] and r["acceptance"]["met"] and r["failed_clear"] == 1
    assert r["leaked_blocks"] == {"prefill": 0.0, "decode": 0.0}
    assert r["counters"]["prefill"]["transfers_ok"] == 6.0  # the killed process's, then the last
    assert r["counters"]["decode"]["transfers_ok"] == 1.0
    for bad in ("hung", "mismatch", "failed_unclear"):
        assert not _report([*fine, _outcome(bad, "x")])["ok"], bad
    assert not _report(fine, free=(100.0, 99.0))["ok"]
    assert not _report(fine, idle=False)["ok"]  # the quiesce timed out
    slow = _report(fine, recovery=(1.0, 6.0))
    assert slow["ok"] and not slow["acceptance"]["met"]
    assert not _report(fine, recovery=(1.0, None))["ok"]
