"""Control-plane messages: every message round-trips, invalid input is refused with
`MessageError` naming the problem, and the helpers (spec mismatches, handshake
answer, TransferKV bounds, prompt hash) say what the spec says."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rapidkv.control.codes import Code
from rapidkv.control.messages import (
    MAX_BLOB,
    MAX_BLOCKS,
    REPLY_TYPE,
    Abort,
    AbortReason,
    AbortReply,
    ErrorReply,
    Handshake,
    HandshakeReply,
    KVSpec,
    MessageError,
    RankEndpoint,
    Stats,
    StatsRequest,
    StepTiming,
    Timeline,
    TimelineRequest,
    TransferKV,
    TransferKVReply,
    XferTimeline,
    answer_handshake,
    decode_reply,
    decode_request,
    encode,
    mismatches,
    prompt_hash,
)

pytestmark = pytest.mark.unit


def make_spec(**changes: object) -> KVSpec:
    fields: dict[str, object] = dict(
        block_size=16,
        kernel_blocks_per_block=1,
        dtype="float32",
        num_layers=2,
        layer_block_bytes=(8192, 8192),
        layer_runs_per_block=(1, 1),
        tp_size=2,
        model_fingerprint="fp-1234",
    )
    fields.update(changes)
    return KVSpec(**fields)  # type: ignore[arg-type]


def endpoints(n: int) -> list[RankEndpoint]:
    return [
        RankEndpoint(
            rank=r, transport="tcp", transport_metadata=b"meta%d" % r, layout=b"lay", num_blocks=64
        )
        for r in range(n)
    ]


def handshake(spec: KVSpec | None = None) -> Handshake:
    spec = spec or make_spec()
    return Handshake(
        instance_id="D-1",
        control_address="127.0.0.1:7000",
        spec=spec,
        endpoints=endpoints(spec.tp_size),
    )


def transfer(**changes: object) -> TransferKV:
    fields: dict[str, object] = dict(
        xfer_id="xfer-1",
        dst_instance="D-1",
        dst_blocks=[7, 8, 9, 10],
        first_block=1,
        num_tokens=60,
        prompt_hash=prompt_hash(range(61)),
    )
    fields.update(changes)
    return TransferKV(**fields)  # type: ignore[arg-type]


EVERY_REQUEST = [
    handshake(),
    transfer(),
    transfer(migration=True, source_xfer_id="src-1", transfer_kv_mode="bypass", first_block=4),
    Abort(xfer_id="xfer-1", reason=AbortReason.NOTHING_TO_LOAD),
    StatsRequest(),
    TimelineRequest(["xfer-1", "xfer-2"]),
]
EVERY_REPLY = [
    HandshakeReply(code=Code.OK, instance_id="P-1", spec=make_spec(), endpoints=endpoints(2)),
    HandshakeReply(code=Code.ERROR, instance_id="P-1", spec=make_spec(), reasons=["dtype"]),
    TransferKVReply(xfer_id="xfer-1", code=Code.OK, tokens_sent=60),
    TransferKVReply(xfer_id="xfer-1", code=Code.GONE, message="aborted"),
    AbortReply(xfer_id="xfer-1", code=Code.NOT_FOUND),
    Stats({"held_blocks": 3.0, "substeps_rejected": 1.0}),
    Timeline(
        {"xfer-1": XferTimeline(events={"transfer_kv": 1.5}, state_at_arrival="last_chunk")},
        [StepTiming(7, 1.0, 1.02, 256)],
    ),
    ErrorReply(Code.BUSY, "too many"),
]


@pytest.mark.parametrize("msg", EVERY_REQUEST, ids=lambda m: type(m).__name__)
def test_every_request_round_trips(msg: object) -> None:
    assert decode_request(encode(msg)) == msg  # type: ignore[arg-type]


@pytest.mark.parametrize("msg", EVERY_REPLY, ids=lambda m: type(m).__name__)
def test_every_reply_round_trips(msg: object) -> None:
    assert decode_reply(encode(msg)) == msg  # type: ignore[arg-type]


def test_every_request_type_has_a_reply_type() -> None:
    assert {type(m) for m in EVERY_REQUEST} == set(REPLY_TYPE)
    assert set(REPLY_TYPE.values()) | {ErrorReply} == {type(m) for m in EVERY_REPLY}


def test_a_reply_is_not_accepted_as_a_request_nor_the_reverse() -> None:
    with pytest.raises(MessageError, match="type"):
        decode_request(encode(EVERY_REPLY[2]))
    with pytest.raises(MessageError, match="type"):
        decode_reply(encode(transfer()))


def as_dict(msg: msgspec.Struct) -> dict:
    """`msg` as the plain msgpack objects a peer would send."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(msg))


