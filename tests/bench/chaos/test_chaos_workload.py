"""`rapidkv bench chaos`'s workload (`chaos/workload.py`): seeded plans and
where each abort falls."""

from __future__ import annotations

import pytest

from rapidkv.bench.chaos.workload import PHASES, Plan, Timing, abort_point, make_plans


@pytest.mark.unit
def test_plans_are_seeded_and_mix_lengths_streams_and_every_abort_phase() -> None:
    kw = dict(
        seed=3,
        min_len=5,
        max_len=900,
        min_tokens=4,
        max_tokens=48,
        stream_share=0.5,
        abort_share=0.2,
    )
    plans = make_plans(500, **kw)
    assert plans == make_plans(500, **kw)
    assert all(5 <= p.prompt_len <= 900 and 4 <= p.max_tokens <= 48 for p in plans)
    assert 200 < sum(p.stream for p in plans) < 300
    aborted = [p for p in plans if p.abort]
    assert 70 < len(aborted) < 130
    assert {p.abort for p in aborted} == set(PHASES)
    assert {(p.abort, p.stream) for p in aborted} == {(a, s) for a in PHASES for s in (0, 1)}


@pytest.mark.unit
def test_abort_points_fall_in_their_phase_of_the_expected_timing() -> None:
    timing = Timing()
    for n in range(10):  # TTFT 50 ms + 0.1 ms per prompt token; 10 ms between tokens
        timing.add(100 * n + 10, 0.05 + 0.0001 * (100 * n + 10), 0.01)
    assert timing.ttft(500) == pytest.approx(0.1)
    assert timing.tpot() == pytest.approx(0.01)

    def point(phase: str, stream: bool, u: float) -> object:
        return abort_point(Plan(0, 500, 21, stream, phase, u), timing)

    assert point("sent", False, 0.99).after_s <= 0.005
    assert 0.005 <= point("prefill", True, 0.0).after_s < point("prefill", True, 0.99).after_s
    assert point("prefill", True, 0.99).after_s <= 0.08
    assert 0.08 <= point("transfer", False, 0.0).after_s < point("transfer", False, 0.99).after_s
    assert point("transfer", False, 0.99).after_s <= 0.13
    assert point("decode", True, 0.0).after_tokens == 1
    assert point("decode", True, 0.999).after_tokens == 20  # never the whole answer
    assert point("decode", False, 0.0).after_s == pytest.approx(0.1 + 0.1 * 0.2)
    assert abort_point(Plan(0, 500, 21, True, None, 0.5), timing) is None
