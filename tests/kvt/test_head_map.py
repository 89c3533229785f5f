"""The KV head mapping between TP sizes: every destination byte written once, by
a rank that holds its head, to the right place; equal TP is the identity;
impossible mappings are refused with their reasons."""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rapidkv.kvt.head_map import (
    MappingError,
    Piece,
    check,
    head_routes,
    heads_from_tensor,
    layer_pieces,
    pairs,
    peer_pieces,
    piece_descs,
    plan,
    rank_heads,
    whole_pieces,
)
from rapidkv.kvt.layout import Heads, LayerLayout, Layout, layer_descs, layer_layout_from_tensor

pytestmark = pytest.mark.unit


# -- which ranks hold which heads --------------------------------------------------


def test_heads_split_over_ranks_as_vllm_does() -> None:
    assert [rank_heads(8, 2, r) for r in range(2)] == [range(0, 4), range(4, 8)]
    assert [rank_heads(8, 1, 0)] == [range(0, 8)]
    # fewer heads than ranks: each head on tp / heads consecutive ranks
    assert [rank_heads(2, 4, r) for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    assert [rank_heads(1, 4, r) for r in range(4)] == [range(0, 1)] * 4


@pytest.mark.parametrize(("total", "tp"), [(6, 4), (3, 2), (4, 6), (0, 1)])
def test_heads_that_do_not_split_are_refused(total: int, tp: int) -> None:
    with pytest.raises(MappingError, match="KV heads"):
        rank_heads(total, tp, 0)


def test_p_at_tp2_to_d_at_tp1_sends_each_rank_its_half() -> None:
    assert dict(head_routes(8, 2, 1)) == {(0, 0): (range(0, 4),), (1, 0): (range(4, 8),)}


def test_p_at_tp1_to_d_at_tp2_sends_each_d_rank_its_half() -> None:
    assert dict(head_routes(8, 1, 2)) == {(0, 0): (range(0, 4),), (0, 1): (range(4, 8),)}


def test_replicated_heads_are_sent_once_to_each_rank_that_needs_them() -> None:
    # 2 heads on P's 4 ranks (0,1 hold head 0; 2,3 hold head 1) to D at TP 1
    assert dict(head_routes(2, 4, 1)) == {(0, 0): (range(0, 1),), (2, 0): (range(1, 2),)}
    # to D at TP 2: one head each, from different replicas
    assert dict(head_routes(2, 4, 2)) == {(0, 0): (range(0, 1),), (3, 1): (range(1, 2),)}
    # D replicates too: every D rank gets its head once, the replicas share the load
    assert pairs(2, 4, 4) == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert pairs(1, 1, 4) == [(0, 0), (0, 1), (0, 2), (0, 3)]


@given(
    total=st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 32]),
    src_tp=st.sampled_from([1, 2, 3, 4, 6, 8, 16]),
    dst_tp=st.sampled_from([1, 2, 3, 4, 6, 8, 16]),
)
def test_every_head_of_every_destination_rank_has_exactly_one_sender(
    total: int, src_tp: int, dst_tp: int
) -> None:
    splits = all(total % tp == 0 or tp % total == 0 for tp in (src_tp, dst_tp))
    if not splits:
        with pytest.raises(MappingError, match="do not split"):
            head_routes(total, src_tp, dst_tp)
        return
    routes = head_routes(total, src_tp, dst_tp)
    for d in range(dst_tp):
        got = sorted(h for (p, dd), rs in routes.items() if dd == d for r in rs for h in r)
        assert got == list(rank_heads(total, dst_tp, d))
    for (p, _), ranges in routes.items():
        for heads in ranges:
            assert set(heads) <= set(rank_heads(total, src_tp, p))
    if src_tp == dst_tp:
        assert list(routes) == [(r, r) for r in range(src_tp)]


# -- byte-level: a model of each rank's memory, one label per byte ---------------------

KINDS = ("cpu", "nhd", "hnd")


def rank_tensor_shape(kind: str, blocks: int, k: int, heads: int, n: int, d: int) -> list[int]:
    """vLLM's per-layer KV tensor of one rank (`k` kernel blocks a block)."""
    nk = n // k
    if kind == "cpu":
        return [blocks * k, heads, nk, 2 * d]
    if kind == "nhd":
        return [2, blocks * k, nk, heads, d]
    return [2, blocks * k, heads, nk, d]


