"""The destination side of a live migration, on a real `SchedulerSide` (D)
talking to a stand-in source over the real control plane: what its TransferKV
says, and that a source with no such request (NOT_FOUND or GONE) is not asked
again: D recomputes at once."""

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
    ErrorReply,
    Handshake,
    TransferKV,
    TransferKVReply,
    answer_handshake,
    prompt_hash,
)
from rapidkv.control.server import RpcServer

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

BS = 16

RANK_INFO = rank_info(b"d-rank-0")


class StandInSource:
    """Answers handshakes OK and every TransferKV with `code`; keeps them."""

    def __init__(self, code: Code) -> None:
        self.code = code
        self.transfers: list[TransferKV] = []
        self.server = RpcServer(self.handle)
        self.server.start()

    async def handle(self, msg: Any) -> Any:
        if isinstance(msg, Handshake):
            return answer_handshake(msg, instance_id="S", spec=msg.spec, endpoints=msg.endpoints)
        if isinstance(msg, TransferKV):
            self.transfers.append(msg)
            return TransferKVReply(xfer_id=msg.xfer_id, code=self.code, message="as scripted")
        return ErrorReply(Code.ERROR, "unexpected")


@dataclass
class Blocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


@pytest.mark.parametrize("code", [Code.NOT_FOUND, Code.GONE])
def test_a_migration_the_source_does_not_know_is_recomputed_at_once(code: Code) -> None:
    source = StandInSource(code)
    d = SchedulerSide(ConnectorConfig(transport="tcp", rpc_timeout_s=10), "D", BS, 1, "fp")
    d.set_ranks({0: RANK_INFO})
    try:
        prompt = list(range(100, 150))  # the source's prompt and what it generated
        req = Request(
            request_id="cmpl-dst-0-0123abcd",
            kv_transfer_params={
                "rapidkv": {
                    "xfer_id": "dst",
                    "role": "decode",
                    "prefill_control": source.server.address,
                    "migrate_from": "src",
                }
            },
            num_prompt_tokens=len(prompt),
            prompt_token_ids=prompt,
        )
        d.on_new_request(req)
        # 32 tokens are local prefix hits (an earlier pre-copy's blocks)
        assert d.matched_tokens(req, 32) == (len(prompt) - 1 - 32, True)
        t0 = time.monotonic()
        d.after_alloc(req, Blocks([5, 6, 7, 8]), len(prompt) - 1 - 32)
        deadline = t0 + 5
        while "cmpl-dst-0-0123abcd" not in d.shared.pending.recv_failed:
            assert time.monotonic() < deadline, "never recomputed"
            time.sleep(0.01)
        assert time.monotonic() - t0 < 1.0  # no backoff: asked once, recomputed
        time.sleep(0.3)  # a retry would come within its first backoff
        [msg] = source.transfers
        assert msg.migration and msg.source_xfer_id == "src" and msg.xfer_id == "dst"
        assert (msg.first_block, msg.num_tokens, msg.dst_blocks) == (2, 49, [5, 6, 7, 8])
        assert msg.prompt_hash == prompt_hash(prompt)
        s = d.stats()
        assert s["recompute_fallbacks"] == 1 and s["migration_transfer_kv_sent"] == 1
        assert s.get("transfer_kv_retries_not_found", 0) == 0
    finally:
        d.close()
        source.server.stop()


def test_a_plain_decode_request_still_retries_not_found() -> None:
    """Without `migrate_from`, NOT_FOUND means P has not seen the request yet."""
    source = StandInSource(Code.NOT_FOUND)
    d = SchedulerSide(ConnectorConfig(transport="tcp", rpc_timeout_s=1.0), "D", BS, 1, "fp")
    d.set_ranks({0: RANK_INFO})
    try:
        prompt = list(range(40))
        req = Request(
            request_id="cmpl-x-0-0123abcd",
            kv_transfer_params={
                "rapidkv": {
                    "xfer_id": "x",
                    "role": "decode",
                    "prefill_control": source.server.address,
                }
            },
            num_prompt_tokens=len(prompt),
            prompt_token_ids=prompt,
        )
        d.on_new_request(req)
        assert d.matched_tokens(req, 0) == (39, True)
        d.after_alloc(req, Blocks([1, 2, 3]), 39)
        deadline = time.monotonic() + 5
        while req.request_id not in d.shared.pending.recv_failed:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert len(source.transfers) > 2 and not source.transfers[0].migration
        assert d.stats()["transfer_kv_retries_not_found"] == len(source.transfers) - 1
    finally:
        d.close()
        source.server.stop()
