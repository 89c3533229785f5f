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
- Only a completions request with one prompt (text or token ids) and nothing
  that needs the prompt's own logits (`echo`, `prompt_logprobs`) is split; its
  first token comes from D (P's token ends a different prompt).
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


def splittable(body: Body, endpoint: Endpoint) -> bool:
    """A completions request with one prompt (text or token ids) and none of
    `NOT_SPLITTABLE`."""
    if endpoint != "completions":
        return False
    if any(body.get(key) not in (None, False, [], "") for key in NOT_SPLITTABLE):
        return False
    return single_prompt(body)


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
    timeout: float,
    headers: dict[str, str] | None = None,
) -> list[int] | None:
    """The prompt's token ids: given, or from the instance's ``/tokenize``
    (with the request's `add_special_tokens`, as its completion would); None if
    it cannot tell."""
    ids = token_ids(body.get("prompt"))
    if ids is not None:
        return ids
    ask: dict[str, Any] = {"prompt": body["prompt"]}
    for key in ("model", "add_special_tokens"):
        if key in body:
            ask[key] = body[key]
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


def head_body(body: Body, xfer_id: str, ids: list[int], head: int) -> Body:
    """What P is sent for a split: a one-token completion of the head's ids."""
    out = prefill_body(body, "completions", xfer_id, first_token=False)
    out["prompt"] = ids[:head]
    return out
