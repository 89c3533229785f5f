"""What the P/D e2e tests share: the workload constants, the `Pair` of a real
P and D with RapidKVConnector (driven directly or through the router), and the
checks that everything is back at its baseline."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from rapidkv.connector.config import kv_transfer_config
from rapidkv.control.client import RpcClient
from rapidkv.control.messages import StatsRequest, TimelineRequest, XferTimeline
from rapidkv.harness import VLLMServer
from rapidkv.harness.client import (
    acomplete_full,
    complete,
    complete_full,
    get_metrics,
    metric_sum,
)
from rapidkv.harness.procs import all_pids
from rapidkv.harness.server import kv_bytes_per_token

MAX_TOKENS = 16
BLOCK = 128
# shorter than a block, exactly one block, many blocks, several 256-token chunks
LENGTHS = [
    5,
    60,
    127,
    128,
    129,
    200,
    255,
    256,
    257,
    384,
    500,
    640,
    700,
    800,
    900,
    1000 - MAX_TOKENS,
]


# (name, prompt lengths, seed) of the workloads run on the small-P pair
# (dispatch, transfer_kv_mode) of the full mixed workload; each has its own
# prompts, since D's prefix cache would otherwise hold them
MODE_RUNS = {
    "dual-step": ("dual", "step"),
    "dual-bypass": ("dual", "bypass"),
    "dual-substep": ("dual", "substep"),
    "serial-step": ("serial", "step"),
    "serial-bypass": ("serial", "bypass"),
}
# live migration: (name, prompt lengths, seed), each output MIGRATION_TOKENS long
MIGRATION_TOKENS = 240
# the shared pair's etcd lease (test_fleet_etcd): a killed instance leaves within it
ETCD_TTL_S = 3.0
MIGRATION_WORKLOADS = [
    ("migrate-once", [300], 2500),
    ("migrate-twice", [420], 2501),
    ("migrate-load", [260, 380, 330, 500], 2502),
    ("migrate-drain", [200, 250, 300, 350, 280, 320, 260, 240], 2503),
    ("migrate-fail", [310, 290], 2504),
    ("migrate-unstreamed", [350], 2505),
    ("migrate-busy", [600], 2506),  # test_pd_small_p: to a P without room
]
# test_pd_abort_while_writing: Y decodes for ~3 s, long after P's last layer of X
ABORT_WRITING_TOKENS = 300
# a chat request moved there and back (test_migration): greedy, token ids returned
MIGRATION_CHAT = [
    {"role": "user", "content": "Tell me about the lighthouse keeper and the storm, at length."}
]


def migration_chat_body(stream: bool) -> dict:
    """The chat request `test_migration` moves, as the single instance gets it too."""
    return {
        "messages": MIGRATION_CHAT,
        "max_completion_tokens": MIGRATION_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }


SMALL_P_WORKLOADS = [  # (name, prompt lengths, seed, max_tokens)
    ("small_wait", [130, 130], 4000, 300),
    ("small_busy", [400, 400, 400], 4002, MAX_TOKENS),
    ("small_late", [900], 4003, MAX_TOKENS),
]
# D kept busy: per round, 8 plain decodes ahead of 8 PD prompts
LATE_ROUNDS = 4
LATE_SLOTS = 8  # = D's max_num_seqs: D admits nothing while these decode
# per round, how long D's decodes run: D's TransferKVs (all sent once a slot
# frees) reach P at a later point of P's prefills each round
LATE_DECODE_TOKENS = [10, 40, 70, 100]
LATE_LENGTHS = [300, 450, 250, 500, 380, 420, 260, 480]
# a mixed load for adaptive placement: short prompts first (local), then long
# ones (split when the fleet is idle), then all of them at once
FLEET_LENGTHS = [40, 900, 60, 850, 30, 900, 800, 50, 700, 880, 650, 45, 900, 760, 35, 820]
# P and D in two network namespaces: short, one block, many blocks, the longest
NETNS_LENGTHS = [5, 129, 300, 640, 900, 256, 500, 1000 - MAX_TOKENS]
# the connector's half of live migration (test_migration_connector): a few
# hundred prompt tokens, decoded long enough to move mid-way
SOURCE_MIGRATION_PROMPT = 300
SOURCE_MIGRATION_TOKENS = 600


def connector_config(control_port: int, **extra: object) -> dict:
    # every TTL well above the 2 s leak window: a timeout cannot hide a leak;
    # 5 ms after each layer: a step's layer-by-layer sends are observable;
    # D gives up on a silent P after 10 s (a frozen P's test waits that long)
    settings = {
        "park_ttl_s": 30.0,
        "finished_ttl_s": 60.0,
        "rpc_timeout_s": 10.0,
        "debug_layer_delay_s": 0.005,
    }
    return kv_transfer_config(control_port, **{**settings, **extra})


class Pair:
    def __init__(
        self, model: Path, p: VLLMServer, d: VLLMServer, p_control: str, d_control: str
    ) -> None:
        self.model = model
        self.p, self.d = p, d
        self.p_control, self.d_control = p_control, d_control
        self.rpc = RpcClient()

    def close(self) -> None:
        """Close the control-plane client (the servers belong to the pool)."""
        self.rpc.close()

    def params(self, xfer_id: str, mode: str | None = None) -> tuple[dict, dict]:
        """`kv_transfer_params` for P and for D of one transfer (as the router sets);
        `mode` is the request's transfer_kv_mode (None: P's configured default)."""
        pk = {"rapidkv": {"xfer_id": xfer_id, "role": "prefill"}}
        ours = {"xfer_id": xfer_id, "role": "decode", "prefill_control": self.p_control}
        if mode is not None:
            ours["transfer_kv_mode"] = mode
        return pk, {"do_remote_prefill": True, "rapidkv": ours}

    async def start_d_and_wait_parked(
        self, client: httpx.AsyncClient, xfer_id: str, ids: list[int]
    ) -> asyncio.Task:
        """Send only D's request; return once its TransferKV is parked on P."""
        _, dk = self.params(xfer_id)
        to_d = asyncio.create_task(
            acomplete_full(client, self.d.base_url, ids, MAX_TOKENS, kv_transfer_params=dk)
        )
        deadline = time.monotonic() + 10
        while self.stats("p")["parked_now"] < 1:
            assert time.monotonic() < deadline, "TransferKV never parked on P"
            await asyncio.sleep(0.02)
        return to_d

    def stats(self, which: str) -> dict[str, float]:
        address = self.p_control if which == "p" else self.d_control
        return self.rpc.call(address, StatsRequest(), 10).counters

    def since(self, before: dict[str, dict[str, float]], which: str, name: str) -> float:
        """How much counter `name` of `which` ("p" | "d") grew since `before`."""
        return self.stats(which).get(name, 0) - before[which].get(name, 0)

    def timeline(self, xfer_id: str) -> XferTimeline:
        """P's connector timeline of one transfer (empty until P knows it)."""
        xfers = self.rpc.call(self.p_control, TimelineRequest([xfer_id]), 10).xfers
        return xfers.get(xfer_id, XferTimeline())

    def d_during_last_chunk(
        self, xfer_id: str, p_ids: list[int], d_ids: list[int], pk: dict, dk: dict
    ):
        """Send P its request; once P's timeline shows it computing the prompt's
        last chunk, send D's (its TransferKV reaches P mid-step). D's completion."""

        async def main():
            async with httpx.AsyncClient() as client:
                to_p = asyncio.create_task(
                    acomplete_full(client, self.p.base_url, p_ids, 1, kv_transfer_params=pk)
                )
                deadline = time.monotonic() + 20
                while "last_chunk_begin" not in self.timeline(xfer_id).events:
                    assert time.monotonic() < deadline, "P never started the last chunk"
                    await asyncio.sleep(0.005)
                out = await acomplete_full(
                    client, self.d.base_url, d_ids, MAX_TOKENS, kv_transfer_params=dk
                )
                await to_p
                return out

        return asyncio.run(main())

    async def _one(
        self,
        client: httpx.AsyncClient,
        xfer_id: str,
        ids: list[int],
        serial: bool,
        mode: str | None = None,
    ):
        pk, dk = self.params(xfer_id, mode)
        to_p = acomplete_full(client, self.p.base_url, ids, 1, kv_transfer_params=pk)
        to_d = acomplete_full(client, self.d.base_url, ids, MAX_TOKENS, kv_transfer_params=dk)
        if serial:
            await to_p
            return await to_d
        return (await asyncio.gather(to_p, to_d))[1]

    def run(
        self,
        prompts: list[list[int]],
        tag: str,
        serial: bool,
        concurrency: int = 4,
        mode: str | None = None,
    ):
        async def main():
            sem = asyncio.Semaphore(concurrency)
            async with httpx.AsyncClient() as client:

                async def one(i: int, ids: list[int]):
                    async with sem:
                        return await self._one(client, f"{tag}-{i}", ids, serial, mode)

                return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))

        return [c.token_ids for c in asyncio.run(main())]