def raw(msg: msgspec.Struct, **changes: object) -> bytes:
    """`msg` encoded with some fields replaced by arbitrary values (bypasses
    construction, as a hostile peer would)."""
    fields = as_dict(msg)
    fields.update(changes)
    return msgspec.msgpack.encode(fields)


@pytest.mark.parametrize(
    ("changes", "names"),
    [
        ({"xfer_id": ""}, "xfer_id"),
        ({"xfer_id": "x" * 257}, "xfer_id"),
        ({"dst_instance": ""}, "dst_instance"),
        ({"dst_blocks": [1, -2]}, "dst_blocks[1]"),
        ({"dst_blocks": [1, 1 << 31]}, "dst_blocks[1]"),
        ({"first_block": -1}, "first_block"),
        ({"first_block": 5}, "first_block 5 beyond 4"),
        ({"num_tokens": 0}, "num_tokens"),
        ({"prompt_hash": "abc"}, "prompt_hash"),
        ({"prompt_hash": "G" * 32}, "prompt_hash"),
        ({"transfer_kv_mode": "fast"}, "transfer_kv_mode"),
        ({"migration": "yes"}, "migration"),
        ({"migration": True}, "a migration names its source_xfer_id"),
        ({"source_xfer_id": "src-1"}, "a migration names its source_xfer_id"),
        ({"migration": True, "source_xfer_id": ""}, "source_xfer_id"),
        ({"migration": True, "source_xfer_id": "s" * 257}, "source_xfer_id"),
        (
            {"migration": True, "source_xfer_id": "src-1", "notify_layers": True},
            "a migration is not a split prefill",
        ),
    ],
)
def test_invalid_transfer_kv_is_refused_naming_the_field(
    changes: dict[str, object], names: str
) -> None:
    with pytest.raises(MessageError, match=names.replace("[", r"\[").replace("]", r"\]")):
        decode_request(raw(transfer(), **changes))


def test_list_sizes_are_bounded() -> None:
    with pytest.raises(MessageError, match="dst_blocks"):
        decode_request(raw(transfer(), dst_blocks=[0] * (MAX_BLOCKS + 1), first_block=0))
    big = as_dict(handshake())
    big["endpoints"][0]["transport_metadata"] = b"x" * (MAX_BLOB + 1)
    with pytest.raises(MessageError, match="transport_metadata"):
        decode_request(msgspec.msgpack.encode(big))
    with pytest.raises(MessageError, match="counters"):
        decode_reply(raw(Stats(), counters={f"c{i}": 1.0 for i in range(1025)}))


@pytest.mark.parametrize(
    ("spec_changes", "problem"),
    [
        ({"num_layers": 3}, "layer_block_bytes has 2 entries for 3 layers"),
        ({"layer_runs_per_block": (1,)}, "layer_runs_per_block has 1 entries"),
        ({"layer_block_bytes": (8192, 1001), "layer_runs_per_block": (1, 2)}, "layer 1"),
        ({"block_size": 0}, "block_size"),
        ({"model_fingerprint": ""}, "model_fingerprint"),
        ({"tp_size": 3}, "ranks 0..2"),
    ],
)
def test_invalid_handshake_is_refused(spec_changes: dict[str, object], problem: str) -> None:
    fields = as_dict(handshake())
    fields["spec"].update(spec_changes)
    with pytest.raises(MessageError, match=problem):
        decode_request(msgspec.msgpack.encode(fields))


