"""KV between instances of different tensor-parallel sizes: which bytes of a
source rank's block go where in a destination rank's block.

Theory of operation
-------------------
Pure: layouts in (`LayerLayout`s whose `Heads` say which KV heads each rank's
blocks hold and where, as each rank's handshake entry carries them: the
connector's workers describe them when they register their KV caches), byte
runs out. Nothing here touches memory or a transport.

Every KV head lives on the ranks that own it under vLLM's split (`rank_heads`):
with at least as many heads as ranks each rank holds `heads / tp` consecutive
heads; with fewer, each head is replicated on `tp / heads` consecutive ranks. A
destination rank needs every head it owns, and for each (destination rank, head)
exactly one source rank sends it (`head_routes`): the head's only owner, or, when
the source replicates heads, the owners take turns over the destination ranks
that need that head (owner `d mod replicas` for destination rank `d`), so a
replicated head is sent once to each rank that needs it and the load spreads.
Equal TP sizes route rank r to rank r and nothing else.

Inside a block every run (one on vLLM CPU; K and V on GPU layouts) is
`[outer][this rank's heads][head_bytes]` (`Heads`). A range of `n` consecutive
heads sent from rank p to rank d is, in each run, `outer` segments of
`n * head_bytes` bytes, `heads(p) * head_bytes` apart in the source block and
`heads(d) * head_bytes` apart in the destination block: one `Piece`. Where the
segments touch on both sides (whole runs, or `outer == 1`) the piece is one
segment. Equal TP gives one piece a run, the whole run: the identity.

Invariants (tests/kvt/test_head_map.py, hypothesis over head counts, TP sizes,
block sizes, head sizes, element sizes and layouts):
- every byte of every destination rank's block is written exactly once, by a
  source rank that holds its head, from the same head, run, repetition and byte
  of the source block the task pairs with it;
- nothing outside a source block is read, nothing outside a destination block
  written;
- equal TP: rank r -> rank r in whole runs; other pairs move nothing.

Refused with a `MappingError` naming every reason: heads that do not split over
a TP size (neither of heads and ranks divides the other), different KV head
counts, head sizes, block sizes, element sizes, runs a block or arrangements of
the heads in a run (`outer`, `head_bytes`), a layer whose runs do not hold the
heads its description says, and layouts that differ without describing heads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import lru_cache
from types import MappingProxyType
from typing import NamedTuple

import numpy as np

from rapidkv.kvt.layout import Heads, LayerLayout, Layout


class MappingError(ValueError):
    """The KV of one layout cannot be mapped onto the other; says why."""


class Piece(NamedTuple):
    """`count` segments of `nbytes`, the i-th at `src_offset + i * src_stride` in
    a source block and `dst_offset + i * dst_stride` in the destination block."""

    src_offset: int
    dst_offset: int
    nbytes: int
    count: int = 1
    src_stride: int = 0
    dst_stride: int = 0


# -- which ranks hold which heads ----------------------------------------------


def _check_split(total: int, tp_size: int) -> None:
    if total < 1 or tp_size < 1:
        raise MappingError(f"{total} KV heads over TP {tp_size}: both must be at least 1")
    if total % tp_size and tp_size % total:
        raise MappingError(
            f"{total} KV heads do not split over TP {tp_size} (neither divides the other)"
        )


def rank_heads(total: int, tp_size: int, rank: int) -> range:
    """The KV heads (global indices) that `rank` of `tp_size` holds, as vLLM
    splits them."""
    _check_split(total, tp_size)
    if not 0 <= rank < tp_size:
        raise MappingError(f"rank {rank} is not a rank of TP {tp_size}")
    if total >= tp_size:
        n = total // tp_size
        return range(rank * n, rank * n + n)
    head = rank // (tp_size // total)
    return range(head, head + 1)


def head_owners(total: int, tp_size: int, head: int) -> range:
    """The ranks of `tp_size` that hold `head`."""
    _check_split(total, tp_size)
    if total >= tp_size:
        rank = head // (total // tp_size)
        return range(rank, rank + 1)
    replicas = tp_size // total
    return range(head * replicas, head * replicas + replicas)


@lru_cache(maxsize=256)
def head_routes(
    total: int, src_tp: int, dst_tp: int
) -> Mapping[tuple[int, int], tuple[range, ...]]:
    """`(source rank, destination rank) -> ranges of heads` the source sends
    there; only pairs that exchange something, in order. Every head of every
    destination rank is in exactly one source rank's ranges."""
    _check_split(total, src_tp)
    _check_split(total, dst_tp)
    routes: dict[tuple[int, int], list[range]] = {}
    for d in range(dst_tp):
        for head in rank_heads(total, dst_tp, d):
            owners = head_owners(total, src_tp, head)
            p = owners[d % len(owners)]
            ranges = routes.setdefault((p, d), [])
            if ranges and ranges[-1].stop == head:
                ranges[-1] = range(ranges[-1].start, head + 1)
            else:
                ranges.append(range(head, head + 1))
    return MappingProxyType({pair: tuple(ranges) for pair, ranges in sorted(routes.items())})


