"""P's first token, stitched in front of D's stream (dual dispatch).

In dual dispatch P computes the whole prompt and, with it, the first output
token: it reaches the router about when D's KV arrives, one D step before D's
own first token. For a request whose first token is determined by the prompt
alone (`rewrite.stitchable`: streamed, greedy, no stop strings, ...) the router
sends P's first token to the client as soon as it has it, then D's stream from
its second token on. D computes the same first token (the master oracle: D's
output is the single instance's); the router checks that it did.

`FirstTokenStitch` is the pure core of that merge: fed P's first output event
and D's events as parsed JSON payloads, it returns the SSE events to send to the
client. States:

- ``waiting``: nothing sent yet;
- ``prefill_first``: the client has P's first token; D's first output event
  is compared with it when it comes: equal tokens -> D's event minus that token
  (``matched``); different -> ``mismatched`` (the caller stops D and continues
  from the prompt plus P's token, see `continuation_body`);
- ``decode_first``: D's first token came first; P's is ignored, D relayed as is;
- ``matched``: D's events relayed.

Once resolved (``matched`` / ``decode_first``), D's further events need no
change when the client asked for token ids and both streams carry the same id
(vLLM builds it from ``X-Request-Id``, which the router gives P and D alike):
`passthrough` then lets the caller relay D's bytes untouched.

Invariants: the client never sees a token twice, never a token from P followed
by one of D's computed after a different first token, and never a
``finish_reason`` from P (P's request always stops after one token). Token ids
the client did not ask for (``return_token_ids``; the router asks P and D for
them to compare) are removed from every event.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from rapidkv.router.sse import split_events

Payload = dict[str, Any]
State = Literal["waiting", "prefill_first", "decode_first", "matched", "mismatched"]
MAX_EVENT_BYTES = 1 << 20  # one SSE event; a longer one is an upstream fault


class StreamError(ValueError):
    """An upstream stream that is not the SSE vLLM sends."""


class EventSplitter:
    """Raw SSE bytes in, complete events' ``data`` payloads out (``None`` for ``[DONE]``)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[Payload | None]:
        events, self._buffer = split_events(self._buffer + chunk)
        out: list[Payload | None] = []
        for data in events:
            if data.strip() == b"[DONE]":
                out.append(None)
                continue
            try:
                payload = json.loads(data)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise StreamError(f"event is not JSON: {e}") from None
            if not isinstance(payload, dict):
                raise StreamError("event is not a JSON object")
            out.append(payload)
        if len(self._buffer) > MAX_EVENT_BYTES:
            raise StreamError(f"an event longer than {MAX_EVENT_BYTES} bytes")
        return out

    def take_rest(self) -> bytes:
        """The bytes of an unfinished event, handed back (the splitter is then empty)."""
        rest, self._buffer = self._buffer, b""
        return rest


def sse(payload: Payload | None) -> bytes:
    """One SSE event (``[DONE]`` for None), framed as vLLM frames them."""
    if payload is None:
        return b"data: [DONE]\n\n"
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def output_tokens(payload: Payload) -> list[int] | None:
    """The token ids a completions event carries (None if it has no choice)."""
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    ids = choices[0].get("token_ids")
    return list(ids) if isinstance(ids, list) else []


def is_output(payload: Payload) -> bool:
    """An event with generated tokens, or one that ends the choice."""
    tokens = output_tokens(payload)
    if tokens is None:
        return False
    return bool(tokens) or payload["choices"][0].get("finish_reason") is not None