def block_bytes(model: Path) -> int:
    """Bytes of one KV block across all layers, from the model's config."""
    return BLOCK * kv_bytes_per_token(model)


def _gauges_idle(server: VLLMServer) -> bool:
    m = get_metrics(server.base_url)
    return metric_sum(m, "vllm:num_requests_running") == 0 and (
        metric_sum(m, "vllm:num_requests_waiting") == 0
    )


def engine_idle(server: VLLMServer) -> bool:
    """No request running or waiting in `server`'s engine.

    vLLM records these gauges when a step's output is processed, after the
    step's finished requests left; a request aborted between steps (a
    migration's source closed, a client that left) when nothing else runs
    stays counted until the next step. So when they say busy, a 1-token probe
    (shorter than a block: nothing cached) makes one step, and its record is
    current: a request really running or waiting is still counted in it."""
    if _gauges_idle(server):
        return True
    complete(server.base_url, [1, 2, 3], 1)
    return _gauges_idle(server)


def wait_for(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def assert_back_to_baseline(pair: Pair, within: float = 2.0) -> None:
    """Within `within` s, on P and on D: every block of vLLM's pool free (no
    request holds one: a baseline that does not depend on when it is read),
    nothing parked, held or awaited, no request running or waiting."""
    for w, server in (("p", pair.p), ("d", pair.d)):

        def unsettled(w=w, server=server) -> list[str]:
            s = pair.stats(w)
            out = [
                f"{k} {s[k]:g}"
                for k in ("parked_now", "transfers_live", "waiting_for_kv", "held_blocks")
                if s[k] != 0
            ]
            if s["free_blocks"] != s["usable_blocks"]:
                out.append(f"free_blocks {s['free_blocks']:g} of {s['usable_blocks']:g}")
            if not out and not engine_idle(server):
                out.append("a request running or waiting in vLLM")
            return out

        assert wait_for(lambda u=unsettled: not u(), within), (
            f"{w} did not return to its baseline: {unsettled()}; {pair.stats(w)}"
        )


def router_healthy(url: str) -> bool:
    """The router at `url` answers its `/health` with 200 now."""
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def log_mark(server: VLLMServer) -> int:
    """Where `server`'s log ends now (`logged_since` reads what comes after)."""
    return server.log_path.stat().st_size if server.log_path.exists() else 0


def logged_since(server: VLLMServer, mark: int) -> str:
    """What `server`'s log (every start of it appends there) got since `mark`."""
    with server.log_path.open("rb") as f:
        f.seek(mark)
        return f.read().decode(errors="replace")


# -- what a process tree holds of the machine (read from /proc), for the checks
# that it left nothing behind when it exited


def _fd_links(pids: list[int]) -> Iterator[str]:
    """Where each open file descriptor of `pids` points (those still readable)."""
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    yield os.readlink(f"/proc/{pid}/fd/{fd}")


def _socket_inodes(pids: list[int]) -> set[int]:
    return {int(link[8:-1]) for link in _fd_links(pids) if link.startswith("socket:[")}


def _tcp_address(hex_addr: str) -> tuple[str, int]:
    """`/proc/net/tcp{,6}`'s ``ADDR:PORT`` (the address in 32-bit host-order words)."""
    addr, port = hex_addr.split(":")
    raw = b"".join(struct.pack("=I", int(addr[i : i + 8], 16)) for i in range(0, len(addr), 8))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, raw), int(port, 16)


