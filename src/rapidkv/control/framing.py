"""The control plane's wire: length-prefixed, optionally authenticated frames. Sans-I/O.

Theory of operation
-------------------
A connection is a byte stream of frames, each::

    length: u32 big-endian | body | tag

`length` counts body and tag. A frame longer than `max_frame` is refused
(`FrameTooLarge`) as soon as its four length bytes are in: none of its body is
read or buffered. The opening frames have fixed sizes, and one announced longer
is refused the same way (an unauthenticated peer makes the server buffer no
more than a HELLO).

A connection opens with one frame each way, then carries messages:

1. PREAMBLE, server -> client: ``MAGIC | flags: u8 | server nonce (32 bytes)``.
   Flag bit 0: the server requires authentication. Never tagged.
2. HELLO, client -> server: ``MAGIC | client nonce (32 bytes)``, tagged.
3. MESSAGE frames both ways: ``request id: u64 BE | msgpack message``, tagged.
   A reply carries its request's id; replies may come in any order.

With a shared secret every frame after the preamble ends in a 32-byte tag::

    key = HMAC-SHA256(secret, "rapidkv-rpc/1 key" | server nonce | client nonce)
    tag = HMAC-SHA256(key, direction | counter: u64 BE | body)

`direction` is ``c>s`` or ``s>c``; `counter` numbers the frames sent in that
direction on this connection, from 0 (HELLO is the client's frame 0). Fresh
nonces from both ends make each connection's key new, so a frame recorded on one
connection verifies on no other; the implicit counter refuses replayed, dropped
or reordered frames within one; the direction refuses reflected ones. Tags are
compared in constant time before anything decodes the body. Without a secret
the tag is empty and nothing is checked.

`ServerSession` and `ClientSession` are the two ends: they take bytes in
(`receive`) and give bytes out (`outgoing`, `seal`); they own no socket.

Rules
-----
- A server session yields no message until the peer's HELLO verified, and the
  server sends nothing before that but the preamble (a random nonce and a flag).
- Any bad frame (size, magic, tag, framing) raises `FrameError` (`AuthError`
  for authentication) and leaves the session unusable: close the connection,
  reply nothing.
- A client with a secret refuses a server that does not ask for one (no silent
  downgrade); a client without one refuses a server that does.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from pathlib import Path

LENGTH = struct.Struct(">I")
REQUEST_ID = struct.Struct(">Q")
_COUNTER = struct.Struct(">Q")
MAGIC = b"RKRPC\x01"  # protocol rapidkv-rpc, version 1
NONCE_BYTES = 32
TAG_BYTES = 32
FLAG_AUTH = 0x01
DEFAULT_MAX_FRAME = 16 << 20
MIN_MAX_FRAME = 256
_PREAMBLE_BYTES = len(MAGIC) + 1 + NONCE_BYTES
_HELLO_BYTES = len(MAGIC) + NONCE_BYTES
_KEY_LABEL = b"rapidkv-rpc/1 key"
_CLIENT_TO_SERVER = b"c>s"
_SERVER_TO_CLIENT = b"s>c"


class FrameError(Exception):
    """The peer broke the framing protocol; close the connection, reply nothing."""


class FrameTooLarge(FrameError):
    """A frame's length prefix exceeds `max_frame` (its body was not read)."""


class AuthError(FrameError):
    """Authentication failed: bad or missing tag, or a secret configured on one
    end only."""


def normalize_secret(secret: bytes | str | None) -> bytes | None:
    """A secret as bytes (str is UTF-8); None means no authentication."""
    if secret is None:
        return None
    key = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not key:
        raise ValueError("an empty shared secret authenticates nothing; use None")
    return key


def read_secret_file(path: str | os.PathLike[str]) -> bytes:
    """The shared secret held in the file at `path`: its bytes with surrounding
    whitespace (a trailing newline) removed. An unreadable or empty file raises
    ValueError naming the path (never the content)."""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as e:
        raise ValueError(f"cannot read the secret file {path}: {e.strerror or e}") from None
    if not secret:
        raise ValueError(f"the secret file {path} is empty")
    return secret