def test_handshake_endpoints_must_be_every_rank_in_order() -> None:
    eps = endpoints(2)
    with pytest.raises(MessageError, match=r"ranks 0..1 in order, got \[1, 0\]"):
        decode_request(raw(handshake(), endpoints=[as_dict(e) for e in eps[::-1]]))
    with pytest.raises(ValueError, match="ranks"):
        Handshake(instance_id="D", control_address="h:1", spec=make_spec(), endpoints=eps[:1])


@pytest.mark.parametrize("address", ["nohost", "h:0", "h:65536", "h:x", ":80", "::1:80", "h:٣"])
def test_handshake_control_address_must_be_host_port(address: str) -> None:
    with pytest.raises(MessageError, match="control address"):
        decode_request(raw(handshake(), control_address=address))


def test_replies_keep_their_invariants() -> None:
    with pytest.raises(ValueError, match="must give a reason"):
        HandshakeReply(code=Code.BUSY, instance_id="P")
    with pytest.raises(ValueError, match="carries a spec"):
        HandshakeReply(code=Code.OK, instance_id="P")
    with pytest.raises(ValueError, match="cannot be OK"):
        ErrorReply(Code.OK, "fine")
    with pytest.raises(MessageError, match="code"):
        decode_reply(raw(EVERY_REPLY[2], code=201))
    with pytest.raises(MessageError, match="tokens_sent"):
        decode_reply(raw(EVERY_REPLY[2], tokens_sent=-1))
    with pytest.raises(MessageError, match="reason"):
        decode_request(raw(Abort(xfer_id="x", reason=AbortReason.TIMEOUT), reason="bored"))


def test_mismatches_name_every_differing_field_with_both_values() -> None:
    a = make_spec()
    b = make_spec(
        dtype="bfloat16",
        kernel_blocks_per_block=2,
        layer_block_bytes=(8192, 4096),
        model_fingerprint="other",
    )
    assert mismatches(a, a) == []
    assert mismatches(a, b) == [
        "kernel_blocks_per_block: 1 vs 2",
        "dtype: 'float32' vs 'bfloat16'",
        "layer_block_bytes: layer 1: 8192 vs 4096",
        "model_fingerprint: 'fp-1234' vs 'other'",
    ]
    c = make_spec(num_layers=3, layer_block_bytes=(1, 1, 1), layer_runs_per_block=(1, 1, 1))
    assert mismatches(a, c) == [
        "num_layers: 2 vs 3",
        "layer_block_bytes: 2 layers vs 3 layers",
        "layer_runs_per_block: 2 layers vs 3 layers",
    ]


def test_answer_handshake_refuses_a_mismatch_with_reasons_and_accepts_a_match() -> None:
    mine = make_spec()
    ok = answer_handshake(handshake(mine), instance_id="P-1", spec=mine, endpoints=endpoints(2))
    assert ok.code == Code.OK and ok.endpoints == endpoints(2) and ok.spec == mine
    theirs = make_spec(block_size=32, tp_size=1)
    refused = answer_handshake(
        handshake(theirs), instance_id="P-1", spec=mine, endpoints=endpoints(2)
    )
    assert refused.code == Code.ERROR and refused.endpoints == []
    assert refused.reasons == ["KV spec mismatch with D-1: block_size: 16 vs 32"]
    assert decode_reply(encode(refused)) == refused


def test_specs_of_different_tp_sizes_are_compared_without_their_per_rank_fields() -> None:
    """Another TP size holds another share of the KV heads a rank: its per-rank
    block bytes differ too, and neither is a mismatch (the connector decides
    from the ranks' layouts whether the heads map); every other field still is."""
    tp2 = make_spec()
    tp1 = make_spec(tp_size=1, layer_block_bytes=(16384, 16384))
    assert mismatches(tp2, tp1) == [] and mismatches(tp1, tp2) == []
    assert mismatches(tp2, make_spec(tp_size=1, dtype="bfloat16")) == [
        "dtype: 'float32' vs 'bfloat16'"
    ]
    # at equal TP the per-rank bytes must be equal
    assert mismatches(tp2, make_spec(layer_block_bytes=(16384, 16384))) == [
        "layer_block_bytes: layer 0: 8192 vs 16384, layer 1: 8192 vs 16384"
    ]
    ok = answer_handshake(handshake(tp1), instance_id="P-1", spec=tp2, endpoints=endpoints(2))
    assert ok.code == Code.OK and ok.endpoints == endpoints(2)


