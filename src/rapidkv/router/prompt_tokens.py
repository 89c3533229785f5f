"""A request's prompt as the token ids its instance will compute, without asking it.

The prefix index (`kvindex`) answers for token ids; the router needs them
before it places a request, so it tokenizes as vLLM's OpenAI server does,
with the served model's own tokenizer files:

- a completion whose ``prompt`` is token ids: those ids (no tokenizer needed);
- a completion whose ``prompt`` is one text: the tokenizer's encoding with
  ``add_special_tokens`` (the request's, default true, as vLLM's);
- a chat completion whose messages' contents are all text: the model's chat
  template rendered with ``add_generation_prompt`` (default true),
  ``continue_final_message`` (default false) and the request's
  ``chat_template_kwargs``, encoded without special tokens (the template
  writes them), as vLLM renders it; a request with tools, documents, its own
  ``chat_template`` or content parts is not tokenized here.

Anything else (several prompts, no tokenizer configured, a tokenizer that
fails) is None: the request is placed without knowing what is cached. A
tokenization that differs from the instance's costs cache hits, never an
answer: the instances compute from their own tokenization, and a head sent
for a split is checked against D's by hash.

The tokenizer loads once, on first use (`transformers`' AutoTokenizer over a
local directory: the ``--tokenizer`` option, else the ``root`` an instance's
``/v1/models`` names when that directory exists here).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rapidkv.router.rewrite import Body, Endpoint, token_ids

log = logging.getLogger(__name__)

CHAT_UNSUPPORTED = ("tools", "documents", "chat_template", "mm_processor_kwargs")


class PromptTokens:
    """Token ids of request prompts, from a tokenizer directory loaded lazily."""

    def __init__(self, path: str | Path | None = None) -> None:
        self._path = Path(path) if path is not None else None
        self._tokenizer: Any = None
        self._failed = False
        self._lock = threading.Lock()

    @property
    def path(self) -> Path | None:
        return self._path

    def offer(self, path: str | Path) -> None:
        """An instance names its model directory: used when none is set yet and
        it exists on this host."""
        if self._path is None and Path(path).is_dir():
            self._path = Path(path)
            log.info("prompt tokens: the tokenizer of %s", path)

    def ids(self, body: Body, endpoint: Endpoint) -> list[int] | None:
        """The prompt's token ids (see the module), or None."""
        if endpoint == "completions":
            prompt = body.get("prompt")
            ids = token_ids(prompt)
            if ids is not None:
                return list(ids)
            if not isinstance(prompt, str):
                return None
            add_special = body.get("add_special_tokens", True)
            return self._run(lambda t: t.encode(prompt, add_special_tokens=bool(add_special)))
        messages = body.get("messages")
        if not _plain_messages(messages) or any(body.get(k) for k in CHAT_UNSUPPORTED):
            return None
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            return None
        options = {
            "add_generation_prompt": bool(body.get("add_generation_prompt", True)),
            "continue_final_message": bool(body.get("continue_final_message", False)),
            **kwargs,
        }

        def render(t: Any) -> list[int]:
            text = t.apply_chat_template(messages, tokenize=False, **options)
            return t.encode(text, add_special_tokens=False)

        return self._run(render)

    def _run(self, fn: Callable[[Any], Any]) -> list[int] | None:
        tokenizer = self._load()
        if tokenizer is None:
            return None
        try:
            ids = fn(tokenizer)
        except Exception as e:  # a template that refuses these messages, ...
            log.debug("prompt tokens: not tokenized: %s: %s", type(e).__name__, e)
            return None
        return token_ids(list(ids))

    def _load(self) -> Any:
        if self._tokenizer is not None or self._failed or self._path is None:
            return self._tokenizer
        with self._lock:
            if self._tokenizer is None and not self._failed:
                try:
                    from transformers import AutoTokenizer

                    self._tokenizer = AutoTokenizer.from_pretrained(str(self._path))
                except Exception as e:
                    self._failed = True
                    log.warning(
                        "prompt tokens: no tokenizer from %s (%s: %s): requests are placed "
                        "without knowing what the instances hold cached, but for token-id "
                        "prompts",
                        self._path,
                        type(e).__name__,
                        e,
                    )
        return self._tokenizer


def _plain_messages(messages: Any) -> bool:
    return (
        isinstance(messages, list)
        and bool(messages)
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            and set(m) <= {"role", "content", "name"}
            for m in messages
        )
    )