def check_max_frame(max_frame: int) -> int:
    if max_frame < MIN_MAX_FRAME:
        raise ValueError(f"max_frame {max_frame} below {MIN_MAX_FRAME}")
    return max_frame


class FrameReader:
    """Splits a byte stream into frame payloads (``body | tag``).

    Invariant: it buffers at most one frame of at most `max_frame` bytes plus
    whatever was fed after it; a length over `max_frame` raises before any of the
    frame's body is buffered for it.
    """

    def __init__(self, max_frame: int) -> None:
        self.max_frame = check_max_frame(max_frame)
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data

    @property
    def pending(self) -> int:
        """Bytes buffered of a frame not complete yet."""
        return len(self._buf)

    def next_frame(self, limit: int | None = None) -> bytes | None:
        """The next complete frame's payload, or None until more bytes arrive.
        `limit` lowers `max_frame` for this frame."""
        if len(self._buf) < LENGTH.size:
            return None
        (n,) = LENGTH.unpack_from(self._buf)
        limit = self.max_frame if limit is None else min(limit, self.max_frame)
        if n > limit:
            raise FrameTooLarge(f"frame of {n} bytes exceeds the limit of {limit}")
        end = LENGTH.size + n
        if len(self._buf) < end:
            return None
        frame = bytes(self._buf[LENGTH.size : end])
        del self._buf[:end]
        return frame


