"""The two-namespace link: its pure parts (tc arguments, rates, addresses), and,
where this machine allows network namespaces, a real link: the cap holds, the
root namespace reaches both sides, and nothing is left afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from rapidkv.harness.netns import (
    NetnsUnavailable,
    _addresses,
    netns_exec_prefix,
    netns_link,
    rate_bits,
    tbf_args,
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


SINK = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5555)); s.listen(); print("ready", flush=True)
c, _ = s.accept(); n = 0
while (d := c.recv(1 << 20)):
    n += len(d)
print(n, flush=True)
"""
SOURCE = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 5555)); buf = bytes(1 << 20); t = time.perf_counter()
for _ in range(int(sys.argv[2])):
    c.sendall(buf)
c.close(); print(time.perf_counter() - t, flush=True)
"""


def test_a_real_link_caps_a_to_b_and_is_gone_afterwards() -> None:
    try:
        with netns_link(rate="200mbit") as link:
            names = (link.a.name, link.b.name)
            sink = subprocess.Popen(
                [*netns_exec_prefix(link.b.name), sys.executable, "-c", SINK, link.b.host],
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
                before = link.tx_bytes(link.a)
                mib = 8
                source = [sys.executable, "-c", SOURCE, link.b.host, str(mib)]
                out = subprocess.run(
                    [*netns_exec_prefix(link.a.name), *source],
                    capture_output=True,
                    text=True,
                    timeout=30,
                    check=True,
                )
                assert int(sink.stdout.readline()) == mib << 20
                seconds = float(out.stdout)
                # through A's veth, at about the rate (200 Mbit/s: 25 MB/s)
                assert link.tx_bytes(link.a) - before >= mib << 20
                assert (mib << 20) / seconds < 1.3 * 25e6, f"{(mib << 20) / seconds / 1e6} MB/s"
            finally:
                sink.kill()
                sink.wait(10)
            # the root namespace reaches both sides (a refused port, not a timeout)
            import socket

            for host in (link.a.host, link.b.host):
                with socket.socket() as s, pytest.raises(ConnectionRefusedError):
                    s.settimeout(5)
                    s.connect((host, 9))
    except NetnsUnavailable as e:
        pytest.skip(f"network namespaces not allowed here: {e}")
    time.sleep(0.1)
    left = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    assert not set(names) & set(left)
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert f"rkv{link.index}r" not in links
