"""`RankLinks`: which ranks of each destination instance one worker rank is
connected to, as peer entries arrive (twice, in any order, after restarts),
checked against a model by hypothesis; and `describe_heads` on the vLLM CPU
tensor shape."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rapidkv.connector.rank_links import ModelHeads, RankLinks, describe_heads
from rapidkv.kvt.layout import LayerLayout

pytestmark = pytest.mark.unit


def test_a_restart_replaces_the_old_ranks_and_a_stale_drop_does_nothing() -> None:
    links = RankLinks()
    assert links.targets("D") is None
    assert links.offer("D", 1, 0, True) == ((), True)
    assert links.offer("D", 1, 1, False) is None  # not ours: nothing to connect
    assert links.offer("D", 1, 0, True) is None  # the same entry again
    assert links.targets("D") == (0,)
    assert links.offer("D", 2, 1, True) == ((0,), True)  # restarted: rank 0 of gen 1 goes
    assert links.offer("D", 1, 0, True) is None  # an old entry, late
    assert links.offer("D", 2, 0, True) == ((), True)
    assert links.targets("D") == (1, 0)
    assert links.drop("D", 1) is None and links.generation("D") == 2
    assert links.drop("D", 2) == (1, 0)
    assert links.targets("D") is None and links.generation("D") is None


entries = st.lists(
    st.tuples(st.integers(1, 3), st.integers(0, 2), st.booleans(), st.booleans()), max_size=30
)  # (generation, rank, sends, or a drop of that generation)


@given(entries)
def test_connected_ranks_follow_the_newest_generation(events) -> None:
    links = RankLinks()
    connected: set[tuple[int, int]] = set()  # (generation, rank) connected now
    adds: list[tuple[int, int]] = []
    for generation, rank, sends, drop in events:
        if drop:
            ranks = links.drop("D", generation)
            if ranks is not None:
                assert {(generation, r) for r in ranks} == connected
                connected.clear()
            continue
        before = links.generation("D")
        offer = links.offer("D", generation, rank, sends)
        if offer is None:
            assert before is not None and (
                before > generation
                or (before == generation and ((before, rank) in connected or not sends))
            )
            continue
        if before is not None and before < generation:  # every older rank goes
            assert set(offer.remove) == {r for _, r in connected}
            connected.clear()
        else:
            assert offer.remove == ()
        assert offer.add == sends
        if offer.add:
            connected.add((generation, rank))
            adds.append((generation, rank))
        newest = links.generation("D")
        assert all(g == newest for g, _ in connected)
        assert set(links.targets("D") or ()) == {r for _, r in connected}
    # a rank is connected once per generation, until that generation is dropped
    assert len(adds) >= len(connected)


def test_describe_heads_on_the_vllm_cpu_shape() -> None:
    layer = LayerLayout(base=0, block_stride=2 * 128 * 128 * 4, run_bytes=2 * 128 * 128 * 4)
    model = ModelHeads(total=4, tp_size=2, head_size=64)
    described, why = describe_heads(layer, (10, 2, 128, 128), 4, 0, 1, model, 1, 128)
    assert why == "" and described.heads is not None
    assert (described.heads.rank, described.heads.tp_size, described.heads.outer) == (1, 2, 1)
    assert described.heads.head_bytes == 128 * 128 * 4
    same, why = describe_heads(layer, (10, 2, 128, 100), 4, 0, 1, model, 1, 128)
    assert same is layer and "no head dimension" in why
    wrong, why = describe_heads(layer, (10, 3, 128, 128), 4, 0, 1, model, 0, 128)
    assert wrong is layer and why
