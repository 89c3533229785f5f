"""`head_map.route` (whom a source rank sends to, and how many source ranks
send to a destination rank) and `head_map.find_head_dim` (where vLLM's KV
tensors keep their heads)."""

from __future__ import annotations

import pytest

from rapidkv.bench.kvt.tp import rank_kvs
from rapidkv.kvt.head_map import find_head_dim, pairs, route
from rapidkv.kvt.layout import LayerLayout, Layout

pytestmark = pytest.mark.unit


def layouts(tp: int) -> list[Layout]:
    return [layout for _, layout in rank_kvs("cpu", tp, False, layers=1, blocks=1)]


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 1), (2, 2), (2, 1), (1, 2), (4, 2), (2, 8)])
def test_route_agrees_with_the_pairs(src_tp: int, dst_tp: int) -> None:
    src, dst = layouts(src_tp), layouts(dst_tp)
    want = set(pairs(8, src_tp, dst_tp))
    for p in range(src_tp):
        for d in range(dst_tp):
            r = route(src[p], p, dst[d], d)
            assert r.sends == ((p, d) in want)
            assert r.sources == sum(1 for _, x in want if x == d)
    if src_tp == 2 and dst_tp == 1:
        assert route(src[1], 1, dst[0], 0) == (True, 2)
    if src_tp == 1 and dst_tp == 2:
        assert route(src[0], 0, dst[1], 1) == (True, 1)


def test_layouts_without_heads_route_rank_r_to_rank_r() -> None:
    bare = Layout((LayerLayout(0, 64, 64),), 4)
    assert route(bare, 1, bare, 1) == (True, 1)
    assert route(bare, 0, bare, 1) == (False, 1)
    assert route(layouts(2)[0], 0, bare, 0) == (True, 1)  # one side undescribed: equal TP


@pytest.mark.parametrize(
    ("shape", "block_dim", "heads", "head_size", "want"),
    [
        ((100, 2, 16, 128), 0, 2, 64, 1),  # CPU [blocks, H, N, 2D]
        ((100, 1, 16, 128), 0, 1, 64, 1),
        ((2, 100, 4, 16, 64), 1, 4, 64, 2),  # GPU HND [2, blocks, H, N, D]
        ((2, 100, 16, 4, 64), 1, 4, 64, 3),  # GPU NHD [2, blocks, N, H, D]
        ((100, 16, 16, 128), 0, 16, 64, None),  # H == N: cannot tell
        ((100, 2, 16, 100), 0, 2, 64, None),  # last dimension is no head vector
        ((100, 3, 16, 128), 0, 2, 64, None),  # no dimension holds the heads
        ((100, 2, 128), 0, 2, 64, None),  # not three dimensions after the blocks
    ],
)
def test_find_head_dim(shape, block_dim, heads, head_size, want) -> None:
    assert find_head_dim(shape, block_dim, heads, head_size) == want
