"""`placement`: learned costs, queue state, and the local / PD / split decision."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rapidkv.router.placement import (
    SLO,
    Decision,
    Decode,
    DecodeObservation,
    FleetState,
    InstanceLoad,
    LinearCost,
    Models,
    NoPlacement,
    Option,
    Placement,
    Policy,
    PrefillObservation,
    Priors,
    Request,
    TransferObservation,
    decide,
    options,
)
from rapidkv.router.placement.policy import is_free_split, safe_tpot_ms
from rapidkv.router.placement.state import ROLES, beyond_slots
from rapidkv.router.split import split_point

pytestmark = pytest.mark.unit

IDLE = InstanceLoad(block_size=16)
FASTEST = Policy(ttft_headroom=0.0)  # the lowest TTFT, whatever the SLO's headroom
UNSTITCHED = Policy(stitch=False)  # a PD's first token is D's (--no-prefill-first-token)


def option_for(opts: list[Option], placement: Placement) -> Option:
    (found,) = [o for o in opts if o.placement == placement]
    return found


# the decision, on synthetic loads


def test_a_short_prompt_on_an_idle_fleet_stays_local() -> None:
    d = decide([IDLE, IDLE], Models(2), Request(64, splittable=True))
    assert (d.kind, d.prefill, d.decode, d.reason) == ("local", 0, 0, "lowest-ttft")
    assert d.meets_ttft and d.meets_tpot


def test_a_long_splittable_prompt_on_an_idle_pair_is_split_and_predicted_faster() -> None:
    models, request = Models(2), Request(900, splittable=True)
    d = decide([IDLE, IDLE], models, request, policy=FASTEST)
    assert d.kind == "split" and d.reason == "lowest-ttft"
    assert d.head_tokens % 16 == 0 and 0 < d.head_tokens < 900
    # the head carries the crossing's fixed cost: it is the smaller half
    assert 0.3 * 900 < d.head_tokens < 0.5 * 900
    local = option_for(options([IDLE, IDLE], models, request), Placement("local", 0, 0))
    assert d.ttft_ms < local.ttft_ms - 30


def test_on_an_idle_fleet_a_whole_prompt_never_crosses() -> None:
    """PD on an idle pair is local's prefill plus a transfer."""
    for tokens in (16, 256, 2000):
        d = decide([IDLE, IDLE], Models(2), Request(tokens, splittable=False))
        assert d.kind == "local"


def test_a_long_prompt_behind_a_queue_goes_to_an_idle_prefill_instance() -> None:
    queued = InstanceLoad(decodes=4, waiting_prefills=3, waiting_prefill_tokens=3000)
    spare = InstanceLoad(role="prefill", block_size=16)
    models = Models(2)
    d = decide([queued, spare], models, Request(1500))
    assert (d.kind, d.prefill, d.decode, d.reason) == ("pd", 1, 0, "lowest-ttft")
    local = option_for(options([queued, spare], models, Request(1500)), Placement("local", 0, 0))
    assert d.ttft_ms < local.ttft_ms
    # splittable, it crosses too (PD or split, whichever is predicted faster)
    opts = options([queued, spare], models, Request(1500, splittable=True))
    d = decide([queued, spare], models, Request(1500, splittable=True))
    assert d.kind in ("pd", "split") and d.prefill == 1
    assert d.ttft_ms == min(o.ttft_ms for o in opts)


def test_a_pinned_prefill_instance_splits_with_an_idle_decoder_while_both_are_idle() -> None:
    """As a fixed pair splits while idle: the decoder's idle core computes
    the tail, the prefill instance is free again sooner, nobody is stalled."""
    p, d = InstanceLoad(role="prefill", block_size=16), InstanceLoad(role="decode", block_size=16)
    request, slo = Request(600, splittable=True), SLO(250.0, 18.0)
    pd = option_for(options([p, d], Models(2), request), Placement("pd", 0, 1))
    assert pd.ttft_ms < 0.5 * slo.ttft_ms  # PD is within the headroom: it would tie
    chosen = decide([p, d], Models(2), request, slo)
    assert chosen.kind == "split" and is_free_split(chosen.placement, [p, d])
    assert decide([p, d], Models(2), request, slo, Policy(free_split=False)).kind == "pd"
    busy = InstanceLoad(role="decode", block_size=16, decodes=1, outstanding=1)
    assert not is_free_split(Placement("split", 0, 1, 256), [p, busy])
    assert decide([p, busy], Models(2), request, slo).kind == "pd"  # fewer crossings
    either = InstanceLoad(block_size=16)  # not pinned: local, and no free split
    assert not is_free_split(Placement("split", 0, 1, 256), [either, d])


def test_a_fixed_split_fraction_is_used_when_set() -> None:
    policy = Policy(split_fraction=0.5, ttft_headroom=0.0)
    d = decide([IDLE, IDLE], Models(2), Request(1000, splittable=True), policy=policy)
    assert d.kind == "split" and d.head_tokens == split_point(1000, 16, 0.5)


def test_no_split_leaves_a_part_under_the_policy_s_minimum() -> None:
    """A 40-token prompt halves into 16 + 24 tokens: under the default minimum
    of 32 no split is an option; with no minimum one is."""
    request = Request(40, splittable=True)
    policy = Policy(split_fraction=0.5)
    assert policy.split_min_tokens == 32
    kinds = {o.placement.kind for o in options([IDLE, IDLE], Models(2), request, policy)}
    assert "split" not in kinds and "pd" in kinds
    any_part = Policy(split_fraction=0.5, split_min_tokens=0)
    heads = [o.placement.head_tokens for o in options([IDLE, IDLE], Models(2), request, any_part)]
    assert 16 in heads


def test_no_split_without_the_head_instance_s_block_size_or_a_splittable_request() -> None:
    no_block = InstanceLoad()
    for fleet, request in (
        ([no_block, no_block], Request(900, splittable=True)),
        ([IDLE, IDLE], Request(900, splittable=False)),
    ):
        assert all(o.placement.kind != "split" for o in options(fleet, Models(2), request))


def test_a_decoder_whose_batch_would_break_tpot_is_not_chosen() -> None:
    crowded = InstanceLoad(decodes=30)  # step(31) = 4.5 + 0.6 * 31 = 23.1 ms
    queued = InstanceLoad(decodes=2, waiting_prefills=2, waiting_prefill_tokens=1000)
    models, slo, request = Models(2), SLO(tpot_ms=20), Request(100)
    opts = options([crowded, queued], models, request)
    fastest = min(opts, key=lambda o: o.ttft_ms)
    assert fastest.placement == Placement("local", 0, 0)  # no queue ahead on 0
    d = decide([crowded, queued], models, request, slo)
    assert (d.kind, d.decode, d.reason) == ("local", 1, "tpot-slo")
    assert d.tpot_ms <= 20 < fastest.tpot_ms
    # without the SLO binding, and with no TTFT headroom, the crowded decoder's
    # shorter TTFT wins (with the headroom, both TTFTs tie and the lower TPOT does)
    fastest_wins = Policy(ttft_headroom=0)
    d = decide([crowded, queued], models, request, policy=fastest_wins)
    assert d.placement == Placement("local", 0, 0)
    assert decide([crowded, queued], models, request).placement == Placement("local", 1, 1)