def dims(kind: str) -> tuple[int, int]:
    """(block_dim, head_dim) of `rank_tensor_shape`."""
    return {"cpu": (0, 1), "nhd": (1, 3), "hnd": (1, 2)}[kind]


def labels(kind: str, shape: list[int], k: int, first_head: int, total: int, e: int, block_of):
    """One int64 label per byte of a rank's tensor, in memory order: which
    (block, K/V, token, global head, element, byte) the byte holds; `block_of`
    maps a block index of this tensor to the logical block whose KV it holds
    (-1: none, the byte is unlabelled)."""
    idx = np.indices(shape, dtype=np.int64)
    if kind == "cpu":
        kb, h, t, c = idx
        kv = np.zeros_like(kb)
    elif kind == "nhd":
        kv, kb, t, h, c = idx
    else:
        kv, kb, h, t, c = idx
    nk, width = t.max() + 1, c.max() + 1
    logical = np.asarray(block_of, dtype=np.int64)[kb // k]
    token = (kb % k) * nk + t
    label = ((((logical * 2 + kv) * (nk * k) + token) * total + first_head + h) * width + c) * e
    label = label[..., None] + np.arange(e, dtype=np.int64)
    label[np.broadcast_to((logical < 0)[..., None], label.shape)] = -1
    return label.ravel()


def rank_layout(kind: str, blocks: int, k: int, total: int, tp: int, rank: int, n, d, e):
    shape = rank_tensor_shape(kind, blocks, k, len(rank_heads(total, tp, rank)), n, d)
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    block_dim, head_dim = dims(kind)
    layer = layer_layout_from_tensor(0, shape, strides, e, block_dim, k)
    heads = heads_from_tensor(
        shape,
        e,
        block_dim,
        head_dim,
        total=total,
        tp_size=tp,
        rank=rank,
        head_size=d,
        block_size=n,
        kernel_blocks_per_block=k,
    )
    return shape, LayerLayout(
        layer.base, layer.block_stride, layer.run_bytes, layer.run_offsets, heads
    )


def split_ok(total: int, tp: int) -> bool:
    return total % tp == 0 or tp % total == 0


@settings(max_examples=150, deadline=None)
@given(
    total=st.sampled_from([1, 2, 4, 6, 8, 12]),
    src_tp=st.sampled_from([1, 2, 3, 4, 6, 8]),
    dst_tp=st.sampled_from([1, 2, 3, 4, 6, 8]),
    kind=st.sampled_from(KINDS),
    k=st.sampled_from([1, 2]),
    nk=st.integers(1, 3),
    d=st.integers(1, 3),
    e=st.sampled_from([1, 2, 4]),
    data=st.data(),
)
def test_every_destination_byte_is_written_once_with_the_right_bytes(
    total, src_tp, dst_tp, kind, k, nk, d, e, data
) -> None:
    assume(split_ok(total, src_tp) and split_ok(total, dst_tp))
    n = nk * k
    blocks = 4
    src_blocks = data.draw(st.permutations(range(blocks)))[:3]
    dst_blocks = data.draw(st.permutations(range(blocks)))[:3]
    logical_of_dst = [-1] * blocks
    for s_b, d_b in zip(src_blocks, dst_blocks, strict=True):
        logical_of_dst[d_b] = s_b
    src = []
    for p in range(src_tp):
        shape, lay = rank_layout(kind, blocks, k, total, src_tp, p, n, d, e)
        first = rank_heads(total, src_tp, p).start
        src.append((lay, labels(kind, shape, k, first, total, e, list(range(blocks)))))
    dst = []
    for r in range(dst_tp):
        shape, lay = rank_layout(kind, blocks, k, total, dst_tp, r, n, d, e)
        first = rank_heads(total, dst_tp, r).start
        expected = labels(kind, shape, k, first, total, e, logical_of_dst)
        dst.append((lay, expected, np.full_like(expected, -1), np.zeros_like(expected)))
    full = plan(
        [Layout((lay,), blocks) for lay, _ in src], [Layout((lay,), blocks) for lay, *_ in dst]
    )
    assert {pair for pair in full} == set(pairs(total, src_tp, dst_tp))
    for (p, r), (pieces,) in full.items():
        s_lay, s_mem = src[p]
        d_lay, _, d_mem, written = dst[r]
        for sa, da, nbytes in piece_descs(s_lay, d_lay, pieces, src_blocks, dst_blocks).tolist():
            assert sa >= 0 and sa + nbytes <= len(s_mem)
            assert da >= 0 and da + nbytes <= len(d_mem)
            d_mem[da : da + nbytes] = s_mem[sa : sa + nbytes]
            written[da : da + nbytes] += 1
    for _, expected, d_mem, written in dst:
        assert (written == (expected >= 0)).all(), "a byte written twice, or not at all"
        assert (d_mem == expected).all(), "a byte from the wrong head, block or place"


@given(
    total=st.sampled_from([1, 2, 4, 8]),
    tp=st.sampled_from([1, 2, 4, 8]),
    kind=st.sampled_from(KINDS),
    k=st.sampled_from([1, 2]),
)
def test_equal_tp_is_the_identity_per_rank(total: int, tp: int, kind: str, k: int) -> None:
    assume(split_ok(total, tp))
    layouts = [
        Layout((rank_layout(kind, 3, k, total, tp, r, 2 * k, 2, 2)[1],), 3) for r in range(tp)
    ]
    for r, lay in enumerate(layouts):
        assert peer_pieces(lay, layouts[r]) is None
        assert layer_pieces(lay.layers[0], layouts[r].layers[0]) == whole_pieces(lay.layers[0])
        for other in range(tp):
            if other != r:
                assert layer_pieces(lay.layers[0], layouts[other].layers[0]) == ()
    full = plan(layouts, layouts)
    assert list(full) == [(r, r) for r in range(tp)]
    for r in range(tp):
        s = layouts[r].layers[0]
        moved = piece_descs(s, s, full[(r, r)][0], [0, 2], [1, 0])
        assert sorted(moved.tolist()) == sorted(layer_descs(s, s, [0, 2], [1, 0]).tolist())


# -- refusals --------------------------------------------------------------------


def heads(**over) -> Heads:
    base = dict(
        total=8,
        tp_size=2,
        rank=0,
        head_size=128,
        block_size=16,
        element_size=2,
        outer=1,
        head_bytes=16 * 2 * 128 * 2,
    )
    base.update(over)
    return Heads(**base)


def layer_of(h: Heads, runs: int = 1) -> LayerLayout:
    held = len(rank_heads(h.total, h.tp_size, h.rank))
    run = h.outer * held * h.head_bytes
    return LayerLayout(0, run * runs, run, tuple(i * run for i in range(runs)), h)


def test_different_head_size_and_block_size_are_refused_with_both_reasons() -> None:
    src = layer_of(heads())
    dst = layer_of(heads(tp_size=1, head_size=64, block_size=32))
    with pytest.raises(MappingError) as e:
        layer_pieces(src, dst)
    assert "head size 128 vs 64" in str(e.value)
    assert "block size 16 vs 32" in str(e.value)
    assert "TP 2 rank 0 to TP 1 rank 0" in str(e.value)


def test_different_head_counts_runs_and_arrangements_are_refused() -> None:
    with pytest.raises(MappingError, match="KV heads 8 vs 16"):
        check(layer_of(heads()), layer_of(heads(total=16, tp_size=4)))
    with pytest.raises(MappingError, match="runs a block 1 vs 2"):
        check(layer_of(heads()), layer_of(heads(tp_size=1), runs=2))
    nhd = heads(tp_size=1, outer=16, head_bytes=256)
    with pytest.raises(MappingError, match="outer"):
        check(layer_of(heads()), layer_of(nhd))


def test_heads_not_dividing_the_ranks_are_refused() -> None:
    src = layer_of(heads(total=6, tp_size=2))
    bad = Heads(6, 4, 0, 128, 16, 2, 1, 16 * 2 * 128 * 2)
    dst = LayerLayout(0, bad.head_bytes, bad.head_bytes, (0,), bad)
    with pytest.raises(MappingError, match="6 KV heads do not split over TP 4"):
        check(src, dst)


def test_a_layer_whose_runs_do_not_hold_its_heads_is_refused() -> None:
    src = layer_of(heads())
    dst = msgspec_replace(layer_of(heads(tp_size=1)), run_bytes=12345)
    with pytest.raises(MappingError, match="runs of 12345 bytes"):
        check(src, dst)


def test_layouts_that_differ_without_heads_are_refused() -> None:
    a = Layout((LayerLayout(0, 64, 64),), 4)
    b = Layout((LayerLayout(0, 32, 32),), 4)
    with pytest.raises(MappingError, match="does not describe its KV heads"):
        peer_pieces(a, b)
    assert peer_pieces(a, a) is None


def test_a_tensor_with_the_wrong_head_count_is_refused() -> None:
    with pytest.raises(MappingError, match="should hold 4 of 8 KV heads"):
        heads_from_tensor(
            [10, 8, 16, 256], 2, 0, 1, total=8, tp_size=2, rank=1, head_size=128, block_size=16
        )


def msgspec_replace(layer: LayerLayout, **changes) -> LayerLayout:
    import msgspec

    return msgspec.structs.replace(layer, **changes)


# -- real tensors -------------------------------------------------------------------


def global_kv(kind: str, blocks: int, total: int, n: int, d: int) -> torch.Tensor:
    shape = rank_tensor_shape(kind, blocks, 1, total, n, d)
    return torch.randint(-30000, 30000, shape, dtype=torch.int16)


def take_heads(kind: str, full: torch.Tensor, heads: range) -> torch.Tensor:
    head_dim = dims(kind)[1]
    return full.narrow(head_dim, heads.start, len(heads)).contiguous()


def tensor_layout(kind: str, t: torch.Tensor, total: int, tp: int, rank: int, n: int, d: int):
    block_dim, head_dim = dims(kind)
    lay = layer_layout_from_tensor(t.data_ptr(), t.shape, t.stride(), t.element_size(), block_dim)
    h = heads_from_tensor(
        t.shape,
        t.element_size(),
        block_dim,
        head_dim,
        total=total,
        tp_size=tp,
        rank=rank,
        head_size=d,
        block_size=n,
    )
    return Layout((msgspec_replace(lay, heads=h),), t.shape[block_dim])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("total", "src_tp", "dst_tp"),
    [(8, 2, 1), (8, 1, 2), (8, 4, 2), (8, 2, 4), (2, 4, 1), (2, 1, 4)],
)
def test_real_tensors_land_in_the_rank_that_owns_each_head(kind, total, src_tp, dst_tp) -> None:
    blocks, n, d = 6, 4, 8
    full = global_kv(kind, blocks, total, n, d)
    src = [take_heads(kind, full, rank_heads(total, src_tp, p)) for p in range(src_tp)]
    dst = [
        torch.zeros_like(take_heads(kind, full, rank_heads(total, dst_tp, r)))
        for r in range(dst_tp)
    ]
    src_l = [tensor_layout(kind, t, total, src_tp, p, n, d) for p, t in enumerate(src)]
    dst_l = [tensor_layout(kind, t, total, dst_tp, r, n, d) for r, t in enumerate(dst)]
    src_blocks, dst_blocks = [1, 2, 3, 5], [0, 1, 4, 2]
    for (p, r), (pieces,) in plan(src_l, dst_l).items():
        rows = piece_descs(src_l[p].layers[0], dst_l[r].layers[0], pieces, src_blocks, dst_blocks)
        for sa, da, nbytes in rows.tolist():
            ctypes.memmove(da, sa, nbytes)
    block_dim = dims(kind)[0]
    for r, t in enumerate(dst):
        want = take_heads(kind, full, rank_heads(total, dst_tp, r))
        for sb, db in zip(src_blocks, dst_blocks, strict=True):
            assert torch.equal(t.select(block_dim, db), want.select(block_dim, sb))
        untouched = [b for b in range(blocks) if b not in dst_blocks]
        for b in untouched:
            assert not t.select(block_dim, b).any()


def test_tp2_to_tp1_on_the_gpu_layout_moves_strided_segments() -> None:
    # NHD: per token and K/V, 4 heads of 256 bytes from each P rank
    src = Heads(8, 2, 1, 128, 16, 2, outer=16, head_bytes=256)
    dst = Heads(8, 1, 0, 128, 16, 2, outer=16, head_bytes=256)
    s = LayerLayout(0, 16 * 1024, 16 * 1024, (0, 1 << 30), src)
    t = LayerLayout(0, 32 * 1024, 32 * 1024, (0, 1 << 31), dst)
    assert layer_pieces(s, t) == (
        Piece(0, 1024, 1024, 16, 1024, 2048),
        Piece(1 << 30, (1 << 31) + 1024, 1024, 16, 1024, 2048),
    )
