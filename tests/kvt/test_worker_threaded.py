"""The threaded shell (`KvtWorker`) over a real transport in one process: the
engine thread runs steps while a second thread attaches substeps and starts full
sends; every accepted transfer lands exactly, rejected ones are re-sent, and
every transfer settles once on both sides."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
import torch

from rapidkv.kvt.coordinator import Attach
from rapidkv.kvt.layout import Layout, layer_layout_from_tensor
from rapidkv.kvt.messages import SendDone
from rapidkv.kvt.priority import BOOST_NICE
from rapidkv.kvt.task import InvalidTask, Task
from rapidkv.kvt.transport import create_transport
from rapidkv.kvt.worker import KvtWorker

pytestmark = pytest.mark.unit

LAYERS, BLOCKS, BLOCK = 4, 256, 16


def kv_memory(fill: bool) -> tuple[torch.Tensor, Layout]:
    storage = (
        torch.randn(LAYERS, BLOCKS, 2, BLOCK, 8)
        if fill
        else torch.zeros(LAYERS, BLOCKS, 2, BLOCK, 8)
    )
    layers = tuple(
        layer_layout_from_tensor(
            storage[i].data_ptr(), storage[i].shape, storage[i].stride(), 4, block_dim=0
        )
        for i in range(LAYERS)
    )
    return storage, Layout(layers, BLOCKS)


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


@pytest.fixture(params=["tcp", "nixl"])
def pair(request):
    kind = request.param
    src_mem, src_layout = kv_memory(fill=True)
    dst_mem, dst_layout = kv_memory(fill=False)
    src_done: list[SendDone] = []
    src = KvtWorker(
        create_transport(kind, "src"),
        src_layout,
        rank=0,
        block_size=BLOCK,
        on_send_done=src_done.append,
    )
    dst = KvtWorker(create_transport(kind, "dst"), dst_layout, rank=0, block_size=BLOCK)
    peer = src.add_peer(dst.metadata, dst_layout)
    yield src, dst, peer, src_mem, dst_mem, src_done
    src.close()
    dst.close()


def test_steps_substeps_and_full_sends_from_two_threads(pair) -> None:
    src, dst, peer, src_mem, dst_mem, src_done = pair
    rng = random.Random(7)
    free_dst = list(range(BLOCKS))
    rng.shuffle(free_dst)
    lock = threading.Lock()
    expected: dict[str, Task] = {}
    n = [0]

    def new_task() -> Task:
        with lock:
            n[0] += 1
            nblocks = rng.randint(1, 3)
            dst_blocks = tuple(free_dst.pop() for _ in range(nblocks))
            src_blocks = tuple(rng.sample(range(BLOCKS), nblocks))
            tokens = (nblocks - 1) * BLOCK + rng.randint(1, BLOCK)
            task = Task(f"x{n[0]}", peer, src_blocks, dst_blocks, 0, tokens, True)
            expected[task.xfer_id] = task
            return task

    step = [1]
    stop = threading.Event()
    outcomes = {a: 0 for a in Attach}

    def side_thread() -> None:
        next_sub: dict[int, int] = {}
        while not stop.is_set() and len(free_dst) > 8:
            if rng.random() < 0.3:
                src.send_full([new_task()])
                continue
            target = max(1, step[0] + rng.choice([-1, 0, 0, 1]))  # steps start at 1
            sub = next_sub.get(target, 1)
            task = new_task()
            result = src.attach_substep(target, sub, [task])
            outcomes[result] += 1
            if result is Attach.REJECTED:
                src.send_full([task])  # the scheduler's rollback re-sends it
            else:
                next_sub[target] = sub + 1
            time.sleep(rng.random() * 0.002)

    side = threading.Thread(target=side_thread)
    side.start()
    for s in range(1, 60):
        step[0] = s
        src.begin_step(s, [])
        for layer in range(LAYERS):
            torch.mm(torch.randn(64, 64), torch.randn(64, 64))  # a little compute
            src.layer_done(layer)
        src.freeze_step()
    stop.set()
    side.join()
    last = step[0] + 1  # run the steps pending substeps may wait for
    for s in (last, last + 1):
        src.begin_step(s, [])
        for layer in range(LAYERS):
            src.layer_done(layer)
        src.freeze_step()

    received: dict[str, SendDone] = {}

    def all_received() -> bool:
        for done in dst.take_received():
            assert done.xfer_id not in received, f"second SendDone for {done.xfer_id}"
            received[done.xfer_id] = done
        return len(received) == len(expected)

    wait_for(all_received, 20, "SendDones at the destination")
    assert outcomes[Attach.ATTACHED] > 0 and outcomes[Attach.REJECTED] + outcomes[Attach.PENDING]
    for xfer_id, task in expected.items():
        done = received[xfer_id]
        assert done.ok and done.tokens_sent == task.new_tokens, done
        for sb, db in zip(task.src_blocks, task.dst_blocks, strict=True):
            assert torch.equal(dst_mem[:, db], src_mem[:, sb]), (xfer_id, sb, db)
    untouched = sorted(set(range(BLOCKS)) - {b for t in expected.values() for b in t.dst_blocks})
    assert not dst_mem[:, untouched].any()
    wait_for(lambda: len(src_done) == len(expected), 5, "SendDones at the source")
    assert sorted(d.xfer_id for d in src_done) == sorted(expected)
    assert not src.busy()


def test_an_invalid_task_registers_none_of_its_batch() -> None:
    _, layout = kv_memory(fill=False)
    worker = KvtWorker(create_transport("tcp", "solo"), layout, rank=0, block_size=BLOCK)
    try:
        good = Task("g", "p", (0,), (0,), 0, BLOCK, True)
        bad = Task("b", "p", (1,), (0,), 0, BLOCK, True)  # same destination block
        with pytest.raises(InvalidTask, match="already being written"):
            worker.send_full([good, bad])
        assert not worker.busy()
        worker.begin_step(1, [good])  # the good task's blocks were released
        assert worker.busy()
    finally:
        worker.close()


def test_tasks_of_a_transfer_already_settled_are_dropped_not_raised(pair) -> None:
    """A transfer failed (a write the transport gave up on, an abort) while its
    next chunk was being planned, or a resend crossed it: the late task is
    dropped and counted, in a step, a substep and a full send, and the engine
    step goes on; the transfer settled once, with its error."""
    src, _, peer, _, dst_mem, src_done = pair
    first = Task("late", peer, (0,), (5,), 0, BLOCK, False)
    src.send_full([first])
    src.fail("late", "given up")
    wait_for(lambda: any(d.xfer_id == "late" for d in src_done), 5, "the failed SendDone")
    more = Task("late", peer, (1,), (6,), BLOCK, BLOCK, True)
    src.begin_step(1, [more])  # the next chunk, planned before the failure was known
    for layer in range(LAYERS):
        src.layer_done(layer)
    assert src.attach_substep(1, 1, [more]) in (Attach.ATTACHED, Attach.PENDING, Attach.REJECTED)
    src.freeze_step()
    src.send_full([more])
    assert src.stats.late_tasks_dropped == 3
    assert [(d.xfer_id, d.ok) for d in src_done] == [("late", False)]
    assert not src.busy() and not dst_mem[:, 6].any()


def test_poll_received_collects_notifications_without_the_background_poll(pair) -> None:
    """A destination whose owner thread never polls on its own (idle interval of
    an hour) gets its SendDone by asking: each `poll_received` makes the owner
    collect notifications (and progress the transport, which some transports
    need on both sides for a write to complete)."""
    src, dst, peer, src_mem, dst_mem, src_done = pair
    dst.IDLE_POLL_S = 3600.0
    dst.poll_received()  # the owner thread now waits with the new interval
    task = Task("p1", peer, (3, 4), (10, 11), 0, 2 * BLOCK, True)
    src.send_full([task])
    done: list[SendDone] = []
    wait_for(lambda: bool(done.extend(dst.poll_received()) or done), 10, "the SendDone")
    assert [d.xfer_id for d in done] == ["p1"] and done[0].ok
    assert torch.equal(dst_mem[:, [10, 11]], src_mem[:, [3, 4]])
    wait_for(lambda: len(src_done) == 1, 10, "the source to settle")


def test_a_layer_notifying_transfer_tells_the_destination_each_layer_in_place(pair) -> None:
    """With `notify_layers`, each confirmed layer of a step-by-step transfer is
    announced (`LayersLanded`) before the next is computed, and the layers it
    announces are in the destination's memory; the last layer settles it with
    its SendDone. A transfer without the flag announces nothing."""
    src, dst, peer, src_mem, dst_mem, _ = pair
    plain = Task("plain", peer, (1,), (20,), 0, BLOCK, True)
    task = Task("split", peer, (3, 4), (10, 11), 0, 2 * BLOCK, True, notify_layers=True)
    src.begin_step(1, [task, plain])
    for layer in range(LAYERS - 1):
        src.layer_done(layer)
        wait_for(lambda n=layer + 1: dst.poll_received() or dst.landed("split") >= n, 10, "layers")
        assert dst.landed("split") == layer + 1
        assert torch.equal(dst_mem[: layer + 1, [10, 11]], src_mem[: layer + 1, [3, 4]])
        assert not dst_mem[layer + 1 :, [10, 11]].any(), "a layer landed before it was computed"
    src.layer_done(LAYERS - 1)
    src.freeze_step()
    done: list[SendDone] = []
    wait_for(lambda: bool(done.extend(dst.poll_received()) or len(done) == 2), 10, "SendDones")
    assert sorted((d.xfer_id, d.ok) for d in done) == [("plain", True), ("split", True)]
    assert torch.equal(dst_mem[:, [10, 11]], src_mem[:, [3, 4]])
    assert dst.landed("plain") == 0 and dst.landed("split") == LAYERS - 1
    dst.forget_landed(["split"])
    assert dst.landed("split") == 0


class CountingTransport:
    """A transport that counts `take_notifs` calls (everything else passes through)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.notif_polls = 0

    def take_notifs(self):
        self.notif_polls += 1
        return self.inner.take_notifs()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_the_owner_polls_notifications_often_only_while_a_transfer_is_awaited() -> None:
    """Each background poll interrupts the engine: an idle destination polls every
    IDLE_POLL_S (50 ms), one awaiting a transfer every AWAIT_POLL_S (2 ms), and
    turning awaiting on takes effect at once, not after the idle wait."""
    _mem, layout = kv_memory(fill=False)  # kept alive: the worker registered it
    transport = CountingTransport(create_transport("tcp", "dst"))
    worker = KvtWorker(transport, layout, rank=0, block_size=BLOCK)  # type: ignore[arg-type]
    try:

        def polls_in(seconds: float) -> int:
            before = transport.notif_polls
            time.sleep(seconds)
            return transport.notif_polls - before

        time.sleep(0.1)
        idle = polls_in(0.5)
        before = transport.notif_polls
        worker.set_awaiting(True)
        wait_for(lambda: transport.notif_polls > before, 0.04, "the first poll once awaiting")
        awaiting = polls_in(0.5)
        worker.set_awaiting(False)
        time.sleep(0.1)
        idle_again = polls_in(0.5)
        assert idle <= 0.5 / worker.IDLE_POLL_S + 2, idle
        assert idle_again <= 0.5 / worker.IDLE_POLL_S + 2, idle_again
        assert awaiting >= 4 * (0.5 / worker.IDLE_POLL_S), awaiting
    finally:
        worker.close()


