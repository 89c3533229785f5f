"""Finding the first token in an OpenAI server-sent-event stream (for router-side TTFT).

`split_events` is the framing (shared with `stitch.EventSplitter`); `sse_error`
ends a stream that failed with an error event.
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

from rapidkv.router.rewrite import error_body

MAX_BUFFER = 1 << 20


def sse_error(message: str) -> bytes:
    """The end of a stream that failed: an error event (a 502, shaped as vLLM's),
    then ``[DONE]``. The leading blank line ends an event D left half-sent."""
    return b"\n\ndata: " + error_body(502, message) + b"\n\ndata: [DONE]\n\n"


def split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """The ``data`` of every complete event in `buffer` (its data lines joined;
    comments and keep-alives, which have none, skipped) and the unfinished rest.
    Events end with a blank line, LF or CRLF."""
    out: list[bytes] = []
    while True:
        lf, crlf = buffer.find(b"\n\n"), buffer.find(b"\r\n\r\n")
        end, sep = (crlf, 4) if crlf >= 0 and (lf < 0 or crlf < lf) else (lf, 2)
        if end < 0:
            return out, buffer
        event, buffer = buffer[:end], buffer[end + sep :]
        data = b"".join(
            line[5:].lstrip(b" ")
            for line in event.replace(b"\r\n", b"\n").split(b"\n")
            if line.startswith(b"data:")
        )
        if data:
            out.append(data)


class FirstTokenDetector:
    """Feed SSE bytes; `feed` is True for the chunk holding the first output event."""

    def __init__(self) -> None:
        self._buffer = b""
        self.done = False  # found, or gave up

    def feed(self, chunk: bytes) -> bool:
        if self.done:
            return False
        events, self._buffer = split_events(self._buffer + chunk)
        if any(_has_output(data) for data in events):
            self.done = True
            self._buffer = b""
            return True
        if len(self._buffer) > MAX_BUFFER:
            self.done = True
            self._buffer = b""
        return False


def _has_output(data: bytes) -> bool:
    if data.strip() == b"[DONE]":
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
