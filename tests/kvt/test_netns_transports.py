"""Both transports between two network namespaces joined by a capped veth
(`harness.netns`), as P and D on two hosts: the receiver in namespace B, the
sender in A, each given the address of its end of the link as the connector
gives `kvt_host`. The bytes must cross the veth (its counter grows by at
least the payload) and land intact.

NIXL with no address is the control experiment: UCX finds the peer on the
same host and writes by shared memory / cross-memory attach, past the veth
(docs/environment.md, "NIXL/UCX over TCP on one interface"): that is why the
connector sets ``UCX_TLS=tcp`` with ``UCX_NET_DEVICES``.

Skips, with the reason, where network namespaces are not allowed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rapidkv.harness.netns import NetnsLink, NetnsUnavailable, netns_exec_prefix, netns_link
from rapidkv.harness.server import SRC_DIR

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

PEER = Path(__file__).with_name("netns_peer.py")
NBYTES = 16 << 20
HAS_NIXL = importlib.util.find_spec("nixl") is not None


@pytest.fixture(scope="module")
def link() -> Iterator[NetnsLink]:
    try:
        with netns_link(rate="2gbit") as link:
            yield link
    except NetnsUnavailable as e:
        pytest.skip(f"network namespaces not allowed here: {e}")


def write_across(link: NetnsLink, kind: str, tmp: Path, send: dict, recv: dict) -> int:
    """Run one write A -> B; the bytes A's veth end sent meanwhile."""
    env = {"PYTHONPATH": str(SRC_DIR), "PATH": "/usr/bin:/bin:/usr/sbin:/sbin"}
    before = link.tx_bytes(link.a)

    def start(side, role: str, options: dict) -> subprocess.Popen:
        argv = [sys.executable, str(PEER), kind, role, str(tmp), json.dumps(options)]
        log = open(tmp / f"{role}.log", "w")  # noqa: SIM115 - closed with the process
        return subprocess.Popen(
            [*netns_exec_prefix(side.name), *argv], env=env, stdout=log, stderr=log
        )

    procs = [start(link.b, "recv", recv), start(link.a, "send", send)]
    try:
        codes = [p.wait(60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    logs = {role: (tmp / f"{role}.log").read_text()[-3000:] for role in ("recv", "send")}
    assert codes == [0, 0], f"exit codes {codes}: {logs}"
    assert (tmp / "result").read_bytes() == b"ok", logs
    return link.tx_bytes(link.a) - before


@pytest.mark.parametrize(
    "kind", ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(not HAS_NIXL, reason="no nixl"))]
)
def test_a_write_crosses_the_link_at_the_given_addresses(
    link: NetnsLink, kind: str, tmp_path: Path
) -> None:
    if kind == "tcp":  # the receiver listens everywhere and advertises its link address
        recv = {"host": "0.0.0.0", "advertise_host": link.b.host}
    else:
        recv = {"host": link.b.host}
    crossed = write_across(link, kind, tmp_path, {"host": link.a.host}, recv)
    assert crossed >= NBYTES, f"{crossed} bytes crossed the veth for {NBYTES}"


@pytest.mark.skipif(not HAS_NIXL, reason="no nixl")
def test_nixl_left_to_ucx_writes_past_the_veth(link: NetnsLink, tmp_path: Path) -> None:
    crossed = write_across(link, "nixl", tmp_path, {}, {})
    assert crossed < NBYTES // 10, f"{crossed} bytes crossed: UCX now uses the network here"