def test_a_loose_tpot_slo_balances_and_a_tight_one_keeps_an_instance_free() -> None:
    """Instance 1 decodes three 32-token answers, instance 0 nothing. Under a
    loose TPOT SLO every option has margin: the prompt stays local, on the
    instance whose decodes it slows least (0), as a balancer would; keeping 0
    free of decodes would pile the fleet's work onto 1. Under a tighter one the
    prompt would leave no margin beside 1's decodes: 0 is kept for prompts, and
    the request is decoded on 1 (what a fixed P/D pair does)."""
    fleet = [IDLE, InstanceLoad(decodes=3, running=(Decode(0.0, 32),) * 3)]
    models, request = Models(2), Request(600, output_tokens=32)
    loose = decide(fleet, models, request, SLO(1000, 100))
    assert (loose.kind, loose.decode) == ("local", 0)
    assert decide(fleet, models, request, SLO(1000, 100), Policy(balance=False)).decode == 1
    slo = SLO(1000, 11)  # safe: a lone step (5.1 ms) + 0.6 x the 5.9 ms of slack above it
    safe = models.step_ms(0, 1) + 0.6 * (11 - models.step_ms(0, 1))
    assert safe == pytest.approx(8.64)
    local_1 = option_for(options(fleet, models, request, slo=slo), Placement("local", 1, 1))
    assert local_1.tpot_ms > safe  # the prompt beside 1's decodes
    tight = decide(fleet, models, request, slo)
    assert tight.placement == Placement("pd", 0, 1) and tight.tpot_ms <= safe


def test_a_decode_step_near_the_tpot_slo_still_leaves_safe_options_and_balances() -> None:
    """A real model's step (SmolLM2 on a CPU core: 41 ms + 2.3 a request)
    under its TPOT SLO (1.5x a lone step's TPOT, 65 ms): the margin counts
    the slack above a lone step, so options with room are safe and the fleet
    is not tight. A hit prompt (1,024 of its 1,070 tokens cached everywhere)
    goes to the idle instance, not beside instance 0's two decodes; with the
    margin taken of the whole SLO (39 ms, below any step) nothing was safe,
    the fleet always tight, and it went beside them to keep 1 free."""
    priors = Priors(
        prefill_ms=0.0, prefill_ms_per_token=0.45, step_ms=41.0, step_ms_per_request=2.3
    )
    models = Models(2, priors)
    fleet = [InstanceLoad(decodes=2, running=(Decode(0.0, 24),) * 2), IDLE]
    request = Request(1070, output_tokens=24, splittable=True, cached=(1024, 1024))
    slo = SLO(262.0, 65.0)
    assert safe_tpot_ms(fleet, models, slo, Policy()) == pytest.approx(43.3 + 0.6 * 21.7)
    d = decide(fleet, models, request, slo)
    assert d.placement == Placement("local", 1, 1, decode_hit=1024)
    assert d.tpot_ms == pytest.approx(models.step_ms(1, 1))


def test_prefill_on_a_busy_decoder_is_avoided_when_it_breaks_tpot() -> None:
    busy = InstanceLoad(decodes=8)
    spare = InstanceLoad(role="prefill")
    models, request = Models(2), Request(2000)
    d = decide([busy, spare], models, request, policy=UNSTITCHED)  # TPOT SLO 100 ms
    assert (d.kind, d.decode, d.reason) == ("local", 0, "lowest-ttft")  # the fastest
    # 2000 tokens on the decoder stall its 8 decodes by ~240 ms over 16 tokens
    assert d.tpot_ms > 20
    d = decide([busy, spare], models, request, SLO(tpot_ms=15), UNSTITCHED)
    assert (d.kind, d.prefill, d.decode, d.reason) == ("pd", 1, 0, "tpot-slo")
    assert d.tpot_ms == pytest.approx(models.step_ms(0, 9))


def test_stalls_a_running_decode_already_suffered_count_against_the_next_one() -> None:
    """Each prefill placed beside a decode may be within the SLO on its own;
    the decode's TPOT carries them all. Instance 0's decodes suffered 120 ms of
    prefill already, instance 1's none: a prompt that would fit beside either
    alone goes where it adds to nothing."""
    request, slo = Request(300), SLO(tpot_ms=15)
    models = Models(2)
    fresh = [
        InstanceLoad(decodes=2),
        InstanceLoad(decodes=2, waiting_prefills=1, waiting_prefill_tokens=100),
    ]
    d = decide(fresh, models, request, slo, Policy(pd=False, split=False))
    assert (d.kind, d.decode) == ("local", 0)  # no queue ahead on 0, within the SLO
    stalled = [dataclasses.replace(fresh[0], running=(Decode(120.0), Decode())), fresh[1]]
    opts = options(stalled, models, request, Policy(pd=False, split=False))
    on0 = option_for(opts, Placement("local", 0, 0))
    assert on0.tpot_ms == pytest.approx(
        option_for(options(fresh, models, request), Placement("local", 0, 0)).tpot_ms + 120.0 / 16
    )
    d = decide(stalled, models, request, slo, Policy(pd=False, split=False))
    assert (d.kind, d.decode, d.reason) == ("local", 1, "tpot-slo")


@pytest.mark.parametrize(
    "bad",
    [
        dict(block_size=0),
        dict(decodes=1, running=(Decode(-1.0),)),
        dict(decodes=1, running=(Decode(0.0, 0),)),
        dict(decodes=1, running=(Decode(), Decode())),
        dict(max_num_seqs=0),
    ],
    ids=[
        "block-size-0",
        "negative-stall",
        "no-output",
        "more-running-than-decodes",
        "max-num-seqs-0",
    ],
)
def test_an_impossible_instance_load_is_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        InstanceLoad(**bad)


