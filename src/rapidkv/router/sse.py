"""Finding the first token in an OpenAI server-sent-event stream (for router-side TTFT).

`FirstTokenDetector` is fed the raw bytes of a streamed answer, chunk by chunk,
as they are relayed; it never changes them. It reports the first event that
carries generated output: a choice with non-empty ``token_ids`` or ``text``, a
chat ``delta`` with anything but its ``role`` (vLLM's chat stream opens with a
role-only chunk before any token is generated), or a ``finish_reason``.

Invariants: `feed` returns True exactly once, for the chunk that completes that
event; afterwards it does no work. It buffers at most `MAX_BUFFER` bytes of an
unfinished event, then gives up (returns False for ever), so a stream that is
not SSE costs bounded memory.
"""

from __future__ import annotations

import json
from typing import Any

MAX_BUFFER = 1 << 20


class FirstTokenDetector:
    """Feed SSE bytes; `feed` is True for the chunk holding the first output event."""

    def __init__(self) -> None:
        self._buffer = b""
        self.done = False  # found, or gave up

    def feed(self, chunk: bytes) -> bool:
        if self.done:
            return False
        self._buffer = (self._buffer + chunk).replace(b"\r\n", b"\n")
        while b"\n\n" in self._buffer:
            event, self._buffer = self._buffer.split(b"\n\n", 1)
            if _has_output(event):
                self.done = True
                self._buffer = b""
                return True
        if len(self._buffer) > MAX_BUFFER:
            self.done = True
            self._buffer = b""
        return False


def _has_output(event: bytes) -> bool:
    data = b"".join(
        line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
    )
    if not data or data.strip() == b"[DONE]":
        return False
    try:
        payload = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    choices = payload.get("choices") if isinstance(payload, dict) else None
    return isinstance(choices, list) and any(_choice_has_output(c) for c in choices)


def _choice_has_output(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    if choice.get("token_ids") or choice.get("text") or choice.get("finish_reason"):
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and any(v for k, v in delta.items() if k != "role")
