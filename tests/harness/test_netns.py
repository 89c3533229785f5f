"""The two-namespace link: its pure parts (tc arguments, rates, addresses), and,
where this machine allows network namespaces, a real link: the cap holds, the
root namespace reaches both sides, and nothing is left afterwards."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess

import pytest

from rapidkv.harness.netns import (
    NetnsUnavailable,
    _addresses,
    bench_link,
    netns_exec_prefix,
    netns_link,
    rate_bits,
    tbf_args,
    tcp_throughput,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_rates_are_tc_rates_in_bits() -> None:
    assert rate_bits("1gbit") == 1e9
    assert rate_bits("500mbit") == 5e8
    assert rate_bits("2.5Gbit") == 2.5e9
    for bad in ("1gb", "fast", "0gbit", "-1mbit", "1 gbit/s", ""):
        with pytest.raises(ValueError, match="rate"):
            rate_bits(bad)


def test_tbf_bucket_holds_four_milliseconds_at_the_rate_and_at_least_64_kib() -> None:
    assert tbf_args("1gbit") == [
        "tbf",
        "rate",
        "1gbit",
        "burst",
        "500000",
        "latency",
        "50ms",
    ]
    assert tbf_args("10mbit", latency="20ms")[4] == str(64 * 1024)
    assert tbf_args("10GBIT")[2] == "10gbit"


def test_each_index_has_its_own_addresses() -> None:
    a = _addresses(7)
    assert (a["a"], a["b"]) == ("10.77.7.1", "10.77.7.2")
    assert (a["root_a"], a["a_root"], a["root_b"], a["b_root"]) == (
        "10.78.7.1",
        "10.78.7.2",
        "10.78.7.5",
        "10.78.7.6",
    )
    assert set(a.values()).isdisjoint(_addresses(8).values())


def test_the_exec_prefix_names_the_namespace() -> None:
    assert netns_exec_prefix(None) == []
    prefix = netns_exec_prefix("rapidkv-3-99-b")
    assert prefix[0].endswith("ip") and prefix[1:] == ["netns", "exec", "rapidkv-3-99-b"]
    for bad in ("", "a/b", ".."):
        with pytest.raises(ValueError):
            netns_exec_prefix(bad)


def test_a_bad_rate_is_the_callers_error_not_a_skip() -> None:
    with pytest.raises(ValueError), netns_link(rate="1gb"):
        pass


def test_a_benchmark_without_a_link_gets_none_and_keeps_its_sigterm_handler() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with contextlib.ExitStack() as stack:
        assert bench_link(stack, None, progress=None) == (None, None)
        assert bench_link(stack, "", progress=None) == (None, None)
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_real_link_caps_a_to_b_and_is_gone_afterwards() -> None:
    try:
        with netns_link(rate="200mbit") as link:
            names = (link.a.name, link.b.name)
            got = tcp_throughput(link, mib=8)
            # through A's veth, at about the rate (200 Mbit/s: 0.025 GB/s)
            assert got["veth_bytes"] >= 8 << 20
            assert got["gbps"] < 1.2 * 0.025, got
            # the root namespace reaches both sides (a refused port, not a timeout)
            for host in (link.a.host, link.b.host):
                with socket.socket() as s, pytest.raises(ConnectionRefusedError):
                    s.settimeout(5)
                    s.connect((host, 9))
    except NetnsUnavailable as e:
        pytest.skip(f"network namespaces not allowed here: {e}")
    left = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    assert not set(names) & set(left)
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert f"rkv{link.index}r" not in links


def test_where_namespaces_are_not_allowed_the_reason_is_given_and_nothing_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not root, or `ip netns add` refused (a container without CAP_SYS_ADMIN):
    `NetnsUnavailable` says which; whatever was created is deleted again."""
    from rapidkv.harness import netns

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NetnsUnavailable, match="needs root"), netns_link():
        pass
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    monkeypatch.setattr(netns, "_existing", lambda: [])
    monkeypatch.setattr(netns, "sweep_stale", lambda: [])
    deleted = []
    monkeypatch.setattr(netns, "_delete", lambda n, names: deleted.append((n, list(names))))

    def refuse(args, tool="ip"):
        if args[:2] == ["netns", "add"]:
            raise netns._Refused(
                "`ip netns add x` failed: mount --make-shared /run/netns failed: "
                "Operation not permitted"
            )
        return ""

    monkeypatch.setattr(netns, "_ip", refuse)
    with (
        pytest.raises(NetnsUnavailable, match=r"does not allow the link.*Operation not permitted"),
        netns_link(rate="1gbit"),
    ):
        pass
    assert deleted and deleted[0][0] == 1 and len(deleted[0][1]) == 2