def test_the_fleet_state_reports_the_stall_its_running_decodes_suffered() -> None:
    fleet = FleetState(2)
    fleet.on_dispatch("a", Placement("local", 0, 0), 100, now_s=0.0, output_tokens=40)
    assert fleet.view()[0].running == (Decode(0.0, 40, started=False),)
    fleet.on_first_token("a", now_s=0.02)
    assert fleet.view()[0].stalled_ms == 0.0
    fleet.on_dispatch("b", Placement("local", 0, 0), 1000, now_s=0.05)  # length not known
    fleet.on_first_token("b", now_s=0.15)  # 100 ms of "b"'s prefill beside "a"
    fleet.on_dispatch("c", Placement("pd", 0, 1), 500, now_s=0.2, output_tokens=8)
    fleet.on_prefill_done("c", now_s=0.25)  # 50 more: "a" 150, "b" 50
    assert fleet.view()[0].stalled_ms == pytest.approx(150.0)
    assert [d.output_tokens for d in fleet.view()[0].running] == [40, None]
    assert [d.stalled_ms for d in fleet.view()[0].running] == pytest.approx([150.0, 50.0])
    assert fleet.view()[1].running == (Decode(0.0, 8, started=False),)  # "c": no first token
    fleet.on_finish("a", now_s=0.3, output_tokens=40)
    assert fleet.view()[0].stalled_ms == pytest.approx(50.0)  # "b" is the most stalled now
    fleet.on_finish("b", now_s=0.35, output_tokens=16)
    assert fleet.view()[0].stalled_ms == 0.0 and fleet.view()[0].running == ()


def test_a_short_answer_beside_a_prefill_suffers_more_than_a_long_one() -> None:
    """A stall spreads over the output of the decode that suffers it: beside
    a running 20-token answer, a prefill that a 200-token answer would absorb
    breaks the SLO. The request's own length no longer stands for the
    running ones'."""
    request, models = Request(600, output_tokens=200), Models(2)
    pf = models.prefill_ms(0, 600)
    slo = SLO(tpot_ms=models.step_ms(0, 2) + pf / 50)  # 200 tokens absorb it, 20 do not
    nobody = Policy(pd=False, split=False)

    def on(running: tuple[Decode, ...]) -> Decision:
        loads = [InstanceLoad(decodes=1, running=running), InstanceLoad(decodes=1)]
        return decide(loads, models, request, slo, nobody)

    long_one = on((Decode(0.0, 200),))
    assert (long_one.decode, long_one.reason) == (0, "lowest-ttft")
    short_one = on((Decode(0.0, 20),))
    assert short_one.meets_tpot and short_one.decode == 1  # as fast, and within the SLO
    opts = options(
        [InstanceLoad(decodes=1, running=(Decode(0.0, 20),)), InstanceLoad(decodes=1)],
        models,
        request,
        nobody,
    )
    beside_short = option_for(opts, Placement("local", 0, 0)).tpot_ms
    assert (
        beside_short == pytest.approx(models.step_ms(0, 2) + pf / 20) and beside_short > slo.tpot_ms
    )


def test_a_split_onto_a_busy_decoder_is_charged_the_whole_wait_for_its_head() -> None:
    """D's tail forward waits for a head stuck in P's queue: its decodes stall all along."""
    decoder = InstanceLoad(decodes=6, block_size=16)
    queued_p = InstanceLoad(
        role="prefill", waiting_prefills=4, waiting_prefill_tokens=4000, block_size=16
    )
    models, request = Models(2), Request(600, splittable=True)
    # balanced, the head would be empty (P's queue is longer than the whole prompt)
    assert all(o.placement.kind != "split" for o in options([decoder, queued_p], models, request))
    half = Policy(split_fraction=0.5)
    opts = options([decoder, queued_p], models, request, half)
    (split,) = [o for o in opts if o.placement.kind == "split"]
    local = option_for(opts, Placement("local", 0, 0))
    queue_p = 4 * (models.prefill_ms(1, 0) + models.step_ms(1, 0)) + 0.12 * 4000
    assert split.tpot_ms > models.step_ms(0, 7) + queue_p / 16  # the wait counts as a stall
    assert split.tpot_ms > local.tpot_ms
    assert decide([decoder, queued_p], models, request, policy=half).kind == "local"


def test_a_full_engine_is_waited_for_and_one_with_a_free_slot_preferred() -> None:
    """Instance 0 runs its max_num_seqs (8) requests, each asking 200 tokens:
    a ninth waits for one of them to finish, about 1/9 of an output of 8-wide
    steps. Instance 1 has a prompt queued but a free slot: it wins, where an
    unknown capacity (or one slot fewer in use) would have chosen 0."""
    no_cross = Policy(pd=False, split=False, ttft_headroom=0)  # the lowest TTFT, local
    models, request = Models(2), Request(100)

    def load(n: int, cap: int | None, queued: int = 0) -> InstanceLoad:
        return InstanceLoad(
            decodes=n,
            outstanding=n,
            running=(Decode(0.0, 200),) * n,
            waiting_prefills=1 if queued else 0,
            waiting_prefill_tokens=queued,
            max_num_seqs=cap,
        )

    unknown = [load(8, None), load(5, None, queued=600)]
    full = [load(8, 8), load(5, 8, queued=600)]
    assert decide(unknown, models, request, policy=no_cross).decode == 0
    d = decide(full, models, request, policy=no_cross)
    assert (d.kind, d.decode) == ("local", 1)
    wait = 200 * models.step_ms(0, 8) / 9
    local = Placement("local", 0, 0)
    assert option_for(options(full, models, request), local).ttft_ms == pytest.approx(
        option_for(options(unknown, models, request), local).ttft_ms + wait
    )
    # a slot free: no wait; two requests beyond the slots: twice the wait
    free = [load(7, 8), load(5, 8, queued=600)]
    assert decide(free, models, request, policy=no_cross).decode == 0
    over = [dataclasses.replace(full[0], outstanding=9), full[1]]
    assert option_for(options(over, models, request), local).ttft_ms == pytest.approx(
        option_for(options(unknown, models, request), local).ttft_ms + 2 * wait
    )
    assert [beyond_slots(n, 8) for n in (0, 7, 8, 9)] == [0, 0, 1, 2]
    assert beyond_slots(100, None) == 0  # capacity not known: never full
    # the state passes the capacity on
    fleet = FleetState(2)
    fleet.set_max_num_seqs(1, 8)
    assert [load.max_num_seqs for load in fleet.view()] == [None, 8]
    with pytest.raises(ValueError, match="max_num_seqs"):
        fleet.set_max_num_seqs(0, 0)


def test_when_no_option_meets_tpot_the_least_violation_is_chosen() -> None:
    """One running 16-token decode per instance, under a 10 ms TPOT SLO: 0's
    not stalled yet, 1's by 30 ms. A 900-token prompt (~110 ms) breaks
    whichever instance computes it. The least violation: computed beside the
    less stalled decode (0's) and decoded on 1, which adds a step to 1's
    batch but no stall (crossings from busy instances allowed: by default a
    crossing borrows only an idle one)."""
    models, request, slo = Models(2), Request(900), SLO(tpot_ms=10)
    busy_crossings = Policy(idle_crossings=False)
    fleet = [
        InstanceLoad(decodes=1, running=(Decode(0.0, 16),)),
        InstanceLoad(decodes=1, running=(Decode(30.0, 16),)),
    ]
    d = decide(fleet, models, request, slo, busy_crossings)
    opts = options(fleet, models, request, busy_crossings, slo)
    assert d.reason == "no-option-meets-tpot" and not d.meets_tpot
    assert d.tpot_ms == min(o.tpot_ms for o in opts)
    assert d.prefill == 0 and d.decode == 1  # PD from the less stalled, onto the other


