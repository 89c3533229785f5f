"""What an instance says of itself in etcd (`InstanceRecord`, JSON), and where.

The key is ``<prefix>instances/<instance_id>``: one per connector start (the
id is new each start), so a restarted instance is a new key and its old one
goes when its lease expires.
"""

from __future__ import annotations

import msgspec

MAX_RECORD_BYTES = 4096  # a record is a few hundred bytes; anything larger is refused


class InstanceRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """One instance: its HTTP base URL, control address, the roles it may play
    (``prefill``, ``decode``), its KV block size, who it is and how many
    requests its engine runs at once (vLLM's ``max_num_seqs``; absent from
    records of older instances)."""

    url: str
    control: str
    roles: tuple[str, ...]
    block_size: int
    instance_id: str
    incarnation: str = ""
    max_num_seqs: int | None = None

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"an instance URL is http(s)://..., not {self.url!r}")
        if not self.roles or set(self.roles) - {"prefill", "decode"}:
            raise ValueError(f"roles are prefill and/or decode, not {self.roles!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, not {self.block_size}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, not {self.max_num_seqs}")


def record_key(prefix: str, instance_id: str) -> str:
    return f"{prefix}instances/{instance_id}"


def encode_record(record: InstanceRecord) -> str:
    return msgspec.json.encode(record).decode()


def decode_record(text: str) -> InstanceRecord:
    """The record in `text`; ValueError naming what is wrong (too large, not
    JSON, a field missing or of the wrong type, a bad value)."""
    if len(text) > MAX_RECORD_BYTES:
        raise ValueError(f"a record of {len(text)} bytes (at most {MAX_RECORD_BYTES})")
    try:
        return msgspec.json.decode(text.encode(), type=InstanceRecord)
    except msgspec.ValidationError as e:
        raise ValueError(f"not an instance record: {e}") from None
    except msgspec.DecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
