"""Request rewriting for PD disaggregation: the router's side of `kv_transfer_params`.

Pure functions: bytes or dicts in, dicts out, no I/O. The connector implements
the other end of this contract (see docs/vllm-connector-contract.md §4.5, §8):

- every request gets a fresh ``xfer_id`` (uuid4 hex), sent to P and D both in
  `kv_transfer_params` and as the ``X-Request-Id`` header;
- P gets the client's body with ``max_tokens=1`` (and ``max_completion_tokens=1``
  for chat), ``min_tokens`` at most 1, ``stream=false`` (vLLM refuses
  ``stream_options`` without streaming: they are dropped) or, when P's first
  token opens the client's stream (`stitchable`), ``stream=true`` and
  ``return_token_ids=true`` (D gets those token ids too), and
  ``kv_transfer_params = {"rapidkv": {"xfer_id": X, "role": "prefill"}}``;
- D gets the client's body unchanged except
  ``kv_transfer_params = {"do_remote_prefill": true, "rapidkv": {"xfer_id": X,
  "role": "decode", "prefill_control": <P's control address or null>,
  "prefill_url": <P's URL>}}``, plus the client's own
  ``kv_transfer_params.rapidkv.transfer_kv_mode`` when it gave one (a
  per-request mode choice for tests and benchmarks);
- any other `kv_transfer_params` the client sent are dropped: routing owns them.

Invariants: the input dict is never mutated; the P and D bodies carry the same
``xfer_id``; a body the router cannot re-encode (nested deeper than
`MAX_DEPTH`) or a ``transfer_kv_mode`` it does not know is refused with
`BadRequest` before anything is sent. Requests that are several engine
requests on vLLM (a batch of prompts, ``n > 1``) are not refused: they fan out
(`fanout.plan`) or go to one instance whole (`one_sequence` is false).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal, get_args

from rapidkv.router.config import Instance

Endpoint = Literal["completions", "chat"]
ENDPOINTS: tuple[str, ...] = get_args(Endpoint)
TRANSFER_KV_MODES = ("step", "bypass", "substep")  # = control.messages.TransferKVMode

Body = dict[str, Any]


class BadRequest(ValueError):
    """The client's request cannot be routed; answered 400 in OpenAI's error format."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def new_xfer_id() -> str:
    """A fresh transfer id: 32 lowercase hex digits."""
    return uuid.uuid4().hex


# JSON nesting a request may have: far more than any OpenAI body needs, and little
# enough that re-encoding it never exhausts Python's recursion limit (a body that
# just parsed could otherwise fail to encode for P or D, one call deeper)
MAX_DEPTH = 256


def parse_request(raw: bytes) -> Body:
    """The client's JSON body, checked for what the router itself must refuse.

    Everything else (model names, sampling parameters) is vLLM's to validate.
    """
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        # not JSON, not UTF-8 (UnicodeDecodeError), an integer of more digits than
        # Python converts (ValueError), nested deeper than the parser recurses
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if _deeper_than(body, raw, MAX_DEPTH):
        raise BadRequest(f"request body nested deeper than {MAX_DEPTH} levels")
    mode = client_transfer_kv_mode(body)
    if mode is not None and mode not in TRANSFER_KV_MODES:
        raise BadRequest(
            f"kv_transfer_params.rapidkv.transfer_kv_mode must be one of "
            f"{', '.join(TRANSFER_KV_MODES)}, not {mode!r}",
            "kv_transfer_params",
        )
    return body


def _deeper_than(body: Body, raw: bytes, limit: int) -> bool:
    """Whether `body` (parsed from `raw`) nests more than `limit` levels (the
    object itself is one). Fewer brackets than that in `raw`: no walk needed."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        for child in value.values() if isinstance(value, dict) else value:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
    return False


def as_count(value: Any) -> int | None:
    """`value` as vLLM reads an integer field (pydantic, lax): an int, a float
    or a string that is a whole number (``2.0``, ``"2"``, ``" 2 "``, ``"2.0"``);
    None for anything else (vLLM refuses it)."""
    if isinstance(value, int):
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:  # not an integer literal, or too many digits
            pass
        try:
            value = float(text)
        except ValueError:
            return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def client_transfer_kv_mode(body: Body) -> Any:
    """The client's ``kv_transfer_params.rapidkv.transfer_kv_mode``, or None."""
    params = body.get("kv_transfer_params")
    if not isinstance(params, dict):
        return None
    ours = params.get("rapidkv")
    return ours.get("transfer_kv_mode") if isinstance(ours, dict) else None


GREEDY_TEMPERATURE = 1e-5  # vLLM samples greedily below this temperature
# completions parameters under which P's first token is not simply the prompt's
# argmax as a stream's first event: text held back for stop strings, echoed
# prompts, several prompts or choices, prompt logprobs.
NOT_STITCHABLE = ("stop", "echo", "prompt_logprobs", "suffix")