class _Session:
    """What both ends share: the frame reader, the key and the two counters."""

    _send_dir: bytes
    _recv_dir: bytes
    _opening_bytes: int  # the size of the opening frame received

    def __init__(self, secret: bytes | str | None, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self._secret = normalize_secret(secret)
        self._reader = FrameReader(max_frame)
        self._key: bytes | None = None
        self._sent = 0
        self._received = 0
        self._out = bytearray()
        self._ready = False
        self._broken = False

    @property
    def ready(self) -> bool:
        """The opening frames are done: messages may be sealed and received."""
        return self._ready

    @property
    def max_frame(self) -> int:
        return self._reader.max_frame

    @property
    def pending(self) -> int:
        """Bytes received of a frame not complete yet (a peer that stops here
        sent a truncated frame)."""
        return self._reader.pending

    def outgoing(self) -> bytes:
        """Opening bytes waiting to be sent (then cleared)."""
        out = bytes(self._out)
        self._out.clear()
        return out

    def seal(self, request_id: int, payload: bytes) -> bytes:
        """One MESSAGE frame carrying `payload` under `request_id`, ready to write.

        Frames must be written in the order they were sealed (the counter).
        ValueError if the frame would exceed `max_frame`.
        """
        if not self._ready:
            raise RuntimeError("the connection's opening frames are not done")
        return self._seal(REQUEST_ID.pack(request_id) + payload)

    def receive(self, data: bytes) -> list[tuple[int, bytes]]:
        """Feed bytes read from the peer; return the `(request id, payload)` of
        every complete MESSAGE frame, in stream order. Raises `FrameError`."""
        if self._broken:
            raise FrameError("the connection already failed")
        try:
            self._reader.feed(data)
            messages = []
            while (
                frame := self._reader.next_frame(None if self._ready else self._opening_bytes)
            ) is not None:
                if not self._ready:
                    self._opening(frame)
                    continue
                body = self._open(frame)
                if len(body) < REQUEST_ID.size:
                    raise FrameError(f"message frame of {len(body)} bytes has no request id")
                (request_id,) = REQUEST_ID.unpack_from(body)
                messages.append((request_id, body[REQUEST_ID.size :]))
            return messages
        except FrameError:
            self._broken = True
            raise

    def _opening(self, frame: bytes) -> None:
        raise NotImplementedError

    def _seal(self, body: bytes) -> bytes:
        size = len(body) + (TAG_BYTES if self._key else 0)
        if size > self.max_frame:
            raise ValueError(f"frame of {size} bytes exceeds the limit of {self.max_frame}")
        tag = self._tag(self._send_dir, self._sent, body)
        self._sent += 1
        return LENGTH.pack(size) + body + tag

    def _open(self, frame: bytes) -> bytes:
        """The body of a received frame whose tag verified (constant time)."""
        if self._key is None:
            body = frame
        else:
            if len(frame) < TAG_BYTES:
                raise AuthError(f"frame of {len(frame)} bytes cannot carry a tag")
            body, tag = frame[:-TAG_BYTES], frame[-TAG_BYTES:]
            if not hmac.compare_digest(tag, self._tag(self._recv_dir, self._received, body)):
                raise AuthError(f"bad tag on frame {self._received} (wrong secret or tampered)")
        self._received += 1
        return body

    def _tag(self, direction: bytes, counter: int, body: bytes) -> bytes:
        if self._key is None:
            return b""
        mac = hmac.new(self._key, direction, hashlib.sha256)
        mac.update(_COUNTER.pack(counter))
        mac.update(body)
        return mac.digest()

    def _derive_key(self, server_nonce: bytes, client_nonce: bytes) -> None:
        if self._secret is not None:
            msg = _KEY_LABEL + server_nonce + client_nonce
            self._key = hmac.new(self._secret, msg, hashlib.sha256).digest()


class ServerSession(_Session):
    """The accepting end. Its preamble is in `outgoing()` from the start."""

    _send_dir = _SERVER_TO_CLIENT
    _recv_dir = _CLIENT_TO_SERVER

    def __init__(self, secret: bytes | str | None, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        super().__init__(secret, max_frame)
        self._opening_bytes = _HELLO_BYTES + (TAG_BYTES if self._secret is not None else 0)
        self._nonce = os.urandom(NONCE_BYTES)
        flags = FLAG_AUTH if self._secret is not None else 0
        body = MAGIC + bytes([flags]) + self._nonce
        self._out += LENGTH.pack(len(body)) + body

    def _opening(self, frame: bytes) -> None:
        """Verify the client's HELLO."""
        if not frame.startswith(MAGIC):
            raise FrameError("not a rapidkv-rpc/1 client (bad HELLO)")
        if len(frame) != self._opening_bytes:
            if self._secret is not None:
                raise AuthError(f"HELLO of {len(frame)} bytes carries no valid tag")
            raise FrameError(f"HELLO of {len(frame)} bytes, expected {self._opening_bytes}")
        self._derive_key(self._nonce, frame[len(MAGIC) : _HELLO_BYTES])
        self._open(frame)
        self._ready = True


class ClientSession(_Session):
    """The connecting end. After the server's preamble arrived, its HELLO is in
    `outgoing()` and `ready` is True; messages sealed afterwards follow it."""

    _send_dir = _CLIENT_TO_SERVER
    _recv_dir = _SERVER_TO_CLIENT
    _opening_bytes = _PREAMBLE_BYTES

    def _opening(self, frame: bytes) -> None:
        """Check the server's preamble and answer with HELLO."""
        if len(frame) != _PREAMBLE_BYTES or not frame.startswith(MAGIC):
            raise FrameError("not a rapidkv-rpc/1 server (bad preamble)")
        flags = frame[len(MAGIC)]
        if flags & ~FLAG_AUTH:
            raise FrameError(f"unknown preamble flags {flags:#x}")
        if flags & FLAG_AUTH and self._secret is None:
            raise AuthError("the server requires a shared secret and none is configured")
        if not flags & FLAG_AUTH and self._secret is not None:
            raise AuthError("the server does not authenticate; refusing to talk without it")
        client_nonce = os.urandom(NONCE_BYTES)
        self._derive_key(frame[len(MAGIC) + 1 :], client_nonce)
        self._out += self._seal(MAGIC + client_nonce)
        self._ready = True
