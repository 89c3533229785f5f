"""Reading a prefill instance's control address out of its probe answer."""

from __future__ import annotations

import pytest

from rapidkv.router.config import Instance
from rapidkv.router.fleet.discovery import (
    Discovered,
    DiscoveryError,
    control_from_answer,
    discovered_from_answer,
    probe_body,
)

P = Instance("http://10.1.2.3:8100")


def answer(control: object) -> dict:
    return {"choices": [], "kv_transfer_params": {"rapidkv": {"control": control}}}


def test_the_probe_asks_for_one_token_and_the_address() -> None:
    body = probe_body()
    assert body["max_tokens"] == 1 and body["stream"] is False
    assert body["kv_transfer_params"] == {"rapidkv": {"discover": True}}


def test_a_specific_host_is_kept() -> None:
    assert control_from_answer(P, answer("127.0.0.1:9100")) == "127.0.0.1:9100"


@pytest.mark.parametrize("wildcard", ["0.0.0.0:9100", "[::]:9100"])
def test_a_wildcard_host_becomes_the_instance_urls_host(wildcard: str) -> None:
    assert control_from_answer(P, answer(wildcard)) == "10.1.2.3:9100"


@pytest.mark.parametrize(
    "bad",
    [
        {"choices": []},  # no connector: vLLM returns no kv_transfer_params
        {"kv_transfer_params": None},
        {"kv_transfer_params": {"rapidkv": {}}},
        answer(9100),
        answer("no-port"),
        answer("host:99999"),
        [],
    ],
)
def test_anything_else_is_a_clear_error(bad: object) -> None:
    with pytest.raises(DiscoveryError, match=r"10\.1\.2\.3"):
        control_from_answer(P, bad)


def test_block_size_and_max_num_seqs_come_with_the_address_when_valid() -> None:
    full = answer("127.0.0.1:9100")
    full["kv_transfer_params"]["rapidkv"].update(block_size=16, max_num_seqs=8)
    assert discovered_from_answer(P, full) == Discovered("127.0.0.1:9100", 16, 8)
    for bad in (0, -1, True, 8.0, "8", None):
        odd = answer("127.0.0.1:9100")
        odd["kv_transfer_params"]["rapidkv"].update(block_size=bad, max_num_seqs=bad)
        assert discovered_from_answer(P, odd) == Discovered("127.0.0.1:9100", None, None)
    with pytest.raises(DiscoveryError):
        discovered_from_answer(P, {"kv_transfer_params": {"rapidkv": {"max_num_seqs": 8}}})
