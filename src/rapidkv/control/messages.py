"""Control-plane messages: what instances say to each other, and what replies oblige.

Every message is a frozen `msgspec.Struct` in one of two tagged unions, `Request`
and `Reply`, encoded as msgpack (the tag is the ``"type"`` field). Each request
has exactly one reply type (`REPLY_TYPE`); any request may instead be answered
with an `ErrorReply` when it could not be handled at all (invalid, refused by
the RPC layer, handler failure).

=============== ============ ==================== ==========================
request         from -> to   reply                answered when
=============== ============ ==================== ==========================
`Handshake`     any -> any   `HandshakeReply`     at once
`TransferKV`    D -> P       `TransferKVReply`    P's workers settled the KV
`Abort`         either       `AbortReply`         no more writes can land
`StatsRequest`  any -> any   `Stats`              at once
=============== ============ ==================== ==========================

Rules
-----
- Decoding validates: sizes (ids, lists, blobs, dicts are bounded by the
  ``MAX_*`` constants), ranges (no negative counts or block ids), non-empty ids
  and the cross-field invariants written in each struct's ``__post_init__``.
  Anything invalid raises `MessageError`, never a half-built message.
- Constructing a message runs the same ``__post_init__`` checks (msgspec does
  not type-check constructor arguments; the peer's decoder does).
- Unknown fields are ignored (a newer peer may add optional fields); unknown
  message types are refused.
- Nothing here does I/O; see `framing` for the wire and `server`/`client`.
"""

from __future__ import annotations

import enum
import hashlib
import sys
from array import array
from collections.abc import Iterable
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from rapidkv.control.address import MAX_ADDRESS, parse_address
from rapidkv.control.codes import Code

MAX_ID = 256  # characters of an xfer_id / instance_id
MAX_TEXT = 4096  # characters of a free-text message or reason
MAX_REASONS = 64
MAX_LAYERS = 1024
MAX_RANKS = 64
MAX_BLOCKS = 1 << 20  # destination block ids of one TransferKV
MAX_BLOCK_ID = 1 << 31
MAX_BLOB = 1 << 20  # bytes of one opaque transport metadata / layout blob
MAX_COUNTERS = 1024
PROMPT_HASH_HEX = 32  # `prompt_hash` is 16 bytes of blake2b, as lowercase hex

Id = Annotated[str, Meta(min_length=1, max_length=MAX_ID)]
Text = Annotated[str, Meta(max_length=MAX_TEXT)]
NonNegative = Annotated[int, Meta(ge=0, le=1 << 62)]
BlockId = Annotated[int, Meta(ge=0, lt=MAX_BLOCK_ID)]
Blob = Annotated[bytes, Meta(max_length=MAX_BLOB)]
PromptHash = Annotated[str, Meta(pattern=f"^[0-9a-f]{{{PROMPT_HASH_HEX}}}$")]
TransferKVMode = Literal["step", "bypass", "substep"]


class MessageError(ValueError):
    """Bytes that are not a valid message of the expected union; the text says why."""


# --------------------------------------------------------------------------- handshake


class KVSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything that must be equal on two instances for KV to move between them.

    Invariants: `layer_block_bytes` and `layer_runs_per_block` have one entry per
    layer (`num_layers`). A block of layer *i* is `layer_runs_per_block[i]` runs of
    `layer_block_bytes[i] / layer_runs_per_block[i]` bytes each (see
    `rapidkv.kvt.layout.LayerLayout`); equal bytes and runs mean equal run sizes.
    `kernel_blocks_per_block` is vLLM's kernel-block split (kernel blocks per
    manager block). `model_fingerprint` hashes the model config that shapes the
    KV and the tokenizer vocabulary. `layer_block_bytes` are one rank's, so they
    differ with `tp_size`: two instances of different TP sizes are compared
    without either (`mismatches`), and whether their KV heads map from one to
    the other is up to the receiver of the handshake, from the ranks' layouts
    (the connector: `kvt.head_map.plan`). One list of block ids serves every
    rank (the ranks of an instance share their block ids).
    """

    block_size: Annotated[int, Meta(ge=1, le=1 << 16)]  # tokens per block
    kernel_blocks_per_block: Annotated[int, Meta(ge=1, le=1 << 16)]
    dtype: Annotated[str, Meta(min_length=1, max_length=64)]
    num_layers: Annotated[int, Meta(ge=1, le=MAX_LAYERS)]
    layer_block_bytes: Annotated[
        tuple[Annotated[int, Meta(ge=1, le=1 << 40)], ...], Meta(max_length=MAX_LAYERS)
    ]
    layer_runs_per_block: Annotated[
        tuple[Annotated[int, Meta(ge=1, le=1 << 16)], ...], Meta(max_length=MAX_LAYERS)
    ]
    tp_size: Annotated[int, Meta(ge=1, le=MAX_RANKS)]
    model_fingerprint: Id

    def __post_init__(self) -> None:
        for name in ("layer_block_bytes", "layer_runs_per_block"):
            if len(getattr(self, name)) != self.num_layers:
                raise ValueError(
                    f"{name} has {len(getattr(self, name))} entries for {self.num_layers} layers"
                )
        for i, (nbytes, runs) in enumerate(
            zip(self.layer_block_bytes, self.layer_runs_per_block, strict=True)
        ):
            if nbytes % runs:
                raise ValueError(f"layer {i}: {nbytes} block bytes do not split into {runs} runs")


PER_RANK_FIELDS = ("tp_size", "layer_block_bytes")
"""`KVSpec` fields that differ between instances of different TP sizes."""


def mismatches(a: KVSpec, b: KVSpec) -> list[str]:
    """Every field in which `a` and `b` differ, as ``"field: <a> vs <b>"``; empty
    when KV can move between them as far as the specs tell. Per-layer fields
    name the differing layers. Specs of different TP sizes are compared without
    `PER_RANK_FIELDS` (the KV head mapping decides: `KVSpec`)."""
    out = []
    skip = PER_RANK_FIELDS if a.tp_size != b.tp_size else ()
    for name in a.__struct_fields__:
        if name in skip:
            continue
        va, vb = getattr(a, name), getattr(b, name)
        if va == vb:
            continue
        if isinstance(va, tuple) and len(va) == len(vb):
            diff = [i for i, (x, y) in enumerate(zip(va, vb, strict=True)) if x != y]
            shown = ", ".join(f"layer {i}: {va[i]!r} vs {vb[i]!r}" for i in diff[:3])
            more = f" (+{len(diff) - 3} more layers)" if len(diff) > 3 else ""
            out.append(f"{name}: {shown}{more}")
        elif isinstance(va, tuple):
            out.append(f"{name}: {len(va)} layers vs {len(vb)} layers")
        else:
            out.append(f"{name}: {va!r} vs {vb!r}")
    return out


class RankEndpoint(msgspec.Struct, frozen=True, kw_only=True):
    """How to reach the KV memory of one TP rank of an instance.

    `transport_metadata` is the rank's transport's `local_metadata()` (NIXL agent
    metadata or TCP metadata); `layout` is its msgspec-encoded
    `rapidkv.kvt.layout.Layout`. Both are opaque here. `num_blocks` bounds every
    block id a peer may name for this rank.
    """

    rank: Annotated[int, Meta(ge=0, lt=MAX_RANKS)]
    transport: Literal["nixl", "tcp"]
    transport_metadata: Blob
    layout: Blob
    num_blocks: Annotated[int, Meta(ge=1, le=MAX_BLOCK_ID)]


def _check_endpoints(endpoints: Iterable[RankEndpoint], tp_size: int) -> None:
    ranks = [e.rank for e in endpoints]
    if ranks != list(range(tp_size)):
        raise ValueError(f"endpoints must be ranks 0..{tp_size - 1} in order, got {ranks}")


class Handshake(msgspec.Struct, frozen=True, tag="handshake", kw_only=True):
    """Introduce an instance to a peer. Sender: any instance's scheduler side,
    once per peer on first contact (the result is cached). Receiver: the peer's
    scheduler side, which compares `spec` with its own.

    Invariant: `endpoints` holds one entry per TP rank, ranks 0..tp_size-1 in
    order. `control_address` is where the sender's own `RpcServer` listens.
    `incarnation` is drawn at every process start: the same `instance_id` with
    another incarnation (or another instance at a known `control_address`) is a
    restarted process, and the receiver forgets the old one (its transfers fail).
    """

    instance_id: Id
    control_address: Annotated[str, Meta(min_length=1, max_length=MAX_ADDRESS)]
    spec: KVSpec
    endpoints: Annotated[list[RankEndpoint], Meta(max_length=MAX_RANKS)]
    incarnation: Annotated[str, Meta(max_length=MAX_ID)] = ""

    def __post_init__(self) -> None:
        parse_address(self.control_address)
        _check_endpoints(self.endpoints, self.spec.tp_size)


class HandshakeReply(msgspec.Struct, frozen=True, tag="handshake_reply", kw_only=True):
    """The receiver of a `Handshake` introduces itself back.

    Codes, and what they oblige the sender to do:

    - `OK`: the specs match; the sender may transfer with this peer using the
      replier's `endpoints` (cache them for the replier's `instance_id`).
    - `ERROR`: the specs differ (`reasons` names every differing field, as
      `mismatches` does) or the handshake was invalid. Never transfer with this
      peer; requests that needed it fall back to local prefill.
    - `BUSY`: try again later.

    Invariants: `OK` carries the replier's `spec` and one endpoint per rank and
    no reasons; any other code carries at least one reason.
    """

    code: Code
    instance_id: Id
    spec: KVSpec | None = None
    endpoints: Annotated[list[RankEndpoint], Meta(max_length=MAX_RANKS)] = []
    reasons: Annotated[list[Text], Meta(max_length=MAX_REASONS)] = []
    incarnation: Annotated[str, Meta(max_length=MAX_ID)] = ""

    def __post_init__(self) -> None:
        if self.code == Code.OK:
            if self.spec is None or self.reasons:
                raise ValueError("an OK handshake reply carries a spec and no reasons")
            _check_endpoints(self.endpoints, self.spec.tp_size)
        elif not self.reasons:
            raise ValueError(f"a {Code(self.code).name} handshake reply must give a reason")


def answer_handshake(
    hs: Handshake,
    *,
    instance_id: str,
    spec: KVSpec,
    endpoints: list[RankEndpoint],
    incarnation: str = "",
) -> HandshakeReply:
    """The reply the receiver of `hs` owes: OK with its own spec and endpoints, or
    ERROR naming every mismatch (the receiver's values first)."""
    reasons = mismatches(spec, hs.spec)
    if reasons:
        return HandshakeReply(
            code=Code.ERROR,
            instance_id=instance_id,
            spec=spec,
            reasons=[f"KV spec mismatch with {hs.instance_id}: {r}" for r in reasons],
            incarnation=incarnation,
        )
    return HandshakeReply(
        code=Code.OK,
        instance_id=instance_id,
        spec=spec,
        endpoints=endpoints,
        incarnation=incarnation,
    )


# --------------------------------------------------------------------------- transfer


class TransferKV(msgspec.Struct, frozen=True, tag="transfer_kv", kw_only=True):
    """D's blocks are ready: write the KV of `xfer_id` into them. Sender: D's
    scheduler side (or a migration destination). Receiver: P's scheduler side
    (the migration source), after a successful handshake.

    `dst_blocks` are D's block ids for the first `num_tokens` tokens, in order;
    one list serves every rank (D's ranks share their block ids, whatever the
    TP sizes). Blocks before `first_block` are D's prefix-cache hits (shared
    blocks): P never writes them. `prompt_hash` is `prompt_hash(prompt_token_ids)`
    on D; P refuses a mismatch (ERROR), since a different tokenization would
    otherwise produce garbage. `transfer_kv_mode`
    overrides P's configured mode for this request (for side-by-side measurement).

    A *migration* (`migration=True`) asks the source instance for the KV of a
    request it is running (`source_xfer_id`, that request's `xfer_id`) rather
    than of one it prefills: `prompt_hash` is then the hash of D's whole prompt,
    the source's prompt and the tokens it generated so far; the source answers
    GONE at once when it runs no such request (D does not retry: it recomputes).

    P validates what only it can (`problems`): every written id below its
    `num_blocks`, no id written twice, `num_tokens` within the blocks. P parks a
    TransferKV for an id its engine has not admitted yet (bounded, TTL) and acts
    the moment the request appears. If the RPC fails or times out on D, D does
    not know whether writes may still land: it must `Abort` the id and wait for
    the `AbortReply` before it reuses the blocks.

    Invariants: ``0 <= first_block <= len(dst_blocks)``; `source_xfer_id` is
    set exactly when `migration` is, and a migration is no split prefill (no
    `notify_layers`).
    """

    xfer_id: Id
    dst_instance: Id
    dst_blocks: Annotated[list[BlockId], Meta(max_length=MAX_BLOCKS)]
    first_block: NonNegative
    num_tokens: Annotated[int, Meta(ge=1, le=1 << 40)]
    prompt_hash: PromptHash
    migration: bool = False
    transfer_kv_mode: TransferKVMode | None = None
    # D computes the rest of its prompt with these layers as they land (a split
    # prefill): P announces each layer in place (kvt `LayersLanded`)
    notify_layers: bool = False
    # a migration: the xfer_id of the running request on the source whose KV it asks for
    source_xfer_id: Id | None = None

    def __post_init__(self) -> None:
        if self.first_block > len(self.dst_blocks):
            raise ValueError(
                f"xfer {self.xfer_id}: first_block {self.first_block} beyond "
                f"{len(self.dst_blocks)} destination blocks"
            )
        if self.migration != (self.source_xfer_id is not None):
            raise ValueError(
                f"xfer {self.xfer_id}: a migration names its source_xfer_id, and only a "
                f"migration does (migration={self.migration}, "
                f"source_xfer_id={self.source_xfer_id!r})"
            )
        if self.migration and self.notify_layers:
            raise ValueError(f"xfer {self.xfer_id}: a migration is not a split prefill")

    def problems(self, block_size: int, num_blocks: int) -> list[str]:
        """Why P must refuse this transfer into a destination with `num_blocks`
        blocks of `block_size` tokens (empty: acceptable)."""
        out = []
        if self.num_tokens > len(self.dst_blocks) * block_size:
            out.append(
                f"{self.num_tokens} tokens do not fit in {len(self.dst_blocks)} blocks "
                f"of {block_size}"
            )
        written = self.dst_blocks[self.first_block :]
        bad = [b for b in written if b >= num_blocks]
        if bad:
            out.append(f"destination block ids {bad[:8]} out of range (num_blocks {num_blocks})")
        if len(set(written)) != len(written):
            out.append("a destination block appears twice among the blocks to write")
        return [f"xfer {self.xfer_id}: {p}" for p in out]


class TransferKVReply(msgspec.Struct, frozen=True, tag="transfer_kv_reply", kw_only=True):
    """The outcome of a `TransferKV`. Sender: P, once its workers confirmed
    completion or failure on every rank (the RPC may stay open for seconds).

    Whatever the code, when this reply is sent no more writes of `xfer_id` can
    land in D's blocks. `tokens_sent` is how many tokens of KV are in place on
    D (never more than arrived). Codes, and what they oblige D to do:

    - `OK`: the KV of the first `tokens_sent` tokens is in place; use it.
    - `NOT_FOUND`: P's engine never admitted `xfer_id` within the park TTL;
      nothing was written. Retry the TransferKV with short backoff.
    - `GONE`: P finished, aborted or timed out `xfer_id`; nothing more will be
      written. Do not retry: recompute what is missing locally.
    - `BUSY`: P refused admission; nothing was written. Retry later or recompute.
    - `UNKNOWN_PEER`: P has no handshake from D (P restarted, or forgot D after
      a broken data-plane connection); nothing was written. Handshake again and
      retry once.
    - `ERROR`: invalid (prompt hash mismatch, block ids out of range) or failed
      transfer; `message` says why. Recompute beyond `tokens_sent`.
    """

    xfer_id: Id
    code: Code
    tokens_sent: NonNegative = 0
    message: Text = ""


class AbortReason(enum.Enum):
    CLIENT_ABORT = "client_abort"  # the client went away
    NOTHING_TO_LOAD = "nothing_to_load"  # D's local hits cover the prompt: release
    TIMEOUT = "timeout"  # the sender gave up waiting
    PREFILL_FAILED = "prefill_failed"  # the router's request to P failed: D recomputes
    DECODE_FAILED = "decode_failed"  # D refused or failed the request: P frees what it holds


class Abort(msgspec.Struct, frozen=True, tag="abort", kw_only=True):
    """Stop `xfer_id`. Sender: either side (D: client abort, nothing to load,
    TransferKV timed out; P: its request timed out). Receiver: the peer's
    scheduler side. The receiver answers only when no more writes of `xfer_id`
    can land, and keeps a tombstone so a late TransferKV for it gets `GONE`.
    """

    xfer_id: Id
    reason: AbortReason


class AbortReply(msgspec.Struct, frozen=True, tag="abort_reply", kw_only=True):
    """Answer to `Abort`. Codes, and what they oblige the aborting side to do:

    - `OK`, `GONE` (already over), `NOT_FOUND` (never seen; now tombstoned): no
      more writes of `xfer_id` can land. D may free or reuse the blocks.
    - `BUSY`, `ERROR`: the receiver could not confirm. Writes may still land:
      keep the blocks and retry the Abort.
    """

    xfer_id: Id
    code: Code
    message: Text = ""


# --------------------------------------------------------------------------- stats


class StatsRequest(msgspec.Struct, frozen=True, tag="stats_request"):
    """Ask a peer's connector for its counters. Any sender, any receiver."""


class Stats(msgspec.Struct, frozen=True, tag="stats"):
    """The connector's counters (held blocks, parked, tombstones, transfers,
    fallbacks, substeps accepted/rejected/rolled back, ...): what tests and
    operators read. Always `OK`; a peer that cannot answer sends `ErrorReply`."""

    counters: Annotated[
        dict[Annotated[str, Meta(min_length=1, max_length=128)], float],
        Meta(max_length=MAX_COUNTERS),
    ] = {}


# --------------------------------------------------------------------------- timelines

MAX_TIMELINE_IDS = 4096

EventName = Annotated[str, Meta(min_length=1, max_length=64)]


class TimelineRequest(msgspec.Struct, frozen=True, tag="timeline_request"):
    """Ask a P connector what happened to these transfers, and when, plus the
    recent engine steps (for benchmarks and per-request analysis)."""

    xfer_ids: Annotated[list[Id], Meta(max_length=MAX_TIMELINE_IDS)]


class XferTimeline(msgspec.Struct, frozen=True, kw_only=True):
    """Events of one transfer on P, as `time.monotonic()` seconds (one clock for
    every process on a machine), and where the request was when its TransferKV
    arrived: `not_admitted`, `between_steps`, `earlier_chunk`, `last_chunk`,
    `finished` (KV complete)."""

    events: Annotated[dict[EventName, float], Meta(max_length=64)] = {}
    state_at_arrival: Annotated[str, Meta(max_length=32)] = ""
    mode: Annotated[str, Meta(max_length=32)] = ""


class StepTiming(msgspec.Struct, frozen=True, array_like=True):
    """One engine step: built at `begin`, its output back at `end`, scheduling
    `scheduled_tokens` tokens of `requests` requests. The workers' side, in
    seconds (the slowest rank's; 0 where no rank reported it): `forward` from
    the step's metadata bound to its last layer saved (the model's forward,
    the per-layer hooks included), `layer_wait` of it spent waiting for a
    split prefill's head (`wait_for_layer_load`), `hooks` in the connector's
    other worker hooks (binding the step, per-layer saves, the step's ack,
    collecting finished transfers)."""

    step_id: int
    begin: float
    end: float
    scheduled_tokens: int
    requests: int = 0
    forward: float = 0.0
    layer_wait: float = 0.0
    hooks: float = 0.0


class Timeline(msgspec.Struct, frozen=True, tag="timeline"):
    """The answer to `TimelineRequest`: the transfers P still remembers (a
    bounded history) and its most recent steps."""

    xfers: Annotated[dict[Id, XferTimeline], Meta(max_length=MAX_TIMELINE_IDS)] = {}
    steps: Annotated[list[StepTiming], Meta(max_length=1 << 16)] = []


class ErrorReply(msgspec.Struct, frozen=True, tag="error"):
    """A request could not be handled at all: it was malformed or invalid
    (`ERROR`), the server's per-connection limit refused it (`BUSY`), or the
    handler failed (`ERROR`). `message` names the problem. The request had no
    effect unless the handler failed mid-way; `RpcClient` raises it as `RpcError`.
    """

    code: Code
    message: Text

    def __post_init__(self) -> None:
        if self.code == Code.OK:
            raise ValueError("an error reply cannot be OK")


Request = Handshake | TransferKV | Abort | StatsRequest | TimelineRequest
Reply = HandshakeReply | TransferKVReply | AbortReply | Stats | Timeline | ErrorReply

REPLY_TYPE: dict[type, type] = {
    Handshake: HandshakeReply,
    TransferKV: TransferKVReply,
    Abort: AbortReply,
    StatsRequest: Stats,
    TimelineRequest: Timeline,
}


# --------------------------------------------------------------------------- codec

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(msg: Request | Reply) -> bytes:
    return _encoder.encode(msg)


def decode_request(payload: bytes) -> Request:
    """Decode and validate a request; `MessageError` naming the problem otherwise."""
    try:
        return _request_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
        raise MessageError(f"invalid request: {e}") from None


def decode_reply(payload: bytes) -> Reply:
    """Decode and validate a reply; `MessageError` naming the problem otherwise."""
    try:
        return _reply_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
        raise MessageError(f"invalid reply: {e}") from None


def prompt_hash(token_ids: Iterable[int]) -> str:
    """Hash of a prompt's token ids, as `TransferKV.prompt_hash` carries it.

    blake2b (16 bytes, lowercase hex) of the ids as little-endian int64, so equal
    on every machine. OverflowError if an id does not fit in int64.
    """
    ids = array("q", token_ids)
    if sys.byteorder != "little":
        ids.byteswap()
    return hashlib.blake2b(ids.tobytes(), digest_size=16, person=b"rapidkv-prompt").hexdigest()
