"""Sub-requests' answers merged into the one answer vLLM gives (pure).

What one vLLM instance answers for a batch or ``n > 1`` (its
``serving_completion`` / ``serving_chat``), and so what the merge produces:

- one ``id`` and ``created`` for the whole answer (the router takes the first
  sub-request's);
- the choices numbered ``prompt * n + choice`` (`plan.Sub.index`), in that
  order in a whole answer; streamed, each choice's events as its sequence
  produces them, interleaved;
- usage: the prompt tokens of each prompt once (a prompt's lead), the
  completion tokens of every sequence; ``prompt_tokens_details`` of the last
  prompt (as vLLM reports it); no per-request ``metrics`` (vLLM leaves them out
  when they are not one stream's);
- streamed, the usage chunk (``choices: []``) after every sequence ended, when
  the sub-requests sent one (``include_usage``), then ``[DONE]``. Per-chunk
  usage (``continuous_usage_stats``) is per choice on vLLM too: kept as sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rapidkv.router.fanout.plan import Sub
from rapidkv.router.stitch import Payload, sse


def merge_answers(subs: Sequence[Sub], answers: Sequence[Payload]) -> Payload:
    """The whole (non-streamed) answer from each sub-request's, in `subs` order."""
    out = dict(answers[0])
    choices = []
    for sub, answer in zip(subs, answers, strict=True):
        for choice in answer.get("choices") or ():
            choices.append(dict(choice, index=sub.index) if isinstance(choice, dict) else choice)
    out["choices"] = choices
    usage = merged_usage(subs, [a.get("usage") for a in answers])
    if usage is not None:
        out["usage"] = usage
    out.pop("metrics", None)
    return out


def merged_usage(subs: Sequence[Sub], usages: Sequence[Any]) -> Payload | None:
    """The whole request's usage from each sub-request's (None if none gave one)."""
    given = [(s, u) for s, u in zip(subs, usages, strict=True) if isinstance(u, dict)]
    if not given:
        return None
    prompt = sum(_int(u.get("prompt_tokens")) for s, u in given if s.lead is None)
    completion = sum(_int(u.get("completion_tokens")) for _, u in given)
    out = dict(given[-1][1])
    out.update(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
    details = [u.get("prompt_tokens_details") for s, u in given if s.lead is None]
    if details and details[-1] is not None:
        out["prompt_tokens_details"] = details[-1]
    return out


class StreamMerge:
    """The sub-requests' events (parsed SSE payloads) in, the client's stream out."""

    def __init__(self, subs: Sequence[Sub]) -> None:
        self._subs = subs
        self._id: Any = None
        self._created: Any = None
        self._usage: list[Any] = [None] * len(subs)
        self._last_usage_chunk: Payload | None = None

    def on_event(self, k: int, payload: Payload | None) -> bytes:
        """Sub-request `k`'s event (None: its ``[DONE]``): what the client gets of it."""
        if payload is None:
            return b""  # one [DONE] ends the merged stream (`finish`)
        if "error" in payload:
            return sse(payload)
        if self._id is None:
            self._id, self._created = payload.get("id"), payload.get("created")
        out = dict(payload)
        if "id" in out:
            out["id"] = self._id
        if "created" in out:
            out["created"] = self._created
        choices = payload.get("choices")
        if choices == [] and isinstance(payload.get("usage"), dict):
            self._usage[k] = payload["usage"]
            self._last_usage_chunk = out
            return b""
        if isinstance(choices, list):
            index = self._subs[k].index
            out["choices"] = [dict(c, index=index) if isinstance(c, dict) else c for c in choices]
        return sse(out)

    def finish(self) -> bytes:
        """The end of the client's stream: the usage chunk (if the sub-requests
        sent theirs), then ``[DONE]``."""
        out = b""
        usage = merged_usage(self._subs, self._usage)
        if usage is not None and self._last_usage_chunk is not None:
            chunk = dict(self._last_usage_chunk, usage=usage)
            chunk.pop("metrics", None)
            out += sse(chunk)
        return out + sse(None)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
