"""The receiving side's view of a transfer that several source ranks write.

Theory of operation
-------------------
Pure: notifications in, what the destination rank may act on out. Between
instances of different TP sizes a destination rank may take its KV heads from
several source ranks (`kvt.head_map`: P at TP 2 -> D at TP 1 writes each of D's
blocks half from P's rank 0, half from its rank 1). Every source rank says how
many send to this destination rank (`SendDone.sources`, `LayersLanded.sources`).

- `send_done`: a transfer is over on this rank once a `SendDone` came from
  `sources` distinct source ranks: then one combined `SendDone` comes out, ok
  only if every one was ok (a rank whose send failed fails the whole transfer:
  D recomputes, never keeps a partial KV), `tokens_sent` the least of them,
  the errors joined. With one source the `SendDone` comes out as it came in.
- `landed` / `layers`: the leading layers in place are the least over the
  source ranks, 0 until every source rank said something; with several
  sources, one's ok `SendDone` counts as all of its layers (it sends no
  `LayersLanded` after it). With one source, what its `LayersLanded` said.

Invariants (tests/kvt/test_gather.py, hypothesis over orders and outcomes):
- one combined `SendDone` per transfer, only after every source's, ok iff all;
- a duplicate from the same source rank changes nothing, also after the
  transfer was handed on;
- `layers` never exceeds what some source said, and is monotonic.

Memory: at most `memory` transfers are kept per kind (the oldest forgotten).
"""

from __future__ import annotations

from collections import OrderedDict

from rapidkv.kvt.messages import LayersLanded, SendDone

ALL_LAYERS = 1 << 30  # a source whose SendDone was ok: every layer of it in place


class Gather:
    def __init__(self, memory: int = 4096) -> None:
        self.memory = memory
        self._dones: OrderedDict[str, dict[int, SendDone]] = OrderedDict()
        self._over: OrderedDict[str, None] = OrderedDict()  # handed on (several sources)
        # xfer id -> (sources, source rank -> leading layers in place)
        self._landed: OrderedDict[str, tuple[int, dict[int, int]]] = OrderedDict()

    def send_done(self, msg: SendDone) -> SendDone | None:
        """Take a source rank's `SendDone`; the transfer's combined one once
        every source rank's came, else None."""
        if msg.sources <= 1:
            return msg
        if msg.xfer_id in self._over:
            return None  # a duplicate after the transfer was handed on
        if msg.ok:
            self._note(msg.xfer_id, msg.sources, msg.rank, ALL_LAYERS)
        parts = self._dones.setdefault(msg.xfer_id, {})
        parts.setdefault(msg.rank, msg)
        self._trim(self._dones)
        if len(parts) < msg.sources:
            return None
        del self._dones[msg.xfer_id]
        self._over[msg.xfer_id] = None
        self._trim(self._over)
        ranks = sorted(parts)
        errors = [f"rank {r}: {parts[r].error}" for r in ranks if not parts[r].ok]
        return SendDone(
            msg.xfer_id,
            ranks[0],
            min(p.tokens_sent for p in parts.values()),
            not errors,
            "; ".join(errors),
            msg.dst_rank,
            msg.sources,
        )

    def landed(self, msg: LayersLanded) -> None:
        """Take a source rank's `LayersLanded`."""
        self._note(msg.xfer_id, msg.sources, msg.rank, msg.layers)

    def layers(self, xfer_id: str) -> int:
        """Leading layers of `xfer_id` in place from every source rank."""
        known = self._landed.get(xfer_id)
        if known is None:
            return 0
        sources, ranks = known
        if len(ranks) < sources:
            return 0
        return min(ranks.values())

    def forget(self, xfer_id: str) -> None:
        self._landed.pop(xfer_id, None)
        self._dones.pop(xfer_id, None)

    def _note(self, xfer_id: str, sources: int, rank: int, layers: int) -> None:
        known = self._landed.get(xfer_id)
        if known is None:
            known = self._landed[xfer_id] = (sources, {})
            self._trim(self._landed)
        ranks = known[1]
        ranks[rank] = max(ranks.get(rank, 0), layers)

    def _trim(self, d: OrderedDict) -> None:
        while len(d) > self.memory:
            d.popitem(last=False)