class FirstTokenStitch:
    """Merges P's first token with D's stream; see the module docstring."""

    def __init__(self, *, keep_token_ids: bool, debug_mismatch: bool = False) -> None:
        self.keep_token_ids = keep_token_ids
        self.debug_mismatch = debug_mismatch  # test hook: every comparison fails
        self.state: State = "waiting"
        self.prefill_tokens: list[int] = []
        self.prefill_text = ""
        self.prompt_token_ids: list[int] | None = None
        self.stream_id: str | None = None
        self._decode_id: str | None = None  # D's stream id, from its first output event

    @property
    def passthrough(self) -> bool:
        """Whether D's further events reach the client unchanged (no token ids to
        remove, no stream id to rewrite): the caller may relay D's bytes as they are."""
        if not self.keep_token_ids:
            return False
        if self.state == "decode_first":
            return True
        return self.state == "matched" and self._decode_id == self.stream_id

    # ---------------------------------------------------------------- P

    def on_prefill(self, payload: Payload) -> list[bytes]:
        """P's first output event; the events to send the client now."""
        tokens = output_tokens(payload)
        if self.state != "waiting" or not tokens:
            return []  # D was first, or P produced nothing usable
        choice = payload["choices"][0]
        self.state = "prefill_first"
        self.prefill_tokens = tokens
        self.prefill_text = choice.get("text") or ""
        prompt = choice.get("prompt_token_ids")
        self.prompt_token_ids = list(prompt) if isinstance(prompt, list) else None
        self.stream_id = payload.get("id")
        event = _copy_event(payload)
        event["choices"][0]["finish_reason"] = None
        event["choices"][0]["stop_reason"] = None
        return [sse(self._strip(event))]

    # ---------------------------------------------------------------- D

    def on_decode(self, payload: Payload | None) -> list[bytes]:
        """One of D's events (None = ``[DONE]``); the events to send the client now.

        In ``prefill_first``, D's first output event either matches (its first
        token is dropped) or moves to ``mismatched`` and returns nothing: the
        caller must stop relaying D.
        """
        if self.state == "mismatched":
            return []
        if payload is None:
            return [sse(None)]
        if self.state == "waiting" and is_output(payload):
            self.state = "decode_first"
        elif self.state == "prefill_first" and is_output(payload):
            self._decode_id = payload.get("id")
            rest = self._after_first(payload)
            if rest is None:
                self.state = "mismatched"
                return []
            self.state = "matched"
            return [sse(self._strip(rest))] if _worth_sending(rest) else []
        event = payload
        if self.state == "matched" and self.stream_id is not None:
            event = dict(payload, id=self.stream_id)
        return [sse(self._strip(event))]

    def _after_first(self, payload: Payload) -> Payload | None:
        """D's first output event without the token P already gave; None if they differ."""
        choice = payload["choices"][0]
        tokens = output_tokens(payload) or []
        n = len(self.prefill_tokens)
        text = choice.get("text") or ""
        if self.debug_mismatch:
            return None
        if tokens[:n] != self.prefill_tokens or not text.startswith(self.prefill_text):
            return None
        event = _copy_event(payload)
        out = event["choices"][0]
        out["token_ids"] = tokens[n:]
        out["text"] = text[len(self.prefill_text) :]
        out.pop("prompt_token_ids", None)
        logprobs = out.get("logprobs")
        if isinstance(logprobs, dict):
            out["logprobs"] = {k: v[n:] if isinstance(v, list) else v for k, v in logprobs.items()}
        if self.stream_id is not None:
            event["id"] = self.stream_id
        return event

    # ---------------------------------------------------------------- continuation

    def on_continuation(self, payload: Payload | None) -> list[bytes]:
        """An event of the continuation request that replaced D after a mismatch."""
        if payload is None:
            return [sse(None)]
        event = _copy_event(payload)
        if self.stream_id is not None:
            event["id"] = self.stream_id
        for choice in event.get("choices") or ():
            if isinstance(choice, dict):
                choice.pop("prompt_token_ids", None)
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            n = len(
                self.prefill_tokens
            )  # P's token: prompt to the continuation, output to the client
            event["usage"] = dict(
                usage,
                prompt_tokens=usage["prompt_tokens"] - n,
                completion_tokens=(usage.get("completion_tokens") or 0) + n,
            )
        return [sse(self._strip(event))]

    def finish_after_prefill(self) -> list[bytes]:
        """The end of a stream whose whole output was P's token (``max_tokens`` 1)."""
        event: Payload = {
            "id": self.stream_id,
            "object": "text_completion",
            "choices": [{"index": 0, "text": "", "finish_reason": "length", "stop_reason": None}],
        }
        return [sse(event), sse(None)]

    def _strip(self, event: Payload) -> Payload:
        if self.keep_token_ids:
            return event
        for choice in event.get("choices") or ():
            if isinstance(choice, dict):
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)
        return event


def continuation_body(client_body: Payload, stitch: FirstTokenStitch) -> Payload | None:
    """The completions request that continues after P's first token.

    Its prompt is the prompt's token ids plus P's token; its output budget is
    one token less. None when no budget is left (then
    `FirstTokenStitch.finish_after_prefill` ends the stream); `StreamError` when
    P's stream lacked the prompt's token ids.
    It runs on D without `kv_transfer_params`: computed locally, on the rare
    path where D's first token differed from P's.
    """
    if stitch.prompt_token_ids is None or not stitch.prefill_tokens:
        raise StreamError("prefill's stream carried no prompt_token_ids to continue from")
    out = dict(client_body)
    out["prompt"] = [*stitch.prompt_token_ids, *stitch.prefill_tokens]
    n = len(stitch.prefill_tokens)
    budget = client_body.get("max_tokens")
    if isinstance(budget, int) and budget - n < 1:
        return None
    for key in ("max_tokens", "min_tokens"):
        value = out.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            out[key] = max(value - n, 0)
    out.pop("kv_transfer_params", None)
    out["return_token_ids"] = True
    out["stream"] = True
    return out


def _copy_event(payload: Payload) -> Payload:
    """A copy deep enough to edit its first choice."""
    event = dict(payload)
    event["choices"] = [dict(c) if isinstance(c, dict) else c for c in payload["choices"]]
    return event


def _worth_sending(event: Payload) -> bool:
    choice = event["choices"][0]
    return bool(
        choice.get("token_ids")
        or choice.get("text")
        or choice.get("finish_reason") is not None
        or event.get("usage")
    )
