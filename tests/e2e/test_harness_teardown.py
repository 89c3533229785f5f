"""No vLLM process outlives the test runner that started it.

A child pytest session starts a shared server fixture, reports the server's
pids and waits; we then SIGKILL it (no cleanup code can run: the harness's
watchdog must act) or SIGINT it (pytest's own teardown stops the server), two
children at once, one per signal, each server on its own core; and check
through /proc that each server's whole process tree is gone within a bounded
time, and its temporary directory with it. Also: a server that cannot start
fails with its log.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rapidkv.harness import ServerSpec, ServerStartError, VLLMServer, procs, shm, wait_until
from rapidkv.harness.server import EXECUTOR_ENV, SRC_DIR

pytestmark = pytest.mark.e2e

TESTS_DIR = Path(__file__).resolve().parents[1]
CHILD = Path(__file__).with_name("harness_child_session.py")
GONE_WITHIN_S = 60.0


def _identity(pid: int) -> tuple[int, int] | None:
    st = procs.proc_stat(pid)
    return None if st is None or not st.alive else (pid, st.starttime)


def _alive(idents: list[tuple[int, int]]) -> list[int]:
    return [pid for pid, start in idents if procs.is_alive(pid, start)]


@dataclass
class Child:
    """One child pytest session holding a server of its own, to be killed by `sig`."""

    sig: signal.Signals
    fixture: str  # the child's server: `single_server` (core 0) or `single_server_chunked` (1)
    dir: Path
    runner: subprocess.Popen | None = None
    tree: list[tuple[int, int]] = field(default_factory=list)
    shm: set[str] = field(default_factory=set)  # the server's files in /dev/shm

    def start(self) -> None:
        self.dir.mkdir(parents=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC_DIR), env.get("PYTHONPATH")]))
        env["RAPIDKV_CHILD_INFO"] = str(self.info_path)
        env["RAPIDKV_CHILD_SERVER"] = self.fixture
        env["RAPIDKV_LOG_DIR"] = str(self.dir / "logs")
        env[EXECUTOR_ENV] = "mp"  # the whole tree: API server, engine core, worker
        with open(self.log, "wb") as out:
            self.runner = subprocess.Popen(
                [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-s",
                 "-o", "addopts=", "--rootdir", str(TESTS_DIR.parent), str(CHILD)],
                cwd=TESTS_DIR.parent, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    @property
    def info_path(self) -> Path:
        return self.dir / "server.json"

    @property
    def log(self) -> Path:
        return self.dir / "runner.log"

    def ready(self) -> bool:
        assert self.runner is not None
        if self.runner.poll() is not None:
            pytest.fail(f"child runner exited early:\n{self.log.read_text()[-5000:]}")
        return self.info_path.exists()

    def kill_leftovers(self) -> None:
        """Only finds something if the test failed: never leak it."""
        if self.runner is not None and self.runner.poll() is None:
            self.runner.kill()
            self.runner.wait()
        for pid in _alive(self.tree):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(400)
def test_runner_death_leaves_no_vllm_process(tmp_path: Path, tiny_model: Path) -> None:
    """Both signals at once, each child's server on its own core (one start's time)."""
    children = [
        Child(signal.SIGKILL, "single_server", tmp_path / "SIGKILL"),
        Child(signal.SIGINT, "single_server_chunked", tmp_path / "SIGINT"),
    ]
    try:
        for child in children:
            child.start()
        wait_until(lambda: all(c.ready() for c in children), 300, what="the children's servers")
        infos = [json.loads(c.info_path.read_text()) for c in children]
        for child, info in zip(children, infos, strict=True):
            members = procs.live_in_group(info["pgid"])
            child.tree = [i for i in map(_identity, [*members, info["watchdog"]]) if i is not None]
            # api server, engine core, worker at least, plus the watchdog
            assert len(members) >= 3, f"expected a process tree, got {members}"
            assert info["pid"] in members
            assert Path(info["tmp_dir"]).is_dir(), "the server's TMPDIR should exist while it runs"
            child.shm = set(shm.held(members))  # vLLM's message queues, semaphores
            assert child.shm, "an mp server maps files in /dev/shm"
        for child in children:
            assert child.runner is not None
            child.runner.send_signal(child.sig)
        for child, info in zip(children, infos, strict=True):
            assert child.runner is not None
            name = child.sig.name
            wait_until(lambda c=child: not _alive(c.tree), GONE_WITHIN_S, what=f"{name}'s tree")
            assert procs.live_in_group(info["pgid"]) == [], name
            assert not Path(info["tmp_dir"]).exists(), f"{name}: the TMPDIR outlived the runner"
            left = sorted(p for p in child.shm if os.path.exists(p))
            assert left == [], f"{name}: these /dev/shm files outlived the runner"
            rc = child.runner.wait(GONE_WITHIN_S)
            if child.sig == signal.SIGINT:
                assert rc == 2, f"pytest should report an interrupted session, got {rc}"
                assert "KeyboardInterrupt" in child.log.read_text()
                # The runner's own teardown stopped the server (not just the watchdog).
                server_logs = list((child.dir / "logs").glob("*.log"))
                assert any(" stopped single_chunked.server" in p.read_text() for p in server_logs)
            else:
                assert rc == -signal.SIGKILL
    finally:
        for child in children:
            child.kill_leftovers()


@pytest.mark.timeout(300)
def test_failed_start_raises_with_log_tail(tmp_path: Path) -> None:
    bogus = tmp_path / "no-model-here"
    bogus.mkdir()
    spec = ServerSpec(model=bogus, name="bogus", cpus=(0,), startup_timeout=240)
    with pytest.raises(ServerStartError) as err:
        VLLMServer.start(spec, tmp_path / "logs")
    msg = str(err.value)
    assert "exited with status" in msg and "bogus" in msg
    assert str(bogus) in msg  # the tail of vLLM's own error names the model path
    assert "Traceback" in msg or "Error" in msg
