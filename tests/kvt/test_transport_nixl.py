"""NixlTransport against real NIXL/UCX, receivers in second processes (`nixl_peer`).

The sender lives in the test process; every receiver is a spawned process owning
``guard | region | guard`` (only the region registered) that keeps progressing its
transport like a real receiver. Receivers are started together at module start
(NIXL import and agent creation dominate). Waits poll with deadlines.

What is proved: bytes land exactly where the rows say (nowhere else) for
contiguous, scattered, partial and random maps, with one NIXL request per post;
a notification arrives after the data of the writes it follows; `take_notifs`
on another thread is safe while the owner posts; refused rows move nothing; a
killed destination turns writes into ERROR promptly, a frozen one leaves them
PENDING and the caller's release/remove_peer/close stay prompt; the sender keeps
working with other peers after all of it.
"""

from __future__ import annotations

import threading
import time
import uuid
import zlib
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("nixl._api", reason="NIXL is not installed")

from nixl_peer import FILL, Peer, start_peer

from rapidkv.kvt.transport import TransportError, XferState, create_transport
from rapidkv.kvt.transport import nixl as nixl_mod
from rapidkv.kvt.transport.nixl import NixlTransport, apply_ucx_env_defaults, coalesce

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

BLOCK = 4096
REGION = 1 << 20  # the receivers' registered region
SRC = 32 << 20  # the sender's registered source buffer
BIG = 64 << 20  # region of the victim killed mid-stream
DEADLINE = 10.0  # seconds any single wait may take before the test fails
PROMPT = 1.0  # seconds within which a call on a dead or frozen peer must return


def _uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def wait(t: NixlTransport, handle: int, timeout: float = DEADLINE) -> XferState:
    """Poll `handle` until it leaves PENDING or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while (state := t.poll(handle)) is XferState.PENDING and time.monotonic() < deadline:
        pass
    return state


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, Peer]]:
    """Every receiver process of the module, started at once."""
    peers = {
        "rx": start_peer(_uid("rx"), REGION),
        "killed_mid": start_peer(_uid("victim-mid"), BIG),
        "killed_early": start_peer(_uid("victim-early"), REGION),
        "frozen": start_peer(_uid("victim-frozen"), REGION),
    }
    try:
        yield peers
    finally:
        for p in peers.values():
            p.stop()


@pytest.fixture(scope="module")
def tx() -> Iterator[NixlTransport]:
    t = create_transport("nixl", _uid("tx"))
    assert isinstance(t, NixlTransport)
    src = np.random.default_rng(7).integers(0, 256, SRC, dtype=np.uint8)
    t.register_memory([(src.ctypes.data, src.nbytes)])
    t.src = src  # type: ignore[attr-defined]  # keeps the buffer alive with the transport
    yield t
    t.close()


@pytest.fixture
def rx(fleet: dict[str, Peer], tx: NixlTransport) -> Peer:
    """The shared receiver, reset (FILL, no notifications) and linked to `tx`."""
    peer = fleet["rx"].ready()
    peer.call("reset")
    peer.call("watch", 0)
    peer.call("echo", None)
    assert tx.add_peer(peer.metadata) == peer.name  # again: harmless
    return peer


def src_of(t: NixlTransport) -> np.ndarray:
    return t.src  # type: ignore[attr-defined,no-any-return]


def absolute(t: NixlTransport, peer: Peer, rows: np.ndarray) -> np.ndarray:
    """`(src_offset, dst_offset, nbytes)` → absolute `(src, dst, nbytes)` rows."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    return rows + np.array([src_of(t).ctypes.data, peer.base, 0], dtype=np.int64)


def expected(t: NixlTransport, peer: Peer, rows: np.ndarray) -> np.ndarray:
    out = np.full(peer.nbytes + 2 * peer.guard, FILL, dtype=np.uint8)
    for s, d, n in np.asarray(rows, dtype=np.int64).reshape(-1, 3):
        out[peer.guard + d : peer.guard + d + n] = src_of(t)[s : s + n]
    return out


def assert_landed(t: NixlTransport, peer: Peer, rows: np.ndarray) -> None:
    got, want = peer.memory(), expected(t, peer, rows)
    bad = np.flatnonzero(got != want)
    assert not len(bad), f"{len(bad)} bytes differ, first at region offset {bad[0] - peer.guard}"


