"""What a migrated request's destination is sent: pure functions, dicts in, dicts out.

A streamed request runs on its *source* instance; to move it, the router sends
the *destination* a completions request whose prompt is the original prompt's
token ids plus every token generated so far (chat requests too: their prompt is
the chat template's output, which the source's stream named in
``prompt_token_ids``), with the client's sampling parameters and what is left
of its output budget. Its ``kv_transfer_params`` make it a D-role request that
loads the KV from the source (``migrate_from``: the source request's
``xfer_id``), so the destination recomputes only the last token.

- the *pre-copy* (`precopy_body`): one output token, not streamed; its full
  blocks land in the destination's prefix cache;
- the *cut-over* (`cutover_body`): streamed with token ids; its prefix-cache
  hits cover the pre-copy, so only the blocks written since are transferred.

Invariants: the client's body is never mutated; nothing of the client's
``kv_transfer_params`` reaches the destination; `migratable` refuses what a
continuation cannot reproduce faithfully (several choices, echoed prompts,
prompt logprobs, a suffix, structured or tool output, chat logprobs).
"""

from __future__ import annotations

from rapidkv.router.rewrite import Body, Endpoint, single_prompt

# completions parameters a continuation cannot honour
NOT_MIGRATABLE = ("echo", "prompt_logprobs", "suffix")
# chat parameters that change what the output is (constrained or tool output) or
# how it is reported per token: a completions continuation cannot carry them on
CHAT_NOT_MIGRATABLE = (
    "tools",
    "tool_choice",
    "functions",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
)
# chat parameters that also mean something to the completions endpoint
SHARED_SAMPLING = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "length_penalty",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "min_tokens",
    "stream_options",
    "user",
    "priority",
)


def migratable(body: Body, endpoint: Endpoint) -> str | None:
    """Why a request cannot be migrated (None: it can): one choice, one
    prompt, none of the parameters a continuation cannot honour, and, when not
    streamed (its answer is assembled from a stream), no logprobs."""
    if body.get("stream") is not True and body.get("logprobs") not in (None, False, 0):
        return "not streamed, with logprobs"
    if endpoint == "completions":
        if not single_prompt(body):
            return "not a single prompt"
        bad = [k for k in NOT_MIGRATABLE if body.get(k) not in (None, False, [], "", 0)]
    else:
        bad = [k for k in CHAT_NOT_MIGRATABLE if body.get(k) not in (None, False, [], "", 0)]
    if bad:
        return f"uses {', '.join(bad)}"
    return None


def _budget(body: Body, endpoint: Endpoint) -> int | None:
    """The client's output budget (``max_tokens``; chat: ``max_completion_tokens`` first)."""
    keys = ("max_completion_tokens", "max_tokens") if endpoint == "chat" else ("max_tokens",)
    for key in keys:
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def remaining_budget(body: Body, endpoint: Endpoint, generated: int) -> int | None:
    """Output tokens left after `generated` (None: the client set no budget)."""
    budget = _budget(body, endpoint)
    return None if budget is None else budget - generated


def _continuation(
    body: Body,
    endpoint: Endpoint,
    tokens: list[int],
    xfer_id: str,
    source_control: str,
    source_xfer_id: str,
) -> Body:
    """The completions request that continues from `tokens` on the destination."""
    if endpoint == "chat":
        out: Body = {k: body[k] for k in SHARED_SAMPLING if k in body}
    else:
        out = {k: v for k, v in body.items() if k not in ("max_tokens", "kv_transfer_params")}
    out["prompt"] = list(tokens)
    out["kv_transfer_params"] = {
        "do_remote_prefill": True,
        "rapidkv": {
            "xfer_id": xfer_id,
            "role": "decode",
            "prefill_control": source_control,
            "migrate_from": source_xfer_id,
        },
    }
    return out


def precopy_body(
    body: Body,
    endpoint: Endpoint,
    tokens: list[int],
    xfer_id: str,
    source_control: str,
    source_xfer_id: str,
) -> Body:
    """The pre-copy: load `tokens`' KV (all but the last) into the destination's
    prefix cache; one output token, not streamed, read and dropped."""
    out = _continuation(body, endpoint, tokens, xfer_id, source_control, source_xfer_id)
    for key in ("stream_options", "min_tokens", "stop", "include_stop_str_in_output"):
        out.pop(key, None)
    out.update(stream=False, max_tokens=1, ignore_eos=True)
    return out


def cutover_body(
    body: Body,
    endpoint: Endpoint,
    tokens: list[int],
    generated: int,
    xfer_id: str,
    source_control: str,
    source_xfer_id: str,
) -> Body:
    """The cut-over: continue the request from `tokens` (its prompt plus the
    `generated` tokens the client has), streamed with token ids, with what is
    left of the client's budgets."""
    out = _continuation(body, endpoint, tokens, xfer_id, source_control, source_xfer_id)
    left = remaining_budget(body, endpoint, generated)
    if left is not None:
        out["max_tokens"] = left
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and not isinstance(min_tokens, bool):
        out["min_tokens"] = max(min_tokens - generated, 0)
    out["stream"] = True
    out["return_token_ids"] = True
    return out


def streamed(body: Body) -> Body:
    """The client's body as its instances get it when it may migrate: streamed
    (a non-streamed answer is assembled from the stream), with usage at the end
    of a stream the client did not ask for."""
    if body.get("stream") is True:
        return body
    return dict(body, stream=True, stream_options={"include_usage": True})


def local_body(body: Body, xfer_id: str) -> Body:
    """A migratable request served on one instance alone: tagged with its
    ``xfer_id`` (role ``local``: the connector only registers it as a
    migration source), with token ids in its stream."""
    out = dict(body)
    out["kv_transfer_params"] = {"rapidkv": {"xfer_id": xfer_id, "role": "local"}}
    out["return_token_ids"] = True
    return out
