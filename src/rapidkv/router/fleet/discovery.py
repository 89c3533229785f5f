"""Finding a prefill instance's control address over HTTP.

When an instance is configured without one (``--prefill URL``), the router
sends it a one-token completion whose ``kv_transfer_params`` carry
``{"rapidkv": {"discover": true}}``. The instance's connector answers in the
response's ``kv_transfer_params``: ``{"rapidkv": {"control": "host:port",
"instance_id": ..., "block_size": N, "max_num_seqs": M}}``. A control plane
listening on every interface (``0.0.0.0`` or ``::``) is reached at the host of
the instance's URL. The block size (which a split prefill's head is a multiple
of) and the engine's ``max_num_seqs`` (how many requests it runs at once: the
adaptive placement's capacity) are optional.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import aiohttp

from rapidkv.control.address import WILDCARD_HOSTS, format_address, parse_address
from rapidkv.router.config import Instance
from rapidkv.router.upstream import UPSTREAM_ERRORS, get, post_json


class DiscoveryError(RuntimeError):
    """The instance did not say where its control plane listens."""


class Discovered(NamedTuple):
    """What an instance's connector told of itself."""

    control: str
    block_size: int | None = None
    max_num_seqs: int | None = None


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
    return Discovered(
        control_from_answer(inst, answer),
        block_size_from_answer(answer),
        _positive_int(answer, "max_num_seqs"),
    )


def _positive_int(answer: Any, key: str) -> int | None:
    """``kv_transfer_params.rapidkv.<key>`` of an answer if it is an int > 0."""
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    ours = params.get("rapidkv") if isinstance(params, dict) else None
    v = ours.get(key) if isinstance(ours, dict) else None
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
        body["model"] = json.loads(raw)["data"][0]["id"]
        status, raw = await post_json(http, f"{inst.url}/v1/completions", body, timeout)
    except (*UPSTREAM_ERRORS, KeyError, IndexError, TypeError, ValueError) as e:
        raise DiscoveryError(f"{inst.url}: probe failed: {e!r}") from None
    if status != 200:
        raise DiscoveryError(f"{inst.url}: probe answered HTTP {status}")
    try:
        answer = json.loads(raw)
    except ValueError:
        raise DiscoveryError(f"{inst.url}: probe answer is not JSON") from None
    return discovered_from_answer(inst, answer)