def test_a_decode_already_past_its_tpot_slo_does_not_veto_a_prefill() -> None:
    """A decode whose stall and queue already break the TPOT SLO misses it
    whatever this request does: it no longer keeps prompts off its instance.
    The prompt is computed there (no option would meet the SLO if the lost one
    counted)."""
    models, request, slo = Models(2), Request(900), SLO(tpot_ms=10)
    lost = InstanceLoad(decodes=1, running=(Decode(400.0, 16),))  # 25 ms of stall a token
    fresh = InstanceLoad(decodes=1, running=(Decode(0.0, 16),))
    d = decide([lost, fresh], models, request, slo)
    assert d.meets_tpot and d.prefill == 0
    assert d.reason != "no-option-meets-tpot"
    local = option_for(options([lost, fresh], models, request, slo=slo), Placement("local", 0, 0))
    assert local.tpot_ms == pytest.approx(models.step_ms(0, 2))  # its own steps only
    # without the SLO (no decode is lost), the stalled decode counts
    worst = option_for(options([lost, fresh], models, request), Placement("local", 0, 0))
    assert worst.tpot_ms > 25


def test_down_and_draining_instances_are_never_chosen() -> None:
    loaded = InstanceLoad(
        decodes=10, waiting_prefills=5, waiting_prefill_tokens=5000, block_size=16
    )
    fleet = [
        InstanceLoad(healthy=False, block_size=16),
        InstanceLoad(draining=True, block_size=16),
        loaded,
    ]
    for tokens in (10, 900, 3000):
        d = decide(fleet, Models(3), Request(tokens, splittable=True))
        assert (d.kind, d.decode) == ("local", 2)
    opts = options(fleet, Models(3), Request(900, splittable=True))
    assert {o.placement.prefill for o in opts} | {o.placement.decode for o in opts} == {2}


def test_pinned_roles_are_respected() -> None:
    p_only, d_only = InstanceLoad(role="prefill", block_size=16), InstanceLoad(role="decode")
    d = decide([p_only, d_only], Models(2), Request(20))
    assert (d.kind, d.prefill, d.decode, d.reason) == ("pd", 0, 1, "only-option")
    opts = options([p_only, d_only], Models(2), Request(900, splittable=True))
    assert {o.placement.kind for o in opts} == {"pd", "split"}
    assert all((o.placement.prefill, o.placement.decode) == (0, 1) for o in opts)
    # a decode-only instance never computes a head; a prefill-only one never decodes
    fleet = [InstanceLoad(role="decode", block_size=16), InstanceLoad(block_size=16), p_only]
    for o in options(fleet, Models(3), Request(900, splittable=True)):
        assert o.placement.decode != 2
        assert o.placement.kind == "local" or o.placement.prefill != 0


def test_with_no_instance_to_compute_a_prompt_a_decode_instance_serves_it_alone() -> None:
    fleet = [InstanceLoad(role="prefill", healthy=False), InstanceLoad(role="decode")]
    d = decide(fleet, Models(2), Request(500))
    assert (d.kind, d.decode, d.reason) == ("local", 1, "role-fallback")


def test_no_available_decoder_is_no_placement() -> None:
    fleet = [InstanceLoad(role="prefill"), InstanceLoad(healthy=False), InstanceLoad(draining=True)]
    with pytest.raises(NoPlacement, match="1: any down"):
        decide(fleet, Models(3), Request(10))


def test_ties_go_to_local_and_then_to_the_less_loaded_instance() -> None:
    fleet = [InstanceLoad(outstanding=3, block_size=16), InstanceLoad(outstanding=1, block_size=16)]
    # within tie_ms (5 ms) of the split's TTFT, local is taken
    request = Request(150, splittable=True)
    fastest = Policy(ttft_headroom=0.0, idle_crossings=False)  # crossings to busy ones too
    opts = options(fleet, Models(2), request, fastest)
    best = min(opts, key=lambda o: o.ttft_ms)
    assert best.placement.kind == "split"
    d = decide(fleet, Models(2), request, policy=fastest)
    assert (d.kind, d.decode) == ("local", 1)
    assert d.ttft_ms <= best.ttft_ms + 5
    eager = Policy(tie_ms=0, ttft_headroom=0, idle_crossings=False)
    assert decide(fleet, Models(2), request, policy=eager).kind == "split"


def test_a_crossing_borrows_only_an_idle_instance_unless_it_is_there_to_prefill() -> None:
    request = Request(900, splittable=True)
    busy = InstanceLoad(outstanding=1, decodes=1, block_size=16)
    idle = InstanceLoad(block_size=16)
    kinds = {
        (o.placement.kind, o.placement.prefill) for o in options([busy, idle], Models(2), request)
    }
    # from the idle instance 1 to the busy 0: PD and split; from the busy one, nothing
    assert kinds == {("local", 0), ("local", 1), ("pd", 1), ("split", 1)}
    everything = options([busy, idle], Models(2), request, Policy(idle_crossings=False))
    assert {(o.placement.kind, o.placement.prefill) for o in everything} == kinds | {
        ("pd", 0),
        ("split", 0),
    }
    # both busy: only local, whatever a crossing would save
    both = options([busy, busy], Models(2), request, FASTEST)
    assert {o.placement.kind for o in both} == {"local"}
    # an instance pinned to prefill crosses however busy it is
    pinned = InstanceLoad(role="prefill", outstanding=5, waiting_prefills=5, block_size=16)
    crossing = {o.placement.kind for o in options([pinned, idle], Models(2), request)}
    assert crossing == {"local", "pd", "split"}


def test_a_ttft_within_the_slos_headroom_is_not_worth_a_crossing() -> None:
    """Goodput counts a request that meets both SLOs: with the default
    headroom (half the TTFT SLO), a split that would save ~45 ms is not taken
    while local's TTFT is under it, and is once it is not."""
    models, request = Models(2), Request(900, splittable=True)
    local = option_for(options([IDLE, IDLE], models, request), Placement("local", 0, 0))
    d = decide([IDLE, IDLE], models, request, SLO(ttft_ms=1000))
    assert (d.kind, d.reason, d.ttft_ms) == ("local", "ttft-headroom", local.ttft_ms)
    tight = SLO(ttft_ms=1.5 * local.ttft_ms)  # headroom 0.75x local's TTFT
    assert decide([IDLE, IDLE], models, request, tight).kind == "split"
    loose = SLO(ttft_ms=2.5 * local.ttft_ms)
    assert decide([IDLE, IDLE], models, request, loose).kind == "local"
    with pytest.raises(ValueError, match="ttft_headroom"):
        Policy(ttft_headroom=1.5)


