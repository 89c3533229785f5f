"""`kvindex.KVIndex`: members join, leave and restart; queries answer per member,
0 for a member not in sync; events about unknown members are counted, not
fatal."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from rapidkv.router.kvindex import KVIndex, RequestReplay, Reset
from rapidkv.router.kvindex.hashing import prompt_hashes
from rapidkv.router.kvindex.wire import BlockStored, KVEventBatch

pytestmark = pytest.mark.unit

B = 2
PROMPT = [1, 2, 3, 4, 5, 6]
_seq_ts = iter(range(10**6))


def payload(hashes: list[int], parent: int | None, tokens: list[int]) -> bytes:
    event = BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=B
    )
    return msgspec.msgpack.encode(KVEventBatch(ts=float(next(_seq_ts)), events=[event]))


def caught_up(index: KVIndex, member: str, identity: str | None = None) -> None:
    """Join `member`, connect it, and answer its catch-up replay with nothing."""
    index.join(member, identity)
    (ask,) = index.connected(member)
    assert isinstance(ask, RequestReplay) and ask.start_seq == 0
    assert index.replay_ended(member, ask.token) == []


def test_each_member_answers_with_its_own_leading_blocks() -> None:
    index = KVIndex(B)
    caught_up(index, "p")
    caught_up(index, "q")
    index.received("p", 0, payload([1, 2, 3], None, PROMPT))
    index.received("q", 0, payload([7], None, PROMPT[:2]))
    assert index.match(PROMPT) == {"p": 3, "q": 1}
    assert index.longest_prefix(prompt_hashes(PROMPT, B)[1:]) == {"p": 2, "q": 0}
    assert index.match(PROMPT[:3]) == {"p": 1, "q": 1}  # only full blocks count
    assert index.match([9, 9, 9, 9]) == {"p": 0, "q": 0}


def test_a_member_not_in_sync_answers_0() -> None:
    index = KVIndex(B)
    caught_up(index, "p")
    index.received("p", 0, payload([1, 2, 3], None, PROMPT))
    (ask,) = index.received("p", 2, payload([9], None, [9, 9]))  # batch 1 lost
    assert isinstance(ask, RequestReplay) and ask.start_seq == 0
    assert index.match(PROMPT) == {"p": 0} and index.blocks("p") == frozenset()
    index.disconnected("p")
    assert not index.synced("p")


def test_a_new_identity_drops_what_the_member_held_and_catches_up() -> None:
    index = KVIndex(B)
    caught_up(index, "p", identity="one")
    index.received("p", 0, payload([1, 2, 3], None, PROMPT))
    assert index.join("p", "one") == [] and index.match(PROMPT) == {"p": 3}
    reset, ask = index.join("p", "two")
    assert isinstance(reset, Reset) and reset.full and "identity two" in reset.reason
    assert isinstance(ask, RequestReplay) and ask.start_seq == 0
    assert index.match(PROMPT) == {"p": 0}


def test_the_first_identity_of_a_member_joined_without_one_is_taken_as_it_is() -> None:
    index = KVIndex(B)
    caught_up(index, "p")
    index.received("p", 0, payload([1], None, PROMPT[:2]))
    assert index.join("p", "one") == [] and index.match(PROMPT) == {"p": 1}


def test_a_member_that_leaves_is_forgotten_and_its_late_events_are_counted() -> None:
    index = KVIndex(B)
    caught_up(index, "p")
    index.received("p", 0, payload([1], None, PROMPT[:2]))
    assert index.leave("p") == [] and index.members() == ()
    assert index.match(PROMPT) == {}
    assert index.received("p", 1, payload([2], 1, PROMPT[2:4])) == []
    assert index.replay_ended("p", 1) == [] and index.counts["unknown_member"] == 2
    caught_up(index, "p")  # joins again from nothing
    assert index.match(PROMPT) == {"p": 0}


def test_an_unreadable_batch_drops_what_is_held_and_is_counted() -> None:
    index = KVIndex(B, max_payload_bytes=300)
    caught_up(index, "p")
    index.received("p", 0, payload([1], None, PROMPT[:2]))
    (reset,) = index.received("p", 1, payload([2], 1, PROMPT[2:4]) + b"\x00" * 300)
    assert isinstance(reset, Reset) and not reset.full and reset.resume_seq == 2
    assert "unreadable: payload of" in reset.reason
    assert index.match(PROMPT) == {"p": 0}
    index.received("p", 2, payload([2], 1, PROMPT[2:4]))  # block 1 was dropped; its
    assert index.blocks("p") == {prompt_hashes(PROMPT, B)[1]}  # translation was not
    assert index.refused("p") == []
    counts = index.member_counts("p")
    assert counts["refused"] == 1 and counts["refused_frames"] == 1 and counts["applied"] == 3


def test_the_index_and_its_shell_import_no_vllm() -> None:
    code = (
        "import sys\n"
        "import rapidkv.router.kvindex\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch'))\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
