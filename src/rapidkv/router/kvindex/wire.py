"""vLLM's KV-event wire format, decoded by structs of our own (no vLLM import).

What vLLM 0.32 sends (`vllm/distributed/kv_events.py`; the full account is in
docs/vllm-connector-contract.md, "KV events"):

- On the PUB socket, one ZMQ multipart message per engine step that had events:
  ``[topic, seq, payload]``. `topic` is the configured topic (UTF-8), `seq` an
  8-byte big-endian unsigned counter that starts at 0 when the publisher starts
  and goes up by one per message, `payload` a msgpack `KVEventBatch`.
- `KVEventBatch` is an array ``[ts, events, data_parallel_rank]`` (the rank may
  be missing); each event is a map tagged by ``"type"``: ``BlockStored``,
  ``BlockRemoved`` or ``AllBlocksCleared``; fields that hold their default are
  left out.
- Replay (ROUTER socket): a DEALER sends ``[b"", seq]`` (8 bytes big-endian)
  and gets back ``[b"", topic, seq, payload]`` for every batch still buffered
  with a seq at or after it, in order, then ``[b"", b"", -1, b""]`` (-1 as 8
  signed bytes) to end.

Rules: decoding is strict about types and bounded in size. A payload over
`MAX_PAYLOAD_BYTES`, one that is not msgpack, or one that does not match the
structs (an unknown event type included) raises `WireError` naming why; nothing
here raises anything else on bad input. Unknown *fields* of known events are
ignored, so a vLLM that adds optional fields still decodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

MAX_PAYLOAD_BYTES = 16 << 20
"""The largest payload decoded (a 128k-token prefill stores ~0.7 MB of events)."""
MAX_EVENTS = 1 << 16
MAX_BLOCKS = 1 << 16
MAX_TOKENS = 1 << 22
MAX_HASH_BYTES = 64

SEQ_BYTES = 8
END_SEQ = -1
"""The seq of the replay's end marker (8 signed big-endian bytes)."""

ExternalHash = (
    Annotated[bytes, msgspec.Meta(max_length=MAX_HASH_BYTES)] | Annotated[int, msgspec.Meta(ge=0)]
)
"""vLLM's block hash as published: the low 64 bits of its hash as an int
(`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, the default; msgpack carries no
larger int) or the raw digest."""
Token = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]


class WireError(ValueError):
    """A frame or payload that cannot be read; the message says why."""


class BlockStored(msgspec.Struct, tag="BlockStored", frozen=True, gc=False):
    """A run of full blocks was cached: ``block_hashes[i]`` holds
    ``token_ids[i * block_size:(i + 1) * block_size]``; the first block's parent
    is `parent_block_hash` (None: the run starts the prompt)."""

    block_hashes: Annotated[list[ExternalHash], msgspec.Meta(max_length=MAX_BLOCKS)]
    parent_block_hash: ExternalHash | None
    token_ids: Annotated[list[Token], msgspec.Meta(max_length=MAX_TOKENS)]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", frozen=True, gc=False):
    """The blocks under these hashes left the cache (evicted or replaced)."""

    block_hashes: Annotated[list[ExternalHash], msgspec.Meta(max_length=MAX_BLOCKS)]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", frozen=True, gc=False):
    """The whole prefix cache was reset."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One engine step's events, in the order they happened."""

    ts: float
    events: Annotated[list[Event], msgspec.Meta(max_length=MAX_EVENTS)]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes, max_bytes: int = MAX_PAYLOAD_BYTES) -> KVEventBatch:
    """The batch in `payload`; `WireError` if it is oversized or malformed."""
    if len(payload) > max_bytes:
        raise WireError(f"payload of {len(payload)} bytes (at most {max_bytes})")
    try:
        return _decoder.decode(payload)
    except msgspec.ValidationError as e:
        raise WireError(f"not a KVEventBatch: {e}") from None
    except msgspec.DecodeError as e:
        raise WireError(f"not msgpack: {e}") from None


def parse_seq(raw: bytes) -> int:
    """A seq frame's value (8 bytes, big-endian, unsigned)."""
    if len(raw) != SEQ_BYTES:
        raise WireError(f"a seq frame of {len(raw)} bytes (expected {SEQ_BYTES})")
    return int.from_bytes(raw, "big")


def parse_live(frames: Sequence[bytes]) -> tuple[int, bytes]:
    """``(seq, payload)`` of a message from the PUB socket."""
    if len(frames) != 3:
        raise WireError(f"a live message of {len(frames)} frames (expected 3)")
    return parse_seq(frames[1]), frames[2]


def parse_replay(frames: Sequence[bytes]) -> tuple[int, bytes] | None:
    """``(seq, payload)`` of a message from the replay socket as a DEALER
    receives it, or None for the end marker."""
    if len(frames) != 4 or frames[0] != b"":
        raise WireError(f"a replay message of {len(frames)} frames (expected 4, empty first)")
    if frames[2] == END_SEQ.to_bytes(SEQ_BYTES, "big", signed=True):
        return None
    return parse_seq(frames[2]), frames[3]


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to ask for every buffered batch from `start_seq` on."""
    return [b"", start_seq.to_bytes(SEQ_BYTES, "big")]
