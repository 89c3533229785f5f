"""One worker rank's view of tensor parallelism: the KV heads its layers hold,
and which ranks of each destination instance it sends to.

- `ModelHeads` / `describe_heads`: a layer's `kvt.layout.LayerLayout` with
  the KV heads this rank holds (`kvt.layout.Heads`), where the model's config
  and the tensor's shape tell (`kvt.head_map.find_head_dim`); otherwise the
  layer as it is and the reason (such an instance pairs at equal TP only).
- `RankLinks`: pure bookkeeping of the destination ranks this rank is
  connected to. Peer entries (one per rank of a destination instance, each
  with the generation it was added under) arrive both with the step metadata
  and over the bypass channel, in any order and more than once; `offer` says
  what to do with each: nothing (already connected, or older than what is
  known), connect it (this rank routes heads to it: `kvt.head_map.route`), and
  first disconnect the ranks of an older generation (the instance restarted).

Invariants (tests/connector/test_rank_links.py): per instance, the ranks
connected all belong to the newest generation offered; a rank is connected
once per generation; `drop` of a generation that is not the newest does
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import msgspec

from rapidkv.kvt.head_map import MappingError, find_head_dim, heads_from_tensor
from rapidkv.kvt.layout import LayerLayout


@dataclass(frozen=True)
class ModelHeads:
    """What the model says of its KV heads, for `Heads` in the layouts."""

    total: int  # KV heads of the model, all ranks together
    tp_size: int
    head_size: int


def describe_heads(
    layer: LayerLayout,
    shape: tuple[int, ...],
    element_size: int,
    block_dim: int,
    kernel_blocks_per_block: int,
    model: ModelHeads,
    rank: int,
    block_size: int,
) -> tuple[LayerLayout, str]:
    """`layer` with the KV heads rank `rank` holds, and "" ; or `layer` as it
    is and why its heads are not described."""
    try:
        local = max(model.total // model.tp_size, 1)
        head_dim = find_head_dim(shape, block_dim, local, model.head_size)
        if head_dim is None:
            raise MappingError(f"no head dimension of {local} heads found in {shape}")
        heads = heads_from_tensor(
            shape,
            element_size,
            block_dim,
            head_dim,
            total=model.total,
            tp_size=model.tp_size,
            rank=rank,
            head_size=model.head_size,
            block_size=block_size,
            kernel_blocks_per_block=kernel_blocks_per_block,
        )
    except MappingError as e:
        return layer, str(e)
    return msgspec.structs.replace(layer, heads=heads), ""


class Offer(NamedTuple):
    """What to do with one peer entry: disconnect `remove` (ranks of the
    instance's older generation) and then connect it if `add`."""

    remove: tuple[int, ...]
    add: bool


class RankLinks:
    def __init__(self) -> None:
        self._generation: dict[str, int] = {}  # instance -> newest generation seen
        # instance -> its ranks this rank sends to (connected, newest generation)
        self._targets: dict[str, tuple[int, ...]] = {}

    def offer(self, instance: str, generation: int, rank: int, sends: bool) -> Offer | None:
        """A peer entry for rank `rank` of `instance`; `sends`: this rank routes
        KV heads to it. None: nothing to do."""
        known = self._generation.get(instance)
        targets = self._targets.get(instance, ())
        if known is not None and (
            known > generation or (known == generation and (rank in targets or not sends))
        ):
            return None
        remove: tuple[int, ...] = ()
        if known is not None and known < generation:
            remove, targets = targets, ()
        self._generation[instance] = generation
        self._targets[instance] = (*targets, rank) if sends else targets
        return Offer(remove, sends)

    def drop(self, instance: str, generation: int) -> tuple[int, ...] | None:
        """`instance` is gone as of `generation`: the ranks to disconnect; None
        when a newer entry replaced it (or it is not known)."""
        if self._generation.get(instance) != generation:
            return None
        del self._generation[instance]
        return self._targets.pop(instance, ())

    def targets(self, instance: str) -> tuple[int, ...] | None:
        """The ranks of `instance` this rank sends to (None: no entry of it yet)."""
        return self._targets.get(instance)

    def generation(self, instance: str) -> int | None:
        return self._generation.get(instance)
