"""Which requests fan out, and into what (pure: a body in, sub-request bodies out).

vLLM makes one engine request per prompt of a batch and, for ``n > 1``, one
child request per sequence (``parallel_sampling.ParentRequest``: child ``i`` of
a seeded request samples with ``seed + i``). Those engine requests would all
carry the request's one ``kv_transfer_params`` and no transfer could serve
them, so the router sends each sequence as its own request (`Sub`) with
``n = 1`` and the seed its engine request has on one vLLM:

- a completions request whose ``prompt`` is a list of prompts (strings, or
  lists of token ids; at least one), or any request with ``n > 1`` (read as
  vLLM reads an integer) and sampling: one sub-request per (prompt, choice);
  the choice's ``index`` in the client's answer is ``prompt * n + choice``, as
  vLLM numbers them;
- a sequence's first choice is the lead of its prompt (routed like any
  request: PD, split or local); the other choices of that prompt follow it, on
  the instance that decodes the lead, once the lead's prompt KV is there (see
  `relay`), so that the prompt crosses once.

Everything else is not planned (`plan` returns None): one prompt with ``n``
absent or 1 takes the ordinary path; a shape vLLM refuses or serves in a way
sub-requests would not reproduce (``n`` that is not a positive integer, ``n >
1`` with greedy sampling, which vLLM refuses; ``best_of``; beam search; a
prompt list mixing strings and token ids or holding an invalid element) goes
to one instance whole (`rewrite.one_sequence` is false for it, or it is left
to vLLM), so the client gets vLLM's own answer or error. A request of more
than `MAX_SEQUENCES` sequences is refused (`BadRequest`, naming ``n`` or
``prompt``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rapidkv.router.rewrite import (
    GREEDY_TEMPERATURE,
    BadRequest,
    Body,
    Endpoint,
    as_count,
    token_ids,
)

MAX_SEQUENCES = 256  # sub-requests of one request: more is refused (400)


@dataclass(frozen=True)
class Sub:
    """One sequence of the client's request, as a request of its own."""

    body: Body
    index: int  # the choice's index in the client's answer
    prompt: int  # the prompt it answers (its position in the batch)
    lead: int | None  # the index of the sub-request it follows (None: it leads)


def plan(body: Body, endpoint: Endpoint) -> list[Sub] | None:
    """The sub-requests `body` fans out into, in choice order; None if it does
    not. Raises `BadRequest` for more than `MAX_SEQUENCES` of them."""
    n = as_count(body.get("n")) if body.get("n") is not None else 1
    if n is None or n < 1:
        return None  # vLLM's to refuse
    if body.get("best_of") is not None or body.get("use_beam_search") not in (None, False):
        return None
    if n > 1 and _greedy(body.get("temperature")):
        return None  # vLLM refuses n > 1 with greedy sampling
    prompts: list[Any] = [None]  # chat: the messages, unchanged
    if endpoint == "completions":
        prompts = _prompts(body.get("prompt"))
        if not prompts:
            return None
        if len(prompts) == 1 and n == 1 and prompts[0] is body.get("prompt"):
            return None  # one prompt, one sequence: the ordinary path
    elif n == 1:
        return None
    if n * len(prompts) > MAX_SEQUENCES:
        param = "n" if n > 1 else "prompt"
        raise BadRequest(
            f"{n * len(prompts)} sequences ({len(prompts)} prompts, n={n}): the router "
            f"serves at most {MAX_SEQUENCES} per request",
            param,
        )
    seed = as_count(body.get("seed")) if n > 1 and body.get("seed") is not None else None
    subs = []
    for p, prompt in enumerate(prompts):
        for i in range(n):
            sub = dict(body)
            if endpoint == "completions":
                sub["prompt"] = prompt
            if "n" in body or n > 1:
                sub["n"] = 1
            if seed is not None:
                sub["seed"] = seed + i
            subs.append(Sub(sub, p * n + i, p, None if i == 0 else p * n))
    return subs


def _prompts(prompt: Any) -> list[Any]:
    """The prompts of a completions request: [prompt] for one prompt, the list
    for a batch of strings or of token-id lists; [] for anything else."""
    if isinstance(prompt, str) or token_ids(prompt) is not None:
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        return []
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(token_ids(p) is not None for p in prompt):
        return list(prompt)
    return []


def _greedy(temperature: Any) -> bool:
    """Whether vLLM reads `temperature` as greedy (lax: a number or a numeric string)."""
    if isinstance(temperature, bool):
        return False
    if isinstance(temperature, str):
        try:
            temperature = float(temperature.strip())
        except ValueError:
            return False
    return isinstance(temperature, int | float) and temperature < GREEDY_TEMPERATURE
