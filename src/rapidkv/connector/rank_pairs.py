"""Which ranks of a source instance send KV to which ranks of a destination.

Pure: two instances' rank endpoints (their handshake entries, each with its
kvt `Layout`) in; the number of (source rank, destination rank) pairs that
exchange KV out, or a `MappingError` naming every reason no mapping exists.
Equal TP sizes pair rank r with rank r; different ones pair the ranks that
`kvt.head_map` routes each KV head through (P at TP 2 -> D at TP 1: both P
ranks to D's rank; P at TP 1 -> D at TP 2: P's rank to both D ranks). A source
transfer is settled once that many SendDones came (`Produced.settles`).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from rapidkv.control.messages import RankEndpoint
from rapidkv.kvt.head_map import MappingError, plan
from rapidkv.kvt.layout import Layout


def rank_pairs(src: Sequence[RankEndpoint], dst: Sequence[RankEndpoint]) -> int:
    """How many (source rank, destination rank) pairs exchange KV; raises
    `MappingError` (a `ValueError`) where the KV heads cannot map, or a layout
    does not decode. Equal TP sizes (as many ranks on both sides) pair rank r
    with rank r without looking at the layouts: the KV specs, equal, already
    say that each rank's blocks are the other's."""
    if len(src) == len(dst):
        return len(src)
    try:
        src_layouts = [msgspec.msgpack.decode(e.layout, type=Layout) for e in src]
        dst_layouts = [msgspec.msgpack.decode(e.layout, type=Layout) for e in dst]
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise MappingError(f"a rank's layout does not decode: {e}") from e
    pairs = plan(src_layouts, dst_layouts)
    if not pairs:
        raise MappingError("no rank of the source sends anything to the destination")
    return len(pairs)
