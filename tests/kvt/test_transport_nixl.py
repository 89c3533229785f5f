"""NixlTransport against real NIXL/UCX: what only NIXL has or promises.

The generic conformance suite (test_transports) runs for "nixl" too and checks
there, with NIXL's stronger promises under `kind == "nixl"`: block maps and random
ranges land exactly with one NIXL request per post, a notification arrives after
the data of the writes it follows, rows outside registered memory are refused at
post time and move nothing, a destination killed while writes stream turns them
into ERROR (a disconnect) promptly, unknown peers and garbage metadata are refused.

Here, with the same peer processes (`transport_peer`, receivers started together
at module start: NIXL import and agent creation dominate): `coalesce`; empty
batches and zero-length rows; `take_notifs` on another thread is safe while the
owner posts; malformed descriptors are refused; a destination killed before the
first write gives ERROR, a frozen one leaves writes PENDING and the caller's
release/remove_peer/close stay prompt, and the sender keeps working with other
peers after either; UCX environment defaults and constructor options.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("nixl._api", reason="NIXL is not installed")

from transport_peer import Peer, Sender, assert_written, start_peer, wait_all

from rapidkv.kvt.transport import Transport, TransportError, XferState, create_transport
from rapidkv.kvt.transport import nixl as nixl_mod
from rapidkv.kvt.transport.nixl import NixlTransport, apply_ucx_env_defaults, coalesce

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

BLOCK = 4096
REGION = 1 << 20  # the receivers' registered region
SRC = 16 << 20  # the sender's registered source buffer
DEADLINE = 10.0  # seconds any single wait may take before the test fails
PROMPT = 1.0  # seconds within which a call on a dead or frozen peer must return


def _uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def wait(t: Transport, handle: int, timeout: float = DEADLINE) -> XferState:
    """Poll `handle` until it leaves PENDING or `timeout` passes."""
    return wait_all(t, [handle], timeout)[0]


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, Peer]]:
    """Every receiver process of the module, started at once."""
    peers = {
        "rx": start_peer("nixl", _uid("rx"), REGION, wait=False),
        "killed_early": start_peer("nixl", _uid("victim-early"), REGION, wait=False),
        "frozen": start_peer("nixl", _uid("victim-frozen"), REGION, wait=False),
    }
    try:
        for p in peers.values():
            p.ready()
        yield peers
    finally:
        for p in peers.values():
            p.stop()


@pytest.fixture(scope="module")
def tx() -> Iterator[Sender]:
    t = create_transport("nixl", _uid("tx"))
    assert isinstance(t, NixlTransport)
    src = np.random.default_rng(7).integers(0, 256, SRC, dtype=np.uint8)
    t.register_memory([(src.ctypes.data, src.nbytes)])
    yield Sender(t, src)
    t.close()


@pytest.fixture
def rx(fleet: dict[str, Peer], tx: Sender) -> Peer:
    """The shared receiver, reset (FILL, no notifications) and linked to `tx`."""
    peer = fleet["rx"]
    peer.call("reset")
    assert tx.t.add_peer(peer.metadata) == peer.name  # again: harmless
    return peer


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


# --- writes and notifications ----------------------------------------------------------------


def test_empty_batch_is_done_and_zero_length_rows_are_skipped(tx: Sender, rx: Peer) -> None:
    h = tx.t.post_write(rx.name, np.zeros((0, 3), dtype=np.int64))
    assert tx.t.poll(h) is XferState.DONE
    tx.t.release(h)
    rows = np.array([(0, 0, 0), (BLOCK, 2 * BLOCK, 100), (0, 5 * BLOCK, 0)])
    h = tx.t.post_write(rx.name, tx.descs(rx, rows).astype(np.uint64))
    assert wait(tx.t, h) is XferState.DONE
    tx.t.release(h)
    assert_written(tx, rx, rows)


def test_take_notifs_on_another_thread_while_the_owner_posts(tx: Sender, rx: Peer) -> None:
    n = 200
    rx.call("echo", tx.t.local_metadata())  # the peer sends every notification back
    echoes: list[tuple[str, bytes]] = []
    stop = threading.Event()

    def receiver() -> None:
        while not stop.is_set() and len(echoes) < n:
            echoes.extend(tx.t.take_notifs())

    thread = threading.Thread(target=receiver)
    thread.start()
    try:
        rng = np.random.default_rng(11)
        dst = rng.permutation(REGION // BLOCK)[:n]
        src = rng.choice(SRC // BLOCK, size=n, replace=False)
        rows = np.stack([src * BLOCK, dst * BLOCK, np.full(n, BLOCK)], axis=1)
        for i, row in enumerate(rows):
            h = tx.post(rx, row)
            assert wait(tx.t, h) is XferState.DONE
            tx.t.release(h)
            tx.t.send_notif(rx.name, b"%d" % i)
        thread.join(DEADLINE)
    finally:
        stop.set()
        thread.join()
    assert echoes == [(rx.name, b"%d" % i) for i in range(n)]
    rx.call("echo", None)
    assert_written(tx, rx, rows)


# --- refusals ---------------------------------------------------------------------------------


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
def test_malformed_descs_are_refused(tx: Sender, rx: Peer, descs: np.ndarray) -> None:
    with pytest.raises(TransportError):
        tx.t.post_write(rx.name, descs)


# --- dead and frozen peers --------------------------------------------------------------------


def _assert_sender_still_works(tx: Sender, fleet: dict[str, Peer]) -> None:
    rx = fleet["rx"]
    rx.call("reset")
    rows = np.array([(7 * BLOCK, 9 * BLOCK, 2 * BLOCK)])
    h = tx.post(rx, rows)
    assert wait(tx.t, h) is XferState.DONE
    tx.t.release(h)
    assert_written(tx, rx, rows)


def test_destination_killed_before_the_first_write_gives_error(
    tx: Sender, fleet: dict[str, Peer]
) -> None:
    victim = fleet["killed_early"]
    assert tx.t.add_peer(victim.metadata) == victim.name
    victim.kill()
    t0 = time.monotonic()
    h = tx.post(victim, [(0, 0, BLOCK)])
    assert wait(tx.t, h, timeout=5.0) is XferState.ERROR
    tx.t.release(h)
    tx.t.remove_peer(victim.name)
    assert time.monotonic() - t0 < PROMPT
    _assert_sender_still_works(tx, fleet)


def test_frozen_destination_leaves_writes_pending_and_giving_up_is_clean(
    tx: Sender, fleet: dict[str, Peer]
) -> None:
    t: NixlTransport = tx.t  # type: ignore[assignment]
    victim = fleet["frozen"]
    victim.freeze()  # alive, never progresses: no connection setup answered
    t0 = time.monotonic()
    assert t.add_peer(victim.metadata) == victim.name
    h = tx.post(victim, [(0, 0, BLOCK)])
    h2 = tx.post(victim, [(BLOCK, BLOCK, BLOCK)])
    assert time.monotonic() - t0 < PROMPT
    # measured (see the nixl module docstring): PENDING for as long as the peer is frozen
    assert wait(t, h, timeout=0.3) is XferState.PENDING
    assert t.poll(h2) is XferState.PENDING
    t0 = time.monotonic()
    t.release(h)  # the caller gave up: cancels the request
    t.remove_peer(victim.name)  # fails the other one
    assert time.monotonic() - t0 < PROMPT
    assert t.poll(h2) is XferState.ERROR
    assert t.error(h2) == "peer removed"
    t.release(h2)

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
