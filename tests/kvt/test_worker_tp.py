"""`KvtWorker` between ranks of different TP sizes with one transfer id, as the
connector sends a request's KV: P at TP 1 sends one transfer to both ranks of
a D at TP 2 (two peers, settled apart, each SendDone naming its destination
rank), and a D at TP 1 takes one transfer from both ranks of a P at TP 2 (it
hands the transfer on once both SendDones came, failed if either failed).
Every head lands where the destination rank holds it (CPU head layout)."""

from __future__ import annotations

import time

import pytest

from rapidkv.bench.kvt.tp import KV_HEADS, TOKENS, dims, rank_kvs
from rapidkv.kvt.head_map import rank_heads
from rapidkv.kvt.messages import SendDone
from rapidkv.kvt.task import Task
from rapidkv.kvt.transport import create_transport
from rapidkv.kvt.worker import KvtWorker

pytestmark = pytest.mark.unit

LAYERS, BLOCKS = 2, 6
SRC_BLOCKS, DST_BLOCKS = (0, 1, 2), (5, 3, 4)


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def workers(tp: int, fill: bool, name: str, done: list[SendDone] | None = None):
    out = []
    for rank, (storage, layout) in enumerate(rank_kvs("cpu", tp, fill, LAYERS, BLOCKS)):
        worker = KvtWorker(
            create_transport("tcp", f"{name}{rank}"),
            layout,
            rank=rank,
            block_size=TOKENS,
            on_send_done=None if done is None else done.append,
            boost=False,
            hugepages=False,
        )
        out.append((worker, storage))
    return out


def model(tp: int, ranks) -> object:
    """The whole model's KV `[LAYERS, blocks, heads, ...]` from `tp` ranks' storages."""
    import torch

    _, head_dim = dims("cpu")
    return torch.cat([storage for _, storage in ranks], dim=1 + head_dim)


def task(peer: str) -> Task:
    return Task("x", peer, SRC_BLOCKS, DST_BLOCKS, 0, len(SRC_BLOCKS) * TOKENS, True)


def test_tp_1_to_2_one_transfer_to_both_destination_ranks() -> None:
    sent: list[SendDone] = []
    [(src, src_mem)] = workers(1, True, "p", sent)
    dst = workers(2, False, "d")
    try:
        peers = [src.add_peer(w.metadata, w.layout, d) for d, (w, _) in enumerate(dst)]
        src.send_full([task(p) for p in peers])
        got: list[list[SendDone]] = [[], []]
        for d, (w, _) in enumerate(dst):
            wait_for(lambda w=w, g=got[d]: bool(g.extend(w.poll_received()) or g), 10, "SendDone")
        assert [(g.xfer_id, g.ok, g.dst_rank, g.sources) for [g] in got] == [
            ("x", True, 0, 1),
            ("x", True, 1, 1),
        ]
        wait_for(lambda: len(sent) == 2, 5, "both settled on the source")
        assert sorted((s.rank, s.dst_rank, s.ok) for s in sent) == [(0, 0, True), (0, 1, True)]
        assert src.stats.transfers_ok == 2
        for d, (_, storage) in enumerate(dst):
            heads = rank_heads(KV_HEADS, 2, d)
            want = src_mem[:, list(SRC_BLOCKS), heads.start : heads.stop]
            assert (storage[:, list(DST_BLOCKS)] == want).all()
            assert not storage[:, [0, 1, 2]].any()  # nothing outside the task's blocks
    finally:
        for w, _ in [(src, None), *dst]:
            w.close()


def test_tp_2_to_1_the_destination_waits_for_both_source_ranks() -> None:
    sent: list[SendDone] = []
    src = workers(2, True, "p", sent)
    [(dst, dst_mem)] = workers(1, False, "d")
    try:
        peers = [w.add_peer(dst.metadata, dst.layout, 0) for w, _ in src]
        src[0][0].send_full([task(peers[0])])
        wait_for(lambda: len(sent) == 1, 10, "rank 0 settled")
        time.sleep(0.1)
        assert dst.poll_received() == [], "handed on before the other source rank's SendDone"
        assert (sent[0].rank, sent[0].dst_rank, sent[0].sources) == (0, 0, 2)
        src[1][0].send_full([task(peers[1])])
        got: list[SendDone] = []
        wait_for(lambda: bool(got.extend(dst.poll_received()) or got), 10, "SendDone")
        assert [(g.xfer_id, g.ok, g.tokens_sent, g.sources) for g in got] == [
            ("x", True, len(SRC_BLOCKS) * TOKENS, 2)
        ]
        assert dst.stats.received_ok == 1
        whole = model(2, src)
        assert (dst_mem[:, list(DST_BLOCKS)] == whole[:, list(SRC_BLOCKS)]).all()
    finally:
        for w, _ in [*src, (dst, None)]:
            w.close()


def test_tp_2_to_1_one_source_rank_failing_fails_the_transfer() -> None:
    src = workers(2, True, "p")
    [(dst, _)] = workers(1, False, "d")
    try:
        peers = [w.add_peer(dst.metadata, dst.layout, 0) for w, _ in src]
        src[0][0].send_full([task(peers[0])])
        # rank 1 gives up on its part before any layer of it was written
        src[1][0].begin_step(1, [task(peers[1])])
        src[1][0].fail("x", "given up")
        got: list[SendDone] = []
        wait_for(lambda: bool(got.extend(dst.poll_received()) or got), 10, "SendDone")
        assert len(got) == 1 and not got[0].ok and "rank 1: given up" in got[0].error
        assert dst.stats.received_failed == 1 and dst.stats.received_ok == 0
    finally:
        for w, _ in [*src, (dst, None)]:
            w.close()
