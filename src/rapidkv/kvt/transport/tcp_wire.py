"""Wire format of the TCP transport: frame headers, handshake messages, MACs.

Pure data and functions; no sockets. Both sides of a connection use it.

Connection
----------
The *sender* (the transport that posts writes) connects to the *receiver*'s
listening socket. One connection carries one direction of data: WRITE and NOTIF
frames go sender → receiver, ACK frames come back. Frames are processed strictly
in stream order, which is what orders a NOTIF after the writes before it.

Every frame starts with a 16-byte little-endian header::

    magic "RK" (2) | version (1) | kind (1) | count: u32 | word: u64

=========  =========  ===============  ===============================================
kind       direction  count            word / what follows the header
=========  =========  ===============  ===============================================
CHALLENGE  recv→send  body bytes       0; msgpack `Challenge`
HELLO      send→recv  body bytes       0; msgpack `Hello`
WELCOME    recv→send  body bytes       0; msgpack `Welcome`
WRITE      send→recv  n rows           request id; n x (dst: u64, nbytes: u64), then
                                       the payload: the rows' bytes, concatenated
ACK        recv→send  0                request id whose payload is now in memory
NOTIF      send→recv  payload bytes    0; the payload
=========  =========  ===============  ===============================================

Handshake: CHALLENGE (receiver nonce) → HELLO (sender name, sender nonce, the
receiver instance the sender expects, MAC) → WELCOME (receiver name and instance,
MAC). With a secret, both MACs are HMAC-SHA256 over all of the above, under
different labels, so neither can be replayed nor reflected; a receiver acts on
nothing, and answers nothing, before a HELLO verified. Without a secret MACs are
empty and not checked.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from typing import TypeVar

import msgspec
import numpy as np

from rapidkv.kvt.transport.base import TransportError

MAGIC = b"RK"
VERSION = 1
HEADER = struct.Struct("<2sBBIQ")
HEADER_SIZE = HEADER.size  # 16
DESC_DTYPE = np.dtype("<u8")  # wire rows are (dst, nbytes) pairs of this type
ROW_BYTES = 2 * DESC_DTYPE.itemsize
MAX_HANDSHAKE_BODY = 4096
MAX_NAME = 256
NONCE_BYTES = 32

_S = TypeVar("_S", bound=msgspec.Struct)


class Kind(enum.IntEnum):
    CHALLENGE = 1
    HELLO = 2
    WELCOME = 3
    WRITE = 4
    ACK = 5
    NOTIF = 6


class ProtocolError(Exception):
    """The peer sent something this side must not act on; drop the connection."""


class Metadata(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What `local_metadata()` publishes. `instance` is random per transport
    object, so stale metadata (a restarted worker on a reused port) is refused."""

    name: str
    host: str
    port: int
    instance: bytes


class Challenge(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    nonce: bytes
    auth: bool  # the receiver requires a MAC


class Hello(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    nonce: bytes
    instance: bytes  # the receiver instance the sender means to reach
    mac: bytes


class Welcome(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    instance: bytes
    mac: bytes


def pack_header(kind: Kind, count: int = 0, word: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, count, word)


def unpack_header(buf: bytes | bytearray | memoryview) -> tuple[Kind, int, int]:
    """Parse a header; ProtocolError on bad magic, version or kind."""
    magic, version, kind, count, word = HEADER.unpack(buf)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"bad frame header (magic {magic!r}, version {version})")
    try:
        return Kind(kind), count, word
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None


def encode_body(kind: Kind, msg: msgspec.Struct) -> bytes:
    body = msgspec.msgpack.encode(msg)
    return pack_header(kind, len(body)) + body


def decode_body(body: bytes, typ: type[_S]) -> _S:
    try:
        return msgspec.msgpack.decode(body, type=typ)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"bad {typ.__name__}: {e}") from None


def encode_metadata(meta: Metadata) -> bytes:
    return msgspec.msgpack.encode(meta)


def decode_metadata(blob: bytes) -> Metadata:
    """Decode a peer's metadata blob; TransportError if it is not TCP metadata."""
    try:
        meta = msgspec.msgpack.decode(blob, type=Metadata)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise TransportError(f"not tcp transport metadata: {e}") from None
    if not 0 < meta.port < 65536 or not meta.name or len(meta.name) > MAX_NAME:
        raise TransportError(f"invalid tcp transport metadata: {meta!r}")
    return meta


def hello_mac(
    secret: bytes, server_nonce: bytes, client_nonce: bytes, name: str, instance: bytes
) -> bytes:
    msg = msgspec.msgpack.encode(
        ["rapidkv-tcp/1 hello", server_nonce, client_nonce, name, instance]
    )
    return hmac.new(secret, msg, hashlib.sha256).digest()


def welcome_mac(
    secret: bytes, server_nonce: bytes, client_nonce: bytes, name: str, instance: bytes
) -> bytes:
    msg = msgspec.msgpack.encode(
        ["rapidkv-tcp/1 welcome", server_nonce, client_nonce, name, instance]
    )
    return hmac.new(secret, msg, hashlib.sha256).digest()


def mac_ok(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)
