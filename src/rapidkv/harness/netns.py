"""Two Linux network namespaces joined by a (rate-capped) veth pair: P and D as
if on two hosts, on one machine.

    with netns_link(rate="1gbit") as link:
        p = ServerSpec(..., netns=link.a.name, host=link.a.host)
        d = ServerSpec(..., netns=link.b.name, host=link.b.host)

Topology (``n`` is a free index, 1..250, per link; names carry the creating pid)::

    namespace A "rapidkv-{n}-{pid}-a"           namespace B "rapidkv-{n}-{pid}-b"
      rkv{n}a 10.77.n.1/24 <== veth, tbf ==> rkv{n}b 10.77.n.2/24
      rkv{n}ar 10.78.n.2/30                     rkv{n}br 10.78.n.6/30
          |                                          |
    root namespace (the test, router, client)        |
      rkv{n}ra 10.78.n.1/30                     rkv{n}rb 10.78.n.5/30
      routes: 10.77.n.1 via 10.78.n.2, 10.77.n.2 via 10.78.n.6

Each instance is known to everyone by its address on the A-B link
(`Side.host`): P and D reach each other over the capped veth (their only
route to each other's 10.77 address); the root namespace reaches both over
uncapped veths of their own (a host route per address). So the router and the
client in the root namespace talk to the servers' HTTP and control ports at
the very addresses the servers advertise, and only P<->D traffic crosses the
cap. With `rate`, both ends of the A-B veth get ``tc qdisc add dev DEV root
tbf rate RATE burst B latency L`` (`tbf_args`). Loopback is up in both
namespaces.

Invariants:
* `netns_link` removes everything it created when its block ends, however it
  ends (links first, then namespaces); a process still inside a namespace
  keeps only that namespace alive, never a link in the root namespace.
* Creation is serialised by a lock file and the index is chosen among those no
  namespace of a live creator uses; namespaces left by a creator that died
  (SIGKILL) are removed at the next creation.
* Where this machine does not allow it (not root, no iproute2 / tc, `ip netns
  add` or the tbf qdisc refused), `netns_link` raises `NetnsUnavailable` with
  the reason, after removing what it had created: tests skip with it.

Processes run in a namespace with `netns_exec_prefix` (``ip netns exec NS``,
which execs the command: same pid, same process group, killed by group as
any server; it also mounts the namespace's own /sys, which UCX needs to list
the namespace's interfaces: a process that only `setns`-ed finds none of them).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NETNS_DIR = Path("/run/netns")
NAME_RE = re.compile(r"^rapidkv-(\d+)-(\d+)-([ab])$")
MAX_INDEX = 250
LINK_NET = "10.77"  # 10.77.n.0/24: the A-B link
ROOT_NET = "10.78"  # 10.78.n.0/30 and 10.78.n.4/30: root <-> A, root <-> B
DEFAULT_LATENCY = "50ms"  # tbf: the longest a packet may wait in the queue
MIN_BURST = 64 * 1024  # bytes; at least one GSO segment
BURST_S = 0.004  # tbf bucket: 4 ms at the rate


class NetnsUnavailable(RuntimeError):
    """Network namespaces (or the rate cap) cannot be set up here; the message says why."""


@dataclass(frozen=True)
class Side:
    """One namespace of a link: its name, its address and device on the A-B link."""

    name: str
    host: str
    device: str


@dataclass(frozen=True)
class NetnsLink:
    """A running link (see the module docstring)."""

    index: int
    a: Side
    b: Side
    rate: str | None
    tbf: tuple[str, ...]  # tc arguments after "root", empty without a rate

    def tx_bytes(self, side: Side) -> int:
        """Bytes sent so far by `side`'s end of the A-B veth (its kernel counter)."""
        out = _ip(["-n", side.name, "-j", "-s", "link", "show", "dev", side.device])
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def describe(self) -> dict[str, object]:
        return {
            "a": {"netns": self.a.name, "host": self.a.host, "device": self.a.device},
            "b": {"netns": self.b.name, "host": self.b.host, "device": self.b.device},
            "rate": self.rate,
            "qdisc": " ".join(self.tbf) if self.tbf else None,
        }


_SINK = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 0)); s.listen(); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); n = 0
while (d := c.recv(1 << 20)):
    n += len(d)
print(n, flush=True)
"""
_SOURCE = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
buf = bytes(1 << 20); t = time.perf_counter()
for _ in range(int(sys.argv[3])):
    c.sendall(buf)
c.shutdown(socket.SHUT_WR); c.recv(1); c.close()  # the sink has read it all
print(time.perf_counter() - t, flush=True)
"""


