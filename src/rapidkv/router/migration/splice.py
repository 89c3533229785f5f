"""The client's stream of a migratable request, spliced across instances.

`StreamSplice` is the pure core: fed the events (parsed SSE payloads, None for
``[DONE]``) of whichever upstream serves the request now, it returns the SSE
bytes to send the client and keeps what a migration needs: the prompt's token
ids and every token generated so far.

The first upstream (the *source*) streams in the client's own format
(completions or chat), with token ids the router asked for. After a cut-over
the upstream is a completions *continuation* (see `bodies`), whose prompt is
the original prompt plus the `offset` tokens generated before it; its events are
rewritten into the client's format: the first stream's ``id``, ``created`` and
``model``, chat ``delta`` content for chat clients, and ``usage`` counted
against the original prompt (``prompt_tokens - offset``, ``completion_tokens +
offset``).

Invariants: every generated token reaches the client exactly once and in order
(the caller relays one upstream at a time and switches only at an event
boundary); token ids reach the client only if it asked (``return_token_ids``);
`tokens` is always the prompt plus exactly the tokens the client was sent.
"""

from __future__ import annotations

from typing import Any

from rapidkv.router.rewrite import Endpoint
from rapidkv.router.stitch import Payload, StreamError


class StreamSplice:
    """One client stream, fed by one upstream after another (see module doc)."""

    def __init__(self, endpoint: Endpoint, *, keep_token_ids: bool) -> None:
        self.endpoint = endpoint
        self.keep_token_ids = keep_token_ids
        self.prompt_ids: list[int] | None = None
        self.generated: list[int] = []
        self.finished = False  # a finish_reason was sent
        self.offset = 0  # tokens generated before the upstream now relayed
        self.continuation = False  # the upstream now relayed is a completions continuation
        self._first: Payload | None = None  # the client stream's first event (id, created, model)

    # ---------------------------------------------------------------- state

    @property
    def tokens(self) -> list[int]:
        """The prompt and every token the client was sent: a continuation's prompt."""
        if self.prompt_ids is None:
            raise StreamError("the stream carried no prompt_token_ids to continue from")
        return [*self.prompt_ids, *self.generated]

    def switch(self) -> None:
        """The next events come from a continuation of what was sent so far."""
        self.offset = len(self.generated)
        self.continuation = True

    # ---------------------------------------------------------------- events

    def feed(self, payload: Payload | None) -> Payload | None:
        """One event of the upstream now relayed (None: ``[DONE]``); the event
        for the client (`stitch.sse` frames it)."""
        if payload is None:
            return None
        if self.continuation:
            payload = self._as_client(payload)
        elif self._first is None:
            self._first = payload
        self._record(payload)
        return self._strip(payload)

    def _record(self, payload: Payload) -> None:
        if self.prompt_ids is None:
            prompt = payload.get("prompt_token_ids")  # chat: on the first chunk
            choice = _choice(payload)
            if prompt is None and choice is not None:
                prompt = choice.get("prompt_token_ids")  # completions: on the first choice
            if isinstance(prompt, list):
                self.prompt_ids = list(prompt)
        choice = _choice(payload)
        if choice is None:
            return
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            self.generated.extend(ids)
        if choice.get("finish_reason") is not None:
            self.finished = True

    def _as_client(self, payload: Payload) -> Payload:
        """A continuation's completions event in the client's format."""
        first = self._first or {}
        event: Payload = {k: v for k, v in payload.items() if k != "choices"}
        for key in ("id", "created", "model"):
            if key in first:
                event[key] = first[key]
        if self.endpoint == "chat":
            event["object"] = first.get("object", "chat.completion.chunk")
            event.pop("prompt_token_ids", None)
        choices = payload.get("choices")
        if isinstance(choices, list):
            event["choices"] = [self._choice_as_client(c) for c in choices]
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            completion = usage.get("completion_tokens") or 0
            event["usage"] = dict(
                usage,
                prompt_tokens=usage["prompt_tokens"] - self.offset,
                completion_tokens=completion + self.offset,
            )
        return event

    def _choice_as_client(self, choice: Any) -> Any:
        if not isinstance(choice, dict):
            return choice
        out = {k: v for k, v in choice.items() if k != "prompt_token_ids"}
        if self.endpoint == "chat":
            text = out.pop("text", None)
            out.pop("logprobs", None)
            delta: dict[str, Any] = {"content": text} if text else {}
            out = {"index": out.get("index", 0), "delta": delta, "logprobs": None, **out}
        return out

    def _strip(self, event: Payload) -> Payload:
        if self.keep_token_ids:
            return event
        if "prompt_token_ids" in event:
            event = {k: v for k, v in event.items() if k != "prompt_token_ids"}
        choices = event.get("choices")
        if isinstance(choices, list) and any(
            isinstance(c, dict) and ("token_ids" in c or "prompt_token_ids" in c) for c in choices
        ):
            stripped = [
                {k: v for k, v in c.items() if k not in ("token_ids", "prompt_token_ids")}
                if isinstance(c, dict)
                else c
                for c in choices
            ]
            event = dict(event, choices=stripped)
        return event


def _choice(payload: Payload) -> dict[str, Any] | None:
    choices = payload.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0]
    return None
