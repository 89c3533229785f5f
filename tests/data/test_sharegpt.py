"""The ShareGPT loader (`rapidkv.data.sharegpt`): the packaged file read as it
is (cut off mid-record), and the requests drawn from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rapidkv.data.sharegpt import Conversation, Turn, load, multi_turn, single_turn

pytestmark = pytest.mark.unit


def words(text: str) -> int:
    return len(text.split())


def chat_ids(messages: list[dict[str, str]]) -> list[int]:
    """A stand-in tokenizer: a template of 3 tokens around one token per word."""
    return [0, 1, *range(words(messages[0]["content"])), 2]


def test_the_packaged_file_is_read_up_to_its_cut() -> None:
    loaded = load()
    assert loaded.truncated  # the package's file ends inside a record
    # every complete record before the cut: conversations, or counted as skipped
    assert len(loaded.conversations) + loaded.skipped == 17_671
    assert len(loaded.conversations) > 17_000
    assert {t.role for c in loaded.conversations for t in c.turns} <= {
        "user",
        "assistant",
        "system",
    }
    assert sum(len(c.turns) >= 6 for c in loaded.conversations) > 9_000


def test_a_file_cut_mid_record_keeps_what_is_complete(tmp_path: Path) -> None:
    records = [
        {"id": "a", "conversations": [{"from": "human", "value": "hi"},
                                      {"from": "gpt", "value": "yo"}]},
        {"id": "b", "conversations": [{"from": "bing", "value": "?"}]},  # not a role we know
        {"id": "c", "conversations": [{"from": "system", "value": "s"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "cut"}]},
    ]  # fmt: skip
    text = json.dumps(records, indent=2)
    path = tmp_path / "cut.json"
    path.write_text(text[: text.index('"cut"') + 2])
    loaded = load(path)
    assert [c.id for c in loaded.conversations] == ["a", "c"]
    assert loaded.conversations[0].turns == (Turn("user", "hi"), Turn("assistant", "yo"))
    assert loaded.skipped == 1 and loaded.truncated
    path.write_text(text)
    assert not load(path).truncated and len(load(path).conversations) == 3
    assert [c.id for c in load(path, limit=1).conversations] == ["a"]


def conversation(i: int, question_words: int, answer_words: int, users: int = 1) -> Conversation:
    turns: list[Turn] = []
    for _ in range(users):
        turns += [Turn("user", "q " * question_words), Turn("assistant", "a " * answer_words)]
    return Conversation(str(i), tuple(turns))


def test_single_turn_requests_are_vllm_s_sampling_seeded() -> None:
    pool = [conversation(i, 10 + i, 5 + i) for i in range(40)]
    pool += [conversation(100, 0, 50), conversation(101, 50, 1), conversation(102, 2000, 5)]
    first = single_turn(pool, 20, 7, chat_ids, words)
    assert len(first) == 20 and first == single_turn(pool, 20, 7, chat_ids, words)
    assert first != single_turn(pool, 20, 8, chat_ids, words)  # another shuffle
    for r in first:
        i = int(r.conversation)
        assert r.prompt_ids == chat_ids([{"role": "user", "content": "q " * (10 + i)}])
        assert r.max_tokens == 5 + i  # the first answer's length
    # too short a prompt or answer, too long a prompt: never drawn
    everything = single_turn(pool, 100, 7, chat_ids, words)
    assert {r.conversation for r in everything}.isdisjoint({"100", "101", "102"})
    assert len(everything) == 40


def test_multi_turn_conversations_keep_their_user_turns_in_order() -> None:
    pool = [conversation(i, 3, 3, users=1 + i % 4) for i in range(20)]
    chosen = multi_turn(pool, 5, 1, min_turns=3)
    assert len(chosen) == 5 and all(len(c) >= 3 for c in chosen)
    assert chosen == multi_turn(pool, 5, 1, min_turns=3)


def test_the_repaired_file_is_valid_json_with_every_complete_record(tmp_path: Path) -> None:
    """`rapidkv data sharegpt --out`: what `vllm bench serve --dataset-name
    sharegpt` reads: a JSON array of the complete records, as they were."""
    import json

    from rapidkv.data.sharegpt import repair

    source = tmp_path / "cut.json"
    records = [{"id": "a", "conversations": [{"from": "human", "value": "hi"}]}, {"id": "b"}]
    source.write_text(json.dumps(records)[:-1] + ', {"id": "c", "conv')
    out = tmp_path / "fixed.json"
    assert repair(out, source) == (2, True)
    assert json.loads(out.read_text()) == records
    assert [c.id for c in load(out).conversations] == ["a"]
