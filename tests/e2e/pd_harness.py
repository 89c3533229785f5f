"""What the P/D e2e tests share: the workload constants, the `Pair` of a real
P and D with RapidKVConnector (driven directly or through the router), and the
checks that everything is back at its baseline."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx

from rapidkv.connector.config import kv_transfer_config
from rapidkv.control.client import RpcClient
from rapidkv.control.messages import StatsRequest, TimelineRequest, XferTimeline
from rapidkv.harness import VLLMServer
from rapidkv.harness.client import (
    acomplete_full,
    get_metrics,
    metric_sum,
)

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
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_layer = 2 * cfg["num_key_value_heads"] * head_dim * BLOCK * 4  # K and V, float32
    return cfg["num_hidden_layers"] * per_layer


def engine_idle(server: VLLMServer) -> bool:
    m = get_metrics(server.base_url)
    return metric_sum(m, "vllm:num_requests_running") == 0 and (
        metric_sum(m, "vllm:num_requests_waiting") == 0
    )


def wait_for(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def assert_back_to_baseline(
    pair: Pair, before: dict[str, dict[str, float]], within: float = 2.0
) -> None:
    """Within `within` s: vLLM's free blocks as before, nothing parked, held or
    awaited, no request running or waiting, on P and on D."""
    for w, server in (("p", pair.p), ("d", pair.d)):

        def settled(w=w, server=server) -> bool:
            s = pair.stats(w)
            return (
                s["free_blocks"] == before[w]["free_blocks"]
                and s["parked_now"] == 0
                and s["transfers_live"] == 0
                and s["waiting_for_kv"] == 0
                and engine_idle(server)
            )

        assert wait_for(settled, within), f"{w} did not return to its baseline: {pair.stats(w)}"


def log_mark(server: VLLMServer) -> int:
    """Where `server`'s log ends now (`logged_since` reads what comes after)."""
    return server.log_path.stat().st_size if server.log_path.exists() else 0


def logged_since(server: VLLMServer, mark: int) -> str:
    """What `server`'s log (every start of it appends there) got since `mark`."""
    with server.log_path.open("rb") as f:
        f.seek(mark)
        return f.read().decode(errors="replace")
