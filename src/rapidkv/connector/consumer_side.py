"""D's role on the scheduler side (`ConsumerSide`): requests whose KV another
instance (P) computes and writes into this one's blocks.

A request with `kv_transfer_params.rapidkv.role == "decode"` asks vLLM to load
`prompt_len - 1 - local hits` tokens asynchronously; once vLLM allocated its
blocks (`after_alloc`) D sends P a Handshake (once per P address while it
succeeds) and the TransferKV, from the RPC client's threads; the next step's
metadata tells the workers which transfer the request waits for. A refused or
failed transfer becomes a load failure (vLLM's "recompute" policy then
prefills locally).

A *split prefill* (`split_tokens` in the request's params: P was sent only that
block-aligned head of the prompt) is loaded synchronously instead: vLLM
schedules the tail at once and the workers wait for each layer of the head in
`wait_for_layer_load`; the TransferKV's answer reaches them over the bypass
channel (`recv_over`), so a refused or failed head stops their wait (its blocks
are then reported invalid, and recomputed).

A *migration destination* (`migrate_from` in the params: the `xfer_id` of a
request another instance is running, at `prefill_control`) loads the same way:
its prompt is the source's prompt and every token generated so far, and its
TransferKV is a migration (`migration`, `source_xfer_id`). Its local prefix
hits (an earlier pre-copy's blocks, say) are never written (`first_block`).
NOT_FOUND and GONE to a migration are not retried: the source runs no such
request now, and D recomputes.

The write fence: D gives up blocks P may still write into (reports the request
failed, or ends a split load as failed) only once P said no more writes of
their transfer can land: any TransferKV answer, or an Abort confirmed by P
(`abort_p`), or `fence_timeout_s` after asking.

Locking: `_consumed` and `_handshakes` change under the shared lock; a
`Consumed`'s `state` changes only on the engine thread, which reads `_consumed`
without the lock. The RPC client's callbacks and retry timers take the lock for
everything they touch.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from rapidkv.connector.bypass import BypassMsg
from rapidkv.connector.shared_state import SharedState
from rapidkv.control.client import RpcClient
from rapidkv.control.codes import Code
from rapidkv.control.messages import (
    MAX_ID,
    Abort,
    AbortReason,
    Handshake,
    HandshakeReply,
    TransferKV,
    prompt_hash,
)

log = logging.getLogger(__name__)


@dataclass
class Consumed:
    """D-side state of one request."""

    xfer_id: str
    req_id: str
    prefill_control: str | None
    mode: str | None
    split: int = 0  # split prefill: P computes this head of the prompt (0: all of it)
    local_hits: int = 0
    migrate_from: str | None = None  # a migration: the source request's xfer_id
    state: str = "new"  # new -> loading -> done | local; new -> split (loaded in one step)
    loading_since: float = 0.0  # time.monotonic() it began waiting for its KV (loading)


class ConsumerSide:
    """D's requests and D's half of the control protocol (it is P's client)."""

    def __init__(self, shared: SharedState) -> None:
        self._shared = shared
        # the shared state's own objects, never reassigned
        self._config = shared.config
        self._counters = shared.counters
        self._lock = shared.lock
        self._client = RpcClient(secret=shared.config.shared_secret())
        self._consumed: dict[str, Consumed] = {}  # req_id ->
        # P's control address -> the future of its HandshakeReply to us
        self._handshakes: dict[str, concurrent.futures.Future] = {}

    # -- request lifecycle (engine thread) ---------------------------------------

    def admit(self, request: Any, xfer_id: str, params: dict[str, Any]) -> None:
        """A decode request was admitted (caller holds the lock)."""
        split = params.get("split_tokens", 0)
        if not isinstance(split, int) or isinstance(split, bool) or split < 0:
            log.warning("rapidkv: xfer %s: bad split_tokens %r ignored", xfer_id, split)
            split = 0
        control = params.get("prefill_control")
        migrate_from = params.get("migrate_from")
        if migrate_from is not None and not (
            isinstance(migrate_from, str) and 0 < len(migrate_from) <= MAX_ID
        ):
            log.warning(
                "rapidkv: xfer %s: bad migrate_from %r: computed here", xfer_id, migrate_from
            )
            migrate_from, control = None, None
        if migrate_from is not None and split:
            log.warning("rapidkv: xfer %s: a migration is no split prefill: split ignored", xfer_id)
            split = 0
        self._consumed[request.request_id] = Consumed(
            xfer_id,
            request.request_id,
            control,
            params.get("transfer_kv_mode"),
            split,
            migrate_from=migrate_from,
        )
        self._shared.timeline.event(xfer_id, "d_admitted")

    def matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        """D: tokens to load from P. Side-effect free apart from remembering the
        local hits of the latest query (overwritten by every call)."""
        c = self._consumed.get(request.request_id)
        if c is None or c.state != "new" or not c.prefill_control:
            return 0, False
        c.local_hits = num_computed
        if c.split:
            # a block-aligned head that leaves D at least one token to compute,
            # loaded synchronously: D computes the tail as the head's layers land
            if c.split % self._shared.block_size or c.split > request.num_prompt_tokens - 1:
                return 0, False  # D computes it all (P is told nothing is loaded)
            return max(c.split - num_computed, 0), False
        n = request.num_prompt_tokens - 1 - num_computed
        return (n, True) if n > 0 else (0, False)

    def after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        """vLLM allocated the request's blocks: ask P for the KV, or tell P
        nothing is loaded."""
        c = self._consumed.get(request.request_id)
        if c is None or c.state != "new":
            return
        if num_external == 0:
            c.state = "local"
            if c.prefill_control:  # nothing to load: P may free at once
                self.abort_p(c, AbortReason.NOTHING_TO_LOAD)
            return
        c.state = "split" if c.split else "loading"
        c.loading_since = time.monotonic()
        block_size = self._shared.block_size
        num_tokens = c.split or request.num_prompt_tokens - 1
        nblocks = -(-num_tokens // block_size)
        block_ids = list(blocks.get_block_ids()[0][:nblocks])
        first_block = c.local_hits // block_size
        msg = TransferKV(
            xfer_id=c.xfer_id,
            dst_instance=self._shared.instance_id,
            dst_blocks=block_ids,
            first_block=first_block,
            num_tokens=num_tokens,
            prompt_hash=prompt_hash(
                request.prompt_token_ids[:num_tokens] if c.split else request.prompt_token_ids
            ),
            transfer_kv_mode=c.mode,
            notify_layers=bool(c.split),
            migration=c.migrate_from is not None,
            source_xfer_id=c.migrate_from,
        )
        with self._lock:
            if c.split:
                self._counters["split_prefills"] += 1
                self._shared.pending.split_recv[c.xfer_id] = block_ids[first_block:]
            else:
                self._shared.pending.expect[c.xfer_id] = c.req_id
        with self._lock:
            self._counters["transfer_kv_sent"] += 1
            if c.migrate_from is not None:
                self._counters["migration_transfer_kv_sent"] += 1
            self._shared.timeline.event(c.xfer_id, "d_transfer_kv_sent")
        self._send_transfer_kv(c, msg)

    def request_finished(self, req_id: str) -> None:
        """The request is done; one aborted while waiting for KV is reported
        once P answered the Abort (caller holds the lock)."""
        c = self._consumed.pop(req_id, None)
        if c is not None and c.state == "loading":
            # aborted while waiting for KV: vLLM frees the blocks once we report
            # it in finished_recving, which we do once P answered the Abort
            self.abort_p(c, AbortReason.CLIENT_ABORT, report=True)

    def kv_received(self, req_ids: set[str]) -> None:
        """The workers reported these requests' KV in place, or its load failed
        (vLLM recomputes it; caller holds the lock). A request that was loading
        observes `kv_wait_seconds`: from its KV asked for (vLLM allocated its
        blocks and holds it waiting for remote KV) to now."""
        for req_id in req_ids:
            c = self._consumed.get(req_id)
            if c is not None:
                if c.state == "loading":  # its wait for remote KV is over
                    self._shared.observations.observe(
                        "kv_wait_seconds", time.monotonic() - c.loading_since
                    )
                c.state = "done"
                self._shared.timeline.event(c.xfer_id, "d_kv_received")

    def gauges(self) -> dict[str, float]:
        """Requests waiting for their KV; P instances handshaken with, by the
        state of the handshake (caller holds the lock)."""
        out = {"waiting_for_kv": float(sum(c.state == "loading" for c in self._consumed.values()))}
        states = [_handshake_state(f) for f in self._handshakes.values()]
        for state in ("ready", "connecting", "failed"):
            out[f"peers_prefill_{state}"] = float(states.count(state))
        return out

    def close(self) -> None:
        self._client.close()

    # -- talking to P (RPC client threads) ---------------------------------------

    def _handshake(self, address: str) -> Any:
        """A future of P's HandshakeReply (cached per address while it succeeds;
        caller holds the lock)."""
        fut = self._handshakes.get(address)
        if fut is None or (fut.done() and fut.exception() is not None):
            assert self._shared.spec is not None
            fut = self._client.submit(
                address,
                Handshake(
                    instance_id=self._shared.instance_id,
                    control_address=self._shared.control_address,
                    spec=self._shared.spec,
                    endpoints=self._shared.endpoints,
                    incarnation=self._shared.incarnation,
                ),
                self._config.rpc_timeout_s,
            )
            self._handshakes[address] = fut
        return fut

    def _send_transfer_kv(self, c: Consumed, msg: TransferKV) -> None:
        address = c.prefill_control
        assert address is not None
        instance_id = self._shared.instance_id

        def failed(why: str, answered: bool = True) -> None:
            """`answered`: P said the transfer is over (or never reached P), so
            no write of it can land; else (the RPC failed: P died, froze or was
            cut off) D recomputes, and a split prefill's workers stop waiting,
            only once P confirmed an Abort (`abort_p`: the write fence)."""
            log.warning(
                "rapidkv %s: transfer %s fails (%s); D recomputes", instance_id, c.xfer_id, why
            )
            with self._lock:
                self._counters["recompute_fallbacks"] += 1
                if answered:
                    if c.split:
                        self._split_over(c.xfer_id, ok=False)
                    else:
                        self._shared.pending.recv_failed.append(c.req_id)
                elif c.split:
                    self.abort_p(c, AbortReason.TIMEOUT, split_failed=True)
                else:  # P may still be writing: recompute once it confirmed the abort
                    self.abort_p(c, AbortReason.TIMEOUT, report=True)

        deadline = time.monotonic() + self._config.rpc_timeout_s
        backoff = [0.05]
        handshake: list[Any] = []  # the handshake this transfer went out under

        def send() -> None:
            self._client.submit(address, msg, self._config.rpc_timeout_s).add_done_callback(
                on_reply
            )

        def on_reply(fut: Any) -> None:
            try:
                reply = fut.result()
            except Exception as e:
                failed(f"TransferKV: {type(e).__name__}: {e}", answered=False)
                return
            if reply.code == Code.UNKNOWN_PEER and len(handshake) == 1:
                # P restarted (or forgot us): nothing was written; introduce
                # ourselves again and ask once more
                log.info(
                    "rapidkv %s: %s has no handshake from us (restarted?); handshaking again",
                    instance_id,
                    address,
                )
                with self._lock:
                    self._counters["rehandshakes"] += 1
                    if self._handshakes.get(address) is handshake[0]:
                        del self._handshakes[address]
                    again = self._handshake(address)
                handshake.append(again)
                again.add_done_callback(on_handshake)
                return
            # a split prefill's tail is computing now, waiting for the head: no
            # retries; a migration's source never parks it: NOT_FOUND is final
            retry = reply.code in (Code.NOT_FOUND, Code.BUSY) and not c.split
            if c.migrate_from is not None and reply.code == Code.NOT_FOUND:
                retry = False
            if reply.code == Code.OK:
                with self._lock:
                    self._counters["transfer_kv_ok"] += 1
                    if c.split:
                        self._split_over(c.xfer_id, ok=True)
            elif retry and time.monotonic() + backoff[0] < deadline:
                # NOT_FOUND: P has not seen the request within its park TTL;
                # BUSY: too many of our transfers outstanding there. Ask again later.
                with self._lock:
                    self._counters[f"transfer_kv_retries_{reply.code.name.lower()}"] += 1
                _later(backoff[0], send)
                backoff[0] = min(backoff[0] * 2, 1.0)
            elif reply.code != Code.OK:
                failed(f"TransferKV answered {reply.code.name}: {reply.message}")

        def on_handshake(fut: Any) -> None:
            try:
                reply = fut.result()
            except Exception as e:
                failed(f"handshake with {address}: {type(e).__name__}: {e}")
                return
            if not isinstance(reply, HandshakeReply) or reply.code != Code.OK:
                failed(f"handshake refused: {getattr(reply, 'reasons', reply)}")
                return
            send()

        with self._lock:
            handshake.append(self._handshake(address))
        handshake[0].add_done_callback(on_handshake)

    def _split_over(self, xfer_id: str, ok: bool) -> None:
        """P answered a split prefill's TransferKV (or it failed): tell the
        workers waiting for its layers (caller holds the lock)."""
        if self._shared.bypass is not None:
            self._shared.bypass.send(BypassMsg(kind="recv_over", xfer_id=xfer_id, ok=ok))

    def abort_p(
        self,
        c: Consumed,
        reason: AbortReason,
        report: bool = False,
        split_failed: bool = False,
    ) -> None:
        """Send P an Abort of `c`'s transfer; once P confirmed that no more of
        its writes can land: report the request failed (`report`: vLLM then
        frees or recomputes its blocks), end its split load as failed
        (`split_failed`).

        The fence: only an answer OK / GONE / NOT_FOUND confirms (`AbortReply`),
        or a refused connection (no process listens at P's control address any
        more). Anything else (BUSY, an error, no answer: P frozen or cut off) is
        asked again with backoff while the blocks stay held, for up to
        `fence_timeout_s`; then the blocks are given up with an error logged."""
        deadline = time.monotonic() + self._config.fence_timeout_s
        backoff = [0.1]

        def over() -> None:
            with self._lock:
                if report:
                    self._shared.pending.recv_failed.append(c.req_id)
                if split_failed:
                    self._split_over(c.xfer_id, ok=False)

        def send() -> None:
            assert c.prefill_control is not None
            abort = Abort(xfer_id=c.xfer_id, reason=reason)
            self._client.submit(
                c.prefill_control, abort, self._config.rpc_timeout_s
            ).add_done_callback(answered)

        def answered(fut: Any) -> None:
            try:
                reply = fut.result()
                confirmed = reply.code in (Code.OK, Code.GONE, Code.NOT_FOUND)
                why = f"{reply.code.name}: {reply.message}"
            except ConnectionRefusedError:
                confirmed, why = True, "refused"
            except Exception as e:
                confirmed, why = False, f"{type(e).__name__}: {e}"
            if confirmed or not (report or split_failed):
                over()
                return
            with self._lock:
                self._counters["abort_retries"] += 1
            now = time.monotonic()
            if now >= deadline:
                log.error(
                    "rapidkv %s: %s never confirmed the abort of %s (%s) within %gs; "
                    "its blocks are given up and a late write of it could land in them",
                    self._shared.instance_id,
                    c.prefill_control,
                    c.xfer_id,
                    why,
                    self._config.fence_timeout_s,
                )
                with self._lock:
                    self._counters["abort_fence_gave_up"] += 1
                over()
                return
            log.warning(
                "rapidkv %s: abort of %s unconfirmed (%s); holding its blocks, asking again",
                self._shared.instance_id,
                c.xfer_id,
                why,
            )
            _later(min(backoff[0], deadline - now), send)  # the last try at the deadline
            backoff[0] = min(backoff[0] * 2, 2.0)

        if not c.prefill_control:
            over()
            return
        send()


def _later(delay_s: float, fn: Any) -> None:
    """Run `fn` on a daemon timer thread after `delay_s` (a retry's backoff)."""
    timer = threading.Timer(delay_s, fn)
    timer.daemon = True
    timer.start()


def _handshake_state(fut: concurrent.futures.Future) -> str:
    """`ready` (P accepted our Handshake), `connecting` (no answer yet) or
    `failed` (refused, or the RPC failed)."""
    if not fut.done():
        return "connecting"
    if fut.cancelled() or fut.exception() is not None:
        return "failed"
    reply = fut.result()
    return "ready" if isinstance(reply, HandshakeReply) and reply.code == Code.OK else "failed"
