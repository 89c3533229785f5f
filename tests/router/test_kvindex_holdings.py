"""`kvindex.hashing` (the own chained block hash) and `kvindex.holdings` (the
blocks one instance holds, from its events)."""

from __future__ import annotations

import struct
from hashlib import blake2b

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rapidkv.router.kvindex.hashing import ROOT, block_hash, prompt_hashes
from rapidkv.router.kvindex.holdings import Holdings
from rapidkv.router.kvindex.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

pytestmark = pytest.mark.unit

B = 4


# ---------------------------------------------------------------- hashing


def test_the_hash_is_blake2b_128_of_parent_and_little_endian_int32_tokens() -> None:
    assert blake2b(b"rapidkv.kvindex.v1", digest_size=16).digest() == ROOT
    expected = blake2b(ROOT + struct.pack("<4i", 1, 2, 3, 70000), digest_size=16).digest()
    assert block_hash(ROOT, [1, 2, 3, 70000]) == expected
    assert expected.hex() == block_hash(ROOT, (1, 2, 3, 70000)).hex()  # any sequence type


def test_only_full_blocks_are_hashed_and_each_chains_on_the_previous() -> None:
    tokens = list(range(10))
    h = prompt_hashes(tokens, B)
    assert len(h) == 2
    assert h[0] == block_hash(ROOT, tokens[0:4]) and h[1] == block_hash(h[0], tokens[4:8])
    assert prompt_hashes(tokens[:3], B) == []


def test_a_token_that_is_not_an_int32_is_refused() -> None:
    with pytest.raises(ValueError, match="int32"):
        block_hash(ROOT, [2**31])
    with pytest.raises(ValueError, match="block_size"):
        prompt_hashes([1], 0)


@given(st.lists(st.integers(0, 50), max_size=40), st.lists(st.integers(0, 50), max_size=40))
def test_two_prompts_share_exactly_the_hashes_of_their_common_full_blocks(a, b) -> None:
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    ha, hb = prompt_hashes(a, B), prompt_hashes(b, B)
    shared = 0
    while shared < min(len(ha), len(hb)) and ha[shared] == hb[shared]:
        shared += 1
    assert shared == min(common // B, len(ha), len(hb))


# ---------------------------------------------------------------- holdings


def stored(hashes, parent, tokens, **kw) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(tokens),
        block_size=B,
        **kw,
    )


def apply(h: Holdings, *events) -> None:
    h.apply(KVEventBatch(ts=0.0, events=list(events)))


TOKENS = list(range(100, 116))  # four blocks
OWN = prompt_hashes(TOKENS, B)


def test_a_stored_run_from_the_root_is_held_under_the_prompts_own_hashes() -> None:
    h = Holdings(B)
    apply(h, stored([11, 12], None, TOKENS[:8], medium="GPU", group_idx=0))
    assert h.blocks() == set(OWN[:2])
    assert h.leading(OWN) == 2 and h.counts["stored"] == 2


def test_a_run_continues_the_chain_of_its_parent() -> None:
    h = Holdings(B)
    apply(h, stored([11], None, TOKENS[:4]), stored([12, 13, 14], 11, TOKENS[4:16]))
    assert h.leading(OWN) == 4


def test_a_run_whose_parent_is_unknown_is_not_indexed() -> None:
    h = Holdings(B)
    apply(h, stored([12], 11, TOKENS[4:8]))
    assert len(h) == 0 and h.counts["skipped_orphan"] == 1


def test_a_removed_parent_ends_the_prefix_and_its_translation_outlives_it() -> None:
    h = Holdings(B)
    apply(h, stored([11, 12], None, TOKENS[:8]), BlockRemoved(block_hashes=[11]))
    assert h.leading(OWN) == 0 and h.holds(OWN[1])
    apply(h, stored([13], 12, TOKENS[8:12]), BlockRemoved(block_hashes=[12]))
    apply(h, stored([14], 13, TOKENS[12:16]))  # parent 13 still held
    apply(h, stored([11], None, TOKENS[:4]))
    assert h.leading(OWN) == 1 and h.blocks() == {OWN[0], OWN[2], OWN[3]}


