"""`kvindex.wire` reads what vLLM 0.32's own encoder writes, and refuses
anything else with a `WireError`: oversized, not msgpack, wrong shapes, unknown
event types. Payloads are built with vLLM's structs (tests may import vLLM;
the router may not)."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rapidkv.router.kvindex import wire

pytestmark = pytest.mark.unit

kv_events = pytest.importorskip("vllm.distributed.kv_events")

_encode = msgspec.msgpack.Encoder().encode  # what ZmqEventPublisher uses


def vllm_stored(**fields) -> object:
    base = dict(
        block_hashes=[2**64 - 1, 7],
        parent_block_hash=None,
        token_ids=[1, 2, 3, 4],
        block_size=2,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    return kv_events.BlockStored(**{**base, **fields})


def vllm_payload(events: list, rank: int | None = 0) -> bytes:
    return _encode(kv_events.KVEventBatch(ts=1.25, events=events, data_parallel_rank=rank))


def test_every_event_type_decodes_with_its_fields() -> None:
    events = [
        vllm_stored(group_idx=0, extra_keys=[None, ("salt",)], session_id="s"),
        kv_events.BlockRemoved(block_hashes=[b"\x01" * 32], medium="GPU", group_idx=0),
        kv_events.AllBlocksCleared(),
    ]
    batch = wire.decode_batch(vllm_payload(events, rank=3))
    assert batch.ts == 1.25 and batch.data_parallel_rank == 3
    stored, removed, cleared = batch.events
    assert isinstance(stored, wire.BlockStored)
    assert stored.block_hashes == [2**64 - 1, 7]  # uint64 ints, as vLLM publishes by default
    assert stored.parent_block_hash is None and stored.token_ids == [1, 2, 3, 4]
    assert stored.block_size == 2 and stored.medium == "GPU" and stored.group_idx == 0
    assert stored.extra_keys == [None, ("salt",)] and stored.session_id == "s"
    assert isinstance(removed, wire.BlockRemoved) and removed.block_hashes == [b"\x01" * 32]
    assert isinstance(cleared, wire.AllBlocksCleared)


def test_defaults_left_out_by_vllm_decode_as_none() -> None:
    """vLLM omits fields holding their default (omit_defaults): group_idx, extra_keys..."""
    (stored,) = wire.decode_batch(vllm_payload([vllm_stored()], rank=None)).events
    assert stored.group_idx is None and stored.extra_keys is None and stored.locality is None


def test_a_batch_without_the_rank_element_decodes() -> None:
    payload = msgspec.msgpack.encode([1.0, [{"type": "AllBlocksCleared"}]])
    assert wire.decode_batch(payload).data_parallel_rank is None


def test_unknown_fields_of_known_events_are_ignored() -> None:
    event = msgspec.to_builtins(vllm_stored())
    event |= {"type": "BlockStored", "a_future_field": [1, 2]}
    payload = msgspec.msgpack.encode([1.0, [event], 0])
    (stored,) = wire.decode_batch(payload).events
    assert stored.token_ids == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "payload, why",
    [
        (b"\xc1", "not msgpack"),
        (b"", "not msgpack"),
        (msgspec.msgpack.encode({"ts": 1}), "not a KVEventBatch"),
        (msgspec.msgpack.encode([1.0, [{"type": "BlockEvicted"}], 0]), "not a KVEventBatch"),
        (msgspec.msgpack.encode([1.0, [{"block_hashes": []}], 0]), "not a KVEventBatch"),
        (msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved"}], 0]), "not a KVEventBatch"),
        (
            msgspec.msgpack.encode(
                [1.0, [{"type": "BlockRemoved", "block_hashes": ["x"], "medium": None}], 0]
            ),
            "not a KVEventBatch",
        ),
        (
            msgspec.msgpack.encode(
                [
                    1.0,
                    [
                        {
                            "type": "BlockStored",
                            "block_hashes": [1],
                            "parent_block_hash": None,
                            "token_ids": [-1],
                            "block_size": 1,
                        }
                    ],
                ]
            ),
            "not a KVEventBatch",
        ),
        (msgspec.msgpack.encode(["soon", [], 0]), "not a KVEventBatch"),
    ],
)
def test_malformed_payloads_are_refused_with_the_reason(payload: bytes, why: str) -> None:
    with pytest.raises(wire.WireError, match=why):
        wire.decode_batch(payload)


def test_an_oversized_payload_is_refused_before_decoding() -> None:
    payload = vllm_payload([vllm_stored(token_ids=list(range(4000)), block_size=1000)])
    assert wire.decode_batch(payload, max_bytes=len(payload)).events
    with pytest.raises(wire.WireError, match=r"payload of \d+ bytes \(at most 100\)"):
        wire.decode_batch(payload, max_bytes=100)


def test_lists_over_their_limits_are_refused() -> None:
    payload = msgspec.msgpack.encode([1.0, [{"type": "AllBlocksCleared"}] * (wire.MAX_EVENTS + 1)])
    with pytest.raises(wire.WireError, match="length"):
        wire.decode_batch(payload)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_raise_anything_but_a_wire_error(payload: bytes) -> None:
    with contextlib.suppress(wire.WireError):
        wire.decode_batch(payload)


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=5),
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(st.sampled_from(["type", "block_hashes", "token_ids"]), inner)
        ),
        max_leaves=12,
    )
)
def test_random_msgpack_never_raises_anything_but_a_wire_error(value: object) -> None:
    with contextlib.suppress(wire.WireError):
        wire.decode_batch(msgspec.msgpack.encode(value))


def test_live_frames_are_topic_seq_payload() -> None:
    assert wire.parse_live([b"kv", (5).to_bytes(8, "big"), b"p"]) == (5, b"p")
    with pytest.raises(wire.WireError, match="2 frames"):
        wire.parse_live([b"kv", b"p"])
    with pytest.raises(wire.WireError, match="seq frame of 4 bytes"):
        wire.parse_live([b"kv", b"\x00" * 4, b"p"])


def test_replay_frames_and_the_end_marker_match_vllms_publisher() -> None:
    end = kv_events.ZmqEventPublisher.END_SEQ
    assert wire.parse_replay([b"", b"", end, b""]) is None
    assert wire.parse_replay([b"", b"kv", (2**64 - 2).to_bytes(8, "big"), b"p"]) == (
        2**64 - 2,
        b"p",
    )
    with pytest.raises(wire.WireError, match="3 frames"):
        wire.parse_replay([b"kv", (1).to_bytes(8, "big"), b"p"])
    # the ROUTER reads [identity, b"", start] and int.from_bytes(start, "big")
    empty, start = wire.replay_request(42)
    assert empty == b"" and int.from_bytes(start, "big") == 42