def test_the_owner_thread_runs_first_in_the_fair_class_and_nothing_inherits_it() -> None:
    """The owner thread runs SCHED_OTHER at nice -20, never real-time; a thread
    started from it (as UCX, NIXL or OpenMP may start one) runs at nice 0, and
    so does the caller."""
    _mem, layout = kv_memory(fill=False)
    worker = KvtWorker(create_transport("tcp", "rt"), layout, rank=0, block_size=BLOCK)
    try:

        def nice() -> int:
            return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

        def from_the_owner() -> tuple[int, int, int]:
            seen: list[int] = []
            child = threading.Thread(target=lambda: seen.append(nice()))
            child.start()
            child.join()
            return os.sched_getscheduler(0), nice(), seen[0]

        policy, owner_nice, child_nice = worker._call(from_the_owner)
        assert policy & ~os.SCHED_RESET_ON_FORK == os.SCHED_OTHER
        if owner_nice == 0:
            pytest.skip("no privilege for a negative nice value here (CAP_SYS_NICE)")
        assert owner_nice == BOOST_NICE
        assert child_nice == 0, "a thread started by the owner inherited its priority"
        assert nice() == 0
    finally:
        worker.close()


def test_a_write_the_transport_fails_names_its_peer_and_a_new_one_connects() -> None:
    """The destination goes away: the write to it fails, the transfer settles
    failed, and `on_peer_failed` names the peer (the connector then has it
    handshake anew); removing it and adding its new process connects again."""
    src_mem, src_layout = kv_memory(fill=True)
    _, dst_layout = kv_memory(fill=False)
    failed: list[tuple[str, str]] = []
    done: list[SendDone] = []
    src = KvtWorker(
        create_transport("tcp", "src"),
        src_layout,
        rank=0,
        block_size=BLOCK,
        on_send_done=done.append,
        on_peer_failed=lambda peer, why: failed.append((peer, why)),
        write_timeout_s=5.0,
    )
    dst = KvtWorker(create_transport("tcp", "dst"), dst_layout, rank=0, block_size=BLOCK)
    again_mem, again_layout = kv_memory(fill=False)
    again = None
    try:
        peer = src.add_peer(dst.metadata, dst_layout)
        dst.close()
        src.send_full([Task("lost", peer, (3,), (10,), 0, BLOCK, True)])
        wait_for(lambda: bool(failed) and bool(done), 10, "the write to fail")
        assert failed[0][0] == peer
        assert [(d.xfer_id, d.ok) for d in done] == [("lost", False)]

        again = KvtWorker(create_transport("tcp", "dst"), again_layout, rank=0, block_size=BLOCK)
        src.remove_peer(peer)
        assert src.add_peer(again.metadata, again_layout) == peer
        src.send_full([Task("found", peer, (3,), (10,), 0, BLOCK, True)])
        wait_for(lambda: len(done) == 2, 10, "the new destination to be written")
        assert done[1].xfer_id == "found" and done[1].ok
        assert torch.equal(again_mem[:, [10]], src_mem[:, [3]])
        assert len(failed) == 1
    finally:
        src.close()
        if again is not None:
            again.close()


