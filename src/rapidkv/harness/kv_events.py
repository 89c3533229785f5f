"""vLLM's KV-event publisher, bound to one address.

vLLM 0.32's ZMQ publisher binds its PUB socket only to an endpoint that
contains ``*`` or ``::`` (or an ``ipc://`` / ``inproc://`` one) and connects out
to any other (`ZmqEventPublisher._is_bind_endpoint`), so ``tcp://*:PORT``, the
documented form, listens on every interface. An IPv4 address written
IPv4-mapped, ``tcp://[::ffff:127.0.0.1]:PORT``, contains ``::``: vLLM binds it,
and libzmq binds the IPv4 address alone. The harness's servers publish so, on
loopback; a router reads the endpoint as that IPv4 address
(`router.fleet.discovery`).
"""

from __future__ import annotations

import ipaddress

from rapidkv.harness.ports import LOOPBACK


def bound_endpoint(port: int, host: str = LOOPBACK) -> str:
    """The publisher endpoint that vLLM binds on `host` (an IPv4 address) only."""
    ipaddress.IPv4Address(host)  # ValueError for anything else
    return f"tcp://[::ffff:{host}]:{port}"