def tcp_throughput(link: NetnsLink, mib: int = 64, timeout: float = 120.0) -> dict[str, float]:
    """One TCP stream A -> B of `mib` MiB (plain sockets, one process per side):
    GB/s from the first send to the sink's end of reading, and the bytes A's
    veth end sent meanwhile."""
    sink = subprocess.Popen(
        [*netns_exec_prefix(link.b.name), sys.executable, "-c", _SINK, link.b.host],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sink.stdout is not None
        port = sink.stdout.readline().strip()
        if not port:
            raise RuntimeError("the sink in namespace B did not start")
        before = link.tx_bytes(link.a)
        source = [sys.executable, "-c", _SOURCE, link.b.host, port, str(mib)]
        out = subprocess.run(
            [*netns_exec_prefix(link.a.name), *source],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        )
        got = int(sink.stdout.readline())
        if got != mib << 20:
            raise RuntimeError(f"the sink read {got} bytes of {mib << 20}")
        return {
            "gbps": round((mib << 20) / float(out.stdout) / 1e9, 4),
            "veth_bytes": link.tx_bytes(link.a) - before,
            "bytes": mib << 20,
        }
    finally:
        sink.kill()
        sink.wait(10)


def netns_exec_prefix(netns: str | None) -> list[str]:
    """The argv prefix that runs a command in network namespace `netns` (none for None)."""
    if netns is None:
        return []
    if not netns or "/" in netns or netns in (".", ".."):
        raise ValueError(f"invalid network namespace name {netns!r}")
    ip = shutil.which("ip")
    if ip is None:
        raise RuntimeError("running in a network namespace needs `ip` (iproute2)")
    return [ip, "netns", "exec", netns]


_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$")
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def rate_bits(rate: str) -> float:
    """Bits per second of a tc rate such as ``1gbit``, ``500mbit`` (ValueError otherwise)."""
    m = _RATE_RE.match(rate.strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"rate {rate!r}: give a positive number and bit, kbit, mbit, gbit or tbit")
    return float(m.group(1)) * _RATE_UNITS[m.group(2)]


def tbf_args(rate: str, latency: str = DEFAULT_LATENCY) -> list[str]:
    """``tbf rate R burst B latency L``: the bucket holds `BURST_S` at the rate
    (at least `MIN_BURST` bytes: tbf must fit a segment, and a bucket below
    rate/HZ caps below the rate)."""
    burst = max(MIN_BURST, int(rate_bits(rate) / 8 * BURST_S))
    return ["tbf", "rate", rate.strip().lower(), "burst", str(burst), "latency", latency]


def _addresses(n: int) -> dict[str, str]:
    return {
        "a": f"{LINK_NET}.{n}.1",
        "b": f"{LINK_NET}.{n}.2",
        "root_a": f"{ROOT_NET}.{n}.1",
        "a_root": f"{ROOT_NET}.{n}.2",
        "root_b": f"{ROOT_NET}.{n}.5",
        "b_root": f"{ROOT_NET}.{n}.6",
    }


def _ip(args: Sequence[str], tool: str = "ip") -> str:
    exe = shutil.which(tool)
    if exe is None:
        raise NetnsUnavailable(f"no `{tool}` command (iproute2) on this machine")
    done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise _Refused(
            f"`{tool} {' '.join(args)}` failed: {done.stderr.strip() or done.returncode}"
        )
    return done.stdout


class _Refused(NetnsUnavailable):
    """One command was refused (the message has its stderr)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _existing() -> list[tuple[str, int, int]]:
    """(name, index, creator pid) of every rapidkv namespace."""
    try:
        names = os.listdir(NETNS_DIR)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = NAME_RE.match(name)
        if m:
            out.append((name, int(m.group(1)), int(m.group(2))))
    return out


def _delete(n: int, names: Sequence[str]) -> None:
    """Remove link `n`'s root-side veths (their peers go with them) and `names`."""
    for dev in (f"rkv{n}ra", f"rkv{n}rb"):
        if Path(f"/sys/class/net/{dev}").exists():
            with contextlib.suppress(NetnsUnavailable):
                _ip(["link", "del", dev])
    for name in names:
        if (NETNS_DIR / name).exists():
            with contextlib.suppress(NetnsUnavailable):
                _ip(["-n", name, "link", "del", f"rkv{n}a" if name.endswith("-a") else f"rkv{n}b"])
            with contextlib.suppress(NetnsUnavailable):
                _ip(["netns", "del", name])


def sweep_stale() -> list[str]:
    """Remove the namespaces (and links) of creators that are gone; their names."""
    stale = [(name, n) for name, n, pid in _existing() if not _pid_alive(pid)]
    for name, n in stale:
        _delete(n, [name])
    return [name for name, _ in stale]


@contextlib.contextmanager
def _creation_lock() -> Iterator[None]:
    base = Path("/run/lock") if os.access("/run/lock", os.W_OK) else Path(tempfile.gettempdir())
    with open(base / "rapidkv-netns.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _check_allowed() -> None:
    if not os.uname().sysname == "Linux":
        raise NetnsUnavailable("network namespaces need Linux")
    if os.geteuid() != 0:
        raise NetnsUnavailable("creating network namespaces needs root (CAP_SYS_ADMIN, NET_ADMIN)")
    if shutil.which("ip") is None:
        raise NetnsUnavailable("no `ip` command (iproute2) on this machine")


def _create(n: int, pid: int, rate: str | None, latency: str) -> NetnsLink:
    addr = _addresses(n)
    a, b = f"rapidkv-{n}-{pid}-a", f"rapidkv-{n}-{pid}-b"
    dev_a, dev_b = f"rkv{n}a", f"rkv{n}b"
    tbf = tuple(tbf_args(rate, latency)) if rate else ()
    try:
        _ip(["netns", "add", a])
        _ip(["netns", "add", b])
        _ip(["link", "add", dev_a, "netns", a, "type", "veth", "peer", "name", dev_b, "netns", b])
        _ip(["link", "add", f"rkv{n}ra", "type", "veth", "peer", "name", f"rkv{n}ar", "netns", a])
        _ip(["link", "add", f"rkv{n}rb", "type", "veth", "peer", "name", f"rkv{n}br", "netns", b])
        for ns, dev, host, prefix in (
            (a, dev_a, addr["a"], 24),
            (b, dev_b, addr["b"], 24),
            (a, f"rkv{n}ar", addr["a_root"], 30),
            (b, f"rkv{n}br", addr["b_root"], 30),
        ):
            _ip(["-n", ns, "addr", "add", f"{host}/{prefix}", "dev", dev])
            _ip(["-n", ns, "link", "set", dev, "up"])
            _ip(["-n", ns, "link", "set", "lo", "up"])
        for dev, host in ((f"rkv{n}ra", addr["root_a"]), (f"rkv{n}rb", addr["root_b"])):
            _ip(["addr", "add", f"{host}/30", "dev", dev])
            _ip(["link", "set", dev, "up"])
        _ip(["route", "add", f"{addr['a']}/32", "via", addr["a_root"], "dev", f"rkv{n}ra"])
        _ip(["route", "add", f"{addr['b']}/32", "via", addr["b_root"], "dev", f"rkv{n}rb"])
        # a command must run in it (`ip netns exec` mounts the namespace's /sys)
        _ip(["netns", "exec", a, "ip", "link", "show", "dev", dev_a])
        if tbf:
            if shutil.which("tc") is None:
                raise NetnsUnavailable("a rate cap needs `tc` (iproute2), not on this machine")
            for ns, dev in ((a, dev_a), (b, dev_b)):
                _ip(["-n", ns, "qdisc", "add", "dev", dev, "root", *tbf], tool="tc")
    except BaseException:
        _delete(n, [a, b])
        raise
    return NetnsLink(n, Side(a, addr["a"], dev_a), Side(b, addr["b"], dev_b), rate, tbf)


def bench_link(
    stack: contextlib.ExitStack, rate: str | None, progress: Any
) -> tuple[NetnsLink | None, dict[str, object] | None]:
    """A benchmark's ``--netns-link RATE``: from now on SIGTERM (a `timeout`)
    unwinds like Ctrl-C (servers stopped, the link removed), the link is made
    in `stack` (`NetnsUnavailable` as `netns_link` raises it), `progress`
    told, and the link described, with one TCP stream's throughput across it.
    No `rate`: no link, ``(None, None)``."""
    if not rate:
        return None, None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    link = stack.enter_context(netns_link(rate=rate))
    progress.stage(f"link {link.a.name} <-> {link.b.name}: {' '.join(link.tbf)}")
    return link, {**link.describe(), "tcp": tcp_throughput(link)}


@contextlib.contextmanager
def netns_link(rate: str | None = None, latency: str = DEFAULT_LATENCY) -> Iterator[NetnsLink]:
    """Create a link (see the module docstring), yield it, remove it. Raises
    `NetnsUnavailable` (nothing left behind) where this machine does not allow it."""
    if rate is not None:
        rate_bits(rate)  # a bad rate is the caller's error (ValueError), not the machine's
    _check_allowed()
    pid = os.getpid()
    with _creation_lock():
        sweep_stale()
        used = {n for _, n, _ in _existing()}
        free = [n for n in range(1, MAX_INDEX + 1) if n not in used]
        if not free:
            raise NetnsUnavailable(f"all {MAX_INDEX} rapidkv link indexes are in use")
        n = free[0]
        try:
            link = _create(n, pid, rate, latency)
        except _Refused as e:
            raise NetnsUnavailable(f"this machine does not allow the link: {e}") from None
    try:
        yield link
    finally:
        with _creation_lock():
            _delete(n, [link.a.name, link.b.name])