def test_the_header_value_names_the_placement() -> None:
    fleet = [InstanceLoad(decodes=8), InstanceLoad(role="prefill")]
    d = decide(fleet, Models(2), Request(2000), SLO(tpot_ms=15), UNSTITCHED)
    assert (
        d.header_value() == "kind=pd;prefill=1;decode=0;reason=tpot-slo;ttft_ms=273.9;tpot_ms=9.9"
    )
    d = decide([IDLE, IDLE], Models(2), Request(900, splittable=True), policy=FASTEST)
    assert d.header_value().startswith(f"kind=split;prefill=0;decode=1;head={d.head_tokens};")


def test_a_fleet_state_and_its_view_decide_alike() -> None:
    fleet = FleetState(2)
    fleet.set_block_size(0, 16)
    fleet.on_dispatch("a", Placement("local", 1, 1), 800, now_s=0.0)
    models, request = Models(2), Request(700, splittable=True)
    assert decide(fleet, models, request) == decide(fleet.view(), models, request)
    with pytest.raises(ValueError, match="3 in the models"):
        decide(fleet, Models(3), request)


# the models


def test_the_prefill_model_converges_to_the_true_cost_from_noisy_observations() -> None:
    rng = random.Random(7)
    models = Models(1)

    def true_ms(tokens: float) -> float:
        return 10 + 0.3 * tokens

    for _ in range(400):
        tokens = rng.randint(64, 2048)
        models.observe_prefill(0, tokens, true_ms(tokens) * rng.lognormvariate(0, 0.15))
    # (over 300 seeds the worst errors were 7 % on the slope, 5 % at 512 and
    # 2048 tokens, 13 ms at 128: 15 % noise on long prompts blurs the intercept)
    assert models.prefill[0].slope == pytest.approx(0.3, rel=0.1)
    for tokens in (512, 2048):
        assert models.prefill_ms(0, tokens) == pytest.approx(true_ms(tokens), rel=0.08)
    assert models.prefill_ms(0, 128) == pytest.approx(true_ms(128), abs=15)


def test_the_decode_step_model_converges_to_the_true_cost_from_noisy_observations() -> None:
    rng = random.Random(11)
    models = Models(1)
    for _ in range(400):
        batch = rng.randint(1, 16)
        models.observe_step(0, batch, (3 + 0.9 * batch) + rng.gauss(0, 0.5))
    for batch in (1, 8, 16):
        assert models.step_ms(0, batch) == pytest.approx(3 + 0.9 * batch, rel=0.08)


def test_a_model_follows_a_change_in_cost_and_keeps_pairs_apart() -> None:
    rng = random.Random(3)
    models = Models(3)
    for cost in (1.0, 3.0):  # the transfer 0 -> 1 gets 3x slower
        for _ in range(300):
            tokens = rng.randint(100, 1000)
            models.observe_transfer(
                0, 1, tokens, cost * (5 + 0.02 * tokens) * rng.uniform(0.9, 1.1)
            )
        assert models.transfer_ms(0, 1, 500) == pytest.approx(cost * 15, rel=0.08)
    prior = Priors()
    assert models.transfer_ms(1, 0, 500) == prior.transfer_ms + prior.transfer_ms_per_token * 500
    assert models.transfer_ms(0, 2, 500) == models.transfer_ms(1, 0, 500)


def test_observations_at_one_point_pivot_the_line_on_the_prior() -> None:
    line = LinearCost(2.0, 0.1, prior_x=512)
    for _ in range(200):
        line.observe(512, 100.0)
    assert line.predict(512) == pytest.approx(100, rel=0.01)
    assert line.predict(0) == pytest.approx(2.0)


def test_a_cost_never_falls_with_its_x_and_ignores_non_finite_observations() -> None:
    line = LinearCost(1.0, 0.01, prior_x=100)
    for x in range(1, 100):
        line.observe(x, 100 - x)  # decreasing with x: noise the fit must not follow
    assert line.slope == 0.0 and line.predict(10_000) == line.predict(1) > 0
    # the flat line is the weighted mean, the best line of slope >= 0
    w, _, sy, _, _ = (p + q for p, q in zip(line._prior, line._data, strict=True))
    assert line.intercept == pytest.approx(sy / w)
    below = LinearCost(-5.0, 0.0, prior_x=100)
    assert below.predict(3) == 0.0  # a fit below 0 predicts 0
    before = (line.intercept, line.slope, line.observations)
    line.observe(5, math.nan)
    line.observe(math.inf, 5)
    assert (line.intercept, line.slope, line.observations) == before


def test_learning_takes_the_decode_step_out_of_prefill_and_transfer_times() -> None:
    models = Models(2)
    step0, step2 = models.step_ms(0, 0), models.step_ms(1, 2)
    models.learn(PrefillObservation(0, 512, 100.0 + step0, batch=0))
    models.learn(TransferObservation(0, 1, 512, 20.0 + step2, batch=1))
    models.learn(DecodeObservation(1, 3.0, 9.0))
    assert models.prefill[0].observations == 1
    assert models.transfer[(0, 1)].observations == 1
    assert models.step[1].observations == 1
    # compared with feeding the step-free values directly
    direct = Models(2)
    direct.observe_prefill(0, 512, 100.0)
    direct.observe_transfer(0, 1, 512, 20.0)
    assert models.prefill_ms(0, 512) == direct.prefill_ms(0, 512)
    assert models.transfer_ms(0, 1, 512) == direct.transfer_ms(0, 1, 512)


# the state


def test_a_local_request_is_queued_then_decodes_then_leaves() -> None:
    fleet = FleetState(2)
    fleet.on_dispatch("a", Placement("local", 1, 1), 300, now_s=10.0, output_tokens=11)
    assert fleet.view()[1] == InstanceLoad(
        decodes=1,
        waiting_prefills=1,
        waiting_prefill_tokens=300,
        outstanding=1,
        running=(Decode(0.0, 11, started=False),),
    )
    (obs,) = fleet.on_first_token("a", now_s=10.05)
    assert obs == PrefillObservation(1, 300, pytest.approx(50.0), batch=0)
    assert fleet.on_first_token("a", now_s=10.06) == []
    assert fleet.view()[1] == InstanceLoad(decodes=1, outstanding=1, running=(Decode(0.0, 11),))
    (obs,) = fleet.on_finish("a", now_s=10.05 + 0.006 * 10, output_tokens=11)
    assert obs == DecodeObservation(1, pytest.approx(1.0), pytest.approx(6.0))
    assert fleet.view() == (InstanceLoad(), InstanceLoad()) and fleet.in_flight == 0
    with pytest.raises(KeyError, match="'a'"):
        fleet.on_finish("a", now_s=11.0)


