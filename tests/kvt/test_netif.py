"""`kvt.netif`: the interface holding an address; UCX settings for one interface."""

from __future__ import annotations

import pytest

from rapidkv.kvt.netif import interface_addresses, interface_of

pytestmark = pytest.mark.unit


def test_loopback_is_found_by_address_and_by_name() -> None:
    found = interface_addresses()
    lo = next(name for name, addresses in found.items() if "127.0.0.1" in addresses)
    assert interface_of("127.0.0.1") == lo
    assert interface_of("localhost") == lo


def test_an_address_no_interface_holds_is_refused_naming_the_interfaces() -> None:
    fake = {"lo": ["127.0.0.1", "::1"], "eth0": ["192.0.2.2", "fd00::2"]}
    assert interface_of("fd00:0::2", fake) == "eth0"
    assert interface_of("[::1]", fake) == "lo"
    with pytest.raises(ValueError, match=r"no network interface holds '10\.1\.2\.3'.*eth0"):
        interface_of("10.1.2.3", fake)
    with pytest.raises(ValueError, match="cannot resolve"):
        interface_of("no-such-host.invalid", fake)


def test_ucx_is_kept_on_the_interface_over_tcp_unless_the_user_chose() -> None:
    from rapidkv.kvt.transport.nixl import ucx_interface_env

    assert ucx_interface_env("rkv1a", {}) == {"UCX_NET_DEVICES": "rkv1a", "UCX_TLS": "tcp"}
    assert ucx_interface_env("rkv1a", {"UCX_TLS": "rc,tcp"}) == {"UCX_NET_DEVICES": "rkv1a"}
    assert ucx_interface_env("eth0", {"UCX_NET_DEVICES": "mlx5_0:1", "UCX_TLS": "rc"}) == {}