def faulty_pair(faults):
    from rapidkv.kvt.faults import SendFaults

    src_mem, src_layout = kv_memory(fill=True)
    dst_mem, dst_layout = kv_memory(fill=False)
    src_done: list[SendDone] = []
    src = KvtWorker(
        create_transport("tcp", "src"),
        src_layout,
        rank=0,
        block_size=BLOCK,
        on_send_done=src_done.append,
        faults=SendFaults(**faults),
    )
    dst = KvtWorker(create_transport("tcp", "dst"), dst_layout, rank=0, block_size=BLOCK)
    return src, dst, src.add_peer(dst.metadata, dst_layout), src_mem, dst_mem, src_done


def test_an_injected_failure_sends_the_layers_before_its_layer_then_fails_like_a_write() -> None:
    """`faults.fail_rate` 1: the transfer's layers up to the one its xfer_id
    picks go out; that layer's write is never posted, and the transfer settles
    with the injected error on both sides, as after a failed write."""
    from rapidkv.kvt.faults import INJECTED, SendFaults

    xfer_id = next(f"f{i}" for i in range(1000) if SendFaults(1.0).plan(f"f{i}", LAYERS)[0] == 2)
    src, dst, peer, src_mem, dst_mem, src_done = faulty_pair({"fail_rate": 1.0})
    try:
        src.begin_step(1, [Task(xfer_id, peer, (3, 4), (10, 11), 0, 2 * BLOCK, True)])
        for layer in range(LAYERS):
            src.layer_done(layer)
            time.sleep(0.05)
        src.freeze_step()
        done: list[SendDone] = []
        wait_for(lambda: bool(done.extend(dst.poll_received()) or done), 10, "the SendDone")
        assert [(d.xfer_id, d.ok, d.error) for d in done] == [(xfer_id, False, INJECTED)]
        wait_for(lambda: len(src_done) == 1, 5, "the source to settle")
        assert not src_done[0].ok and src.stats.injected_failures == 1 and not src.busy()
        assert torch.equal(dst_mem[:2, [10, 11]], src_mem[:2, [3, 4]])  # layers 0, 1 landed
        assert not dst_mem[2:, [10, 11]].any()
    finally:
        src.close()
        dst.close()