def post_counting_requests(t: NixlTransport, peer: str, descs: np.ndarray) -> tuple[int, int]:
    """Post, counting the NIXL transfer requests the post creates."""
    agent = t._agent
    calls = []
    real = agent.initialize_xfer

    def counting(*a: object, **k: object) -> object:
        calls.append(1)
        return real(*a, **k)

    agent.initialize_xfer = counting
    try:
        return t.post_write(peer, descs), len(calls)
    finally:
        del agent.initialize_xfer


# --- coalesce (pure) --------------------------------------------------------------------------


def test_coalesce_merges_only_rows_contiguous_on_both_sides() -> None:
    rows = np.array(
        [
            (100, 1000, 10),
            (110, 1010, 5),  # continues both: merges
            (115, 2000, 5),  # source continues, destination jumps: new run
            (120, 2005, 1),  # merges with the previous
            (500, 2006, 4),  # destination continues, source jumps: new run
        ],
        dtype=np.int64,
    )
    before = rows.copy()
    out = coalesce(rows)
    assert out.tolist() == [[100, 1000, 15], [115, 2000, 6], [500, 2006, 4]]
    assert (rows == before).all(), "input modified"
    scattered = np.array([(0, 50, 10), (10, 0, 10)], dtype=np.int64)
    assert coalesce(scattered) is scattered


def _byte_map(rows: np.ndarray) -> dict[int, int]:
    return {int(d) + i: int(s) + i for s, d, n in rows for i in range(int(n))}


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(1, 4), st.booleans()),
        min_size=0,
        max_size=30,
    )
)
def test_coalesce_keeps_the_byte_mapping_and_leaves_no_mergeable_neighbours(
    steps: list[tuple[int, int, int, bool]],
) -> None:
    rows, s, d = [], 0, 1000
    for gap_s, gap_d, n, jump in steps:  # mostly-adjacent rows with disjoint destinations
        s = s + gap_s if not jump else s + 100
        d = d + gap_d
        rows.append((s, d, n))
        s, d = s + n, d + n
    arr = np.array(rows, dtype=np.int64).reshape(-1, 3)
    out = coalesce(arr)
    assert _byte_map(out) == _byte_map(arr)
    assert out[:, 2].sum() == arr[:, 2].sum()
    if len(out) > 1:
        joinable = (out[1:, 0] == out[:-1, 0] + out[:-1, 2]) & (
            out[1:, 1] == out[:-1, 1] + out[:-1, 2]
        )
        assert not joinable.any()


# --- data lands exactly -----------------------------------------------------------------------


def block_map(scenario: str, rng: np.random.Generator) -> np.ndarray:
    """`(src_offset, dst_offset, nbytes)` rows with disjoint destinations."""
    nb, ns = REGION // BLOCK, SRC // BLOCK
    if scenario == "contiguous":  # runs of consecutive blocks on both sides
        rows = []
        for dst0, length in ((0, 40), (64, 100), (200, 56)):
            src0 = int(rng.integers(0, ns - length))
            rows += [((src0 + i) * BLOCK, (dst0 + i) * BLOCK, BLOCK) for i in range(length)]
        return np.array(rows)
    if scenario == "scattered":  # every block to a random block, random order
        dst = rng.permutation(nb)
        src = rng.choice(ns, size=nb, replace=False)
        return np.stack([src * BLOCK, dst * BLOCK, np.full(nb, BLOCK)], axis=1)
    if scenario == "partial":  # unaligned starts, short lengths
        dst = rng.permutation(nb)[:150]
        off = rng.integers(0, BLOCK - 1, size=len(dst))
        n = rng.integers(1, BLOCK - off + 1)
        return np.stack([rng.integers(0, SRC - BLOCK, size=len(dst)), dst * BLOCK + off, n], 1)
    if scenario == "many_small":  # thousands of 256-byte rows, scattered
        k = REGION // 256
        dst = rng.permutation(k)
        return np.stack([rng.integers(0, SRC - 256, size=k), dst * 256, np.full(k, 256)], 1)
    if scenario == "mixed_sizes":  # 1 byte .. 64 KiB, gaps of 0..3 bytes
        rows, pos = [], 0
        while True:
            n = int(rng.choice([1, 7, 256, 4096, 5000, 65536]))
            if pos + n > REGION:
                return np.array(rows)
            rows.append((int(rng.integers(0, SRC - n)), pos, n))
            pos += n + int(rng.integers(0, 4))
    raise ValueError(scenario)


