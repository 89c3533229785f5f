"""Data-plane messages that ride on the transport (not on the control plane)."""

from __future__ import annotations

import msgspec


class SendDone(msgspec.Struct, frozen=True, tag="send_done"):
    """All writes of a transfer are settled on one source rank.

    `tokens_sent` is cumulative for the `xfer_id`: the destination holds the KV of
    the first `tokens_sent` tokens (what it had before the transfer, its prefix
    hits, plus the confirmed writes that extend it; never more than arrived).
    `ok` is False when some write failed or timed out; `error` says why.
    Sent once per (`xfer_id`, `rank`, `dst_rank`), after which no more writes of
    that transfer can land from that rank in that destination rank.

    Between instances of different TP sizes (`kvt.head_map`) a source rank may
    send to several destination ranks (`dst_rank` says which this one went to)
    and a destination rank take its KV heads from several source ranks
    (`sources`: how many send to `dst_rank`; the destination's worker gathers
    that many, `kvt.gather`, before the transfer counts as landed there).
    """

    xfer_id: str
    rank: int
    tokens_sent: int
    ok: bool
    error: str = ""
    dst_rank: int = 0
    sources: int = 1


class LayersLanded(msgspec.Struct, frozen=True, tag="layers_landed"):
    """The first `layers` layers of every block of a transfer that announces its
    layers (`Task.notify_layers`) are in place at the destination, from one
    source rank. Sent when that count grows, always before the transfer's
    SendDone (which alone says that every layer is in place). Monotonic per
    (`xfer_id`, `rank`). `sources`: how many source ranks send to this
    destination rank (as in `SendDone`); a layer is in place once every one of
    them said so."""

    xfer_id: str
    rank: int
    layers: int
    sources: int = 1


Notif = SendDone | LayersLanded

MAX_NOTIF_BYTES = 4096

_encoder = msgspec.msgpack.Encoder()
_notif_decoder = msgspec.msgpack.Decoder(Notif)


def encode_notif(msg: Notif) -> bytes:
    return _encoder.encode(msg)


def decode_notif(payload: bytes) -> Notif:
    """Decode and validate any data-plane notification; raises
    `msgspec.DecodeError`/`ValueError` on bad input."""
    if len(payload) > MAX_NOTIF_BYTES:
        raise ValueError(f"notification of {len(payload)} bytes exceeds {MAX_NOTIF_BYTES}")
    msg = _notif_decoder.decode(payload)
    if isinstance(msg, SendDone):
        if msg.rank < 0 or msg.tokens_sent < 0 or msg.dst_rank < 0 or msg.sources < 1:
            raise ValueError(f"invalid SendDone {msg}")
    elif msg.rank < 0 or msg.layers < 1 or msg.sources < 1:
        raise ValueError(f"invalid LayersLanded {msg}")
    return msg
