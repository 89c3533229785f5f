"""A real Prometheus server for tests (`PrometheusServer`): scrapes the given
targets every `scrape_interval_s`, evaluates the given rule files as often,
serves its HTTP API on a free loopback port, keeps its data in a directory of
its own; its process tree is a `ManagedProcess` (stopped by process group,
and by the harness's watchdog if this process dies first). `check_rules` runs
`promtool check rules`.

`start()` and `check_rules` raise `PrometheusUnavailable` (with the reason: no
`prometheus` or `promtool` binary; install Debian's `prometheus`, which
`scripts/setup` does where it can) before starting anything they could not
finish.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from rapidkv.harness.ports import free_port
from rapidkv.harness.process import ManagedProcess

INSTALL_HINT = "Debian: apt-get install prometheus"


class PrometheusUnavailable(RuntimeError):
    """Prometheus cannot run on this machine (the reason is the message)."""


def check_rules(path: Path) -> str:
    """`promtool check rules path`'s output; raises `AssertionError` with it
    when promtool finds the file wrong."""
    promtool = shutil.which("promtool")
    if promtool is None:
        raise PrometheusUnavailable(f"no `promtool` binary on PATH ({INSTALL_HINT})")
    run = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    out = run.stdout + run.stderr
    if run.returncode != 0:
        raise AssertionError(f"promtool check rules {path} failed:\n{out}")
    return out


class PrometheusServer:
    """One Prometheus scraping `targets` (job name -> ``host:port`` addresses,
    each scraped at ``/metrics``) and evaluating `rule_files`."""

    def __init__(
        self,
        targets: Mapping[str, Sequence[str]],
        *,
        rule_files: Sequence[Path] = (),
        scrape_interval_s: float = 1.0,
        log_dir: Path | None = None,
    ) -> None:
        self.binary = shutil.which("prometheus")
        self.targets = {job: list(addrs) for job, addrs in targets.items()}
        self.rule_files = [Path(p).resolve() for p in rule_files]
        self.scrape_interval_s = scrape_interval_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data_dir = Path(tempfile.mkdtemp(prefix="rapidkv-prometheus-"))
        self.log_path = (log_dir or self.data_dir) / "prometheus.log"
        self.process: ManagedProcess | None = None

    def config(self) -> dict[str, Any]:
        """The configuration file's content (YAML is a superset of JSON)."""
        interval = f"{int(self.scrape_interval_s * 1000)}ms"
        return {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": addrs}]}
                for job, addrs in self.targets.items()
            ],
        }

    def start(self, timeout_s: float = 30.0) -> PrometheusServer:
        if self.binary is None:
            raise PrometheusUnavailable(f"no `prometheus` binary on PATH ({INSTALL_HINT})")
        config = self.data_dir / "prometheus.yml"
        config.write_text(json.dumps(self.config(), indent=1))
        argv = [
            self.binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={self.data_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        self.process = ManagedProcess(argv, {}, self.log_path, name="prometheus")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.returncode() is not None:
                tail = self.process.log_tail(40)
                self.stop()
                raise PrometheusUnavailable(f"prometheus exited: {tail}")
            try:
                if httpx.get(self.url + "/-/ready", timeout=1, trust_env=False).is_success:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise PrometheusUnavailable(f"prometheus not ready within {timeout_s}s ({self.log_path})")

    def api(self, path: str, **params: str) -> Any:
        """``GET /api/v1/<path>``'s data; raises with Prometheus' error."""
        resp = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10, trust_env=False)
        body = resp.json()
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result now: ``[{"metric": labels, "value": [t, "v"]}]``
        (a scalar's value comes back as one such element without labels)."""
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def targets_up(self) -> dict[str, str]:
        """Each active target's ``job/address`` and health (``up``, ``down``, ``unknown``)."""
        active = self.api("targets", state="active")["activeTargets"]
        return {f"{t['labels']['job']}/{t['labels']['instance']}": t["health"] for t in active}

    def rules(self) -> list[dict[str, Any]]:
        """Every rule loaded, with its ``health``, ``lastError`` and ``lastEvaluation``."""
        return [r for g in self.api("rules")["groups"] for r in g["rules"]]

    def stop(self) -> None:
        """Stop its process tree and remove its data (idempotent)."""
        if self.process is not None:
            self.process.stop(grace=5.0)
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