@pytest.mark.parametrize(
    "scenario", ["contiguous", "scattered", "partial", "many_small", "mixed_sizes"]
)
def test_block_map_lands_exactly_with_one_nixl_request(
    tx: NixlTransport, rx: Peer, scenario: str
) -> None:
    rows = block_map(scenario, np.random.default_rng(zlib.crc32(scenario.encode())))
    handle, requests = post_counting_requests(tx, rx.name, absolute(tx, rx, rows))
    assert requests == 1
    assert wait(tx, handle) is XferState.DONE, tx.error(handle)
    tx.release(handle)
    assert_landed(tx, rx, rows)


@st.composite
def random_ranges(draw: st.DrawFn) -> np.ndarray:
    """Disjoint destination ranges of random sizes and gaps, random sources."""
    rows, pos = [], draw(st.integers(0, 3 * BLOCK))
    for _ in range(draw(st.integers(1, 24))):
        n = draw(st.integers(1, 5 * BLOCK))
        if pos + n > REGION:
            break
        rows.append((draw(st.integers(0, SRC - n)), pos, n))
        pos += n + draw(st.sampled_from([0, 0, 1, 7, BLOCK, 3 * BLOCK + 5]))
    return np.array(rows if rows else [(0, 0, 1)])


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(rows=random_ranges(), parts=st.integers(1, 3))
def test_random_ranges_land_exactly(
    tx: NixlTransport, rx: Peer, rows: np.ndarray, parts: int
) -> None:
    rx.call("reset")
    handles = [
        tx.post_write(rx.name, absolute(tx, rx, p)) for p in np.array_split(rows, parts) if len(p)
    ]
    assert [wait(tx, h) for h in handles] == [XferState.DONE] * len(handles)
    for h in handles:
        tx.release(h)
    assert_landed(tx, rx, rows)


def test_empty_batch_is_done_and_zero_length_rows_are_skipped(tx: NixlTransport, rx: Peer) -> None:
    h = tx.post_write(rx.name, np.zeros((0, 3), dtype=np.int64))
    assert tx.poll(h) is XferState.DONE
    tx.release(h)
    rows = np.array([(0, 0, 0), (BLOCK, 2 * BLOCK, 100), (0, 5 * BLOCK, 0)])
    h = tx.post_write(rx.name, absolute(tx, rx, rows).astype(np.uint64))
    assert wait(tx, h) is XferState.DONE
    tx.release(h)
    assert_landed(tx, rx, rows)


# --- notifications ----------------------------------------------------------------------------