def test_a_pd_request_yields_prefill_transfer_and_decode_observations() -> None:
    fleet = FleetState(2, roles=("prefill", "decode"))
    fleet.on_dispatch("a", Placement("pd", 0, 1), 512, now_s=0.0)
    assert fleet.view()[0].waiting_prefill_tokens == 512 and fleet.view()[1].decodes == 1
    assert fleet.on_prefill_done("a", now_s=0.070) == [
        PrefillObservation(0, 512, pytest.approx(70.0), 0)
    ]
    assert fleet.view()[0] == InstanceLoad(role="prefill")
    (obs,) = fleet.on_first_token("a", now_s=0.085)
    assert obs == TransferObservation(0, 1, 512, pytest.approx(15.0), batch=0)
    assert fleet.on_finish("a", now_s=0.085 + 0.005 * 4, output_tokens=5) == [
        DecodeObservation(1, pytest.approx(1.0), pytest.approx(5.0))
    ]
    assert fleet.in_flight == 0


def test_a_transfer_observation_takes_out_ds_own_prompts_computed_meanwhile() -> None:
    """P answers at 70 ms; D then computes a local prompt for 80 ms before the
    PD request's first token at 170 ms: the transfer is 20 ms, not 100 (D's
    queue is the policy's ``Q_j``, counted apart)."""
    fleet = FleetState(2)
    fleet.on_dispatch("a", Placement("pd", 0, 1), 512, now_s=0.0)
    fleet.on_dispatch("b", Placement("local", 1, 1), 800, now_s=0.075)
    fleet.on_prefill_done("a", now_s=0.070)
    (pre,) = fleet.on_first_token("b", now_s=0.155)
    assert pre == PrefillObservation(1, 800, pytest.approx(80.0), batch=0)
    (obs,) = fleet.on_first_token("a", now_s=0.170)
    assert obs == TransferObservation(0, 1, 512, pytest.approx(20.0), batch=1)
    # a prompt D finished before P's answer is not taken out of a later transfer
    fleet.on_dispatch("c", Placement("pd", 0, 1), 512, now_s=0.2)
    fleet.on_prefill_done("c", now_s=0.26)
    (obs,) = fleet.on_first_token("c", now_s=0.275)
    assert obs == TransferObservation(0, 1, 512, pytest.approx(15.0), batch=2)


def test_a_request_that_found_no_free_slot_teaches_no_prefill_or_transfer() -> None:
    """With max_num_seqs 1 on instance 1, a second request dispatched there
    waits in vLLM's queue for a time no event shows: its prefill (local) and
    its transfer (PD) are not observed; its decode step still is."""
    fleet = FleetState(2)
    fleet.set_max_num_seqs(1, 1)
    fleet.on_dispatch("a", Placement("local", 1, 1), 100, now_s=0.0)
    fleet.on_dispatch("b", Placement("local", 1, 1), 100, now_s=0.001)
    fleet.on_dispatch("c", Placement("pd", 0, 1), 100, now_s=0.002)
    (first,) = fleet.on_first_token("a", now_s=0.02)
    assert isinstance(first, PrefillObservation)
    assert fleet.on_finish("a", now_s=0.10, output_tokens=9) != []
    assert fleet.on_prefill_done("c", now_s=0.03) != []  # instance 0 had a free slot
    assert fleet.on_first_token("b", now_s=0.12) == []
    assert fleet.on_first_token("c", now_s=0.13) == []
    (step,) = fleet.on_finish("b", now_s=0.20, output_tokens=9)
    assert isinstance(step, DecodeObservation)
    # below the capacity again: observed as before
    fleet.on_finish("c", now_s=0.21, output_tokens=1)
    fleet.on_dispatch("d", Placement("local", 1, 1), 100, now_s=0.3)
    assert len(fleet.on_first_token("d", now_s=0.32)) == 1


def test_p_outliving_d_keeps_its_work_until_p_is_over() -> None:
    fleet = FleetState(2)
    fleet.on_dispatch("a", Placement("split", 0, 1, head_tokens=256), 600, now_s=0.0)
    assert [load.waiting_prefill_tokens for load in fleet.view()] == [256, 344]
    assert fleet.on_first_token("a", now_s=0.05) == []  # a tail yields no prefill observation
    assert fleet.on_finish("a", now_s=0.10, output_tokens=1) == []  # one token: no step
    assert fleet.in_flight == 1 and fleet.view()[0].outstanding == 1
    assert fleet.on_prefill_done("a", now_s=0.12, ok=False) == []  # a failure: no observation
    assert fleet.in_flight == 0 and fleet.view() == (InstanceLoad(), InstanceLoad())


def test_a_decode_step_observation_takes_out_the_prefill_work_that_stalled_it() -> None:
    fleet = FleetState(1)
    fleet.on_dispatch("long", Placement("local", 0, 0), 100, now_s=0.0)
    fleet.on_first_token("long", now_s=0.02)
    # a second prompt is computed on the same instance while "long" decodes
    fleet.on_dispatch("b", Placement("local", 0, 0), 1000, now_s=0.05)
    (pre,) = fleet.on_first_token("b", now_s=0.15)
    assert pre == PrefillObservation(0, 1000, pytest.approx(100.0), batch=1)
    # "long": 0.02 -> 0.32 s for 31 tokens after its first: 300 ms, 100 of them "b"'s prefill
    (obs,) = fleet.on_finish("long", now_s=0.32, output_tokens=31)
    assert obs.step_ms == pytest.approx(200 / 30)
    assert obs.batch == pytest.approx((0.3 + 0.17) / 0.3)  # "b" decoded along from 0.15 s


def test_events_for_unknown_or_duplicate_requests_and_bad_placements_are_refused() -> None:
    fleet = FleetState(2)
    fleet.on_dispatch("a", Placement("local", 0, 0), 10, now_s=0.0)
    with pytest.raises(ValueError, match="already in flight"):
        fleet.on_dispatch("a", Placement("local", 1, 1), 10, now_s=0.0)
    with pytest.raises(ValueError, match="no prefill answer"):
        fleet.on_prefill_done("a", now_s=1.0)
    with pytest.raises(KeyError):
        fleet.on_first_token("b", now_s=1.0)
    with pytest.raises(IndexError):
        fleet.on_dispatch("c", Placement("pd", 0, 2), 10, now_s=0.0)
    with pytest.raises(ValueError, match="leave the decoder"):
        fleet.on_dispatch("d", Placement("split", 0, 1, head_tokens=10), 10, now_s=0.0)
    with pytest.raises(ValueError):
        Placement("pd", 1, 1)
    with pytest.raises(ValueError):
        Placement("local", 0, 0, head_tokens=16)
    fleet.check()


