"""One simulated instance's prefix cache: blocks of KV keyed by their content, LRU.

Theory of operation
-------------------
A prompt is a sequence of *segments*, ``(segment id, tokens)``: a segment is
a run of tokens that is the same wherever its id appears (a group's system
prompt, a conversation's question or answer, a request's own text). A
request's tokens cut into blocks of `block_size`; `block_hashes` keys each
*full* block by a chained hash of its content (the key of the block before
it and the segment pieces it holds), as vLLM's prefix caching keys its
blocks: two prompts share block ``k`` exactly when their first ``(k + 1) *
block_size`` tokens are the same segments. A partial last block has no key
and is never shared.

`PrefixCache` holds `capacity` blocks (`blocks_of`: vLLM's count for a KV
memory budget). An engine request (`Allocation`) takes, when it is admitted
(`admit`), its prompt's leading blocks the cache holds (its *hit*: they gain
a reference, and leave the eviction order if they were in it) and fresh
blocks for the rest of its prompt and its output; fresh blocks come from the
free ones, then by evicting the least recently freed cached block that no
request references (LRU). When the request has not enough, it is not
admitted (`admit` gives None: vLLM's scheduler leaves it waiting). As the
request computes (or receives) its tokens, `cache` gives its full blocks
their keys, so that later requests hit them; a key already held by another
block stays with that one (the duplicate stays uncached: vLLM keeps it
too, but the copy is never the one a lookup finds). When the
request ends (`release`) its blocks lose their reference; cached blocks that
no one references join the eviction order, its last block first (vLLM frees
a request's blocks in reverse, so that its tail is evicted before its head),
and uncached ones are free again.

Invariants (`check`): every block is free, uncached and held, or cached;
the cached ones are held (a positive reference count) or in the eviction
order, never both; free + held uncached + cached = `capacity`, unless one
request alone asked for more than the capacity (`admit` lets a request in
when nothing else holds a block, so that no request waits forever).

Hits follow vLLM's rule (`hit_tokens`): only whole blocks, and at most the
prompt's tokens less one (vLLM computes the last prompt token whatever it
holds).

Pure bookkeeping: no clock, no I/O; the same calls give the same state.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

Segment = tuple[tuple[int, ...], int]  # (segment id, tokens)

_SIZES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_bytes(text: str | int) -> int:
    """A byte count as vLLM's ``--kv-cache-memory-bytes`` reads it: ``256M``
    is 256 * 2**20, ``256m`` 256 * 10**6, a plain number is bytes."""
    if isinstance(text, int):
        return text
    value = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG])", value)
    if match:
        return int(float(match.group(1)) * _SIZES[match.group(2)])
    return int(value)


def blocks_of(kv_cache_bytes: int, block_size: int, kv_bytes_per_token: int) -> int:
    """The blocks an instance with `kv_cache_bytes` of KV memory can cache: vLLM's
    ``available_memory // bytes_per_block`` (a block holds `block_size` tokens of
    every layer), less the one null block its block pool keeps for itself."""
    if block_size < 1 or kv_bytes_per_token < 1:
        raise ValueError("block_size and kv_bytes_per_token must be >= 1")
    return max(kv_cache_bytes // (block_size * kv_bytes_per_token) - 1, 0)


def block_hashes(
    segments: Sequence[Segment], block_size: int, tokens: int | None = None
) -> list[int]:
    """The keys of the full blocks of the first `tokens` tokens (all when None)
    of `segments`, chained (see the module docstring)."""
    total = sum(n for _, n in segments)
    limit = total if tokens is None else min(tokens, total)
    out: list[int] = []
    pieces: list[tuple[tuple[int, ...], int, int]] = []
    filled = 0
    done = 0
    for seg, n in segments:
        start = 0
        while start < n and done < limit:
            take = min(n - start, block_size - filled, limit - done)
            pieces.append((seg, start, start + take))
            start += take
            filled += take
            done += take
            if filled == block_size:
                out.append(hash((out[-1] if out else 0, tuple(pieces))))
                pieces = []
                filled = 0
        if done >= limit:
            break
    return out


def hit_tokens(hit_blocks: int, block_size: int, prompt_tokens: int) -> int:
    """The prompt tokens a hit of `hit_blocks` leading blocks saves: whole
    blocks, at most ``prompt_tokens - 1`` (vLLM's rule)."""
    if prompt_tokens < 1:
        return 0
    return min(hit_blocks, (prompt_tokens - 1) // block_size) * block_size


@dataclass
class Allocation:
    """One engine request's blocks: the cached ones it references (in order,
    its prompt's leading blocks first) and how many uncached ones it holds."""

    keys: list[int] = field(default_factory=list)
    uncached: int = 0
    hit_blocks: int = 0  # of `keys`, those it found cached when admitted
    upto: int = 0  # the request's leading blocks `cache` has been given so far


class PrefixCache:
    """`capacity` blocks with LRU eviction (see the module docstring)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, not {capacity}")
        self.capacity = capacity
        self.refs: dict[int, int] = {}  # cached key -> references (0: in `lru`)
        self.lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached keys, oldest first
        self.uncached = 0  # blocks held without a key
        self.evictions = 0
        self.lookups = 0
        self.hit_blocks = 0

    @property
    def free(self) -> int:
        """Blocks neither cached nor held."""
        return self.capacity - len(self.refs) - self.uncached

    @property
    def cached_blocks(self) -> int:
        return len(self.refs)

    def longest_hit(self, keys: Sequence[int]) -> int:
        """How many of `keys`, from the first, the cache holds (a pure query)."""
        k = 0
        for key in keys:
            if key not in self.refs:
                break
            k += 1
        return k

    def admit(self, keys: Sequence[int], blocks: int, hit_blocks: int) -> Allocation | None:
        """Admit a request needing `blocks` blocks whose first `hit_blocks` are
        the cached `keys[:hit_blocks]`; None when the cache cannot give it the
        rest (it has to wait). Takes the hit's references and the fresh blocks."""
        if hit_blocks > self.longest_hit(keys[:hit_blocks]):
            raise ValueError(f"a hit of {hit_blocks} blocks the cache does not hold")
        hit = list(keys[:hit_blocks])
        fresh = max(blocks - hit_blocks, 0)
        evictable = len(self.lru) - sum(1 for key in hit if self.refs[key] == 0)
        alone = not any(self.refs.values()) and self.uncached == 0
        if fresh > self.free + evictable and not alone:
            return None
        self.lookups += 1
        self.hit_blocks += hit_blocks
        for key in hit:
            if self.refs[key] == 0:
                del self.lru[key]
            self.refs[key] += 1
        while self.free < fresh and self.lru:
            key, _ = self.lru.popitem(last=False)
            del self.refs[key]
            self.evictions += 1
        self.uncached += fresh
        return Allocation(hit, fresh, hit_blocks, hit_blocks)

    def cache(self, alloc: Allocation, keys: Sequence[int]) -> None:
        """`alloc`'s blocks now hold the content of `keys` (its leading full
        blocks, those given before included): each new key moves one of its
        uncached blocks into the cache, unless the cache holds that key
        already (another request computed the same block meanwhile: this
        block stays uncached, and is free again when the request ends)."""
        for key in keys[alloc.upto :]:
            if alloc.uncached == 0:
                break
            alloc.upto += 1
            if key in self.refs:
                continue
            alloc.uncached -= 1
            self.uncached -= 1
            self.refs[key] = 1
            alloc.keys.append(key)

    def release(self, alloc: Allocation) -> None:
        """`alloc`'s request is over: its references go, its uncached blocks are free."""
        for key in reversed(alloc.keys):
            self.refs[key] -= 1
            if self.refs[key] == 0:
                self.lru[key] = None
        self.uncached -= alloc.uncached
        alloc.keys = []
        alloc.uncached = 0

    def clear(self) -> None:
        """Every unreferenced cached block dropped (vLLM's ``/reset_prefix_cache``)."""
        for key in self.lru:
            del self.refs[key]
        self.lru.clear()

    def check(self) -> None:
        """AssertionError unless the invariants of the module docstring hold."""
        assert all(n >= 0 for n in self.refs.values()), "negative reference count"
        assert {k for k, n in self.refs.items() if n == 0} == set(self.lru), "eviction order"
        assert self.uncached >= 0, "negative uncached blocks"
