"""No vLLM process outlives the test runner that started it.

A child pytest session starts the shared `single_server` fixture, reports the
server's pids and waits; we then SIGKILL it (no cleanup code can run: the
harness's watchdog must act) or SIGINT it (pytest's own teardown stops the
server), and check through /proc that the server's whole process tree is gone
within a bounded time, and its temporary directory with it. Also: a server that
cannot start fails with its log.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rapidkv.harness import ServerSpec, ServerStartError, VLLMServer, procs, wait_until
from rapidkv.harness.server import SRC_DIR

pytestmark = pytest.mark.e2e

TESTS_DIR = Path(__file__).resolve().parents[1]
CHILD = Path(__file__).with_name("harness_child_session.py")
GONE_WITHIN_S = 60.0


def _identity(pid: int) -> tuple[int, int] | None:
    st = procs.proc_stat(pid)
    return None if st is None or not st.alive else (pid, st.starttime)


def _alive(idents: list[tuple[int, int]]) -> list[int]:
    return [pid for pid, start in idents if procs.is_alive(pid, start)]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_runner_death_leaves_no_vllm_process(
    tmp_path: Path, tiny_model: Path, sig: signal.Signals
) -> None:
    info_path = tmp_path / "server.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC_DIR), env.get("PYTHONPATH")]))
    env["RAPIDKV_CHILD_INFO"] = str(info_path)
    env["RAPIDKV_LOG_DIR"] = str(tmp_path / "logs")
    runner_log = tmp_path / "runner.log"
    with open(runner_log, "wb") as out:
        runner = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-s",
             "-o", "addopts=", "--rootdir", str(TESTS_DIR.parent), str(CHILD)],
            cwd=TESTS_DIR.parent, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    tree: list[tuple[int, int]] = []
    try:

        def ready() -> bool:
            if runner.poll() is not None:
                pytest.fail(f"child runner exited early:\n{runner_log.read_text()[-5000:]}")
            return info_path.exists()

        wait_until(ready, 300, what="the child session's server")
        info = json.loads(info_path.read_text())
        members = procs.live_in_group(info["pgid"])
        tree = [i for i in map(_identity, [*members, info["watchdog"]]) if i is not None]
        # api server, engine core, worker at least, plus the watchdog
        assert len(members) >= 3, f"expected a process tree, got {members}"
        assert info["pid"] in members
        tmp_dir = Path(info["tmp_dir"])
        assert tmp_dir.is_dir(), f"the server's TMPDIR {tmp_dir} should exist while it runs"

        runner.send_signal(sig)

        wait_until(lambda: not _alive(tree), GONE_WITHIN_S, what="the server tree to be gone")
        assert procs.live_in_group(info["pgid"]) == []
        assert not tmp_dir.exists(), "the server's TMPDIR outlived the runner"
        rc = runner.wait(GONE_WITHIN_S)
        if sig == signal.SIGINT:
            assert rc == 2, f"pytest should report an interrupted session, got {rc}"
            assert "KeyboardInterrupt" in runner_log.read_text()
            # The runner's own teardown stopped the server (not just the watchdog).
            server_logs = list((tmp_path / "logs").glob("*.log"))
            assert any(" stopped single.server" in p.read_text() for p in server_logs)
        else:
            assert rc == -signal.SIGKILL
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
        # only reached with leftovers if the test failed: never leak them
        for pid in _alive(tree):
            os.kill(pid, signal.SIGKILL)


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