def test_the_state_and_models_learn_a_simulated_pair_s_true_costs() -> None:
    """P (0) and D (1) in a closed loop, one request at a time: what the
    observations teach the models is what the simulated instances cost."""

    def prefill(tokens: int) -> float:  # ms, a forward on P or D alone
        return 6 + 0.25 * tokens

    def step(batch: float) -> float:
        return 3 + 1.0 * batch

    def transfer(tokens: int) -> float:
        return 9 + 0.01 * tokens

    rng = random.Random(5)
    fleet, models, now = FleetState(2), Models(2), 0.0
    for k in range(300):
        tokens, out = rng.randint(100, 1500), rng.randint(2, 40)
        rid = str(k)
        if k % 2:
            fleet.on_dispatch(rid, Placement("local", 1, 1), tokens, now)
            now += prefill(tokens) / 1000
        else:
            fleet.on_dispatch(rid, Placement("pd", 0, 1), tokens, now)
            now += prefill(tokens) / 1000
            for obs in fleet.on_prefill_done(rid, now):
                models.learn(obs)
            now += (transfer(tokens) + step(1)) / 1000
        for obs in fleet.on_first_token(rid, now):
            models.learn(obs)
        now += (out - 1) * step(1) / 1000
        for obs in fleet.on_finish(rid, now, output_tokens=out):
            models.learn(obs)
        now += 0.1
    # one request decoding at a time: the step at batch 1 is what is measured
    assert models.step_ms(1, 1) == pytest.approx(step(1), rel=0.05)
    # a forward alone = prefill + the step at batch 0, as the models split it
    for i in (0, 1):
        predicted = models.prefill_ms(i, 800) + models.step_ms(i, 0)
        assert predicted == pytest.approx(prefill(800), rel=0.05)
    assert models.transfer_ms(0, 1, 800) == pytest.approx(transfer(800), rel=0.05)


# properties


@st.composite
def loads(draw: st.DrawFn) -> InstanceLoad:
    decodes = draw(st.integers(0, 40))
    decode = st.builds(Decode, st.just(0.0) | st.floats(0, 500), st.none() | st.integers(1, 256))
    return InstanceLoad(
        role=draw(st.sampled_from(ROLES)),
        healthy=draw(st.booleans() | st.just(True)),
        draining=draw(st.just(False) | st.booleans()),
        decodes=decodes,
        waiting_prefills=draw(st.integers(0, 6)),
        waiting_prefill_tokens=draw(st.integers(0, 8000)),
        outstanding=draw(st.integers(0, 10)),
        block_size=draw(st.sampled_from([None, 16, 64])),
        running=tuple(draw(st.lists(decode, max_size=min(decodes, 3)))),
    )


fleets = st.lists(loads(), min_size=1, max_size=5)
requests = st.builds(
    Request,
    prompt_tokens=st.integers(1, 4000),
    output_tokens=st.integers(1, 256),
    splittable=st.booleans(),
)
slos = st.builds(SLO, tpot_ms=st.floats(1, 200))
policies = st.builds(
    Policy,
    pd=st.booleans() | st.just(True),
    split=st.booleans() | st.just(True),
    split_fraction=st.none() | st.floats(0.05, 0.95),
    tie_ms=st.sampled_from([0.0, 1.0, 5.0]),
    keep_free=st.booleans(),
    free_split=st.booleans(),
    stitch=st.booleans(),
    tpot_margin=st.sampled_from([0.0, 0.6, 1.0]),
    balance=st.booleans(),
    idle_crossings=st.booleans(),
)
priors = st.builds(
    Priors,
    prefill_ms=st.floats(0, 20),
    prefill_ms_per_token=st.floats(0.005, 1.0),
    step_ms=st.floats(0.5, 20),
    step_ms_per_request=st.floats(0, 3),
    transfer_ms=st.floats(0, 50),
    transfer_ms_per_token=st.floats(0, 0.1),
)


@st.composite
def models_for(draw: st.DrawFn, n: int) -> Models:
    """Models from random priors, some pairs and instances with observations."""
    models = Models(n, draw(priors))
    for _ in range(draw(st.integers(0, 6))):
        i, j = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))
        models.observe_transfer(i, j, draw(st.integers(1, 2000)), draw(st.floats(0, 200)))
        models.observe_prefill(i, draw(st.integers(1, 2000)), draw(st.floats(0, 500)))
    return models


@st.composite
def cases(draw: st.DrawFn) -> tuple:
    fleet = draw(fleets)
    return fleet, draw(models_for(len(fleet))), draw(requests), draw(slos), draw(policies)


def snapshot(models: Models) -> tuple:
    lines = [*models.prefill, *models.step, *models.transfer.values()]
    return tuple((line.intercept, line.slope, line.observations) for line in lines), tuple(
        models.transfer
    )


@settings(max_examples=300, deadline=None)
@given(cases())
def test_the_decision_is_an_available_option_that_respects_roles(case: tuple) -> None:
    fleet, models, request, slo, policy = case
    opts = options(fleet, models, request, policy, slo)
    if not any(load.available and load.role != "prefill" for load in fleet):
        assert opts == []
        with pytest.raises(NoPlacement):
            decide(fleet, models, request, slo, policy)
        return
    d = decide(fleet, models, request, slo, policy)
    assert (d.placement, d.ttft_ms, d.tpot_ms) in [
        (o.placement, o.ttft_ms, o.tpot_ms) for o in opts
    ]
    p = d.placement
    assert fleet[p.prefill].available and fleet[p.decode].available
    assert (
        math.isfinite(d.ttft_ms) and d.ttft_ms >= 0 and math.isfinite(d.tpot_ms) and d.tpot_ms > 0
    )
    if d.reason == "role-fallback":
        assert all(
            o.placement.kind == "local" and fleet[o.placement.decode].role == "decode" for o in opts
        )
    elif p.kind == "local":
        assert fleet[p.decode].role == "any"
    else:
        assert fleet[p.prefill].role != "decode" and fleet[p.decode].role != "prefill"
        i = fleet[p.prefill]
        assert not policy.idle_crossings or i.role == "prefill" or i.idle
        assert p.kind != "split" or (
            request.splittable and p.head_tokens % fleet[p.prefill].block_size == 0
        )
    assert policy.pd or p.kind != "pd"
    assert policy.split or p.kind != "split"
    assert d.meets_tpot == (d.tpot_ms <= slo.tpot_ms) and d.meets_ttft == (d.ttft_ms <= slo.ttft_ms)


