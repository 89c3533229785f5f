"""Split prefill: P computes a block-aligned head of the prompt, D the tail.

In ``dual`` dispatch, while P and D have nothing else to do, the router sends P
only the first `split_point` tokens of the prompt (as token ids, from P's
``/tokenize`` for a text prompt) and tells D's connector (``split_tokens``) to
load that head synchronously: D schedules the tail at once, and its forward
waits, layer by layer, for the head's KV, which P sends as each layer is
computed. Both halves are computed at the same time, on two cores: the first
token comes about when the larger half is done, instead of after the whole
prompt on one core.

Rules:
- Only a request with one prompt and nothing that needs the prompt's own
  logits (`echo`, `prompt_logprobs`) is split: a completion of one prompt (text
  or token ids), or a chat completion whose messages are all text (a chat's
  prompt is what P's ``/tokenize`` makes of its messages, tools and template
  options, as its chat endpoint renders them; P is sent the head as a
  completion of those ids). Its first token comes from D (P's token ends a
  different prompt).
- The head is a whole number of P's blocks (its block size comes with the
  discovery answer) and leaves D at least one token; a prompt too short for
  one block is not split, nor one whose head or tail would be shorter than
  `split_min_tokens` (`config.SPLIT_MIN_TOKENS` by default; the adaptive
  placement's `Policy` takes the same): D's per-layer wait for the head costs
  more than computing so few tokens on the other core saves (SmolLM2 on a CPU:
  tails of 1 and 14 tokens made the request 4-5 ms slower than P computing the
  whole prompt; one of 41 tokens, 3 ms faster).
- Whatever goes wrong with the head (P refuses, fails, or was sent other
  tokens than D's prompt starts with: P checks a hash), D recomputes it: a
  split never changes an answer.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from rapidkv.router.rewrite import Body, Endpoint, prefill_body, single_prompt, token_ids
from rapidkv.router.upstream import UPSTREAM_ERRORS, post_json

# completions parameters under which the prompt's own outputs are needed
# (and truncation, which would make P's head differ from D's prompt)
NOT_SPLITTABLE = ("echo", "prompt_logprobs", "suffix", "truncate_prompt_tokens")


# what vLLM's chat endpoint gives its chat template and its /tokenize does
# not (`documents`, `reasoning_effort`, which also sets `enable_thinking`): P's
# rendering would differ and P refuse every head
NOT_RENDERED_BY_TOKENIZE = ("documents", "reasoning_effort")

# what a head's completion keeps of a chat request: where its KV is cached
HEAD_KEEPS_OF_CHAT = ("model", "cache_salt", "priority")

# what a chat's prompt is rendered from (vLLM's /tokenize takes them as its
# chat endpoint does; /v1/chat/completions/render would take the whole request,
# but vLLM serves it only with --enable-scale-out)
CHAT_TOKENIZE_KEYS = (
    "model",
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)


def splittable(body: Body, endpoint: Endpoint) -> bool:
    """A completions request with one prompt (text or token ids), or a chat
    request whose messages' contents are all text (`text_messages`) and
    without `NOT_RENDERED_BY_TOKENIZE`, with none of `NOT_SPLITTABLE`."""
    if any(body.get(key) not in (None, False, [], "") for key in NOT_SPLITTABLE):
        return False
    if endpoint == "chat":
        if any(body.get(key) is not None for key in NOT_RENDERED_BY_TOKENIZE):
            return False
        return text_messages(body.get("messages"))
    return single_prompt(body)


def text_messages(messages: Any) -> bool:
    """A non-empty list of messages whose contents are text: a string, or
    parts that are all ``{"type": "text"}`` (no image, audio or file, whose
    features a head sent as token ids would lose), none with a
    ``reasoning_content`` (the chat endpoint renders it as ``reasoning``,
    /tokenize drops it)."""
    if not isinstance(messages, list) or not messages:
        return False
    for message in messages:
        if not isinstance(message, dict) or "reasoning_content" in message:
            return False
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                return False
        elif content is not None and not isinstance(content, str):
            return False
    return True


def split_point(num_tokens: int, block_size: int, fraction: float, min_part: int = 0) -> int:
    """Tokens of the head P computes: about `fraction` of the prompt, rounded to
    whole blocks, leaving D at least one token; 0 when no block fits, or when
    the head or the tail (the rest of the prompt) would be under `min_part`
    tokens."""
    most = (num_tokens - 1) // block_size * block_size
    head = max(min(round((num_tokens - 1) * fraction / block_size) * block_size, most), 0)
    return head if min(head, num_tokens - head) >= max(min_part, 1) else 0


async def prompt_ids(
    http: aiohttp.ClientSession,
    base_url: str,
    body: Body,
    endpoint: Endpoint,
    timeout: float,
    headers: dict[str, str] | None = None,
) -> list[int] | None:
    """The prompt's token ids: a completion's given ids, or those of the
    instance's ``/tokenize``: of a text prompt (with the request's
    `add_special_tokens`, as its completion would), of a chat's
    `CHAT_TOKENIZE_KEYS` (rendered as its chat endpoint renders them). None if
    it cannot tell. (Where this differs from what D's engine gets, P refuses
    the head, whose hash it checks, and D recomputes it.)"""
    if endpoint == "chat":
        keys: tuple[str, ...] = CHAT_TOKENIZE_KEYS
    else:
        ids = token_ids(body.get("prompt"))
        if ids is not None:
            return ids
        keys = ("prompt", "model", "add_special_tokens")
    ask = {key: body[key] for key in keys if key in body}
    try:
        status, raw = await post_json(http, base_url + "/tokenize", ask, timeout, headers)
    except UPSTREAM_ERRORS:
        return None
    if status != 200:
        return None
    try:
        return token_ids(json.loads(raw).get("tokens"))
    except (ValueError, AttributeError):
        return None


def head_body(body: Body, endpoint: Endpoint, xfer_id: str, ids: list[int], head: int) -> Body:
    """What P is sent for a split (to its ``/v1/completions``): a one-token
    completion of the head's ids; of a chat request, with only
    `HEAD_KEEPS_OF_CHAT` of its fields."""
    if endpoint == "chat":
        body = {k: body[k] for k in HEAD_KEEPS_OF_CHAT if k in body}
    out = prefill_body(body, "completions", xfer_id, first_token=False)
    out["prompt"] = ids[:head]
    return out
