"""Layouts from real tensors, descriptor coalescing, and task validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rapidkv.kvt.completions import CompletionTracker
from rapidkv.kvt.layout import Layout, block_runs, layer_descs, layer_layout_from_tensor
from rapidkv.kvt.task import InvalidTask, Task, validate_task

pytestmark = pytest.mark.unit


def layout_of(t: torch.Tensor, block_dim: int, k: int = 1):
    return layer_layout_from_tensor(
        t.data_ptr(), t.shape, t.stride(), t.element_size(), block_dim, k
    )


def copy_with_descs(descs: np.ndarray) -> None:
    import ctypes

    for src, dst, n in descs.tolist():
        ctypes.memmove(dst, src, n)


def test_cpu_layout_copies_exactly_the_named_blocks() -> None:
    # vLLM CPU: [num_blocks, kv_heads, block_size, 2 * head_dim]
    src = torch.randn(10, 2, 16, 8)
    dst = torch.zeros_like(src)
    s, d = layout_of(src, 0), layout_of(dst, 0)
    assert s.dense and s.run_bytes == 2 * 16 * 8 * 4
    src_blocks, dst_blocks = [3, 4, 5, 9, 0], [0, 1, 2, 7, 8]
    descs = layer_descs(s, d, src_blocks, dst_blocks)
    assert len(descs) == 3  # 3,4,5 -> 0,1,2 coalesced; 9 -> 7; 0 -> 8
    copy_with_descs(descs)
    for sb, db in zip(src_blocks, dst_blocks, strict=True):
        assert torch.equal(dst[db], src[sb])
    untouched = sorted(set(range(10)) - set(dst_blocks))
    assert not dst[untouched].any()


def test_split_kv_layout_copies_both_halves() -> None:
    # GPU flash-attn style: [2, num_blocks, block_size, heads, head_dim]
    src = torch.randn(2, 6, 4, 2, 8)
    dst = torch.zeros_like(src)
    s, d = layout_of(src, 1), layout_of(dst, 1)
    assert not s.dense and len(s.run_offsets) == 2
    descs = layer_descs(s, d, [1, 2], [4, 5])
    assert len(descs) == 4
    copy_with_descs(descs)
    assert torch.equal(dst[:, 4:6], src[:, 1:3])
    assert not dst[:, :4].any()


def test_kernel_block_split_treats_k_kernel_blocks_as_one() -> None:
    src = torch.randn(12, 2, 8, 4)  # 12 kernel blocks = 6 manager blocks of 2
    dst = torch.zeros_like(src)
    s, d = layout_of(src, 0, k=2), layout_of(dst, 0, k=2)
    copy_with_descs(layer_descs(s, d, [5], [0]))
    assert torch.equal(dst[0:2], src[10:12])


def test_non_dense_inner_dims_are_refused() -> None:
    t = torch.randn(4, 2, 16, 8)[:, :, :, :4]  # sliced: inner dims not dense
    with pytest.raises(ValueError, match="not dense"):
        layout_of(t, 0)


def test_registered_regions_merge_adjacent_layers() -> None:
    storage = torch.zeros(3, 5, 2, 4, 8)  # three layer views of one storage
    layers = tuple(layout_of(storage[i], 0) for i in range(3))
    regions = Layout(layers, 5).regions()
    assert regions == [(storage.data_ptr(), storage.numel() * 4)]


def test_block_runs_split_on_either_side_jumping() -> None:
    runs = block_runs([1, 2, 3, 7, 8], [10, 11, 5, 6, 7])
    assert runs.tolist() == [[1, 10, 2], [3, 5, 1], [7, 6, 2]]


def task(**kw) -> Task:
    base = dict(
        xfer_id="x",
        peer="p",
        src_blocks=(0, 1),
        dst_blocks=(5, 6),
        seen_tokens=0,
        new_tokens=8,
        has_last_token=False,
    )
    return Task(**(base | kw))


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        (dict(new_tokens=7), "only carry full blocks"),
        (dict(seen_tokens=2), "block boundary"),
        (dict(dst_blocks=(5, 5)), "appears twice"),
        (dict(dst_blocks=(5,)), "differ in length"),
        (dict(new_tokens=9, has_last_token=True), "does not match"),
    ],
)
def test_invalid_tasks_are_refused(kw: dict, why: str) -> None:
    with pytest.raises(InvalidTask, match=why):
        validate_task(task(**kw), block_size=4)


def test_partial_tail_allowed_with_last_token() -> None:
    validate_task(task(new_tokens=5, has_last_token=True), block_size=4)


def test_tracker_refuses_a_second_write_to_a_busy_block() -> None:
    tracker = CompletionTracker(num_layers=2, block_size=4, rank=0)
    tracker.add_task(task())
    with pytest.raises(InvalidTask, match="already being written"):
        tracker.add_task(task(xfer_id="y", src_blocks=(3,), dst_blocks=(6,), new_tokens=4))
    tracker.add_task(
        task(xfer_id="y", peer="other", src_blocks=(3,), dst_blocks=(6,), new_tokens=4)
    )


def test_tracker_refuses_tasks_for_a_settled_transfer() -> None:
    tracker = CompletionTracker(num_layers=1, block_size=4, rank=3)
    t = tracker.add_task(task(has_last_token=True))
    tracker.posted(1, [(t, 0, 1)])
    ((peer, done),) = [(s.peer, s.done) for s in tracker.settled(1, ok=True)]
    assert peer == "p"
    assert (done.ok, done.tokens_sent, done.rank) == (True, 8, 3)
    with pytest.raises(InvalidTask, match="already settled"):
        tracker.add_task(
            task(seen_tokens=8, src_blocks=(2,), dst_blocks=(7,), new_tokens=1, has_last_token=True)
        )
