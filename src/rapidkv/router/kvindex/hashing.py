"""The index's own block hash: a chain over token ids, the same in every process.

vLLM's block hashes cannot key a fleet-wide index: with a non-cryptographic
hash, or `PYTHONHASHSEED` set differently, the same tokens hash differently on
two instances, and they change with vLLM's version and extra keys. The index
therefore keys blocks by a hash of its own, computed from token ids alone:

    h(block 0) = blake2b-128(ROOT      || tokens of block 0)
    h(block i) = blake2b-128(h(i - 1)  || tokens of block i)

where ``tokens`` are the block's token ids as little-endian int32 and ``ROOT``
is ``blake2b-128(b"rapidkv.kvindex.v1")``. Only full blocks of the index's
block size are hashed; a trailing partial block has no hash.

Invariants: `block_hash` is a pure function of (parent, tokens); equal prompts
give equal chains in any process; `prompt_hashes(t, n)[i]` depends exactly on
``t[: (i + 1) * n]``.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b

DIGEST_BYTES = 16
ROOT = blake2b(b"rapidkv.kvindex.v1", digest_size=DIGEST_BYTES).digest()
"""The parent of every prompt's first block."""

_INT32 = "i"
if array(_INT32).itemsize != 4:  # C int is 32 bits on every platform vLLM runs on
    raise ImportError("rapidkv.router.kvindex.hashing needs a 32-bit C int")


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The hash of a block holding `tokens` after the block hashed `parent`.
    ValueError if a token does not fit an int32."""
    try:
        packed = array(_INT32, tokens)
    except OverflowError:
        raise ValueError("a token id does not fit in int32") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return blake2b(parent + packed.tobytes(), digest_size=DIGEST_BYTES).digest()


def prompt_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chain of hashes of the full blocks of `token_ids`, first block first."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, not {block_size}")
    out: list[bytes] = []
    parent = ROOT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        out.append(parent)
    return out
