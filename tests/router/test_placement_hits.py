"""`placement` with the prefix caches known: hits cut each instance's work, and a
prefix cached on a busy instance is fetched from it (a split whose head is a hit)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rapidkv.router.placement import (
    SLO,
    FleetState,
    InstanceLoad,
    Models,
    Placement,
    Policy,
    Request,
    decide,
    options,
)

pytestmark = pytest.mark.unit

BLOCK = 16
IDLE = InstanceLoad(block_size=BLOCK)
LOOSE = SLO(ttft_ms=10_000, tpot_ms=1_000)


def test_a_placement_computes_only_what_its_instances_do_not_hold() -> None:
    assert Placement("local", 1, 1, decode_hit=512).work(600) == {1: 88}
    assert Placement("local", 1, 1, decode_hit=600).work(600) == {1: 1}  # vLLM computes one
    assert Placement("pd", 0, 1, prefill_hit=256, decode_hit=128).work(600) == {0: 344}
    assert Placement("pd", 0, 1, prefill_hit=256, decode_hit=128).transferred(600) == 472
    fetch = Placement("fetch", 0, 1, head_tokens=512, prefill_hit=520, decode_hit=128)
    assert fetch.work(600) == {0: 1, 1: 88}
    assert fetch.transferred(600) == 384
    split = Placement("split", 0, 1, head_tokens=256, decode_hit=384)
    assert split.work(600) == {0: 256, 1: 216}  # the decoder's own hit shortens its tail
    assert split.transferred(600) == 0


@pytest.mark.parametrize(
    "bad",
    [
        dict(kind="fetch", prefill=0, decode=1, head_tokens=512, prefill_hit=500),
        dict(kind="fetch", prefill=0, decode=1),
        dict(kind="local", prefill=0, decode=0, prefill_hit=16),
        dict(kind="pd", prefill=0, decode=1, decode_hit=-1),
    ],
)
def test_an_impossible_placement_with_hits_is_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        Placement(**bad)


def test_a_request_s_hits_lie_within_its_prompt() -> None:
    with pytest.raises(ValueError):
        Request(100, cached=(101,))
    assert Request(100, cached=(64,)).hit(0) == 64
    assert Request(100, cached=(64,)).hit(3) == 0


def test_an_idle_fleet_serves_a_prompt_where_its_prefix_is_cached() -> None:
    request = Request(600, splittable=True, cached=(0, 512))
    d = decide([IDLE, IDLE], Models(2), request, LOOSE, Policy(ttft_headroom=0.0))
    assert (d.kind, d.decode, d.placement.decode_hit) == ("local", 1, 512)
    assert "hit=512" in d.header_value()
    cold = decide([IDLE, IDLE], Models(2), Request(600, cached=(0, 0)), LOOSE)
    assert d.ttft_ms < cold.ttft_ms / 2


def test_a_holder_full_of_decodes_lends_its_prefix_to_an_idle_instance() -> None:
    """The holder's decodes cannot take one more within the TPOT SLO; the idle
    instance would recompute the whole prompt (223 ms predicted), the fetch
    costs the holder one token and sends 1,760 tokens' KV."""
    busy = InstanceLoad(block_size=BLOCK, decodes=6, outstanding=6)
    request = Request(1800, output_tokens=16, splittable=True, cached=(1760, 0))
    slo = SLO(ttft_ms=300, tpot_ms=9)
    d = decide([busy, IDLE], Models(2), request, slo)
    assert (d.kind, d.prefill, d.decode, d.head_tokens) == ("fetch", 0, 1, 1760)
    assert d.placement.work(1800) == {0: 1, 1: 40}
    assert "kind=fetch" in d.header_value() and "prefill_hit=1760" in d.header_value()
    # without the index the same load recomputes it all on 1
    blind = decide([busy, IDLE], Models(2), Request(1800, 16, True), slo)
    assert (blind.kind, blind.decode) == ("local", 1) and blind.ttft_ms > 2 * d.ttft_ms
    no_fetch = decide([busy, IDLE], Models(2), request, slo, Policy(fetch=False))
    assert no_fetch.kind != "fetch" and no_fetch.ttft_ms > d.ttft_ms
    # with room on the holder, it serves the request itself from its cache
    roomy = decide([busy, IDLE], Models(2), request, SLO(ttft_ms=300, tpot_ms=12))
    assert (roomy.kind, roomy.decode, roomy.placement.decode_hit) == ("local", 0, 1760)


