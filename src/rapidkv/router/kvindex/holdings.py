"""`Holdings`: the blocks one vLLM instance holds, under the index's own hashes.

Pure: events in, a set of own hashes out. The caller (`index.KVIndex`) feeds
the events of one publisher in seq order and calls `forget` when it cannot.

Theory of operation
-------------------
vLLM names a block by its own chained hash; a `BlockStored` run gives the
parent's vLLM hash and the run's token ids. To key the block by our hash
(`hashing`), the parent's own hash must be known: a *translation* (vLLM hash
-> own hash) is learnt from every store and kept after the block leaves (a
translation is a fact about content, not about the cache), in an LRU bounded
by `translation_cap`. Held blocks are a map vLLM hash -> own hash, and a count
per own hash (several vLLM hashes could name one own hash; a block is claimed
while one of them is held).

What is indexed: full blocks of `block_size` tokens of the primary cache
(medium None or "GPU", locality None or "LOCAL", no ownership tier, KV cache
group 0 or None), without LoRA and without extra keys. A block with extra
keys (multimodal, cache_salt, prompt embeddings) and every later block of its
run is left out: vLLM's hash of it, and of its children, is not a hash of
tokens alone. A run whose parent has no translation (an "orphan": its store
was missed) is left out as well. Every event or run left out is counted in
`counts` by reason.

Invariants:
- A block is claimed only if the last event about its vLLM hash that was
  applied is a store (removals and clears are never undone by anything but a
  later store).
- Stores are idempotent: storing a held block again changes nothing (vLLM
  re-reports cached blocks in `kv_cache_report_mode="full"`). A vLLM hash
  stored twice (two physical copies) and removed once is no longer claimed:
  the index errs towards claiming less.
- `forget(full=False)` drops what is held and keeps translations;
  `forget(full=True)` drops both (a new process may hash differently).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

from rapidkv.router.kvindex.hashing import ROOT, block_hash
from rapidkv.router.kvindex.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

ExternalHash = bytes | int

TRANSLATION_CAP = 1 << 18
PRIMARY_MEDIA = (None, "GPU")  # the engine's own pool is "GPU" on every backend, CPU included
LOCAL = (None, "LOCAL")
INDEXED_GROUPS = (None, 0)


class Holdings:
    """One instance's cached blocks, keyed by own hashes."""

    def __init__(self, block_size: int, translation_cap: int = TRANSLATION_CAP) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, not {block_size}")
        self.block_size = block_size
        self.translation_cap = translation_cap
        self._translation: OrderedDict[ExternalHash, bytes] = OrderedDict()
        self._held: dict[ExternalHash, bytes] = {}
        self._own: Counter[bytes] = Counter()
        self.counts: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._own)

    def holds(self, own: bytes) -> bool:
        return self._own[own] > 0

    def leading(self, own_hashes: Sequence[bytes]) -> int:
        """How many of `own_hashes` (a prompt's chain), from the first, are held."""
        n = 0
        for own in own_hashes:
            if self._own[own] <= 0:
                break
            n += 1
        return n

    def blocks(self) -> frozenset[bytes]:
        return frozenset(self._own)

    def forget(self, *, full: bool) -> None:
        """Drop every held block; with `full`, every translation too."""
        self._held.clear()
        self._own.clear()
        if full:
            self._translation.clear()

    def apply(self, batch: KVEventBatch) -> None:
        """Apply one batch's events, in order."""
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                self._removed(event)
            elif isinstance(event, AllBlocksCleared):
                self.counts["cleared"] += 1
                self.forget(full=False)

    def _primary(self, event: BlockStored | BlockRemoved) -> bool:
        return (
            event.medium in PRIMARY_MEDIA
            and event.locality in LOCAL
            and event.ownership is None
            and event.group_idx in INDEXED_GROUPS
        )

    def _stored(self, event: BlockStored) -> None:
        size = self.block_size
        n = len(event.block_hashes)
        if not self._primary(event):
            self.counts["skipped_other_tier"] += 1
        elif event.lora_id is not None or event.lora_name is not None:
            self.counts["skipped_lora"] += 1
        elif event.block_size != size:
            self.counts["skipped_block_size"] += 1
        elif len(event.token_ids) != n * size or (
            event.extra_keys is not None and len(event.extra_keys) != n
        ):
            self.counts["skipped_shape"] += 1
        else:
            first = event.parent_block_hash
            parent = ROOT if first is None else self._lookup(first)
            if parent is None:
                self.counts["skipped_orphan"] += 1
                return
            for i, external in enumerate(event.block_hashes):
                if event.extra_keys is not None and event.extra_keys[i] is not None:
                    self.counts["skipped_extra_keys"] += 1
                    return
                parent = block_hash(parent, event.token_ids[i * size : (i + 1) * size])
                self._learn(external, parent)
                self._hold(external, parent)
            self.counts["stored"] += n

    def _removed(self, event: BlockRemoved) -> None:
        if not self._primary(event):
            self.counts["skipped_other_tier"] += 1
            return
        for external in event.block_hashes:
            own = self._held.pop(external, None)
            if own is None:
                self.counts["removed_unknown"] += 1
                continue
            self._release(own)
            self.counts["removed"] += 1

    def _lookup(self, external: ExternalHash) -> bytes | None:
        own = self._held.get(external)
        if own is not None:
            return own
        own = self._translation.get(external)
        if own is not None:
            self._translation.move_to_end(external)
        return own

    def _learn(self, external: ExternalHash, own: bytes) -> None:
        self._translation[external] = own
        self._translation.move_to_end(external)
        while len(self._translation) > self.translation_cap:
            self._translation.popitem(last=False)

    def _hold(self, external: ExternalHash, own: bytes) -> None:
        before = self._held.get(external)
        if before == own:
            return
        if before is not None:  # the same vLLM hash, other tokens: a 64-bit collision
            self._release(before)
        self._held[external] = own
        self._own[own] += 1

    def _release(self, own: bytes) -> None:
        self._own[own] -= 1
        if self._own[own] <= 0:
            del self._own[own]
