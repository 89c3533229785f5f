"""`kvt.gather.Gather`: a destination rank that several source ranks write
hands a transfer on once, after every source rank's SendDone, failed if any
failed; its layers in place are the least over the sources (hypothesis over
the number of sources, the order notifications arrive in, duplicates and
outcomes)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rapidkv.kvt.gather import Gather
from rapidkv.kvt.messages import LayersLanded, SendDone

pytestmark = pytest.mark.unit


def test_one_source_passes_through_unchanged() -> None:
    g = Gather()
    done = SendDone("x", 3, 48, True)
    assert g.send_done(done) is done
    g.landed(LayersLanded("y", 0, 2))
    assert g.layers("y") == 2
    assert g.send_done(SendDone("y", 0, 32, True)) is not None
    assert g.layers("y") == 2  # one source: what its LayersLanded said
    g.forget("y")
    assert g.layers("y") == 0


@st.composite
def arrivals(draw):
    sources = draw(st.integers(1, 4))
    oks = draw(st.lists(st.booleans(), min_size=sources, max_size=sources))
    tokens = draw(st.lists(st.integers(0, 500), min_size=sources, max_size=sources))
    layers = draw(st.lists(st.integers(1, 6), min_size=sources, max_size=sources))
    events = [("landed", r) for r in range(sources)] + [("done", r) for r in range(sources)]
    events += draw(st.lists(st.sampled_from(events), max_size=4))  # duplicates
    order = draw(st.permutations(events))
    # a source's LayersLanded comes before its SendDone
    seen_done: set[int] = set()
    ordered = []
    for kind, r in order:
        if kind == "landed" and r in seen_done:
            continue
        if kind == "done":
            seen_done.add(r)
        ordered.append((kind, r))
    return sources, oks, tokens, layers, ordered


@given(arrivals())
def test_handed_on_once_after_every_source_ok_only_if_all(case) -> None:
    sources, oks, tokens, layers, order = case
    g = Gather()
    out = []
    seen: set[int] = set()
    said: dict[int, int] = {}  # the model: source rank -> leading layers in place
    for kind, r in order:
        if kind == "landed":
            g.landed(LayersLanded("x", r, layers[r], sources))
            said[r] = max(said.get(r, 0), layers[r])
        else:
            err = "" if oks[r] else f"boom {r}"
            whole = g.send_done(SendDone("x", r, tokens[r], oks[r], err, 0, sources))
            seen.add(r)
            if oks[r] and sources > 1:
                said[r] = 1 << 30  # done: all of its layers
            if whole is not None:
                out.append(whole)
                assert seen == set(range(sources)) or sources == 1
        expected = min(said.values()) if len(said) == sources else 0
        assert g.layers("x") == expected
    if sources == 1:
        assert len(out) == len([e for e in order if e[0] == "done"])
        return
    assert len(out) == 1
    [whole] = out
    assert whole.ok == all(oks)
    assert whole.tokens_sent == min(tokens)
    assert whole.sources == sources
    for r in range(sources):
        assert (f"rank {r}: boom {r}" in whole.error) == (not oks[r])


def test_layers_wait_for_every_source_and_take_the_least() -> None:
    g = Gather()
    g.landed(LayersLanded("x", 0, 3, 2))
    assert g.layers("x") == 0  # rank 1 said nothing yet
    g.landed(LayersLanded("x", 1, 1, 2))
    assert g.layers("x") == 1
    assert g.send_done(SendDone("x", 1, 16, True, "", 0, 2)) is None
    assert g.layers("x") == 3  # rank 1 done: all of its layers; rank 0 said 3
    g.landed(LayersLanded("x", 0, 2, 2))  # an older, smaller count changes nothing
    assert g.layers("x") == 3


def test_memory_is_bounded() -> None:
    g = Gather(memory=2)
    for i in range(5):
        assert g.send_done(SendDone(f"x{i}", 0, 0, True, "", 0, 2)) is None
        g.landed(LayersLanded(f"x{i}", 0, 1, 2))
    # only the last two are remembered: x0 completes as a fresh transfer would not
    assert g.send_done(SendDone("x0", 1, 0, True, "", 0, 2)) is None
    assert g.send_done(SendDone("x4", 1, 0, True, "", 0, 2)) is not None
