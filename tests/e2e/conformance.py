"""The request shapes of the router's conformance suite, sent with the official
`openai` SDK, and the normalised answers compared between one vLLM instance and
the router (test_conformance).

An answer is normalised to what a client can rely on: status and error type;
every choice's text, token ids, finish and stop reasons, logprobs (floats
within `TOLERANCE`); usage. What differs between two servers by design is left
out: ids, timestamps, ``system_fingerprint``, ``kv_transfer_params``, per-request
``metrics``. A stream is assembled per choice index (texts and token ids
concatenated, logprobs appended, tool calls merged per call index: how many
deltas carry a call's arguments depends on timing), with its usage chunk and, for
``continuous_usage_stats``, per choice the last chunk's usage and whether
every chunk's added up (`running_usage`: how many chunks there are depends on
timing); a
Responses stream to its event types, its text deltas concatenated and its
last event (how many events carry the text depends on timing).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

TOLERANCE = 2e-3  # logprobs: float32 PD against one instance, within rounding
VOLATILE = {"id", "created", "system_fingerprint", "kv_transfer_params", "metrics",
            "created_at", "service_tier", "item_id", "sequence_number"}  # fmt: skip
PROMPT = "The quick brown fox jumps over the lazy dog. Then"
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@dataclass(frozen=True)
class Shape:
    name: str
    api: str  # completions | chat | responses | tokenize | detokenize
    kwargs: dict[str, Any] = field(default_factory=dict)


G = {"temperature": 0}  # greedy
USAGE = {"stream_options": {"include_usage": True}}
CONTINUOUS = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
SHAPES = [
    Shape("completion", "completions", {"prompt": PROMPT, "max_tokens": 12, **G}),
    Shape("completion-stream-usage", "completions",
          {"prompt": PROMPT, "max_tokens": 12, "stream": True, **USAGE, **G}),
    Shape("completion-stream-continuous-usage", "completions",
          {"prompt": PROMPT, "max_tokens": 8, "stream": True, **CONTINUOUS, **G}),
    Shape("completion-seeded-sampling", "completions",
          {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.9, "top_p": 0.9, "seed": 1234}),
    Shape("completion-stop", "completions",
          {"prompt": PROMPT, "max_tokens": 16, "stop": ["e"], **G}),
    Shape("completion-logprobs", "completions",
          {"prompt": PROMPT, "max_tokens": 6, "logprobs": 3, **G}),
    Shape("completion-logprobs-stream", "completions",
          {"prompt": PROMPT, "max_tokens": 6, "logprobs": 2, "stream": True, **G}),
    Shape("completion-echo", "completions",
          {"prompt": PROMPT, "max_tokens": 4, "echo": True, **G}),
    Shape("completion-max-tokens-1", "completions", {"prompt": PROMPT, "max_tokens": 1, **G}),
    Shape("completion-penalties", "completions",
          {"prompt": PROMPT, "max_tokens": 12, "presence_penalty": 0.8,
           "frequency_penalty": 0.6, **G}),
    Shape("completion-min-tokens-ignore-eos", "completions",
          {"prompt": PROMPT, "max_tokens": 10, "extra_body": {"min_tokens": 10,
                                                              "ignore_eos": True}, **G}),
    Shape("completion-logit-bias", "completions",
          {"prompt": PROMPT, "max_tokens": 8, "logit_bias": {"100": 5, "200": -100}, **G}),
    Shape("completion-token-ids", "completions",
          {"prompt": [1, 300, 301, 302, 7, 90, 1000, 1500], "max_tokens": 8, **G}),
    Shape("completion-return-token-ids", "completions",
          {"prompt": PROMPT, "max_tokens": 6, "stream": True,
           "extra_body": {"return_token_ids": True}, **G}),
    Shape("completion-prompt-logprobs", "completions",
          {"prompt": PROMPT, "max_tokens": 3, "extra_body": {"prompt_logprobs": 1}, **G}),
    Shape("completion-batch", "completions",
          {"prompt": [PROMPT, "Once upon a time"], "max_tokens": 8, **G}),
    Shape("completion-batch-token-ids-stream", "completions",
          {"prompt": [[1, 5, 9, 13, 400], [1, 77, 78, 79]], "max_tokens": 6, "stream": True,
           **USAGE, **G}),
    Shape("completion-n2-seeded", "completions",
          {"prompt": PROMPT, "max_tokens": 8, "n": 2, "temperature": 1.0, "seed": 7}),
    Shape("completion-n2-seeded-stream", "completions",
          {"prompt": PROMPT, "max_tokens": 8, "n": 2, "temperature": 1.0, "seed": 8,
           "stream": True, **USAGE}),
    Shape("completion-batch-n2-seeded", "completions",
          {"prompt": ["Hello", "Goodbye"], "max_tokens": 5, "n": 2, "temperature": 0.8,
           "seed": 3}),
    Shape("error-n3-greedy-stream", "completions",
          {"prompt": PROMPT, "max_tokens": 4, "n": 3, "stream": True, **G}),
    Shape("error-n3-greedy", "completions",
          {"prompt": PROMPT, "max_tokens": 4, "n": 3, **G}),
    Shape("chat", "chat", {"messages": CHAT, "max_tokens": 12, **G}),
    Shape("chat-stream-usage", "chat",
          {"messages": CHAT, "max_tokens": 12, "stream": True, **USAGE, **G}),
    Shape("chat-stream-continuous-usage", "chat",
          {"messages": CHAT, "max_tokens": 8, "stream": True, **CONTINUOUS, **G}),
    Shape("chat-seeded-sampling", "chat",
          {"messages": CHAT, "max_tokens": 12, "temperature": 0.7, "seed": 99}),
    Shape("chat-logprobs", "chat",
          {"messages": CHAT, "max_tokens": 6, "logprobs": True, "top_logprobs": 2, **G}),
    Shape("chat-stop", "chat", {"messages": CHAT, "max_tokens": 16, "stop": ["a"], **G}),
    Shape("chat-json-object", "chat",
          {"messages": CHAT, "max_tokens": 16, "response_format": {"type": "json_object"}, **G}),
    Shape("chat-json-schema", "chat",
          {"messages": CHAT, "max_tokens": 24, **G, "response_format": {
              "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}),
    Shape("chat-tool-named", "chat",
          {"messages": CHAT, "max_tokens": 24, "tools": [TOOL], **G,
           "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    Shape("chat-tool-auto", "chat",
          {"messages": CHAT, "max_tokens": 24, "tools": [TOOL], "tool_choice": "auto", **G}),
    Shape("chat-tool-named-stream", "chat",
          {"messages": CHAT, "max_tokens": 24, "tools": [TOOL], "stream": True, **G,
           "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    Shape("chat-tool-required", "chat",
          {"messages": CHAT, "max_tokens": 24, "tools": [TOOL], "tool_choice": "required", **G}),
    Shape("chat-n2-seeded", "chat",
          {"messages": CHAT, "max_tokens": 8, "n": 2, "temperature": 1.0, "seed": 5}),
    Shape("chat-n2-seeded-stream", "chat",
          {"messages": CHAT, "max_tokens": 8, "n": 2, "temperature": 1.0, "seed": 6,
           "stream": True, **USAGE}),
    Shape("error-unknown-model", "completions",
          {"prompt": PROMPT, "max_tokens": 4, "model": "no-such-model"}),
    Shape("error-prompt-over-context", "completions",
          {"prompt": [5] * 1100, "max_tokens": 4, **G}),
    Shape("error-negative-max-tokens", "completions", {"prompt": PROMPT, "max_tokens": -1}),
    Shape("error-chat-negative-max-tokens", "chat", {"messages": CHAT, "max_tokens": -3}),
    Shape("responses", "responses", {"input": "Say hello.", "max_output_tokens": 16, **G}),
    Shape("responses-stream", "responses",
          {"input": "Say hello.", "max_output_tokens": 16, "stream": True, **G}),
    Shape("tokenize", "tokenize", {"prompt": PROMPT}),
    Shape("detokenize", "detokenize", {"tokens": [1, 300, 301, 302]}),
]  # fmt: skip


def run(base_url: str, model: str, shape: Shape) -> dict[str, Any]:
    """`shape` sent to `base_url`: its normalised answer."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", timeout=120, max_retries=0)
    kwargs = {"model": model, **shape.kwargs}
    try:
        if shape.api in ("tokenize", "detokenize"):
            resp = httpx.post(f"{base_url}/{shape.api}", json=kwargs, timeout=60)
            return {"status": resp.status_code, "answer": _clean(resp.json())}
        create = {
            "completions": client.completions.create,
            "chat": client.chat.completions.create,
            "responses": client.responses.create,
        }[shape.api]
        answer = create(**kwargs)
        if kwargs.get("stream"):
            return {"status": 200, "answer": assemble([c.model_dump() for c in answer])}
        return {"status": 200, "answer": _clean(answer.model_dump())}
    except openai.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else {}
        error = body.get("error", body) if isinstance(body, dict) else {}
        kind = error.get("type") if isinstance(error, dict) else None
        return {"status": e.status_code, "error_type": kind}


