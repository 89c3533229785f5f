"""`KvtWorker`: the threaded shell around kvt's pure cores for one worker.

Theory of operation
-------------------
One `KvtWorker` per worker process. It owns a `Transport` and a thread (the
*owner thread*) that makes every transport call; other threads never touch the
transport. The pure cores (`StepCoordinator`, `CompletionTracker`) sit behind
one lock and are driven from whichever thread has the event:

- the engine's main thread: `begin_step`, `layer_done`, `freeze_step`;
- any thread (the bypass channel, the scheduler's RPC thread): `attach_substep`,
  `send_full`, `fail`.

Each call turns the coordinator's `Send` actions into jobs on a queue; the owner
thread builds the byte ranges from the layouts, posts one transport write per
(action, peer), polls writes until DONE/ERROR (giving up after
`write_timeout_s`), settles them in the tracker and, for each transfer that
settles, sends the `SendDone` to the destination as a transport notification and
hands it to `on_send_done`. It also collects SendDones arriving from peers (the
receiving side: `take_received`, kept by its `kvt.inbox.Inbox`).

Rules
-----
- The main thread never waits on the network: its calls take the lock, run a
  pure transition and enqueue.
- A transfer's SendDone goes out only after every write of it was confirmed or
  failed, so when it arrives no more writes of that transfer can land.
- Nothing here raises into the engine for a network failure: failures become
  error SendDones. Caller bugs (illegal events, invalid tasks) raise.

Scheduling
----------
The owner thread shares its core with the engine's forward. With `boost=True`
(default) it runs first in the fair class (nice -20, `kvt.priority`), so it
gets the core at its wake-up instead of after the forward's slice (~3 ms
under EEVDF): layer_done -> send p50 ~0.2 ms. It is never real-time: a
real-time thread that busy-waited once (a library spinning on a lock) would
take its core for about a second. It never spins: it sleeps on its queue or
between polls. Without the privilege (CAP_SYS_NICE) it logs a warning once
and runs at normal priority. The policy carries SCHED_RESET_ON_FORK, so a
thread that a library starts from the owner thread (UCX, NIXL, OpenMP, the
TCP transport) runs at nice 0.

With `hugepages=True` (default) the registered KV memory is backed by huge
pages first (`kvt.memory`): transfers on CPU run ~1.7x faster.

With `bandwidth_cap_bps` set, writes are confirmed as if they crossed one link
of that bandwidth in posting order (a write of n bytes is confirmed no earlier
than n / cap after the link freed up): a benchmark aid that gives transfers the
wire time they have on real clusters. The bytes themselves land at memory speed.

With `faults` (`kvt.faults.SendFaults`, a testing aid) some transfers fail at
one of their layers and every transfer's sends are held back a while, decided
per `xfer_id`; a failed one settles as after a write that failed.

Peers of another TP size: a peer whose layout differs from this worker's (its
layers describe their KV heads, `kvt.layout.Heads`) is sent the pieces of each
block that `kvt.head_map` maps from this rank to that one; `add_peer` refuses
with the reason (`MappingError`) where no mapping exists. One transfer may go
to several peers (this rank holds heads that several destination ranks need):
the tracker settles each (transfer, peer) on its own, and each SendDone says
which destination rank it went to and how many source ranks send to that one
(`kvt.head_map.route`). A receiving worker gathers the SendDones and
LayersLanded of every source rank before it hands a transfer on (`kvt.gather`).

KV written by a device: with `ready` (`kvt.device_ready`: a CUDA event per
layer) `layer_done(i)` records layer i's event on the caller's current stream
(the forward's), and the owner thread waits for it before it posts any write
of a layer up to i made ready by a step event (layer_done, attach): the bytes
leave only once the device has written them. Full sends do not wait (their KV
was written by forwards that finished).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from rapidkv.kvt.completions import CompletionTracker, Settled, Tracked
from rapidkv.kvt.coordinator import Attach, Send, StepCoordinator
from rapidkv.kvt.device_ready import LayerReady
from rapidkv.kvt.faults import INJECTED, FaultPlans, SendFaults
from rapidkv.kvt.head_map import Piece, peer_pieces, piece_descs, route
from rapidkv.kvt.inbox import Inbox
from rapidkv.kvt.layout import Layout, layer_descs
from rapidkv.kvt.memory import advise_hugepages
from rapidkv.kvt.messages import LayersLanded, SendDone, encode_notif
from rapidkv.kvt.priority import boost_current_thread
from rapidkv.kvt.task import Task
from rapidkv.kvt.transport.base import Transport, XferState

log = logging.getLogger(__name__)


@dataclass
class KvtStats:
    """Counters of one worker; all monotonic."""

    writes_posted: int = 0
    writes_failed: int = 0
    bytes_posted: int = 0
    transfers_ok: int = 0
    transfers_failed: int = 0
    substeps_attached: int = 0
    substeps_pending: int = 0
    substeps_rejected: int = 0
    received_ok: int = 0
    received_failed: int = 0
    injected_failures: int = 0  # transfers failed by `faults`
    late_tasks_dropped: int = 0  # tasks of transfers already settled here (`_add_all`)


@dataclass
class _Job:
    pieces: list[tuple[Tracked, int, int]]  # (task, first layer, stop layer)
    kind: str  # what released these layers: "layer", "attach" or "full"
    t_event: float  # perf_counter() of that event


@dataclass
class _Write:
    handle: int
    peer: str
    deadline: float
    ready_at: float = 0.0  # with a bandwidth cap: not confirmed before this
    pieces: list[tuple[Tracked, int, int]] = field(default_factory=list)  # (task, first, stop)
    # its completion may settle a transfer (it carries some task's last layer) or
    # let a destination go on computing (a task that notifies layers)
    settles: bool = True


PEER_MEMORY = 64  # removed peers whose rank a sending worker remembers

# (kind, t_event, t_post, nbytes): a write was handed to the transport at t_post
PostedHook = Callable[[str, float, float, int], None]


def write_descs(
    mine: Layout,
    theirs: Layout,
    pieces: tuple[tuple[Piece, ...], ...] | None,
    group: Sequence[tuple[Tracked, int, int]],
) -> np.ndarray:
    """The descriptors of one write to a peer whose layout is `theirs`: every
    layer `first..stop` of each task in `group`, whole blocks (`pieces` None:
    the same TP) or the pieces of each block that map to that peer."""
    a, b = mine.layers, theirs.layers
    if pieces is None:
        parts = [
            layer_descs(a[i], b[i], t.task.src_blocks, t.task.dst_blocks)
            for t, first, stop in group
            for i in range(first, stop)
        ]
    else:
        parts = [
            piece_descs(a[i], b[i], pieces[i], t.task.src_blocks, t.task.dst_blocks)
            for t, first, stop in group
            for i in range(first, stop)
        ]
    return np.concatenate(parts)


class KvtWorker:
    # While a write that may settle a transfer (it carries a task's last layer)
    # is in flight the owner polls the writes, first every MIN_POLL_S, the
    # interval doubling up to MAX_POLL_S while nothing settles, and never more
    # often than POLL_DUTY allows (a poll round of w seconds is followed by at
    # least w / POLL_DUTY of sleep: the owner preempts the engine, so it must not
    # take its core). Writes of earlier layers alone are polled every
    # LAZY_POLL_S: the data moves when a write is posted (NIXL/UCX on one host
    # copies in `post_write`; TCP on its own threads), so polling them early
    # settles nothing sooner and only interrupts the forward that computes the
    # next layers. Otherwise it collects incoming notifications (and progresses
    # the transport, which a write into this worker may need to complete) every
    # AWAIT_POLL_S while a transfer into this worker is awaited (`set_awaiting`),
    # and only every IDLE_POLL_S when none is: every wake-up of the owner preempts
    # the forward on the shared core and takes the GIL from it. A destination that
    # needs a SendDone the moment it can act on it asks for them (`poll_received`)
    # instead of making the owner poll faster.
    MIN_POLL_S = 0.0002
    MAX_POLL_S = 0.001
    POLL_DUTY = 0.2
    LAZY_POLL_S = 0.02
    AWAIT_POLL_S = 0.002
    IDLE_POLL_S = 0.05

    def __init__(
        self,
        transport: Transport,
        layout: Layout,
        *,
        rank: int,
        block_size: int,
        on_send_done: Callable[[SendDone], None] | None = None,
        write_timeout_s: float = 10.0,
        on_posted: PostedHook | None = None,
        on_peer_failed: Callable[[str, str], None] | None = None,
        boost: bool = True,
        hugepages: bool = True,
        bandwidth_cap_bps: float = 0.0,
        faults: SendFaults | None = None,
        ready: LayerReady | None = None,
    ) -> None:
        self.transport = transport
        self.ready = ready
        self.layout = layout
        self.rank = rank
        self.write_timeout_s = write_timeout_s
        self.on_send_done = on_send_done
        self.on_posted = on_posted
        # (peer, why), on the owner thread, when the transport fails a write to
        # it (posting refused, ERROR, or pending past write_timeout_s)
        self.on_peer_failed = on_peer_failed
        self.boost = boost
        self.bandwidth_cap_bps = bandwidth_cap_bps
        self._link_free_at = 0.0
        self._fault_plans = FaultPlans(faults, len(layout.layers)) if faults else None
        self._deferred: list[tuple[float, _Job]] = []  # (post at, job), in arrival order
        self._awaiting = False
        self._next_notif_poll = 0.0  # owner thread only
        self.stats = KvtStats()
        self._lock = threading.Lock()
        self._coord: StepCoordinator[Tracked] = StepCoordinator(len(layout.layers))
        self._tracker = CompletionTracker(len(layout.layers), block_size, rank)
        self._jobs: queue.SimpleQueue[_Job | Callable[[], None] | None] = queue.SimpleQueue()
        # peer -> its layout and, where it differs from ours, the pieces per layer
        self._peers: dict[str, tuple[Layout, tuple[tuple[Piece, ...], ...] | None]] = {}
        # peer -> (its rank, source ranks that send to it): kept after remove_peer
        # (the last PEER_MEMORY removed ones), for the SendDones of its
        # transfers that settle later
        self._peer_ranks: dict[str, tuple[int, int]] = {}
        self._writes: dict[int, _Write] = {}
        self._next_write = 0
        self._inbox = Inbox(rank, self.stats)  # receiving: every source rank's notifications
        # sending: (xfer_id, peer) -> layers notified
        self._landed_sent: dict[tuple[str, str], int] = {}
        if hugepages:
            advise_hugepages(layout.regions())
        transport.register_memory(layout.regions())
        self.metadata = transport.local_metadata()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"kvt-owner-{rank}", daemon=True)
        self._thread.start()

    # -- peers ----------------------------------------------------------------

    def add_peer(self, metadata: bytes, layout: Layout, rank: int | None = None) -> str:
        """Connect to a destination worker (rank `rank` of its instance; None:
        the rank its layout's heads name, else this worker's rank); returns its
        peer name for tasks. Raises `ValueError` (`MappingError` for KV heads
        that cannot map) when its layout cannot receive this worker's blocks."""
        if len(layout.layers) != len(self.layout.layers):
            raise ValueError(
                f"peer has {len(layout.layers)} layers, this worker {len(self.layout.layers)}"
            )
        pieces = peer_pieces(self.layout, layout)
        if rank is None:
            heads = layout.layers[0].heads if layout.layers else None
            rank = heads.rank if heads is not None else self.rank
        sources = route(self.layout, self.rank, layout, rank).sources
        name = self._call(lambda: self.transport.add_peer(metadata))
        self._peers[name] = (layout, pieces)
        self._peer_ranks[name] = (rank, sources)
        gone = [p for p in self._peer_ranks if p not in self._peers]
        for p in gone[: max(0, len(gone) - PEER_MEMORY)]:  # the oldest removed ones
            del self._peer_ranks[p]
        return name

    def remove_peer(self, peer: str) -> None:
        """Forget a peer; its transfers settle with errors."""
        self._call(lambda: self._drop_peer(peer))

    # -- step events (engine main thread) ---------------------------------------

    def begin_step(self, step_id: int, tasks: Sequence[Task]) -> None:
        with self._lock:
            tracked = self._add_all(tasks)
            dropped = self._coord.begin_step(step_id, tracked)
            self._discard(dropped)

    def layer_done(self, layer: int) -> None:
        t = time.perf_counter()
        if self.ready is not None:
            self.ready.record(layer)
        with self._lock:
            self._enqueue(self._coord.layer_done(layer), "layer", t)

    def freeze_step(self) -> int:
        """Close the step to substeps; returns the ack (highest substep sent)."""
        with self._lock:
            frozen = self._coord.freeze_step()
            self._discard(frozen.dropped)
            return frozen.ack

    # -- any thread -------------------------------------------------------------

    def attach_substep(self, step_id: int, substep_id: int, tasks: Sequence[Task]) -> Attach:
        t = time.perf_counter()
        with self._lock:
            tracked = self._add_all(tasks)
            result, sends = self._coord.attach_substep(step_id, substep_id, tracked)
            if result is Attach.REJECTED:
                self.stats.substeps_rejected += 1
                self._discard(tracked)
            elif result is Attach.PENDING:
                self.stats.substeps_pending += 1
            else:
                self.stats.substeps_attached += 1
            self._enqueue(sends, "attach", t)
        return result

    def send_full(self, tasks: Sequence[Task]) -> None:
        """Send every layer of tasks whose KV is complete, now."""
        t = time.perf_counter()
        with self._lock:
            tracked = self._add_all(tasks)
            self._enqueue(self._coord.send_full(tracked), "full", t)

    def fail(self, xfer_id: str, reason: str) -> None:
        """Give up on a transfer; it settles with an error once nothing of it is
        in flight (its SendDone then reaches both sides)."""
        self._jobs.put(lambda: self._finish(self._locked(self._tracker.fail, xfer_id, reason)))

    # -- receiving side ---------------------------------------------------------

    def take_received(self) -> list[SendDone]:
        """SendDones that arrived from source workers since the last call
        (`Inbox.take`)."""
        return self._inbox.take()

    def poll_received(self) -> list[SendDone]:
        """Collect the transport's notifications now (on the owner thread, which
        makes every transport call), then `take_received`. For a caller that can
        act on a SendDone only at its own pace (an engine step): one round trip
        per call instead of a faster background poll."""
        self._call(self._poll_notifs)
        return self.take_received()

    def landed(self, xfer_id: str) -> int:
        """Receiving side: leading layers of `xfer_id` the source said are in
        place (`LayersLanded`, collected by the owner's notification polls)."""
        return self._inbox.landed(xfer_id)

    def forget_landed(self, xfer_ids: Sequence[str]) -> None:
        self._inbox.forget(xfer_ids)

    def set_awaiting(self, awaiting: bool) -> None:
        """Say whether a transfer into this worker is awaited: the owner then
        polls the transport every AWAIT_POLL_S instead of every IDLE_POLL_S."""
        was, self._awaiting = self._awaiting, awaiting
        if awaiting and not was:
            self._jobs.put(self._poll_soon)  # the owner may be in a long idle wait

    def _poll_soon(self) -> None:
        self._next_notif_poll = 0.0

    def _notif_poll_s(self) -> float:
        return self.AWAIT_POLL_S if self._awaiting else self.IDLE_POLL_S

    def _wait_s(self, poll_s: float) -> float:
        """How long the owner may sleep before it polls again (owner thread)."""
        if any(w.settles for w in self._writes.values()):
            wait = poll_s
        elif self._writes:
            wait = min(self.LAZY_POLL_S, self._notif_poll_s())
        else:
            wait = self._notif_poll_s()
        if self._deferred:
            wait = min(wait, max(0.0, min(t for t, _ in self._deferred) - time.perf_counter()))
        return wait

    def wait_received(self, timeout: float) -> bool:
        """Block until a SendDone is available or `timeout` passes."""
        return self._inbox.wait(timeout)

    # -- lifecycle --------------------------------------------------------------

    def busy(self) -> bool:
        with self._lock:
            return bool(self._tracker.live_transfers())

    def wait_settled(self, xfer_ids: Sequence[str], timeout: float) -> bool:
        """Block until none of `xfer_ids` has a write that may still land (each
        settled or was never registered); False if `timeout` passed first."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if not any(self._tracker.is_live(x) for x in xfer_ids):
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0005)

    def close(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._jobs.put(None)
        self._thread.join(timeout=5)
        self.transport.close()

    # -- internals (caller holds the lock) ---------------------------------------

    def _enqueue(self, sends: list[Send[Tracked]], kind: str, t_event: float) -> None:
        for send in sends:
            self._jobs.put(_Job([(t, send.first, send.stop) for t in send.tasks], kind, t_event))

    def _add_all(self, tasks: Sequence[Task]) -> list[Tracked]:
        """Register every task or none (an invalid one raises, nothing stays).
        A task of a transfer that already settled here is dropped, counted in
        `late_tasks_dropped`: its SendDone is out, and whoever planned the task
        learns the outcome from it (a write failed while a prompt's next chunk
        was being planned; a resend crossed an abort). Raising instead would
        take the engine step down with it."""
        added: list[Tracked] = []
        try:
            for task in tasks:
                ok = self._tracker.settled_ok(task.xfer_id, task.peer)
                if ok is not None:
                    self.stats.late_tasks_dropped += 1
                    (log.error if ok else log.info)(
                        "kvt rank %d: task of %s dropped: the transfer already settled %s",
                        self.rank,
                        task.xfer_id,
                        "ok" if ok else "with an error",
                    )
                    continue
                added.append(self._tracker.add_task(task))
        except Exception:
            self._tracker.discard(added)
            raise
        return added

    def _discard(self, tasks: Sequence[Tracked]) -> None:
        if tasks:
            dones = self._tracker.discard(tasks)
            if dones:
                self._jobs.put(lambda: self._finish(dones))

    def _locked(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self._lock:
            return fn(*args)

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the owner thread and return its result."""
        box: dict[str, Any] = {}
        done = threading.Event()

        def job() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # handed back to the caller
                box["error"] = e
            done.set()

        self._jobs.put(job)
        if not done.wait(30):
            raise TimeoutError("kvt owner thread did not answer in 30 s")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    # -- owner thread -----------------------------------------------------------

    def _raise_priority(self) -> None:
        why = boost_current_thread()
        if why is not None:
            log.warning(
                "kvt rank %d: owner thread stays at normal priority (%s); layer sends may "
                "wait for the forward's time slice",
                self.rank,
                why,
            )

    def _run(self) -> None:
        if self.boost:
            self._raise_priority()
        poll_s = self.MIN_POLL_S
        while True:
            try:
                item = self._jobs.get(timeout=self._wait_s(poll_s))
                poll_s = self.MIN_POLL_S
                while True:
                    if item is None:
                        return
                    self._handle(item)
                    item = self._jobs.get_nowait()
            except queue.Empty:
                pass
            except Exception:
                log.exception("kvt owner thread: job failed")
            try:
                t0 = time.perf_counter()
                if self._deferred:
                    self._post_deferred()
                settled = self._poll_writes()
                floor = (time.perf_counter() - t0) / self.POLL_DUTY
                poll_s = max(
                    floor, self.MIN_POLL_S if settled else min(poll_s * 2, self.MAX_POLL_S)
                )
                now = time.perf_counter()
                if now >= self._next_notif_poll:
                    self._poll_notifs()
                    self._next_notif_poll = now + self._notif_poll_s()
            except Exception:
                log.exception("kvt owner thread: polling failed")

    def _handle(self, item: _Job | Callable[[], None]) -> None:
        if isinstance(item, _Job):
            self._post(item)
        else:
            item()

    def _post(self, job: _Job) -> None:
        if self._deferred:  # held sends that are due go first: a transfer's stay in order
            self._post_deferred()
        self._post_now(job)

    def _post_deferred(self) -> None:
        now = time.perf_counter()
        due = [job for t, job in self._deferred if t <= now]
        if due:
            self._deferred = [(t, job) for t, job in self._deferred if t > now]
            for job in due:
                self._post_now(job)

    def _faulted(
        self, job: _Job, pieces: list[tuple[Tracked, int, int]]
    ) -> list[tuple[Tracked, int, int]]:
        """`pieces` less those `faults` hold back (deferred) or fail (settled
        with INJECTED: the write that carries the failing layer is never posted)."""
        assert self._fault_plans is not None
        out, failing, held = self._fault_plans.sort(pieces, time.perf_counter())
        self._deferred.extend((t, _Job([piece], job.kind, job.t_event)) for t, piece in held)
        if failing:
            xfers = {t.task.xfer_id for t, _, _ in failing}
            self.stats.injected_failures += len(xfers)
            log.info("kvt rank %d: %s: %s", self.rank, INJECTED, sorted(xfers))
            self._fail_pieces(failing, INJECTED)
            out = [p for p in out if p[0].task.xfer_id not in xfers]
        return out

    def _post_now(self, job: _Job) -> None:
        with self._lock:
            pieces = [p for p in job.pieces if self._tracker.live(p[0])]
        if self._fault_plans is not None:
            pieces = self._faulted(job, pieces)
        by_peer: dict[str, list[tuple[Tracked, int, int]]] = {}
        for piece in pieces:
            by_peer.setdefault(piece[0].task.peer, []).append(piece)
        if self.ready is not None and job.kind != "full" and pieces:
            self.ready.wait(max(stop for _, _, stop in pieces) - 1)
        for peer, group in by_peer.items():
            known = self._peers.get(peer)
            if known is None:
                self._fail_pieces(group, f"unknown peer {peer}")
                self._peer_failed(peer, "unknown peer")
                continue
            descs = write_descs(self.layout, *known, group)
            write_id = self._next_write
            self._next_write += 1
            t_post = time.perf_counter()
            try:
                handle = self.transport.post_write(peer, descs)
            except Exception as e:
                log.warning("kvt rank %d: post to %s failed: %s", self.rank, peer, e)
                self._fail_pieces(group, f"post failed: {e}")
                self._peer_failed(peer, f"post failed: {e}")
                continue
            nbytes = int(descs[:, 2].sum())
            self.stats.writes_posted += 1
            self.stats.bytes_posted += nbytes
            write = _Write(handle, peer, t_post + self.write_timeout_s, t_post)
            if self.bandwidth_cap_bps:  # one link: writes queue behind each other
                write.ready_at = max(self._link_free_at, t_post) + nbytes / self.bandwidth_cap_bps
                self._link_free_at = write.ready_at
            write.pieces = group
            write.settles = any(
                stop == len(self.layout.layers) or t.task.notify_layers for t, _, stop in group
            )
            self._writes[write_id] = write
            with self._lock:
                self._tracker.posted(write_id, write.pieces)
            if self.on_posted is not None:
                self.on_posted(job.kind, job.t_event, t_post, nbytes)

    def _peer_failed(self, peer: str, why: str) -> None:
        if self.on_peer_failed is not None:
            self.on_peer_failed(peer, why)

    def _fail_pieces(self, group: list[tuple[Tracked, int, int]], reason: str) -> None:
        with self._lock:
            dones = [
                d
                for xfer_id in {t.task.xfer_id for t, _, _ in group}
                for d in self._tracker.fail(xfer_id, reason)
            ]
        self._finish(dones)

    def _poll_writes(self) -> bool:
        """Settle the writes that finished; True if any did."""
        now = time.perf_counter()
        settled_any = False
        for write_id, write in list(self._writes.items()):
            state = self.transport.poll(write.handle)
            if state is XferState.PENDING and now < write.deadline:
                continue
            if state is XferState.DONE and now < write.ready_at:
                continue  # the emulated link has not carried it yet
            del self._writes[write_id]
            settled_any = True
            ok = state is XferState.DONE
            error = "" if ok else ("write failed" if state is XferState.ERROR else "timeout")
            if not ok:
                self.stats.writes_failed += 1
                log.warning("kvt rank %d: write to %s %s", self.rank, write.peer, error)
                self._peer_failed(write.peer, f"write {error}")
            self.transport.release(write.handle)
            with self._lock:
                dones = self._tracker.settled(write_id, ok, error)
                landed = self._layers_landed(write)
            for peer, msg in landed:
                self._notify(peer, msg)
            self._finish(dones)
        return settled_any

    def _layers_landed(self, write: _Write) -> list[tuple[str, LayersLanded]]:
        """Progress notifications a settled write makes due (lock held): for each
        layer-notifying transfer it carried that is still open, the leading
        layers in place if more than last said (a settled one gets its SendDone)."""
        out = []
        peer = write.peer
        for xfer_id in {t.task.xfer_id for t, _, _ in write.pieces if t.task.notify_layers}:
            key = (xfer_id, peer)
            layers = self._tracker.leading_layers(xfer_id, peer)
            if not layers:  # not live there (a settled one gets its SendDone), or none yet
                continue
            if layers > self._landed_sent.get(key, 0):
                self._landed_sent[key] = layers
                sources = self._peer_ranks.get(peer, (0, 1))[1]
                out.append((peer, LayersLanded(xfer_id, self.rank, layers, sources)))
        return out

    def _notify(self, peer: str, msg: SendDone | LayersLanded) -> None:
        try:
            self.transport.send_notif(peer, encode_notif(msg))
        except Exception as e:
            log.warning("kvt rank %d: %s to %s lost: %s", self.rank, msg, peer, e)

    def _finish(self, settled: list[Settled]) -> None:
        for item in settled:
            dst_rank, sources = self._peer_ranks.get(item.peer, (self.rank, 1))
            done = msgspec.structs.replace(item.done, dst_rank=dst_rank, sources=sources)
            if done.ok:
                self.stats.transfers_ok += 1
            else:
                self.stats.transfers_failed += 1
            log.debug("kvt rank %d: %s", self.rank, done)
            self._landed_sent.pop((done.xfer_id, item.peer), None)
            if self._fault_plans is not None:
                self._fault_plans.forget(done.xfer_id)
            self._notify(item.peer, done)
            if self.on_send_done is not None:
                self.on_send_done(done)

    def _poll_notifs(self) -> None:
        notifs = self.transport.take_notifs()
        if notifs:
            self._inbox.collect(notifs)

    def _drop_peer(self, peer: str) -> None:
        self._peers.pop(peer, None)
        self.transport.remove_peer(peer)
