"""D's `kv_wait_seconds` on a real `SchedulerSide` (D) whose TransferKVs a
stand-in P answers over the real control plane: a request that waited for
its remote KV observes the wait once, from its blocks' allocation to the
workers' report; a request computed locally observes none."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pytest
from vllm_stand_ins import Request, rank_info

from rapidkv.connector.config import ConnectorConfig
from rapidkv.connector.scheduler_side import SchedulerSide
from rapidkv.control.codes import Code
from rapidkv.control.messages import (
    Abort,
    AbortReply,
    ErrorReply,
    Handshake,
    TransferKV,
    TransferKVReply,
    answer_handshake,
)
from rapidkv.control.server import RpcServer

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

BS = 16
WAIT_S = 0.2


class StandInP:
    """Answers handshakes, TransferKVs and Aborts OK."""

    def __init__(self) -> None:
        self.server = RpcServer(self.handle)
        self.server.start()

    async def handle(self, msg: Any) -> Any:
        if isinstance(msg, Handshake):
            return answer_handshake(msg, instance_id="P", spec=msg.spec, endpoints=msg.endpoints)
        if isinstance(msg, TransferKV):
            return TransferKVReply(xfer_id=msg.xfer_id, code=Code.OK, tokens_sent=msg.num_tokens)
        if isinstance(msg, Abort):
            return AbortReply(xfer_id=msg.xfer_id, code=Code.OK)
        return ErrorReply(Code.ERROR, "unexpected")


@dataclass
class Blocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


def decode_request(name: str, control: str, prompt_len: int = 40) -> Request:
    return Request(
        request_id=f"cmpl-{name}-0-0123abcd",
        kv_transfer_params={
            "rapidkv": {"xfer_id": name, "role": "decode", "prefill_control": control}
        },
        num_prompt_tokens=prompt_len,
        prompt_token_ids=list(range(prompt_len)),
    )


def test_a_loaded_request_observes_its_wait_once_and_a_local_one_none() -> None:
    p = StandInP()
    d = SchedulerSide(ConnectorConfig(transport="tcp", rpc_timeout_s=10), "D", BS, 1, "fp")
    d.set_ranks({0: rank_info(b"d-rank-0")})
    try:
        loaded = decode_request("loaded", p.server.address)
        local = decode_request("local", p.server.address)
        for req in (loaded, local):
            d.on_new_request(req)
        assert d.matched_tokens(loaded, 0) == (39, True)
        t0 = time.monotonic()
        d.after_alloc(loaded, Blocks([1, 2, 3]), 39)
        d.after_alloc(local, Blocks([4, 5, 6]), 0)  # nothing to load: computed here
        time.sleep(WAIT_S)
        d.update_output(None, {loaded.request_id, local.request_id})
        waited = time.monotonic() - t0
        [value] = d.take_observations()["kv_wait_seconds"]
        assert WAIT_S <= value <= waited
        d.update_output(None, {loaded.request_id})  # reported again: no second wait
        assert d.take_observations() == {}
        s = d.stats()
        assert s["kv_wait_seconds_count"] == 1 and s["kv_wait_seconds_sum"] == value
    finally:
        d.close()
        p.server.stop()