class Route(NamedTuple):
    """Between one source rank and one destination rank: whether the source
    sends there, and how many source ranks send to that destination rank."""

    sends: bool
    sources: int


def route(src: Layout, src_rank: int, dst: Layout, dst_rank: int) -> Route:
    """The `Route` from rank `src_rank` (layout `src`) to rank `dst_rank` (layout
    `dst`). Layouts that do not describe their heads are taken as equal TP: rank
    r sends to rank r alone."""
    s = src.layers[0].heads if src.layers else None
    d = dst.layers[0].heads if dst.layers else None
    if s is None or d is None:
        return Route(src_rank == dst_rank, 1)
    routes = head_routes(s.total, s.tp_size, d.tp_size)
    return Route((src_rank, dst_rank) in routes, sum(1 for _, x in routes if x == dst_rank))


def pairs(total: int, src_tp: int, dst_tp: int) -> list[tuple[int, int]]:
    """`(source rank, destination rank)` pairs that exchange KV: whom each source
    rank sends to, and whose SendDone each destination rank waits for."""
    return list(head_routes(total, src_tp, dst_tp))


# -- describing a layer ------------------------------------------------------------


def heads_from_tensor(
    shape: Sequence[int],
    element_size: int,
    block_dim: int,
    head_dim: int,
    *,
    total: int,
    tp_size: int,
    rank: int,
    head_size: int,
    block_size: int,
    kernel_blocks_per_block: int = 1,
) -> Heads:
    """`Heads` of a layer's KV tensor whose dimension `head_dim` indexes this
    rank's KV heads (after `block_dim`, the block dimension; the dimensions from
    `block_dim` on must be dense, as `layer_layout_from_tensor` requires).
    E.g. vLLM CPU `[blocks, H, N, 2D]`: block_dim 0, head_dim 1; GPU NHD
    `[2, blocks, N, H, D]`: block_dim 1, head_dim 3."""
    if not block_dim < head_dim < len(shape):
        raise MappingError(
            f"head dimension {head_dim} must come after the block dimension {block_dim} "
            f"of shape {tuple(shape)}"
        )
    held = rank_heads(total, tp_size, rank)
    if shape[head_dim] != len(held):
        raise MappingError(
            f"rank {rank} of TP {tp_size} should hold {len(held)} of {total} KV heads, "
            f"its tensor {tuple(shape)} has {shape[head_dim]} at dimension {head_dim}"
        )
    return Heads(
        total=total,
        tp_size=tp_size,
        rank=rank,
        head_size=head_size,
        block_size=block_size,
        element_size=element_size,
        outer=kernel_blocks_per_block * math.prod(shape[block_dim + 1 : head_dim]),
        head_bytes=math.prod(shape[head_dim + 1 :]) * element_size,
    )


def find_head_dim(shape: Sequence[int], block_dim: int, heads: int, head_size: int) -> int | None:
    """The dimension of a layer's KV tensor that indexes this rank's `heads` KV
    heads, for the layouts vLLM uses (after the block dimension: CPU
    `[H, N, 2D]`, GPU HND `[H, N, D]`, GPU NHD `[N, H, D]`); None where the
    shape fits none of them, or fits two with different answers (N == H)."""
    inner = list(shape[block_dim + 1 :])
    if len(inner) != 3 or inner[-1] not in (head_size, 2 * head_size):
        return None
    found = {block_dim + 1 + i for i in (0, 1) if inner[i] == heads}
    if len(found) != 1:
        return None
    return found.pop()


def _side_reasons(name: str, layer: LayerLayout, heads: Heads) -> list[str]:
    reasons = []
    try:
        held = len(rank_heads(heads.total, heads.tp_size, heads.rank))
    except MappingError as e:
        return [f"{name}: {e}"]
    if heads.outer * held * heads.head_bytes != layer.run_bytes:
        reasons.append(
            f"{name}: runs of {layer.run_bytes} bytes, but {heads.outer} x {held} heads x "
            f"{heads.head_bytes} bytes"
        )
    vector = heads.head_size * heads.element_size
    if vector < 1 or heads.head_bytes % vector:
        reasons.append(
            f"{name}: {heads.head_bytes} bytes a head is no multiple of its head size "
            f"{heads.head_size} x {heads.element_size} bytes"
        )
    return reasons


_EQUAL = (
    ("total", "KV heads"),
    ("head_size", "head size"),
    ("block_size", "block size"),
    ("element_size", "element size"),
    ("outer", "head dimension repetitions a run (outer)"),
    ("head_bytes", "bytes a head a repetition (head_bytes)"),
)