def test_held_sends_go_out_after_their_transfers_delay_in_order() -> None:
    """`faults.send_delay_s`: each transfer's writes wait for the delay its
    xfer_id gives (a share of the bound), then all land: the transfer settles ok."""
    from rapidkv.kvt.faults import SendFaults

    faults = SendFaults(send_delay_s=0.5)
    xfer_id = next(f"d{i}" for i in range(1000) if faults.plan(f"d{i}", LAYERS)[1] > 0.3)
    delay = faults.plan(xfer_id, LAYERS)[1]
    assert faults.plan(xfer_id, LAYERS) == (None, delay)  # never failed at rate 0
    src, dst, peer, src_mem, dst_mem, src_done = faulty_pair({"send_delay_s": 0.5})
    try:
        t0 = time.monotonic()
        src.begin_step(1, [Task(xfer_id, peer, (5, 6), (20, 21), 0, 2 * BLOCK, True)])
        for layer in range(LAYERS):
            src.layer_done(layer)
        src.freeze_step()
        done: list[SendDone] = []
        wait_for(lambda: bool(done.extend(dst.poll_received()) or done), 10, "the SendDone")
        assert time.monotonic() - t0 >= delay - 0.01
        assert [(d.xfer_id, d.ok) for d in done] == [(xfer_id, True)]
        assert torch.equal(dst_mem[:, [20, 21]], src_mem[:, [5, 6]])
        wait_for(lambda: len(src_done) == 1 and src_done[0].ok, 5, "the source to settle")
        assert src.stats.injected_failures == 0
    finally:
        src.close()
        dst.close()
