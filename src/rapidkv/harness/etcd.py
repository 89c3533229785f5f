"""A real etcd server for tests and benchmarks (`EtcdServer`): one member on
free loopback ports, its data in a temporary directory, its own process group.

`EtcdServer.start()` raises `EtcdUnavailable` (with the reason: no `etcd`
binary; install Debian's `etcd-server`, which `scripts/setup` does where it
can) before starting anything it could not finish; `stop()` kills the whole
group and removes the data. `kill()` is a crash (SIGKILL), `restart()` starts
the same member on the same ports and data.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from rapidkv.harness.ports import free_port


class EtcdUnavailable(RuntimeError):
    """etcd cannot run on this machine (the reason is the message)."""


class EtcdServer:
    def __init__(self, log_dir: Path | None = None) -> None:
        self.binary = shutil.which("etcd")
        self.client_port, self.peer_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.client_port}"
        self.data_dir = Path(tempfile.mkdtemp(prefix="rapidkv-etcd-"))
        self.log_path = (log_dir or self.data_dir) / "etcd.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> EtcdServer:
        if self.binary is None:
            raise EtcdUnavailable("no `etcd` binary on PATH (Debian: apt-get install etcd-server)")
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [
            self.binary,
            "--name", "rapidkv-test",
            "--data-dir", str(self.data_dir / "data"),
            "--listen-client-urls", self.url,
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"rapidkv-test={peer}",
        ]  # fmt: skip
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                self.stop()
                raise EtcdUnavailable(f"etcd exited with {self.process.returncode}: {tail}")
            try:
                if httpx.get(self.url + "/version", timeout=1, trust_env=False).is_success:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise EtcdUnavailable(f"etcd did not answer within {timeout_s}s (log: {self.log_path})")

    def kill(self) -> None:
        """Stop it as a crash would (SIGKILL to its group); the data stays."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        """Kill it and remove its data (idempotent)."""
        self.kill()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