def stitchable(body: Body, endpoint: Endpoint) -> bool:
    """Whether P's first token may open the client's stream (see `stitch`).

    A streamed completions request, greedy (``temperature`` given, below vLLM's
    greedy threshold), one prompt (text or token ids), at least one output
    token, none of `NOT_STITCHABLE`, no ``stream_options.continuous_usage_stats``.
    """
    if endpoint != "completions" or body.get("stream") is not True:
        return False
    temperature = body.get("temperature")
    if not isinstance(temperature, int | float) or temperature >= GREEDY_TEMPERATURE:
        return False
    if any(body.get(key) not in (None, False, [], "") for key in NOT_STITCHABLE):
        return False
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        return False  # every event's usage counts D's tokens: P's event has none
    max_tokens = body.get("max_tokens")
    return single_prompt(body) and (
        max_tokens is None or (_non_negative_int(max_tokens) and max_tokens >= 1)
    )


def one_sequence(body: Body, endpoint: Endpoint) -> bool:
    """The request makes one engine request on vLLM, which one transfer can
    serve: a chat request or a completion of one prompt, ``n`` absent or 1, no
    ``best_of``. A batch of prompts, several sequences (or no valid prompt, or
    an ``n`` vLLM refuses) is not."""
    n = body.get("n")
    if (n is not None and as_count(n) != 1) or body.get("best_of") is not None:
        return False
    return endpoint == "chat" or single_prompt(body)


def transferable(body: Body, endpoint: Endpoint) -> bool:
    """D would load this request's prompt KV from P: one engine request
    (`one_sequence`), and no prompt logprobs (``prompt_logprobs``, or ``echo``
    with ``logprobs``, which vLLM serves as prompt logprobs): vLLM computes the
    prompt again for those (``skip_reading_prefix_cache``), ignoring any KV a
    connector would load, so P's work would be wasted."""
    if not one_sequence(body, endpoint):
        return False
    if body.get("prompt_logprobs") is not None:
        return False
    return not (endpoint == "completions" and body.get("echo") and body.get("logprobs") is not None)


def single_prompt(body: Body) -> bool:
    """The body's `prompt` is one prompt: text, or token ids."""
    prompt = body.get("prompt")
    return isinstance(prompt, str) or token_ids(prompt) is not None


def token_ids(value: Any) -> list[int] | None:
    """`value` if it is a non-empty list of token ids, else None."""
    if isinstance(value, list) and value and all(_non_negative_int(t) for t in value):
        return value
    return None


def _non_negative_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def prefill_body(body: Body, endpoint: Endpoint, xfer_id: str, *, first_token: bool) -> Body:
    """What P is sent: a one-token copy of the client's request.

    Non-streaming, unless P's first token is to open the client's stream
    (`first_token`): then streamed, with token ids (P's token and the prompt's,
    which a continuation after a mismatch needs).
    """
    out = dict(body)
    out["max_tokens"] = 1
    if endpoint == "chat":
        out["max_completion_tokens"] = 1
    if _non_negative_int(body.get("min_tokens")) and body["min_tokens"] >= 1:
        out["min_tokens"] = 1  # P's one token obeys it as the client's first would
    else:
        out.pop("min_tokens", None)
    out.pop("stream_options", None)
    out["stream"] = first_token
    if first_token:
        out["return_token_ids"] = True
    out["kv_transfer_params"] = {"rapidkv": {"xfer_id": xfer_id, "role": "prefill"}}
    return out


def decode_body(
    body: Body, xfer_id: str, prefill: Instance, *, first_token: bool = False, split: int = 0
) -> Body:
    """What D is sent: the client's request, told where its prompt's KV comes from
    (with token ids when its first token is compared with P's), and, for a split
    prefill, how many tokens of the prompt P computes (`split`)."""
    ours: dict[str, Any] = {
        "xfer_id": xfer_id,
        "role": "decode",
        "prefill_control": prefill.control,
        "prefill_url": prefill.url,
    }
    mode = client_transfer_kv_mode(body)
    if mode is not None:
        ours["transfer_kv_mode"] = mode
    if split:
        ours["split_tokens"] = split
    out = dict(body)
    out["kv_transfer_params"] = {"do_remote_prefill": True, "rapidkv": ours}
    if first_token:
        out["return_token_ids"] = True
    return out


def encode(body: Body) -> bytes:
    """A body as compact UTF-8 JSON; all-ASCII (with ``\\u`` escapes) when a
    string holds what UTF-8 cannot carry: a lone surrogate, which only a
    client's ``\\ud800`` escape can have sent."""
    try:
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return json.dumps(body, separators=(",", ":")).encode()


ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """An OpenAI-format error, shaped as vLLM's own (``{"error": {...}}``)."""
    kind = ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return encode({"error": {"message": message, "type": kind, "param": param, "code": status}})