def test_notification_arrives_after_the_data_of_the_writes_it_follows(
    tx: NixlTransport, rx: Peer
) -> None:
    rounds, per = 8, 16
    rng = np.random.default_rng(3)
    dst_blocks = rng.permutation(REGION // BLOCK)[: rounds * per].reshape(rounds, per)
    rx.call("watch", BLOCK)  # the peer checksums its region as each notification arrives
    sent = []
    for k in range(rounds):
        src_blocks = rng.choice(SRC // BLOCK, size=per, replace=False)
        rows = np.stack([src_blocks * BLOCK, dst_blocks[k] * BLOCK, np.full(per, BLOCK)], axis=1)
        h = tx.post_write(rx.name, absolute(tx, rx, rows))
        assert wait(tx, h) is XferState.DONE
        tx.release(h)
        tx.send_notif(rx.name, f"round {k}".encode())
        sent.append(src_blocks)
    got = rx.call("notifs", rounds, DEADLINE)
    assert [(p, payload) for p, payload, _ in got] == [
        (tx.name, f"round {k}".encode()) for k in range(rounds)
    ]
    for k, (_, _, crcs) in enumerate(got):
        for s, d in zip(sent[k], dst_blocks[k], strict=True):
            want = zlib.crc32(src_of(tx)[s * BLOCK : (s + 1) * BLOCK])
            assert crcs[d] == want, f"round {k}: block {d} not written when its notification came"


def test_take_notifs_on_another_thread_while_the_owner_posts(tx: NixlTransport, rx: Peer) -> None:
    n = 200
    rx.call("echo", tx.local_metadata())  # the peer sends every notification back
    echoes: list[tuple[str, bytes]] = []
    stop = threading.Event()

    def receiver() -> None:
        while not stop.is_set() and len(echoes) < n:
            echoes.extend(tx.take_notifs())

    thread = threading.Thread(target=receiver)
    thread.start()
    try:
        rng = np.random.default_rng(11)
        dst = rng.permutation(REGION // BLOCK)[:n]
        src = rng.choice(SRC // BLOCK, size=n, replace=False)
        rows = np.stack([src * BLOCK, dst * BLOCK, np.full(n, BLOCK)], axis=1)
        for i, row in enumerate(rows):
            h = tx.post_write(rx.name, absolute(tx, rx, row))
            assert wait(tx, h) is XferState.DONE
            tx.release(h)
            tx.send_notif(rx.name, b"%d" % i)
        thread.join(DEADLINE)
    finally:
        stop.set()
        thread.join()
    assert echoes == [(rx.name, b"%d" % i) for i in range(n)]
    rx.call("echo", None)
    assert_landed(tx, rx, rows)


# --- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "where", ["straddles_end", "before_start", "far_away", "bad_row_among_good", "source"]
)
def test_rows_outside_registered_memory_are_refused_and_move_nothing(
    tx: NixlTransport, rx: Peer, where: str
) -> None:
    rows = {
        "straddles_end": [(0, REGION - 100, 200)],
        "before_start": [(0, -rx.guard, 64)],
        "far_away": [(0, 1 << 40, BLOCK)],
        "bad_row_among_good": [(0, 0, BLOCK), (BLOCK, REGION, 64), (2 * BLOCK, BLOCK, BLOCK)],
        "source": [(SRC, 0, 64)],  # just past the sender's registered buffer
    }[where]
    with pytest.raises(TransportError):
        tx.post_write(rx.name, absolute(tx, rx, np.array(rows)))
    assert (rx.memory() == FILL).all(), "a refused request moved bytes"
    good = np.array([(5 * BLOCK, 3 * BLOCK, BLOCK)])  # still usable
    h = tx.post_write(rx.name, absolute(tx, rx, good))
    assert wait(tx, h) is XferState.DONE
    tx.release(h)
    assert_landed(tx, rx, good)


@pytest.mark.parametrize(
    "descs",
    [
        np.zeros((2, 2), dtype=np.int64),  # wrong shape
        np.zeros(3, dtype=np.int64),  # 1-D
        np.ones((1, 3), dtype=np.float64),  # not integers
        np.array([[1 << 20, 1 << 20, -1]], dtype=np.int64),  # negative size
        np.array([[0, 1 << 20, 8]], dtype=np.int64),  # null address
        np.array([[2**64 - 8, 1 << 20, 8]], dtype=np.uint64),  # beyond int64
    ],
)
def test_malformed_descs_are_refused(tx: NixlTransport, rx: Peer, descs: np.ndarray) -> None:
    with pytest.raises(TransportError):
        tx.post_write(rx.name, descs)


def test_unknown_peer_and_garbage_metadata_are_refused(tx: NixlTransport) -> None:
    row = np.array([[src_of(tx).ctypes.data, 1 << 20, 8]], dtype=np.int64)
    with pytest.raises(TransportError):
        tx.post_write("nobody", row)
    with pytest.raises(TransportError):
        tx.send_notif("nobody", b"x")
    for garbage in (b"", b"\x00not metadata\xff", b"nixlSerDes|"):
        with pytest.raises(TransportError):
            tx.add_peer(garbage)
    tx.remove_peer("nobody")  # unknown: no-op
    tx.release(123456789)  # unknown: no-op
    with pytest.raises(KeyError):
        tx.poll(123456789)


# --- dead and frozen peers --------------------------------------------------------------------


def _assert_sender_still_works(tx: NixlTransport, fleet: dict[str, Peer]) -> None:
    rx = fleet["rx"].ready()
    rx.call("reset")
    rows = np.array([(7 * BLOCK, 9 * BLOCK, 2 * BLOCK)])
    h = tx.post_write(rx.name, absolute(tx, rx, rows))
    assert wait(tx, h) is XferState.DONE
    tx.release(h)
    assert_landed(tx, rx, rows)


def test_destination_killed_while_writes_stream_gives_error(
    tx: NixlTransport, fleet: dict[str, Peer]
) -> None:
    victim = fleet["killed_mid"].ready()
    name = tx.add_peer(victim.metadata)
    chunk = 16 << 20
    handles, states = [], []
    killer = threading.Timer(0.15, victim.kill)  # lands while the owner is inside post_write
    killer.start()
    try:
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            k = len(handles) % (BIG // chunk)
            h = tx.post_write(name, absolute(tx, victim, [(0, k * chunk, chunk)]))
            handles.append(h)
            states.append(wait(tx, h))
            if states[-1] is not XferState.DONE:
                break
    finally:
        killer.join()
    died = time.monotonic()
    assert states[0] is XferState.DONE, "the victim never took a write"
    assert states[-1] is XferState.ERROR, f"stream ended with {states[-1]} after the kill"
    assert "Disconnect" in (tx.error(handles[-1]) or "")
    # later writes to it fail at once (as states, not exceptions); notifications raise
    h = tx.post_write(name, absolute(tx, victim, [(0, 0, BLOCK)]))
    assert wait(tx, h, timeout=PROMPT) is XferState.ERROR
    handles.append(h)
    with pytest.raises(TransportError):
        tx.send_notif(name, b"anyone?")
    for h in handles:
        tx.release(h)
    tx.remove_peer(name)
    assert time.monotonic() - died < PROMPT
    _assert_sender_still_works(tx, fleet)


def test_destination_killed_before_the_first_write_gives_error(
    tx: NixlTransport, fleet: dict[str, Peer]
) -> None:
    victim = fleet["killed_early"].ready()
    name = tx.add_peer(victim.metadata)
    victim.kill()
    t0 = time.monotonic()
    h = tx.post_write(name, absolute(tx, victim, [(0, 0, BLOCK)]))
    assert wait(tx, h, timeout=5.0) is XferState.ERROR
    tx.release(h)
    tx.remove_peer(name)
    assert time.monotonic() - t0 < PROMPT
    _assert_sender_still_works(tx, fleet)


def test_frozen_destination_leaves_writes_pending_and_giving_up_is_clean(
    tx: NixlTransport, fleet: dict[str, Peer]
) -> None:
    victim = fleet["frozen"].ready()
    victim.freeze()  # alive, never progresses: no connection setup answered
    t0 = time.monotonic()
    name = tx.add_peer(victim.metadata)
    h = tx.post_write(name, absolute(tx, victim, [(0, 0, BLOCK)]))
    h2 = tx.post_write(name, absolute(tx, victim, [(BLOCK, BLOCK, BLOCK)]))
    assert time.monotonic() - t0 < PROMPT
    # measured (see the nixl module docstring): PENDING for as long as the peer is frozen
    assert wait(tx, h, timeout=0.3) is XferState.PENDING
    assert tx.poll(h2) is XferState.PENDING
    t0 = time.monotonic()
    tx.release(h)  # the caller gave up: cancels the request
    tx.remove_peer(name)  # fails the other one
    assert time.monotonic() - t0 < PROMPT
    assert tx.poll(h2) is XferState.ERROR
    assert tx.error(h2) == "peer removed"
    tx.release(h2)

    # closing a transport with a write pending on the frozen peer is prompt as well
    other = NixlTransport(_uid("closer"))
    buf = np.ones(BLOCK, dtype=np.uint8)
    other.register_memory([(buf.ctypes.data, BLOCK)])
    oname = other.add_peer(victim.metadata)
    oh = other.post_write(oname, np.array([[buf.ctypes.data, victim.base, BLOCK]]))
    assert wait(other, oh, timeout=0.1) is XferState.PENDING
    t0 = time.monotonic()
    other.close()
    assert time.monotonic() - t0 < PROMPT
    assert other.poll(oh) is XferState.ERROR
    other.close()  # idempotent
    assert other.take_notifs() == []
    with pytest.raises(TransportError):
        other.post_write(oname, np.array([[buf.ctypes.data, victim.base, BLOCK]]))

    victim.kill()
    _assert_sender_still_works(tx, fleet)


# --- options and environment ------------------------------------------------------------------


def test_apply_ucx_env_defaults_never_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nixl_mod, "UCX_ENV_DEFAULTS", {"UCX_A": "1", "UCX_B": "2"})
    env = {"UCX_A": "user"}
    assert apply_ucx_env_defaults(env) == {"UCX_B": "2"}
    assert env == {"UCX_A": "user", "UCX_B": "2"}
    assert apply_ucx_env_defaults(env) == {}


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError):
        NixlTransport("x", mem_type="HBM")
    with pytest.raises(ValueError):
        NixlTransport("x", error_handling="sometimes")