def test_transfer_problems_bound_check_what_is_written() -> None:
    assert transfer().problems(block_size=16, num_blocks=64) == []
    # block 7 is a prefix hit (never written), so it may be anything
    assert transfer(dst_blocks=[99, 8, 9, 10]).problems(16, 64) == []
    assert transfer(dst_blocks=[7, 8, 9, 64]).problems(16, 64) == [
        "xfer xfer-1: destination block ids [64] out of range (num_blocks 64)"
    ]
    assert transfer(dst_blocks=[7, 8, 8, 10]).problems(16, 64) == [
        "xfer xfer-1: a destination block appears twice among the blocks to write"
    ]
    assert transfer(num_tokens=65).problems(16, 64) == [
        "xfer xfer-1: 65 tokens do not fit in 4 blocks of 16"
    ]


def test_prompt_hash_is_stable_and_tells_tokenizations_apart() -> None:
    assert prompt_hash([1, 2, 3]) == prompt_hash((1, 2, 3)) == prompt_hash(iter([1, 2, 3]))
    assert len(prompt_hash([])) == 32
    assert prompt_hash([1, 2, 3]) != prompt_hash([1, 2, 3, 0])
    assert prompt_hash([1, 2, 3]) != prompt_hash([3, 2, 1])
    assert prompt_hash([1 << 40]) != prompt_hash([0])
    # pinned: blake2b-128 (person "rapidkv-prompt") of little-endian int64s, on every machine
    assert prompt_hash([1, 2, 3]) == "c3ce3ffb6ad84253645dbdfaea72c821"


# ---------------------------------------------------------------------------- fuzz

_TAGS = ["handshake", "transfer_kv", "abort", "stats_request", "handshake_reply",
         "transfer_kv_reply", "abort_reply", "stats", "error", "nope"]  # fmt: skip
_FIELDS = sorted(
    {
        name
        for msg in EVERY_REQUEST + EVERY_REPLY
        for name in msgspec.structs.asdict(msg)  # type: ignore[arg-type]
    }
    | set(KVSpec.__struct_fields__)
    | set(RankEndpoint.__struct_fields__)
)
_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=40),
    st.binary(max_size=40),
    st.sampled_from(["127.0.0.1:1", "tcp", "nixl", "step", "client_abort", "0" * 32]),
)
_value = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.sampled_from([*_FIELDS, "type"]), inner, max_size=8),
    ),
    max_leaves=20,
)
_message_like = st.builds(
    lambda tag, fields: {**fields, "type": tag},
    st.sampled_from(_TAGS),
    st.dictionaries(st.sampled_from(_FIELDS), _value, max_size=10),
)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_decode_to_a_message_or_message_error(data: bytes) -> None:
    for decode in (decode_request, decode_reply):
        with contextlib.suppress(MessageError):
            decode(data)


@settings(max_examples=120, deadline=None)
@given(_message_like)
def test_message_shaped_garbage_decodes_or_raises_message_error(obj: dict[str, object]) -> None:
    data = msgspec.msgpack.encode(obj)
    for decode in (decode_request, decode_reply):
        try:
            msg = decode(data)
        except MessageError:
            continue
        assert decode(encode(msg)) == msg  # whatever was accepted is a valid message


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=(1 << 31) - 1), max_size=50),
    st.integers(min_value=0, max_value=50),
    st.integers(min_value=1, max_value=1 << 20),
    st.booleans(),
    st.sampled_from([None, "step", "bypass", "substep"]),
)
def test_valid_transfer_kv_round_trips(
    blocks: list[int], first: int, tokens: int, migration: bool, mode: str | None
) -> None:
    msg = transfer(
        dst_blocks=blocks,
        first_block=min(first, len(blocks)),
        num_tokens=tokens,
        migration=migration,
        source_xfer_id="src-1" if migration else None,
        transfer_kv_mode=mode,
    )
    assert decode_request(encode(msg)) == msg