@settings(max_examples=300, deadline=None)
@given(cases())
def test_the_chosen_ttft_is_the_lowest_of_the_options_that_meet_tpot(case: tuple) -> None:
    fleet, models, request, slo, policy = case
    try:
        d = decide(fleet, models, request, slo, policy)
    except NoPlacement:
        return
    opts = options(fleet, models, request, policy, slo)
    meets = [o for o in opts if o.tpot_ms <= slo.tpot_ms]
    if meets:
        best = min(o.ttft_ms for o in meets)
        tied = max(best + policy.tie_ms, policy.ttft_headroom * slo.ttft_ms)
        assert d.meets_tpot and d.ttft_ms <= tied
        ties = [o for o in meets if o.ttft_ms <= tied]
        chosen = next(o for o in ties if o.placement == d.placement)
        safe_ms = policy.tpot_margin * slo.tpot_ms
        tight = any(o.beside_decodes and o.tpot_ms > safe_ms for o in opts)
        if policy.balance and any(o.tpot_ms <= safe_ms for o in ties):
            assert chosen.tpot_ms <= safe_ms  # ties go first to a TPOT with margin
            ties = [o for o in ties if o.tpot_ms <= safe_ms]
        if policy.balance and policy.free_split:
            free = [o for o in ties if is_free_split(o.placement, fleet)]
            if free:  # then to a split from an idle pinned P to an idle decoder
                assert is_free_split(d.placement, fleet)
                ties = free
        keeping = policy.keep_free and (tight or not policy.balance)
        if keeping and any(o.keeps_free for o in ties):
            assert chosen.keeps_free  # then to an instance left free of decodes
            ties = [o for o in ties if o.keeps_free]
        if any(o.placement.kind == "local" for o in ties):
            assert d.kind == "local"  # then to local (then pd, then split)
        ties = [o for o in ties if o.placement.kind == d.kind]
        if policy.balance:  # then, as balanced, the lowest TPOT
            assert round(chosen.tpot_ms, 1) == min(round(o.tpot_ms, 1) for o in ties)
        if d.ttft_ms > best + policy.tie_ms:  # only for the headroom, and said so
            # said so, unless a decode-only instance's local is all there was
            fallback = d.kind == "local" and fleet[d.placement.decode].role == "decode"
            assert d.reason == ("role-fallback" if fallback else "ttft-headroom")
            assert d.ttft_ms <= policy.ttft_headroom * slo.ttft_ms
        if tied == best:
            assert d.ttft_ms == best
    else:
        assert d.reason in ("no-option-meets-tpot", "role-fallback")
        assert d.tpot_ms == min(o.tpot_ms for o in opts)


@settings(max_examples=200, deadline=None)
@given(cases())
def test_the_decision_is_deterministic_and_reads_nothing_it_changes(case: tuple) -> None:
    fleet, models, request, slo, policy = case
    before = snapshot(models)
    try:
        first = decide(fleet, models, request, slo, policy)
    except NoPlacement:
        return
    assert decide(list(fleet), models, request, slo, policy) == first
    assert snapshot(models) == before


@st.composite
def event_runs(draw: st.DrawFn) -> tuple[int, list[tuple]]:
    n = draw(st.integers(1, 4))
    ops = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["dispatch", "prefill_done", "first_token", "finish", "migrate"]),
                st.integers(0, 7),  # request id
                st.integers(0, n - 1),
                st.integers(0, n - 1),
                st.integers(1, 3000),  # prompt tokens / output tokens
                st.floats(0, 0.2),  # time step, s
                st.booleans(),  # ok
            ),
            max_size=60,
        )
    )
    return n, ops


@settings(max_examples=300, deadline=None)
@given(event_runs())
def test_queue_counters_follow_any_event_order_and_drain_to_zero(
    run: tuple[int, list[tuple]],
) -> None:
    n, ops = run
    fleet, models, now = FleetState(n), Models(n), 0.0
    for op, rid_n, i, j, tokens, dt, ok in ops:
        now += dt
        rid = f"r{rid_n}"
        placement = fleet.tracked().get(rid)
        obs: list = []
        if op == "dispatch" and placement is None:
            if i == j:
                placement = Placement("local", i, i)
            elif tokens > 1 and ok:
                placement = Placement("split", i, j, head_tokens=max(tokens // 2, 1))
            else:
                placement = Placement("pd", i, j)
            fleet.on_dispatch(rid, placement, tokens, now)
        elif op == "prefill_done" and placement is not None and placement.kind != "local":
            obs = fleet.on_prefill_done(rid, now, ok)
        elif op == "first_token" and placement is not None:
            obs = fleet.on_first_token(rid, now)
        elif op == "finish" and placement is not None:
            obs = fleet.on_finish(rid, now, output_tokens=tokens % 50, ok=ok)
        elif op == "migrate" and placement is not None:
            fleet.on_migrated(rid, j, now)
        fleet.check()
        for o in obs:
            assert all(math.isfinite(v) and v >= 0 for v in vars(o).values())
            models.learn(o)
    for rid, placement in fleet.tracked().items():
        if placement.kind != "local":
            fleet.on_prefill_done(rid, now)
        if rid in fleet.tracked():
            fleet.on_finish(rid, now)
        fleet.check()
    assert fleet.in_flight == 0
    assert fleet.view() == tuple(InstanceLoad() for _ in range(n))


def test_a_migrated_decode_counts_on_its_new_instance_and_teaches_no_decode_step() -> None:
    fleet = FleetState(2)
    fleet.on_dispatch("a", Placement("local", 0, 0), 300, now_s=0.0)
    assert len(fleet.on_first_token("a", now_s=0.05)) == 1  # the local prefill learnt
    fleet.on_dispatch("b", Placement("local", 0, 0), 200, now_s=0.1)
    fleet.on_first_token("b", now_s=0.14)  # 40 ms of prefill beside "a"
    fleet.on_finish("b", now_s=0.15, output_tokens=2)
    fleet.on_migrated("a", 1, now_s=0.2)
    fleet.check()
    loads = fleet.view()
    assert (loads[0].decodes, loads[0].outstanding) == (0, 0)
    assert (loads[1].decodes, loads[1].outstanding) == (1, 1)
    assert loads[1].stalled_ms == pytest.approx(40.0)  # the stall it suffered moved with it
    fleet.on_migrated("a", 1, now_s=0.3)  # already there: nothing changes
    assert fleet.view() == loads
    # its window spans two instances: no decode step is learnt from it
    assert fleet.on_finish("a", now_s=1.0, output_tokens=100) == []
    assert fleet.view() == (InstanceLoad(), InstanceLoad())
    with pytest.raises(KeyError):
        fleet.on_migrated("a", 0, now_s=1.1)


def test_no_split_touches_an_instance_with_a_split_in_flight() -> None:
    """A split's decoder holds its engine until the head arrives: a second split
    in the other direction would deadlock both engines until their timeouts."""
    fleet = FleetState(2)
    for i in range(2):
        fleet.set_block_size(i, 16)
    models = Models(2)
    long = Request(900, 16, splittable=True)
    first = decide(fleet, models, long, policy=FASTEST)
    assert first.kind == "split"
    fleet.on_dispatch("a", first.placement, 900, 0.0)
    assert [load.splits for load in fleet.view()] == [1, 1]

    def kinds() -> set[str]:
        return {o.placement.kind for o in options(fleet, models, long)}

    assert "split" not in kinds()  # not even offered
    fleet.on_prefill_done("a", 0.05)
    assert "split" not in kinds()  # the tail is still computing
    fleet.on_first_token("a", 0.1)
    assert [load.splits for load in fleet.view()] == [0, 0]
    assert "split" in kinds()
    assert decide(fleet, models, long, policy=FASTEST).kind == "split"
