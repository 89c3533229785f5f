"""`bench simulate`'s prefix cache: block keys by content, hits, LRU eviction."""

from __future__ import annotations

import pytest

from rapidkv.bench.simulate.prefix_cache import (
    PrefixCache,
    block_hashes,
    blocks_of,
    hit_tokens,
    parse_bytes,
)

pytestmark = pytest.mark.unit

B = 4  # a small block, so that a few tokens make several blocks


def test_prompts_share_exactly_the_full_blocks_of_their_common_segments() -> None:
    system = ((1, 0), 8)  # two full blocks
    a = block_hashes([system, ((2, 0), 5)], B)
    b = block_hashes([system, ((2, 1), 5)], B)
    assert len(a) == len(b) == 3  # 13 tokens: 3 full blocks, the partial one has no key
    assert a[:2] == b[:2] and a[2] != b[2]
    other_system = block_hashes([((1, 1), 8), ((2, 0), 5)], B)
    assert not set(other_system) & set(a)
    # the same tokens cut into other segments at other places are other content
    assert block_hashes([((1, 0), 4), ((1, 0), 4)], B) != block_hashes([system], B)
    # chained: a block's key depends on every block before it
    assert block_hashes([((3, 0), 4), system], B)[1:] != block_hashes([system], B)
    assert block_hashes([system], B, tokens=7) == block_hashes([system], B)[:1]


def test_a_conversations_next_prompt_starts_with_the_last_prompt_and_its_answer() -> None:
    turn0 = [((3, 0, 0), 10)]
    answer0 = ((4, 0, 0), 7)
    turn1 = [*turn0, answer0, ((3, 0, 1), 6)]
    seen = block_hashes([*turn0, answer0], B, tokens=10 + 7 - 1)  # the last token: not computed
    assert block_hashes(turn1, B)[: len(seen)] == seen


def test_hits_are_whole_blocks_and_never_the_last_prompt_token() -> None:
    assert hit_tokens(3, 128, 1000) == 384
    assert hit_tokens(8, 128, 1024) == 896  # the whole prompt held: its last block recomputed
    assert hit_tokens(8, 128, 1025) == 1024  # a fetch's head and one token more
    assert hit_tokens(0, 128, 10) == 0


def test_capacity_is_vllms_block_count_for_the_kv_memory() -> None:
    assert parse_bytes("256M") == 256 * 2**20  # vLLM: upper case binary
    assert parse_bytes("256m") == 256 * 10**6
    assert parse_bytes("1000") == 1000
    assert blocks_of(parse_bytes("256M"), 128, 23040) == 90  # SmolLM2 bf16, less the null block
    assert blocks_of(parse_bytes("256M"), 128, 4096) == 511  # the tiny float32 model


def test_a_hit_takes_references_and_the_rest_are_fresh_blocks() -> None:
    cache = PrefixCache(8)
    keys = [11, 12, 13]
    assert cache.longest_hit(keys) == 0
    a = cache.admit(keys, 4, 0)
    assert a is not None and cache.free == 4
    cache.cache(a, keys)  # three full blocks computed: cached; the fourth stays uncached
    assert cache.longest_hit(keys) == 3 and cache.longest_hit([11, 99, 13]) == 1
    b = cache.admit([11, 12, 77], 3, 2)  # shares two blocks, takes one fresh
    assert b is not None and cache.refs[11] == cache.refs[12] == 2
    assert cache.free == 3 and cache.hit_blocks == 2 and cache.lookups == 2
    cache.release(a)
    cache.release(b)
    cache.check()
    assert cache.free == 8 - 3 and list(cache.lru) == [13, 12, 11]  # uncached blocks freed


def test_eviction_takes_the_least_recently_freed_blocks_tail_first() -> None:
    cache = PrefixCache(4)
    a = cache.admit([1, 2], 2, 0)
    assert a is not None
    cache.cache(a, [1, 2])
    cache.release(a)
    b = cache.admit([3, 4], 2, 0)
    assert b is not None
    cache.cache(b, [3, 4])
    cache.release(b)
    assert list(cache.lru) == [2, 1, 4, 3]
    c = cache.admit([5], 1, 0)  # no free block: the oldest freed tail goes
    assert c is not None and cache.evictions == 1
    assert cache.longest_hit([1, 2]) == 1 and cache.longest_hit([3, 4]) == 2
    # a hit protects its blocks: 3 and 4 taken, 1 is the only one left to evict
    d = cache.admit([3, 4, 9], 3, 2)
    assert d is not None and cache.longest_hit([1]) == 0 and cache.evictions == 2
    cache.check()


def test_a_request_the_cache_cannot_hold_waits_unless_it_is_alone() -> None:
    cache = PrefixCache(4)
    a = cache.admit([1, 2, 3], 3, 0)
    assert a is not None
    assert cache.admit([7, 8], 2, 0) is None  # one free block, nothing evictable
    cache.release(a)
    big = cache.admit([], 6, 0)  # more than the capacity, but nothing else holds a block
    assert big is not None
    cache.release(big)
    assert cache.free == 4
    cache.check()


def test_a_block_already_cached_by_another_request_stays_uncached() -> None:
    cache = PrefixCache(8)
    a = cache.admit([1, 2], 2, 0)
    b = cache.admit([1, 2], 2, 0)  # admitted before a's blocks were computed: no hit
    assert a is not None and b is not None
    cache.cache(a, [1, 2])
    cache.cache(b, [1, 2])
    assert b.keys == [] and b.uncached == 2 and cache.refs == {1: 1, 2: 1}
    cache.release(b)
    cache.release(a)
    assert cache.free == 6 and cache.cached_blocks == 2
    cache.check()


def test_clearing_drops_what_no_request_holds() -> None:
    cache = PrefixCache(8)
    a = cache.admit([1], 1, 0)
    b = cache.admit([2], 1, 0)
    assert a is not None and b is not None
    cache.cache(a, [1])
    cache.cache(b, [2])
    cache.release(a)
    cache.clear()
    assert cache.longest_hit([1]) == 0 and cache.longest_hit([2]) == 1
    cache.check()
