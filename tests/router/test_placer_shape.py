"""The router's `Placer` with a `Specializer`: the shape it sets is what
`decide` places by, and the configured roles come back."""

from __future__ import annotations

import pytest

from rapidkv.router.config import Instance, Member
from rapidkv.router.placement import SLO, Policy, Specializer
from rapidkv.router.placement.placer import Placer

pytestmark = pytest.mark.unit

BOTH = frozenset({"prefill", "decode"})


def placer(tpot_ms: float, shape: bool = True) -> Placer:
    members = (Member(Instance("http://a:1"), BOTH), Member(Instance("http://b:1"), BOTH))
    return Placer(members, SLO(250.0, tpot_ms), Policy(), Specializer() if shape else None)


def body(tokens: int) -> dict:
    return {"prompt": list(range(1, tokens + 1)), "max_tokens": 16}


def serve(p: Placer, count: int, tokens: int = 500) -> list[str]:
    """`count` requests of `tokens` at once, each over before the next
    (answers that teach nothing: the models keep their priors); their
    placements' kinds."""
    kinds = []
    for k in range(count):
        decision, request = p.decide(body(tokens), "completions", splittable=False)
        p.dispatched(f"r{k}", decision.placement, request.prompt_tokens, request.output_tokens)
        if decision.kind != "local":
            p.prefill_done(f"r{k}", ok=False)
        p.finished(f"r{k}", 16, ok=False)
        kinds.append(decision.kind)
    return kinds


def test_a_burst_under_a_tight_tpot_specialises_the_fleet_and_no_prompt_stays_local() -> None:
    """250-token prompts, which the prefill instance alone computes within
    the TTFT SLO at the burst's rate (500-token ones it could not: the pair
    stays unpinned, `test_placement_shape`)."""
    p = placer(9.0)
    kinds = serve(p, 40, 250)  # 16-token answers, all within a moment
    assert p.shape is not None and p.shape.specialized
    assert [load.role for load in p.fleet.view()] == ["prefill", "decode"]
    assert kinds[-10:] == ["pd"] * 10  # P computes, D decodes
    assert kinds[0] == "local"  # before the rate built up
    unshaped = placer(9.0, shape=False)
    assert "local" in serve(unshaped, 40, 250)[-10:]
    assert [load.role for load in unshaped.fleet.view()] == ["any", "any"]


def test_a_loose_tpot_keeps_the_roles_as_configured() -> None:
    p = placer(100.0)
    assert "local" in serve(p, 40)[-10:]
    assert p.shape is not None and not p.shape.specialized and p.shape.switches == 0
    assert [load.role for load in p.fleet.view()] == ["any", "any"]


def test_the_shape_counts_only_the_prompt_work_no_instance_holds_cached() -> None:
    """A burst of conversations' next turns: 500-token prompts of which every
    instance holds 480 cached. The fleet's shape sees 20-token prompts and
    stays as configured, where the same burst uncached specialises it."""
    p = placer(9.0)
    for k in range(40):
        decision, request = p.decide(
            body(500), "completions", False, list(range(1, 501)), (480, 480)
        )
        p.dispatched(f"r{k}", decision.placement, request.prompt_tokens, request.output_tokens)
        if decision.kind != "local":
            p.prefill_done(f"r{k}", ok=False)
        p.finished(f"r{k}", 16, ok=False)
    assert p.shape is not None and p.shape.prompt_tokens == pytest.approx(20)
    assert not p.shape.specialized
    assert [load.role for load in p.fleet.view()] == ["any", "any"]