def running_usage(usages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A choice's chunk usages (``continuous_usage_stats``) as what a client
    can rely on: the last one, and whether every one added up (prompt tokens
    constant, completion tokens growing, the total their sum). How many chunks
    carry them depends on timing (a server that falls behind its engine puts
    several tokens in one chunk), so their number is not compared."""
    if not usages:
        return None
    done = [u.get("completion_tokens") or 0 for u in usages]
    adds_up = all(
        u.get("prompt_tokens") == usages[0].get("prompt_tokens")
        and u.get("total_tokens")
        == (u.get("prompt_tokens") or 0) + (u.get("completion_tokens") or 0)
        for u in usages
    ) and all(b > a for a, b in itertools.pairwise(done))
    return {"last": usages[-1], "adds_up": adds_up}


def assemble(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A stream's chunks as one answer: per choice, per key."""
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    other_events: list[Any] = []
    for chunk in chunks:
        if "choices" not in chunk:  # the Responses API's events
            other_events.append(_clean(chunk))
            continue
        if not chunk["choices"]:
            usage = chunk.get("usage")
            continue
        for choice in chunk["choices"]:
            acc = choices.setdefault(choice["index"], {"usages": []})
            if chunk.get("usage") is not None:
                acc["usages"].append(chunk["usage"])
            _accumulate(acc, {k: v for k, v in choice.items() if k != "index"})
    for acc in choices.values():
        acc["usages"] = running_usage(acc["usages"])
    out = {"choices": {i: choices[i] for i in sorted(choices)}, "usage": usage}
    if other_events:  # how many deltas carry the text depends on timing: not compared
        out["event_types"] = sorted({e.get("type") for e in other_events})
        out["delta_text"] = "".join(
            e.get("delta") or "" for e in other_events if e.get("type", "").endswith("text.delta")
        )
        out["final"] = other_events[-1]
    return _clean(out)


def _accumulate(acc: dict[str, Any], part: dict[str, Any]) -> None:
    for key, value in part.items():
        if value is None:
            continue
        if key in ("finish_reason", "stop_reason", "role", "type"):
            acc[key] = value
        elif key == "tool_calls":  # deltas of the call at their index, as a client merges them
            calls = acc.setdefault(key, {})
            for call in value:
                _accumulate(calls.setdefault(call["index"], {}), call)
        elif isinstance(value, dict):
            _accumulate(acc.setdefault(key, {}), value)
        elif isinstance(value, str):
            acc[key] = acc.get(key, "") + value
        elif isinstance(value, list):
            acc.setdefault(key, []).extend(value)
        else:
            acc[key] = value


def _clean(value: Any) -> Any:
    """`value` without the fields that differ by design (see the module)."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def differences(want: Any, got: Any, path: str = "") -> list[str]:
    """Where `got` differs from `want` (floats within `TOLERANCE`)."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = []
        for key in sorted(set(want) | set(got), key=str):
            if key not in got or key not in want:
                out.append(f"{path}.{key}: {want.get(key)!r} != {got.get(key)!r}")
            else:
                out += differences(want[key], got[key], f"{path}.{key}")
        return out
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{path}: {len(want)} items != {len(got)}"]
        return [
            d
            for i, (a, b) in enumerate(zip(want, got, strict=True))
            for d in differences(a, b, f"{path}[{i}]")
        ]
    close = isinstance(want, float) and isinstance(got, float | int)
    if close and math.isclose(want, got, rel_tol=TOLERANCE, abs_tol=TOLERANCE):
        return []
    if want != got:
        return [f"{path}: {want!r} != {got!r}"]
    return []
