"""A non-streamed answer, assembled from the stream that served it.

A migratable request the client did not ask to stream is still streamed from
its instances (the router must see its tokens as they come to move it);
`Assembler` turns that stream's events, in the client's format (what
`StreamSplice` returns), back into the one JSON answer vLLM would have sent:
the text (chat: the message's content) concatenated, the last
``finish_reason``/``stop_reason``, the stream's ``usage``, and token ids only if
the client asked for them.

Invariant: the answer's text is exactly the concatenation of the events' text
in order, and its ``usage`` is the last one the stream reported.
"""

from __future__ import annotations

from typing import Any

from rapidkv.router.rewrite import Endpoint
from rapidkv.router.stitch import Payload


class Assembler:
    """Events of one streamed answer in, the non-streamed answer out."""

    def __init__(self, endpoint: Endpoint, *, keep_token_ids: bool) -> None:
        self.endpoint = endpoint
        self.keep_token_ids = keep_token_ids
        self._head: Payload | None = None  # id, created, model of the first event
        self._text: list[str] = []
        self._token_ids: list[int] = []
        self._prompt_ids: list[int] | None = None
        self._finish: Any = None
        self._stop: Any = None
        self._usage: Any = None

    def feed(self, payload: Payload) -> None:
        """One event (not ``[DONE]``) as the client would have seen it streamed."""
        if self._head is None:
            self._head = payload
        if isinstance(payload.get("prompt_token_ids"), list):
            self._prompt_ids = payload["prompt_token_ids"]
        if payload.get("usage") is not None:
            self._usage = payload["usage"]
        choices = payload.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return
        choice = choices[0]
        if self.endpoint == "chat":
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else None
        else:
            text = choice.get("text")
            if isinstance(choice.get("prompt_token_ids"), list):
                self._prompt_ids = choice["prompt_token_ids"]
        if isinstance(text, str):
            self._text.append(text)
        if isinstance(choice.get("token_ids"), list):
            self._token_ids.extend(choice["token_ids"])
        if choice.get("finish_reason") is not None:
            self._finish = choice["finish_reason"]
            self._stop = choice.get("stop_reason")

    def answer(self) -> Payload:
        """The non-streamed answer, with every key vLLM 0.32's has (null where
        a stream does not tell: vLLM's whole answers dump every field)."""
        head = self._head or {}
        text = "".join(self._text)
        chat = self.endpoint == "chat"
        choice: dict[str, Any] = {"index": 0}
        if chat:
            choice["message"] = dict(
                {"role": "assistant", "content": text}, **dict.fromkeys(MESSAGE_NULLS)
            )
        else:
            choice["text"] = text
        choice.update(logprobs=None, finish_reason=self._finish, stop_reason=self._stop)
        choice["token_ids"] = self._token_ids if self.keep_token_ids else None
        if not chat:
            choice["prompt_logprobs"] = None
            choice["prompt_token_ids"] = self._prompt_ids if self.keep_token_ids else None
        choice["routed_experts"] = None
        usage = self._usage
        if isinstance(usage, dict):
            usage = {**dict.fromkeys(USAGE_NULLS), **usage}
        out: Payload = {
            "id": head.get("id"),
            "object": "chat.completion" if chat else "text_completion",
            "created": head.get("created"),
            "model": head.get("model"),
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": head.get("system_fingerprint"),
            "usage": usage,
        }
        if chat:
            out["prompt_logprobs"] = None
            out["prompt_token_ids"] = self._prompt_ids if self.keep_token_ids else None
            out["prompt_text"] = None
        out.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
        return out


# keys of vLLM 0.32's whole answers that a stream does not carry, null there
MESSAGE_NULLS = ("refusal", "annotations", "audio", "function_call", "reasoning")
USAGE_NULLS = ("prompt_tokens_details", "completion_tokens_details")