def listening(pids: list[int]) -> tuple[set[tuple[str, int]], set[str]]:
    """The TCP ``(address, port)`` and the unix socket paths that `pids` listen on."""
    inodes = _socket_inodes(pids)
    tcp = set()
    for name in ("tcp", "tcp6"):
        with open(f"/proc/net/{name}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[9]) in inodes:  # LISTEN
                    tcp.add(_tcp_address(fields[1]))
    unix = set()
    with open("/proc/net/unix") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            # Num RefCount Protocol Flags Type St Inode [Path]; flag 0x10000: listening
            if len(fields) >= 8 and int(fields[3], 16) & 0x10000 and int(fields[6]) in inodes:
                unix.add(fields[7])
    return tcp, unix


def shm_paths(pids: list[int]) -> set[str]:
    """The files under /dev/shm that `pids` have open or mapped (not yet unlinked)."""
    out = {
        link
        for link in _fd_links(pids)
        if link.startswith("/dev/shm/") and not link.endswith(" (deleted)")
    }
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                path = fields[5].strip() if len(fields) == 6 else ""
                if path.startswith("/dev/shm/") and not path.endswith("(deleted)"):
                    out.add(path)
    return out


def shm_held_by_anyone() -> set[str]:
    """The /dev/shm files some live process has open or mapped."""
    return shm_paths(all_pids())


def tcp_port_closed(host: str, port: int) -> bool:
    """Nothing accepts on `host:port` and it can be bound again (a wildcard
    listener is tried on loopback)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    target = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        try:
            s.connect((target, port))
            return False
        except ConnectionRefusedError:
            pass
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no listener
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def unix_socket_closed(path: str) -> bool:
    """Nothing accepts on the unix socket `path` (``@name``: abstract)."""
    address = "\0" + path[1:] if path.startswith("@") else path
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        try:
            s.connect(address)
        except (FileNotFoundError, ConnectionRefusedError):
            return True
        except OSError as e:  # e.g. a SOCK_SEQPACKET or DGRAM listener: not this type
            return e.errno not in (errno.EPROTOTYPE,)
    return False


def external_tokens(server: VLLMServer) -> float:
    return metric_sum(
        get_metrics(server.base_url),
        "vllm:prompt_tokens_by_source_total",
        source="external_kv_transfer",
    )


def served_with_transfer(pair: Pair, router_url: str, ids: list[int], expected: list[int]):
    """One greedy request through the router: its output is the single
    instance's, its prompt's KV came from P (P confirmed one more transfer, D
    counted the tokens as external and fell back to recompute none)."""
    p0, d0, ext0 = pair.stats("p"), pair.stats("d"), external_tokens(pair.d)
    out = complete_full(router_url, ids, MAX_TOKENS)
    assert out.token_ids == expected
    assert wait_for(
        lambda: pair.stats("p").get("transfers_ok", 0) == p0.get("transfers_ok", 0) + 1, 2.0
    ), f"P confirmed no transfer: {pair.stats('p')}"
    assert pair.since({"d": d0}, "d", "recompute_fallbacks") == 0
    assert external_tokens(pair.d) - ext0 == len(ids) - 1
