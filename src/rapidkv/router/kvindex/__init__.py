"""kvindex: an index of every instance's prefix cache, fed by vLLM's KV events.

Each vLLM instance runs with ``--kv-events-config`` (ZMQ publisher) and tells
which blocks it stored and removed; the index keeps, per instance, the blocks
it holds under a hash of the index's own, and answers for a prompt the number
of leading blocks each instance holds. Imports no vLLM.

Pure cores (no I/O):
- `wire`: vLLM's frames and msgpack payloads, decoded by structs of our own.
- `hashing`: the own chained block hash over token ids.
- `holdings`: the blocks one instance holds (events in, own hashes out).
- `sequencer`: one publisher's seqs: order, gaps, replays, restarts.
- `index`: `KVIndex`, the members, their events in, `Action`s out, the queries.
- `actions`: `RequestReplay`, `Reset`.

Shells (asyncio + pyzmq):
- `subscriber`: `Member`, `MemberSubscriber` (one member's SUB, monitor, DEALER).
- `service`: `KVIndexService` (the core and a subscriber per member).

The wire format and when vLLM emits what: docs/vllm-connector-contract.md,
"KV events".
"""

from rapidkv.router.kvindex.actions import Action, RequestReplay, Reset
from rapidkv.router.kvindex.hashing import ROOT, block_hash, prompt_hashes
from rapidkv.router.kvindex.index import KVIndex
from rapidkv.router.kvindex.service import KVIndexService
from rapidkv.router.kvindex.subscriber import Member, MemberSubscriber
from rapidkv.router.kvindex.wire import WireError, decode_batch

__all__ = [
    "ROOT",
    "Action",
    "KVIndex",
    "KVIndexService",
    "Member",
    "MemberSubscriber",
    "RequestReplay",
    "Reset",
    "WireError",
    "block_hash",
    "decode_batch",
    "prompt_hashes",
]
