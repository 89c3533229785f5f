"""Where block `b` of layer `l` lives in memory, and the byte ranges a send moves.

A `LayerLayout` describes one layer's KV tensor as seen by the data plane: block
`b` is the set of runs `base + offset + b * block_stride` for each offset in
`run_offsets`, each `run_bytes` long. On vLLM CPU a layer is a contiguous
`[num_blocks, kv_heads, block_size, 2 * head_dim]` tensor: one run per block.
GPU backends put K and V in separate halves (`[2, num_blocks, ...]`): two runs per
block. Layouts are derived from a tensor's shape and strides, never hard-coded.

The unit of transfer is a whole block (inside a block the CPU backend stores K
transposed, so token ranges are not contiguous). Runs of consecutive source
blocks that map to consecutive destination blocks are coalesced into one range
when blocks are adjacent in memory on both sides.

A layer may also say which KV heads its blocks hold and where they sit
(`Heads`): what lets two instances of different tensor-parallel sizes exchange
blocks, each head moved to the rank that owns it (`kvt.head_map`). The
connector's workers describe their layers' heads where the KV tensor's shape
says where they are (`connector.worker_side`), as `bench kvt --tp-from` does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
import numpy as np


class Heads(msgspec.Struct, frozen=True):
    """The KV heads one layer's blocks hold on one TP rank, and where they sit.

    Each run of a block (`LayerLayout.run_offsets`) is `outer` repetitions of
    this rank's heads side by side, `head_bytes` each:
    `run = [outer][heads of this rank][head_bytes]`. Which heads a rank holds
    follows vLLM's split (`kvt.head_map.rank_heads`): with at least as many
    heads as ranks, `total / tp_size` consecutive heads each; with fewer, each
    head replicated on `tp_size / total` consecutive ranks.

    | vLLM layer tensor | runs a block | `outer` | `head_bytes` |
    |---|---|---|---|
    | CPU `[blocks, H, N, 2*D]` | 1 | 1 | `N * 2D * e` |
    | GPU NHD `[2, blocks, N, H, D]` | 2 (K, V) | `N` | `D * e` |
    | GPU HND `[2, blocks, H, N, D]` | 2 (K, V) | 1 | `N * D * e` |

    (H heads of this rank, N tokens a block, D head size, e bytes an element;
    with `k` kernel blocks a block, `outer` is `k` times the kernel block's.)
    `head_size`, `block_size` and `element_size` are carried so that a mapping
    that cannot exist is refused with the reason.
    """

    total: int  # KV heads of the model, all ranks together
    tp_size: int
    rank: int
    head_size: int  # elements of one head's vector
    block_size: int  # tokens a block
    element_size: int  # bytes an element
    outer: int  # repetitions of the head dimension in one run
    head_bytes: int  # bytes of one head at one repetition


class LayerLayout(msgspec.Struct, frozen=True):
    base: int  # address of block 0
    block_stride: int  # bytes from block b to block b + 1
    run_bytes: int  # bytes of each contiguous run of one block
    run_offsets: tuple[int, ...] = (0,)  # offset of each run of a block from its start
    heads: Heads | None = None  # the KV heads inside each run (None: not described)

    @property
    def dense(self) -> bool:
        """Consecutive blocks are adjacent in memory (runs can be merged)."""
        return self.run_offsets == (0,) and self.block_stride == self.run_bytes


class Layout(msgspec.Struct, frozen=True):
    """The KV memory of one worker: one `LayerLayout` per layer, `num_blocks` each."""

    layers: tuple[LayerLayout, ...]
    num_blocks: int

    @property
    def block_bytes(self) -> int:
        """Bytes one block occupies across all layers."""
        return sum(layer.run_bytes * len(layer.run_offsets) for layer in self.layers)

    def regions(self) -> list[tuple[int, int]]:
        """Memory to register: one `(address, nbytes)` span per layer, merged
        where layers touch."""
        spans = sorted(
            (
                lay.base,
                lay.base
                + (self.num_blocks - 1) * lay.block_stride
                + max(lay.run_offsets)
                + lay.run_bytes,
            )
            for lay in self.layers
        )
        merged: list[list[int]] = []
        for start, end in spans:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return [(start, end - start) for start, end in merged]


def layer_layout_from_tensor(
    data_ptr: int,
    shape: Sequence[int],
    stride: Sequence[int],
    element_size: int,
    block_dim: int,
    kernel_blocks_per_block: int = 1,
) -> LayerLayout:
    """Describe one layer's KV tensor.

    `block_dim` is the dimension indexed by block id. Dimensions after it must be
    dense (one run per block); dimensions before it give separate runs (K/V
    halves). With `kernel_blocks_per_block = k` the tensor is indexed by *kernel*
    blocks and a manager block `b` is kernel blocks `b*k .. b*k+k-1`.
    """
    if not 0 <= block_dim < len(shape):
        raise ValueError(f"block_dim {block_dim} out of range for shape {tuple(shape)}")
    inner = shape[block_dim + 1 :]
    expected = 1
    for size, st in zip(reversed(inner), reversed(stride[block_dim + 1 :]), strict=True):
        if size > 1 and st != expected:
            raise ValueError(
                f"KV tensor shape {tuple(shape)} stride {tuple(stride)}: the dimensions after "
                f"the block dimension are not dense"
            )
        expected *= size
    kernel_run = math.prod(inner) * element_size
    kernel_stride = stride[block_dim] * element_size
    k = kernel_blocks_per_block
    if k > 1 and kernel_stride != kernel_run:
        raise ValueError("kernel blocks of one block are not adjacent in memory")
    offsets = [0]
    for size, st in zip(shape[:block_dim], stride[:block_dim], strict=True):
        offsets = [o + i * st * element_size for o in offsets for i in range(size)]
    return LayerLayout(
        base=data_ptr,
        block_stride=kernel_stride * k,
        run_bytes=kernel_run * k,
        run_offsets=tuple(offsets),
    )


def block_runs(src: Sequence[int], dst: Sequence[int]) -> np.ndarray:
    """Split paired block lists into runs where both sides advance by one.

    Returns an int64 array of rows `(first_src, first_dst, count)`.
    """
    s = np.asarray(src, dtype=np.int64)
    d = np.asarray(dst, dtype=np.int64)
    if s.size == 0:
        return np.empty((0, 3), dtype=np.int64)
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [s.size])))
    return np.stack((s[starts], d[starts], counts), axis=1)


def layer_descs(
    src: LayerLayout, dst: LayerLayout, src_blocks: Sequence[int], dst_blocks: Sequence[int]
) -> np.ndarray:
    """Byte ranges `(src_addr, dst_addr, nbytes)` that copy the given blocks of one
    layer; int64 array of shape (n, 3), ready for `Transport.post_write`."""
    if src.run_bytes != dst.run_bytes or len(src.run_offsets) != len(dst.run_offsets):
        raise ValueError(f"source and destination block layouts differ: {src} vs {dst}")
    if src.dense and dst.dense:
        runs = block_runs(src_blocks, dst_blocks)
        return np.stack(
            (
                src.base + runs[:, 0] * src.block_stride,
                dst.base + runs[:, 1] * dst.block_stride,
                runs[:, 2] * src.run_bytes,
            ),
            axis=1,
        )
    s = np.asarray(src_blocks, dtype=np.int64)
    d = np.asarray(dst_blocks, dtype=np.int64)
    parts = [
        np.stack(
            (
                src.base + so + s * src.block_stride,
                dst.base + do + d * dst.block_stride,
                np.full_like(s, src.run_bytes),
            ),
            axis=1,
        )
        for so, do in zip(src.run_offsets, dst.run_offsets, strict=True)
    ]
    return np.concatenate(parts)
