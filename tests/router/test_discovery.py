"""Reading a prefill instance's control address out of its probe answer."""

from __future__ import annotations

import pytest

from rapidkv.router.config import Instance
from rapidkv.router.fleet.discovery import (
    Discovered,
    DiscoveryError,
    KVEvents,
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


def test_the_identity_and_the_kv_event_publisher_come_with_the_address() -> None:
    full = answer("127.0.0.1:9100")
    full["kv_transfer_params"]["rapidkv"].update(
        instance_id="p-1",
        incarnation="abc",
        kv_events={
            "endpoint": "tcp://*:5557",
            "replay_endpoint": "tcp://127.0.0.1:5558",
            "topic": "kv",
        },
    )
    found = discovered_from_answer(P, full)
    assert found.identity == "p-1/abc"
    assert found.kv_events == KVEvents("tcp://10.1.2.3:5557", "tcp://127.0.0.1:5558", "kv")
    assert found.model_root is None  # only a probe asks /v1/models


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        ({"endpoint": "tcp://0.0.0.0:5557"}, KVEvents("tcp://10.1.2.3:5557")),
        ({"endpoint": "tcp://[::]:5557"}, KVEvents("tcp://10.1.2.3:5557")),
        ({"endpoint": "tcp://[fe80::1]:5557"}, KVEvents("tcp://[fe80::1]:5557")),
        ({"endpoint": "tcp://[::ffff:10.0.0.5]:5557"}, KVEvents("tcp://10.0.0.5:5557")),
        (
            {"endpoint": "tcp://*:5557", "replay_endpoint": "ipc:///x"},
            KVEvents("tcp://10.1.2.3:5557"),
        ),
        ({"endpoint": "ipc:///tmp/kv"}, None),  # not reachable from another process's host
        ({"endpoint": "tcp://*:0"}, None),  # a port the OS picked: nobody can tell which
        ({"endpoint": "tcp://*:http"}, None),
        ({"endpoint": 5557}, None),
        ("tcp://*:5557", None),
    ],
)
def test_a_publisher_is_taken_only_where_this_side_can_connect(
    events: object, expected: KVEvents | None
) -> None:
    full = answer("127.0.0.1:9100")
    full["kv_transfer_params"]["rapidkv"]["kv_events"] = events
    assert discovered_from_answer(P, full).kv_events == expected