def test_no_split_computes_a_head_its_decoder_holds() -> None:
    request = Request(1800, splittable=True, cached=(0, 1760))
    for o in options([IDLE, IDLE], Models(2), request):
        if o.placement.kind == "split":
            assert o.placement.head_tokens > o.placement.decode_hit


def test_no_fetch_of_what_the_decoder_holds_or_of_less_than_the_minimum() -> None:
    models = Models(2)
    for cached in ((512, 512), (16, 0), (0, 0)):
        request = Request(600, splittable=True, cached=cached)
        kinds = {o.placement.kind for o in options([IDLE, IDLE], models, request)}
        assert "fetch" not in kinds, cached
    whole = Request(600, splittable=False, cached=(512, 0))  # a fetch is a split: not for this
    assert "fetch" not in {o.placement.kind for o in options([IDLE, IDLE], models, whole)}


def test_no_fetch_touches_an_instance_with_a_split_in_flight() -> None:
    splitting = InstanceLoad(block_size=BLOCK, splits=1, outstanding=1, decodes=1)
    request = Request(600, splittable=True, cached=(512, 0))
    kinds = {o.placement.kind for o in options([splitting, IDLE], Models(2), request)}
    assert "fetch" not in kinds


def test_a_fetch_counts_as_a_split_in_the_fleet_state_and_its_holder_computes_one_token() -> None:
    fleet = FleetState(2)
    fleet.set_block_size(0, BLOCK)
    fleet.set_block_size(1, BLOCK)
    fleet.on_dispatch("x", Placement("fetch", 0, 1, 512, prefill_hit=512), 600, 0.0)
    loads = fleet.view()
    assert loads[0].splits == loads[1].splits == 1
    assert loads[0].waiting_prefill_tokens == 1 and loads[1].waiting_prefill_tokens == 88
    (obs,) = fleet.on_prefill_done("x", 0.05)
    assert obs.tokens == 1
    fleet.on_first_token("x", 0.2)
    fleet.on_finish("x", 0.5, output_tokens=4)
    fleet.check()
    assert all(load.idle for load in fleet.view())


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.integers(2, 2000),
    hits=st.tuples(st.integers(0, 2000), st.integers(0, 2000)),
    decodes=st.tuples(st.integers(0, 8), st.integers(0, 8)),
)
def test_hits_never_make_an_option_predicted_slower(
    tokens: int, hits: tuple[int, int], decodes: tuple[int, int]
) -> None:
    """Holding part of the prompt never raises a placement's predicted TTFT:
    every option with hits is at most the same placement's without them."""
    cached = tuple(min(h, tokens) for h in hits)
    loads = [InstanceLoad(block_size=BLOCK, decodes=d, outstanding=d) for d in decodes]
    models = Models(2)
    warm = options(loads, models, Request(tokens, splittable=True, cached=cached))
    cold = {
        o.placement: o
        for o in options(loads, models, Request(tokens, splittable=True, cached=(0, 0)))
    }
    for o in warm:
        p = o.placement
        if p.kind == "fetch":
            continue  # no cold counterpart
        same = Placement(p.kind, p.prefill, p.decode, p.head_tokens)
        if same in cold:
            assert o.ttft_ms <= cold[same].ttft_ms + 1e-6


def test_a_draining_holder_lends_its_prefix_but_serves_nothing_itself() -> None:
    draining = InstanceLoad(block_size=BLOCK, draining=True)
    request = Request(1800, splittable=True, cached=(1760, 0))
    d = decide([draining, IDLE], Models(2), request, LOOSE, Policy(ttft_headroom=0.0))
    assert (d.kind, d.prefill, d.decode) == ("fetch", 0, 1)
    for o in options([draining, IDLE], Models(2), request):
        assert o.placement.decode == 1
        assert o.placement.kind == "fetch" or o.placement.prefill == 1
    down = InstanceLoad(block_size=BLOCK, healthy=False)
    assert "fetch" not in {o.placement.kind for o in options([down, IDLE], Models(2), request)}
