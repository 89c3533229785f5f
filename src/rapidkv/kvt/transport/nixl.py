"""NIXL transport: one-sided WRITEs between registered memory, UCX backend.

Theory of operation
-------------------
A `NixlTransport` is one NIXL agent (named after the worker) with one UCX backend
and **no progress thread** (`enable_prog_thread=False`: with it on, standalone
notifications stalled and throughput halved on this machine kind). The owner
thread drives all progress: `post_write`, `poll` (`check_xfer_state` progresses
the UCX worker) and `take_notifs` (`get_new_notifs` progresses it too).

- `register_memory` registers DRAM regions (or VRAM with ``mem_type="VRAM"``; the
  region's device is the `device_id` option). Writes go to the peer's memory of
  kind `remote_mem_type` on device `remote_device_id` (by default: the same as
  ours), e.g. VRAM -> DRAM. `local_metadata()` is the agent's
  NIXL metadata, which includes the registered regions: take it *after*
  registering (a peer that loaded older metadata cannot write to later regions).
- `add_peer(metadata)` loads a peer's agent metadata and returns its agent name.
- `post_write(peer, descs)` builds ONE NIXL transfer request for the whole batch
  (contiguous rows coalesced first), posts it, and returns a handle. NIXL checks
  every row against the local and the peer's registered regions: a row outside
  them is refused with `TransportError` before anything moves.
- `send_notif` is a standalone NIXL notification (`send_notif`/genNotif), carried
  by the same UCX endpoint as the writes; `take_notifs` is `get_new_notifs`.

Invariants
----------
- Every NIXL call happens under `_lock`, so NIXL is entered by one thread at a
  time: the owner thread, a receiving thread calling `take_notifs`, or `close`.
  The NIXL bindings release the GIL while they work (measured: a Python thread
  kept running during a 28 ms post), so a long copy stalls no other thread.
- A handle's state leaves PENDING exactly once. NIXL resources of a handle are
  released as soon as it is DONE or ERROR; `release` forgets the handle, and for
  a still PENDING one cancels the NIXL request first (a request NIXL refuses to
  free is kept and retried at `close`, never raised to the caller).
- DONE means NIXL reported the transfer complete; its UCX backend flushes the
  endpoint after the puts before it does, so the bytes are in the peer's memory.
  ERROR means NIXL reported a failure, the peer disconnected, or the peer was
  removed while the write was PENDING: bytes may or may not have landed. A peer
  dying before or during `post_write` gives a handle in ERROR, not an
  exception; `TransportError` from `post_write` means the request itself was
  refused (unknown peer, malformed rows, memory not registered).
- A notification is sent on the endpoint the writes use, after the writes the
  caller saw DONE, so it reaches the peer after their bytes.
- Nothing here calls anything that can end the process; every NIXL failure
  becomes a state or a `TransportError`.
- The receiver must keep progressing (its polling thread calls `take_notifs`):
  in error handling mode peer, a new writer's connection setup (UCX wireup) is
  answered only then, and the writer's first write stays PENDING until it is.
  `add_peer` starts that setup at once (`make_connection`) so the first write
  does not pay for it.

Memory
------
Registered memory must stay valid until `close()` returns. With cma (the
intra-node transport UCX picks on CPU) the copy is done by the sender's process
inside `post_write` itself (process_vm_writev, GIL released), so on CPU a
`post_write` returns with the bytes in place (for 1 GiB: ~80-140 ms in the call)
and the first `poll` says DONE.

Dead peers (measured here)
--------------------------
nixl 1.5.1 with its bundled UCX, two processes on one host, progress thread off.
Settings tried: ``ucx_error_handling_mode`` peer and none; ``UCX_TLS`` default
(UCX picks cma for the writes; for active messages, i.e. notifications and
wireup, tcp/lo in mode peer and sysv shared memory in mode none), ``sm,self``
(mode none only), ``tcp,self``.

- Destination killed (SIGKILL) before the first write, between writes, or while
  writes stream: in every combination the next NIXL call on that peer
  (`transfer` or `check_xfer_state`) raised ``nixlRemoteDisconnectError``
  within a millisecond of the death (cma's process_vm_writev fails at once; tcp
  sees the reset). It never returned "ERR", never hung, never aborted the
  process. Releasing the request, `remove_remote_agent`, and writing to a new
  peer all worked afterwards. This transport maps that to ERROR.
- `send_notif` to a killed peer raised in mode peer; in mode none (default TLS
  and sm,self) it *succeeded silently* and the notification was lost.
- Destination alive but not progressing (SIGSTOP): no error to detect. In mode
  peer a write posted before the peer had answered the wireup stays PENDING for
  as long as the peer does not progress (15 s observed), with either TLS; so do all
  writes with ``tcp,self`` in both modes (the tcp put needs the target's
  progress). With cma in mode none, writes complete without the peer. Keepalive
  settings (``UCX_KEEPALIVE_INTERVAL``, ``UCX_TCP_KEEP*`` = 1 s or inf) changed
  nothing. Releasing such a PENDING request returned promptly and cleanly, so
  did `remove_remote_agent` and `close`, and later writes to other peers
  worked: the caller's timeout is what ends these.
- Releasing a PENDING write does not fence it. With ``tcp,self`` a write
  released (and its peer removed) while the peer was stopped still landed when
  the peer resumed (the data was already in the peer's socket). After giving up
  on a write, treat its destination as possibly written later; only DONE says
  a write is over.
- A restarted peer under a name already added is refused by NIXL
  (NIXL_ERR_NOT_ALLOWED) until `remove_peer` forgot the old one.

Chosen: mode **peer** (default), default ``UCX_TLS``. UCX documents mode peer as
the one that guarantees every request completes, successfully or with an error,
when the peer fails, and disables what could hang otherwise; mode none gives no
such guarantee, and network transports, which this machine cannot test, are
where that would bite. Mode none is an option: here it made notifications
faster (round trip 6.5 µs instead of 22 µs) and writes to a frozen peer
complete, at the price of silently lost notifications.

Performance (measured here)
---------------------------
1 GiB in 64 KiB blocks, sender and receiver in two processes pinned to cores 0
and 1, memcpy = numpy copy of the same 1 GiB in the sender, same run (memcpy
13-14 GB/s): contiguous (coalesced to one descriptor) 12.6-13.5 GB/s, 0.90-0.96x
memcpy; scattered (16384 descriptors, random destination order) 7.7-8.2 GB/s,
0.56-0.59x. The same contiguous map without coalescing: 0.57-0.64x (NIXL does
not merge rows of `initialize_xfer`). The cost of scattered is one
process_vm_writev per descriptor (~3.5 µs each over the copy); building the
descriptor lists and the request takes < 1.5 ms for 16384 rows, and
`prep_xfer_dlist`/`make_prepped_xfer` were no faster. Splitting a batch into
4..256 requests, ``UCX_TLS=sm,self``, and mode none changed nothing measurable;
transparent huge pages on the buffers made it slower (0.43x scattered). A 4 KiB
write costs ~18 µs (post + poll + release). No UCX environment setting helped,
so `UCX_ENV_DEFAULTS` is empty: `apply_ucx_env_defaults` is where a setting that
must precede NIXL's initialisation goes.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rapidkv.kvt.transport.base import Transport, TransportError, XferState

log = logging.getLogger("rapidkv.kvt.transport.nixl")

MEM_TYPES = ("DRAM", "VRAM")
ERROR_HANDLING_MODES = ("peer", "none")

UCX_ENV_DEFAULTS: dict[str, str] = {}
"""UCX settings this transport wants unless the user chose otherwise; they must be in
the environment before the first agent's UCX backend is created."""