def test_blocks_with_extra_keys_and_all_after_them_are_not_indexed() -> None:
    h = Holdings(B)
    apply(h, stored([11, 12, 13], None, TOKENS[:12], extra_keys=[None, ("img", 0), None]))
    assert h.blocks() == {OWN[0]} and h.counts["skipped_extra_keys"] == 1
    apply(h, stored([21], None, TOKENS[:4], lora_name="adapter", lora_id=1))
    apply(h, stored([31], None, TOKENS[:4], extra_keys=[("salt",)]))
    assert h.blocks() == {OWN[0]} and h.counts["skipped_lora"] == 1


@pytest.mark.parametrize(
    "fields, reason",
    [
        ({"medium": "CPU"}, "skipped_other_tier"),
        ({"locality": "REMOTE"}, "skipped_other_tier"),
        ({"ownership": "kvcr"}, "skipped_other_tier"),
        ({"group_idx": 1}, "skipped_other_tier"),
    ],
)
def test_events_of_other_tiers_and_groups_are_skipped(fields, reason) -> None:
    h = Holdings(B)
    apply(h, stored([11], None, TOKENS[:4], **fields))
    assert len(h) == 0 and h.counts[reason] == 1
    apply(h, stored([11], None, TOKENS[:4]), BlockRemoved(block_hashes=[11], **fields))
    assert h.holds(OWN[0])  # a removal from another tier does not touch the primary one


def test_runs_of_another_block_size_or_the_wrong_shape_are_skipped() -> None:
    h = Holdings(B)
    apply(
        h,
        BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1] * 8, block_size=8),
        stored([1, 2], None, TOKENS[:4]),
        stored([1], None, TOKENS[:4], extra_keys=[None, None]),
    )
    assert len(h) == 0
    assert h.counts["skipped_block_size"] == 1 and h.counts["skipped_shape"] == 2


def test_storing_a_held_block_again_changes_nothing() -> None:
    h = Holdings(B)
    apply(h, stored([11, 12], None, TOKENS[:8]), stored([11, 12], None, TOKENS[:8]))
    apply(h, BlockRemoved(block_hashes=[12]))
    assert h.blocks() == {OWN[0]}


def test_a_hash_stored_twice_and_removed_once_is_no_longer_claimed() -> None:
    """vLLM may cache two physical copies of one hash; the index errs low."""
    h = Holdings(B)
    apply(h, stored([11], None, TOKENS[:4]), stored([11], None, TOKENS[:4]))
    apply(h, BlockRemoved(block_hashes=[11]))
    assert len(h) == 0


def test_clear_drops_what_is_held_and_keeps_translations() -> None:
    h = Holdings(B)
    apply(h, stored([11], None, TOKENS[:4]), AllBlocksCleared())
    assert len(h) == 0 and h.counts["cleared"] == 1
    apply(h, stored([12], 11, TOKENS[4:8]))
    assert h.blocks() == {OWN[1]}


def test_a_full_forget_drops_translations_too() -> None:
    h = Holdings(B)
    apply(h, stored([11], None, TOKENS[:4]))
    h.forget(full=True)
    apply(h, stored([12], 11, TOKENS[4:8]))
    assert len(h) == 0 and h.counts["skipped_orphan"] == 1


def test_translations_are_bounded_least_recently_used_first() -> None:
    h = Holdings(B, translation_cap=2)
    apply(h, stored([11, 12, 13], None, TOKENS[:12]), AllBlocksCleared())
    apply(h, stored([14], 13, TOKENS[12:16]))  # 13 is among the two kept
    apply(h, stored([99], 11, TOKENS[4:8]))  # 11 was dropped
    assert h.blocks() == {OWN[3]}


def test_a_vllm_hash_reused_for_other_tokens_moves_to_them() -> None:
    """A 64-bit collision: the later store wins, nothing is counted twice."""
    h = Holdings(B)
    apply(h, stored([11], None, TOKENS[:4]), stored([11], None, TOKENS[4:8]))
    assert h.blocks() == {block_hash(ROOT, TOKENS[4:8])}
