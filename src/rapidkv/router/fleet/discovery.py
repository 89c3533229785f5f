"""Finding a prefill instance's control address over HTTP.

When an instance is configured without one (``--prefill URL``), the router
sends it a one-token completion whose ``kv_transfer_params`` carry
``{"rapidkv": {"discover": true}}``. The instance's connector answers in the
response's ``kv_transfer_params``: ``{"rapidkv": {"control": "host:port",
"instance_id": ..., "incarnation": ..., "block_size": N, "max_num_seqs": M,
"kv_events": {"endpoint": ..., "replay_endpoint": ..., "topic": ...}}}``. A
control plane listening on every interface (``0.0.0.0`` or ``::``) is reached
at the host of the instance's URL, and so is a KV-event publisher bound to
``*`` or a wildcard address; one bound to an IPv4-mapped IPv6 address
(``[::ffff:10.0.0.5]``, how vLLM binds one IPv4 address) is reached at that
IPv4 address. The block size (which a split prefill's head is a
multiple of), the engine's ``max_num_seqs`` (how many requests it runs at
once: the adaptive placement's capacity), the process's identity (instance id
and incarnation: a restart changes it) and where vLLM publishes its KV events
(the router's prefix index subscribes there) are optional; so is the model's
directory, the ``root`` the instance's ``/v1/models`` names (the router's
tokenizer, when it is on this host).
"""

from __future__ import annotations

import ipaddress
import json
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import aiohttp

from rapidkv.control.address import WILDCARD_HOSTS, format_address, parse_address
from rapidkv.router.config import Instance
from rapidkv.router.upstream import UPSTREAM_ERRORS, get, post_json


class DiscoveryError(RuntimeError):
    """The instance did not say where its control plane listens."""


class KVEvents(NamedTuple):
    """Where an instance's vLLM publishes its KV events, as this side connects."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


class Discovered(NamedTuple):
    """What an instance's connector told of itself."""

    control: str
    block_size: int | None = None
    max_num_seqs: int | None = None
    identity: str | None = None  # "<instance_id>/<incarnation>": a restart changes it
    kv_events: KVEvents | None = None
    model_root: str | None = None  # /v1/models' root: the model's directory there


def probe_body() -> dict[str, Any]:
    """The completion that asks an instance for its control address."""
    return {
        "prompt": [1],
        "max_tokens": 1,
        "temperature": 0.0,
        "stream": False,
        "kv_transfer_params": {"rapidkv": {"discover": True}},
    }


def control_from_answer(inst: Instance, answer: Any) -> str:
    """The control address in a probe's answer (wildcard hosts replaced by the URL's host)."""
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    ours = params.get("rapidkv") if isinstance(params, dict) else None
    address = ours.get("control") if isinstance(ours, dict) else None
    if not isinstance(address, str):
        raise DiscoveryError(
            f"{inst.url} did not report a control address (is RapidKVConnector loaded?)"
        )
    try:
        host, port = parse_address(address)
    except ValueError as e:
        raise DiscoveryError(f"{inst.url} reported {e}") from None
    if host in WILDCARD_HOSTS:
        host = urlsplit(inst.url).hostname or host
    return format_address(host, port)


def block_size_from_answer(answer: Any) -> int | None:
    """The block size in a probe's answer, if it gives a valid one."""
    return _positive_int(answer, "block_size")


def discovered_from_answer(inst: Instance, answer: Any) -> Discovered:
    """Everything a probe's (or any P's) answer tells; DiscoveryError without
    a control address."""
    ours = _ours(answer)
    instance_id, incarnation = ours.get("instance_id"), ours.get("incarnation")
    identity = None
    if isinstance(instance_id, str) and isinstance(incarnation, str):
        identity = f"{instance_id}/{incarnation}"
    return Discovered(
        control_from_answer(inst, answer),
        block_size_from_answer(answer),
        _positive_int(answer, "max_num_seqs"),
        identity,
        kv_events_from_answer(inst, answer),
    )


def kv_events_from_answer(inst: Instance, answer: Any) -> KVEvents | None:
    """Where the instance publishes KV events, if its answer says it validly
    (ZMQ ``tcp://host:port`` endpoints; a wildcard host is the instance URL's)."""
    events = _ours(answer).get("kv_events")
    if not isinstance(events, dict):
        return None
    endpoint = _tcp_endpoint(inst, events.get("endpoint"))
    if endpoint is None:
        return None
    replay = _tcp_endpoint(inst, events.get("replay_endpoint"))
    topic = events.get("topic")
    return KVEvents(endpoint, replay, topic if isinstance(topic, str) else "")


def _tcp_endpoint(inst: Instance, value: Any) -> str | None:
    if not isinstance(value, str) or not value.startswith("tcp://"):
        return None
    host, sep, port = value[len("tcp://") :].rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    host = host.strip("[]")
    if host in ("*", *WILDCARD_HOSTS):
        host = urlsplit(inst.url).hostname or "127.0.0.1"
    else:
        host = _unmapped(host)
    return f"tcp://{format_address(host, int(port))}"


def _unmapped(host: str) -> str:
    """An IPv4-mapped IPv6 address as its IPv4 address (how a vLLM publisher
    is bound to one IPv4 address: `harness.kv_events`); any other host as is."""
    try:
        mapped = ipaddress.IPv6Address(host).ipv4_mapped
    except ValueError:
        return host
    return str(mapped) if mapped is not None else host


def _ours(answer: Any) -> dict[str, Any]:
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    ours = params.get("rapidkv") if isinstance(params, dict) else None
    return ours if isinstance(ours, dict) else {}


def _positive_int(answer: Any, key: str) -> int | None:
    """``kv_transfer_params.rapidkv.<key>`` of an answer if it is an int > 0."""
    v = _ours(answer).get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


async def discover_control(
    http: aiohttp.ClientSession, inst: Instance, timeout: float
) -> Discovered:
    """Ask `inst` for its control address, block size and max_num_seqs;
    DiscoveryError if it cannot tell the address."""
    try:
        status, raw, _ = await get(http, f"{inst.url}/v1/models", timeout)
        if status != 200:
            raise DiscoveryError(f"{inst.url}: /v1/models answered HTTP {status}")
        body = probe_body()
        model = json.loads(raw)["data"][0]
        body["model"] = model["id"]
        root = model.get("root")
        status, raw = await post_json(http, f"{inst.url}/v1/completions", body, timeout)
    except (*UPSTREAM_ERRORS, KeyError, IndexError, TypeError, ValueError) as e:
        raise DiscoveryError(f"{inst.url}: probe failed: {e!r}") from None
    if status != 200:
        raise DiscoveryError(f"{inst.url}: probe answered HTTP {status}")
    try:
        answer = json.loads(raw)
    except ValueError:
        raise DiscoveryError(f"{inst.url}: probe answer is not JSON") from None
    found = discovered_from_answer(inst, answer)
    return found._replace(model_root=root if isinstance(root, str) else None)
