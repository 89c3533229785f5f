"""A D request aborted while P is writing its KV: P answers D's Abort only once
no write of the transfer can land, so the blocks D frees (and vLLM hands at
once, last freed first, to the next request) are not written into afterwards.

Found by `rapidkv bench chaos` (a mismatch right after a client abort); before
the fix P answered the Abort at once and went on writing the layers of the step
in flight: the next request on D got the aborted one's blocks, P's remaining
layers landed in its KV, and its output (and, through D's prefix cache, every
later request for the same prompt) differed from a single instance's.
`debug_layer_delay_s` only stretches P's step, so that the race is certain."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
from pd_harness import ABORT_WRITING_TOKENS

from rapidkv.connector.config import kv_transfer_config
from rapidkv.control.client import RpcClient
from rapidkv.control.messages import StatsRequest, TimelineRequest
from rapidkv.harness import ServerPool, free_port
from rapidkv.harness.client import acomplete_full
from rapidkv.harness.server import pd_specs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

LAYER_DELAY_S = 0.5  # P's step with the aborted request's prompt: ~2 s (4 layers)


def test_blocks_of_a_request_aborted_mid_transfer_are_not_written_after_the_abort(
    server_pool: ServerPool, tiny_model: Path, workloads: dict
) -> None:
    (x_ids, y_ids), (y_ref,) = workloads["abort-writing"]
    pc, dc = free_port(), free_port()
    specs = pd_specs(
        tiny_model,
        kv_transfer_config(pc, debug_layer_delay_s=LAYER_DELAY_S),
        kv_transfer_config(dc),
    )
    p, d = server_pool.get("pd-abort-writing", specs)
    p_control = f"127.0.0.1:{pc}"

    with RpcClient() as rpc:

        def events(xfer_id: str) -> dict[str, float]:
            tl = rpc.call(p_control, TimelineRequest([xfer_id]), 10).xfers.get(xfer_id)
            return dict(tl.events) if tl is not None else {}

        def d_free() -> float:
            return rpc.call(f"127.0.0.1:{dc}", StatsRequest(), 10).counters["free_blocks"]

        d_baseline = d_free()

        async def main() -> list[list[int]]:
            async with httpx.AsyncClient(timeout=120) as client:
                xfer_id = "abort-while-writing"
                pk = {"rapidkv": {"xfer_id": xfer_id, "role": "prefill"}}
                dk = {
                    "do_remote_prefill": True,
                    "rapidkv": {"xfer_id": xfer_id, "role": "decode", "prefill_control": p_control},
                }
                to_p = asyncio.create_task(
                    acomplete_full(client, p.base_url, x_ids, 1, kv_transfer_params=pk)
                )
                to_d = asyncio.create_task(
                    acomplete_full(client, d.base_url, x_ids, 16, kv_transfer_params=dk)
                )
                deadline = time.monotonic() + 20
                while "accepted" not in events(xfer_id):  # P writes X layer by layer now
                    assert time.monotonic() < deadline, events(xfer_id)
                    await asyncio.sleep(0.005)
                assert "last_chunk_end" not in events(xfer_id)  # P's step is still going
                to_d.cancel()  # the client leaves: D aborts X, Aborts P, then frees
                await asyncio.gather(to_d, return_exceptions=True)
                # D freed X's blocks (P confirmed the Abort): Y gets them
                while d_free() != d_baseline:
                    assert time.monotonic() < deadline, d_free()
                    await asyncio.sleep(0.005)
                # Y, computed on D alone, gets X's blocks (vLLM reuses them first)
                y = await acomplete_full(client, d.base_url, y_ids, ABORT_WRITING_TOKENS)
                await to_p
                again = await acomplete_full(client, d.base_url, y_ids, ABORT_WRITING_TOKENS)
                return [y.token_ids, again.token_ids]

        y, again = asyncio.run(main())
        assert y == y_ref, "P wrote into blocks D had freed after the Abort"
        assert again == y_ref, "D's prefix cache kept what P wrote into Y's blocks"
        s = rpc.call(p_control, StatsRequest(), 10).counters
        assert s["aborts_client_abort"] >= 1 and s["transfers_live"] == 0
        assert s.get("aborts_unconfirmed", 0) == 0