def check(src: LayerLayout, dst: LayerLayout) -> None:
    """Raise `MappingError` with every reason the two layers' heads cannot map."""
    if src.heads is None or dst.heads is None:
        side = "source" if src.heads is None else "destination"
        raise MappingError(
            f"the layouts differ (runs of {src.run_bytes} x {len(src.run_offsets)} vs "
            f"{dst.run_bytes} x {len(dst.run_offsets)} bytes) and the {side} does not "
            "describe its KV heads"
        )
    s, d = src.heads, dst.heads
    reasons = _side_reasons("source", src, s) + _side_reasons("destination", dst, d)
    for field, what in _EQUAL:
        a, b = getattr(s, field), getattr(d, field)
        if a != b:
            reasons.append(f"{what} {a} vs {b}")
    if len(src.run_offsets) != len(dst.run_offsets):
        reasons.append(f"runs a block {len(src.run_offsets)} vs {len(dst.run_offsets)}")
    if reasons:
        raise MappingError(
            f"cannot map KV heads from TP {s.tp_size} rank {s.rank} to TP {d.tp_size} "
            f"rank {d.rank}: " + "; ".join(reasons)
        )


# -- the bytes ---------------------------------------------------------------------


def layer_pieces(src: LayerLayout, dst: LayerLayout) -> tuple[Piece, ...]:
    """What of a source block of this layer goes where in a destination block,
    from the source's rank to the destination's (empty: nothing)."""
    check(src, dst)
    s, d = src.heads, dst.heads
    assert s is not None and d is not None
    routes = head_routes(s.total, s.tp_size, d.tp_size).get((s.rank, d.rank), ())
    src_first = rank_heads(s.total, s.tp_size, s.rank)
    dst_first = rank_heads(d.total, d.tp_size, d.rank)
    hb = s.head_bytes
    src_stride, dst_stride = len(src_first) * hb, len(dst_first) * hb
    pieces = []
    for src_run, dst_run in zip(src.run_offsets, dst.run_offsets, strict=True):
        for heads in routes:
            nbytes = len(heads) * hb
            src_offset = src_run + (heads.start - src_first.start) * hb
            dst_offset = dst_run + (heads.start - dst_first.start) * hb
            if s.outer == 1 or nbytes == src_stride == dst_stride:
                pieces.append(Piece(src_offset, dst_offset, nbytes * s.outer))
            else:
                pieces.append(
                    Piece(src_offset, dst_offset, nbytes, s.outer, src_stride, dst_stride)
                )
    return tuple(pieces)


def _identity(src: LayerLayout, dst: LayerLayout) -> bool:
    """Same blocks on both sides: `layer_descs` moves them whole."""
    if src.heads is not None and dst.heads is not None:
        s, d = src.heads, dst.heads
        if (s.tp_size, s.rank) != (d.tp_size, d.rank):
            return False
    return src.run_bytes == dst.run_bytes and len(src.run_offsets) == len(dst.run_offsets)


def peer_pieces(src: Layout, dst: Layout) -> tuple[tuple[Piece, ...], ...] | None:
    """Per layer, the pieces a source worker sends to a destination worker; None
    when every layer is the same on both sides (blocks move whole)."""
    if len(src.layers) != len(dst.layers):
        raise MappingError(f"{len(src.layers)} layers vs {len(dst.layers)}")
    if all(_identity(s, d) for s, d in zip(src.layers, dst.layers, strict=True)):
        return None
    return tuple(layer_pieces(s, d) for s, d in zip(src.layers, dst.layers, strict=True))


def whole_pieces(layer: LayerLayout) -> tuple[Piece, ...]:
    """The identity: every run of a block to the same place."""
    return tuple(Piece(off, off, layer.run_bytes) for off in layer.run_offsets)


def plan(
    src: Sequence[Layout], dst: Sequence[Layout]
) -> dict[tuple[int, int], tuple[tuple[Piece, ...], ...]]:
    """Every rank of one instance (`src[p]`: rank p's layout) to every rank of
    another: `(p, d) -> pieces per layer`, for the pairs that exchange something
    (layouts without `Heads` are taken as equal TP: rank r to rank r)."""
    out = {}
    for p, s in enumerate(src):
        for d, t in enumerate(dst):
            per_layer = peer_pieces(s, t)
            if per_layer is None:
                if p != d:
                    continue
                per_layer = tuple(whole_pieces(x) for x in s.layers)
            if any(per_layer):
                out[(p, d)] = per_layer
    return out


def piece_descs(
    src: LayerLayout,
    dst: LayerLayout,
    pieces: Sequence[Piece],
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
) -> np.ndarray:
    """Byte ranges `(src_addr, dst_addr, nbytes)` moving `pieces` of each source
    block to its destination block: int64 array of shape (n, 3), ordered by
    piece, block, segment (rows that touch on both sides are merged by the
    transport)."""
    s = src.base + np.asarray(src_blocks, dtype=np.int64) * src.block_stride
    d = dst.base + np.asarray(dst_blocks, dtype=np.int64) * dst.block_stride
    parts = []
    for p in pieces:
        i = np.arange(p.count, dtype=np.int64)
        src_addr = (s[:, None] + (p.src_offset + i * p.src_stride)[None, :]).ravel()
        dst_addr = (d[:, None] + (p.dst_offset + i * p.dst_stride)[None, :]).ravel()
        parts.append(np.stack((src_addr, dst_addr, np.full_like(src_addr, p.nbytes)), axis=1))
    if not parts:
        return np.empty((0, 3), dtype=np.int64)
    return np.concatenate(parts)