def apply_ucx_env_defaults(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Put `UCX_ENV_DEFAULTS` into `env` (default: `os.environ`) without overriding
    anything already set there. Returns what it set. Call before creating the first
    transport of the process (`NixlTransport` calls it itself unless told not to)."""
    target = os.environ if env is None else env
    applied = {k: v for k, v in UCX_ENV_DEFAULTS.items() if k not in target}
    target.update(applied)
    return applied


def ucx_interface_env(interface: str, env: Mapping[str, str]) -> dict[str, str]:
    """The UCX settings that keep this process's NIXL traffic on `interface`,
    over TCP: ``UCX_NET_DEVICES=<interface>`` (UCX's network devices; its
    default is every device, and an agent advertises an address on each) and
    ``UCX_TLS=tcp`` (without it UCX writes through shared memory / cross-memory
    attach whenever it finds the peer on the same host, even in another network
    namespace: nothing crosses the interface). A variable already in `env`
    stays as it is (left out of the result): the user's choice wins, e.g.
    ``UCX_TLS=rc,tcp`` for RDMA with ``UCX_NET_DEVICES`` naming the HCA too."""
    wanted = {"UCX_NET_DEVICES": interface, "UCX_TLS": "tcp"}
    return {k: v for k, v in wanted.items() if k not in env}


def coalesce(descs: np.ndarray) -> np.ndarray:
    """Merge consecutive rows `(src, dst, nbytes)` whose source *and* destination
    ranges follow each other, keeping row order. Returns `descs` itself when no row
    merges; never modifies it."""
    n = len(descs)
    if n < 2:
        return descs
    src, dst, nbytes = descs[:, 0], descs[:, 1], descs[:, 2]
    starts_run = np.empty(n, dtype=bool)
    starts_run[0] = True
    np.not_equal(src[1:], src[:-1] + nbytes[:-1], out=starts_run[1:])
    starts_run[1:] |= dst[1:] != dst[:-1] + nbytes[:-1]
    if starts_run.all():
        return descs
    starts = np.flatnonzero(starts_run)
    out = descs[starts]  # fancy indexing: a copy
    out[:, 2] = np.add.reduceat(nbytes, starts)
    return out


# descriptor-list columns (address, nbytes, device) taken from rows (src, dst, nbytes)
_LOCAL_COLS = np.array([0, 2, 2])
_REMOTE_COLS = np.array([1, 2, 2])


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _is_disconnect(e: BaseException) -> bool:
    # nixl._bindings.nixlRemoteDisconnectError; matched by name so the module
    # imports (and its pure helpers work) without NIXL installed
    return type(e).__name__ == "nixlRemoteDisconnectError"


@dataclass(slots=True)
class _Xfer:
    peer: str
    nixl: Any  # nixl_xfer_handle while NIXL holds resources for it, else None
    state: XferState
    error: str | None = None


class NixlTransport(Transport):
    """NIXL/UCX transport; see the module docstring.

    Options:
      mem_type          "DRAM" (default) or "VRAM": the kind of memory registered
                        and written (both sides of a write are of this kind).
      device_id         device of registered regions (the CUDA device for VRAM; 0).
      remote_mem_type   the kind of the peers' memory written (default: mem_type).
      remote_device_id  the peers' device (default: device_id for VRAM, 0 for DRAM).
      error_handling    UCX backend ``ucx_error_handling_mode``: "peer" (default)
                        or "none" (needed for ``UCX_TLS=sm,self``).
      coalesce          merge rows contiguous on both sides before posting (True).
      apply_env_defaults  put `UCX_ENV_DEFAULTS` into os.environ first (True).
      backend_params    extra UCX backend init parameters (strings), e.g.
                        ``{"num_workers": "1"}``.
      host              an address of this host: UCX runs over TCP on the interface
                        holding it (`ucx_interface_env`, put into os.environ before
                        the backend starts; UCX variables already set win). None
                        (default): UCX's own choice (on one host: shared memory).
                        The backend parameter ``ucx_devices`` does not do this: with
                        nixl 1.5.1 it changed nothing over TCP (a bogus name too).
    """

    def __init__(
        self,
        name: str,
        *,
        mem_type: str = "DRAM",
        device_id: int = 0,
        remote_mem_type: str | None = None,
        remote_device_id: int | None = None,
        error_handling: str = "peer",
        coalesce: bool = True,
        apply_env_defaults: bool = True,
        backend_params: Mapping[str, str] | None = None,
        host: str | None = None,
    ) -> None:
        remote_mem_type = mem_type if remote_mem_type is None else remote_mem_type
        for kind in (mem_type, remote_mem_type):
            if kind not in MEM_TYPES:
                raise ValueError(f"mem_type must be one of {MEM_TYPES}, not {kind!r}")
        if error_handling not in ERROR_HANDLING_MODES:
            raise ValueError(
                f"error_handling must be one of {ERROR_HANDLING_MODES}, not {error_handling!r}"
            )
        if apply_env_defaults:
            apply_ucx_env_defaults()
        self.name = name
        self.interface: str | None = None
        if host is not None:
            self.interface = self._use_interface(host)
        from nixl._api import nixl_agent, nixl_agent_config
        from nixl._bindings import nixlXferDList

        self.mem_type = mem_type
        self.device_id = int(device_id)
        self.remote_mem_type = remote_mem_type
        if remote_device_id is None:
            remote_device_id = self.device_id if remote_mem_type == "VRAM" else 0
        self.remote_device_id = int(remote_device_id)
        self._coalesce = coalesce
        self._lock = threading.RLock()
        params = {"ucx_error_handling_mode": error_handling}
        params.update({str(k): str(v) for k, v in (backend_params or {}).items()})
        try:
            config = nixl_agent_config(
                enable_prog_thread=False, enable_listen_thread=False, backends=[]
            )
            self._agent: Any = nixl_agent(name, config)
            self._agent.create_backend("UCX", params)
        except Exception as e:
            raise TransportError(f"NIXL agent {name!r} failed to start: {_err(e)}") from e
        self._dlist = nixlXferDList  # built straight from (n, 3) int64 arrays
        self._seg = self._agent.nixl_mems[mem_type]
        self._remote_seg = self._agent.nixl_mems[remote_mem_type]
        self._regs: list[Any] = []  # nixlRegDList of each register_memory call
        self._peers: set[str] = set()
        self._xfers: dict[int, _Xfer] = {}
        self._stuck: list[Any] = []  # NIXL requests whose release failed; retried at close
        self._ids = itertools.count(1)
        self._closed = False

    def _use_interface(self, host: str) -> str:
        from rapidkv.kvt.netif import interface_of

        try:
            interface = interface_of(host)
        except (ValueError, OSError) as e:
            raise TransportError(f"NIXL agent {self.name!r}: {e}") from None
        os.environ.update(ucx_interface_env(interface, os.environ))
        devices = os.environ["UCX_NET_DEVICES"]
        if interface not in devices.split(",") and devices != "all":
            log.warning(
                "UCX_NET_DEVICES=%s is set and leaves out %s, the interface holding %s",
                devices,
                interface,
                host,
            )
        log.info(
            "NIXL agent %s: UCX on %s (%s): UCX_NET_DEVICES=%s UCX_TLS=%s",
            self.name,
            interface,
            host,
            devices,
            os.environ["UCX_TLS"],
        )
        return interface

    # --- setup -----------------------------------------------------------------------------

    def register_memory(self, regions: Sequence[tuple[int, int]]) -> None:
        rows = np.array([(int(b), int(n), self.device_id) for b, n in regions], dtype=np.int64)
        if not len(rows):
            return
        if (rows[:, 0] <= 0).any() or (rows[:, 1] <= 0).any():
            raise TransportError(f"regions need positive addresses and sizes: {regions!r}")
        with self._lock:
            self._check_open()
            try:
                self._regs.append(self._agent.register_memory(rows, self.mem_type))
            except Exception as e:
                raise TransportError(f"register_memory failed: {_err(e)}") from e

    def local_metadata(self) -> bytes:
        with self._lock:
            self._check_open()
            return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's agent metadata and return its name, then start connecting
        (the connection setup finishes once the peer progresses, so the first write
        does not wait for it). Loading the same metadata again is harmless; a *new*
        agent under a known name (a restarted peer) is refused by NIXL until
        `remove_peer` forgot the old one."""
        with self._lock:
            self._check_open()
            try:
                raw = self._agent.add_remote_agent(bytes(metadata))
            except Exception as e:
                raise TransportError(
                    f"add_peer refused the metadata ({_err(e)}); if this peer restarted "
                    "under a name already added, remove_peer it first"
                ) from e
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            self._peers.add(name)
            try:
                self._agent.make_connection(name)
            except Exception as e:  # writes will connect (or fail) on their own
                log.info("make_connection(%s) failed: %s", name, _err(e))
        return name

    def remove_peer(self, peer: str) -> None:
        """Forget `peer` (no-op if unknown). Its PENDING writes are checked once more
        and become ERROR unless NIXL now reports them DONE; then the agent's metadata
        is invalidated, which disconnects."""
        with self._lock:
            if self._closed or peer not in self._peers:
                return
            for x in self._xfers.values():
                if x.peer == peer and x.state is XferState.PENDING:
                    self._progress(x)
                    if x.state is XferState.PENDING:
                        self._finish(x, XferState.ERROR, "peer removed")
            self._peers.discard(peer)
            try:
                self._agent.remove_remote_agent(peer)
            except Exception as e:  # already gone on NIXL's side: nothing left to undo
                log.warning("remove_remote_agent(%s) failed: %s", peer, _err(e))

    # --- writes ------------------------------------------------------------------------------

    def post_write(self, peer: str, descs: np.ndarray) -> int:
        rows = np.asarray(descs)
        if rows.ndim != 2 or rows.shape[1] != 3 or rows.dtype.kind not in "iu":
            raise TransportError(f"descs must be an integer array of shape (n, 3), not {rows!r}")
        if rows.dtype != np.int64:
            rows = rows.astype(np.int64)  # uint64 beyond int64 turns negative: refused below
        if len(rows):
            if rows.min() < 0 or not rows[:, :2].all():
                raise TransportError("descs need positive addresses and non-negative sizes")
            if not rows[:, 2].all():
                rows = rows[rows[:, 2] != 0]
            if self._coalesce:
                rows = coalesce(rows)
        local = rows.take(_LOCAL_COLS, axis=1)  # fresh C-contiguous copies (NIXL needs it)
        local[:, 2] = self.device_id
        remote = rows.take(_REMOTE_COLS, axis=1)
        remote[:, 2] = self.remote_device_id
        with self._lock:
            self._check_open()
            if peer not in self._peers:
                raise TransportError(f"unknown peer {peer!r}")
            handle = next(self._ids)
            if not len(rows):  # nothing to move
                self._xfers[handle] = _Xfer(peer, None, XferState.DONE)
                return handle
            agent = self._agent
            try:
                req = agent.initialize_xfer(
                    "WRITE",
                    self._dlist(self._seg, local),
                    self._dlist(self._remote_seg, remote),
                    peer,
                )
            except Exception as e:
                if _is_disconnect(e):
                    self._xfers[handle] = _Xfer(peer, None, XferState.ERROR, _err(e))
                    return handle
                raise TransportError(f"post_write to {peer!r} refused: {_err(e)}") from e
            x = _Xfer(peer, req, XferState.PENDING)
            self._xfers[handle] = x
            try:
                status = agent.transfer(req)
            except Exception as e:
                self._finish(x, XferState.ERROR, _err(e))
            else:
                self._apply(x, status)
            return handle

    def poll(self, handle: int) -> XferState:
        x = self._xfers[handle]  # KeyError: never posted, or released
        if x.state is XferState.PENDING:
            with self._lock:
                if x.state is XferState.PENDING and not self._closed:
                    self._progress(x)
        return x.state

    def error(self, handle: int) -> str | None:
        """Why a handle is ERROR (None if it is not)."""
        return self._xfers[handle].error

    def release(self, handle: int) -> None:
        """Forget `handle` (no-op if unknown); a PENDING write is cancelled first."""
        with self._lock:  # close() may be walking the table on another thread
            x = self._xfers.pop(handle, None)
            if x is not None and x.nixl is not None:
                self._finish(x, XferState.ERROR, "released while pending")

    # --- notifications -------------------------------------------------------------------------

    def send_notif(self, peer: str, payload: bytes) -> None:
        with self._lock:
            self._check_open()
            if peer not in self._peers:
                raise TransportError(f"unknown peer {peer!r}")
            try:
                self._agent.send_notif(peer, bytes(payload))
            except Exception as e:
                raise TransportError(f"send_notif to {peer!r} failed: {_err(e)}") from e

    def take_notifs(self) -> list[tuple[str, bytes]]:
        with self._lock:
            if self._closed:
                return []
            try:
                got = self._agent.get_new_notifs()
            except Exception as e:
                raise TransportError(f"get_new_notifs failed: {_err(e)}") from e
        out: list[tuple[str, bytes]] = []
        for raw, payloads in got.items():
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            out.extend((name, bytes(p)) for p in payloads)
        return out

    # --- teardown ------------------------------------------------------------------------------

    def close(self) -> None:
        """Cancel pending writes (they become ERROR), disconnect every peer, deregister
        memory, destroy the agent. Idempotent. Afterwards `poll`, `error` and `release`
        work on the handles, `take_notifs` returns [], `remove_peer` does nothing, and
        every other call raises `TransportError`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for x in self._xfers.values():
                if x.nixl is not None:
                    self._finish(x, XferState.ERROR, "transport closed")
            for peer in list(self._peers):
                with contextlib.suppress(Exception):
                    self._agent.remove_remote_agent(peer)
            self._peers.clear()
            for req in self._stuck:
                try:
                    req.release()
                except Exception as e:
                    log.warning("NIXL kept a transfer request at close: %s", _err(e))
            self._stuck.clear()
            for reg in self._regs:
                try:
                    self._agent.deregister_memory(reg)
                except Exception as e:
                    log.warning("deregister_memory failed at close: %s", _err(e))
            self._regs.clear()
            self._agent = None  # the C++ agent goes with its last reference

    # --- internals (caller holds _lock) -------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"transport {self.name!r} is closed")

    def _progress(self, x: _Xfer) -> None:
        try:
            status = self._agent.check_xfer_state(x.nixl)
        except Exception as e:
            self._finish(x, XferState.ERROR, _err(e))
        else:
            self._apply(x, status)

    def _apply(self, x: _Xfer, status: str) -> None:
        if status == "DONE":
            self._finish(x, XferState.DONE)
        elif status != "PROC":
            self._finish(x, XferState.ERROR, f"NIXL transfer state {status}")

    def _finish(self, x: _Xfer, state: XferState, error: str | None = None) -> None:
        """Leave PENDING (once) and give NIXL its request back."""
        if x.state is XferState.PENDING:
            x.state = state
            x.error = error
            if state is XferState.ERROR:
                log.info("write to %s failed: %s", x.peer, error)
        req, x.nixl = x.nixl, None
        if req is not None:
            try:
                req.release()
            except Exception as e:
                log.warning("NIXL refused to release a transfer request: %s", _err(e))
                self._stuck.append(req)


__all__ = [
    "UCX_ENV_DEFAULTS",
    "NixlTransport",
    "apply_ucx_env_defaults",
    "coalesce",
    "ucx_interface_env",
]
