"""`ServerPool` with stand-in servers: a script in the place of vLLM's Python
(`ServerSpec.python`) that answers `/health` with 200 once a file exists, so
the test decides when a server becomes healthy."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from rapidkv.harness import ServerPool, ServerSpec

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

FAKE_SERVER = textwrap.dedent(
    """\
    #!{python}
    import os, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer

    port = int(sys.argv[sys.argv.index("--port") + 1])
    go = os.environ["FAKE_GO_FILE"]

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.path == "/health" and os.path.exists(go)
            self.send_response(200 if ok else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)


@pytest.fixture
def stand_in(tmp_path: Path) -> tuple[ServerSpec, Path]:
    """A spec whose "vLLM" is healthy once the returned file exists."""
    script = tmp_path / "fake-python"
    script.write_text(FAKE_SERVER.format(python=sys.executable))
    script.chmod(0o755)
    go = tmp_path / "go"
    spec = ServerSpec(
        model=tmp_path, python=str(script), env={"FAKE_GO_FILE": str(go)}, startup_timeout=60
    )
    return spec, go


def test_prestart_launches_every_group_at_once_and_get_waits_for_health(
    tmp_path: Path, stand_in: tuple[ServerSpec, Path]
) -> None:
    spec, go = stand_in
    pool = ServerPool(tmp_path / "logs", max_running=2)
    try:
        ready = tmp_path / "ready"
        ready.touch()
        healthy_spec = spec.replace(name="s", env={"FAKE_GO_FILE": str(ready)})
        (single,) = pool.get("single", [healthy_spec])  # running before
        pool.prestart(
            {"ref": [spec.replace(name="r")], "pair": [spec.replace(name="p"), spec]},
            keep=["single"],
        )
        # returned with none of the four healthy (the stand-ins wait for `go`):
        # all launched, none waited for, the kept group still running
        assert go.exists() is False and pool.running_count() == 4 and single.running
        assert pool.startups == [("single.s", pytest.approx(pool.startups[0][1]))]
        go.touch()
        (ref,) = pool.get("ref", [spec.replace(name="r")])
        p, d = pool.get("pair", [spec.replace(name="p"), spec])
        assert ref.running and p.running and d.running
        assert {name for name, _ in pool.startups} == {"single.s", "ref.r", "pair.p", "pair.vllm"}
        # asked again: the same servers, no new start
        assert pool.get("pair", [spec.replace(name="p"), spec]) == [p, d]
        assert len(pool.startups) == 4
        with pytest.raises(ValueError, match="other specs"):
            pool.prestart({"ref": [spec.replace(name="r", seed=1)]})
    finally:
        pool.close()
    assert pool.running_count() == 0


def test_a_prestarted_group_that_is_never_healthy_is_stopped_and_raised(
    tmp_path: Path, stand_in: tuple[ServerSpec, Path]
) -> None:
    from rapidkv.harness.server import ServerStartError

    spec, _go = stand_in  # never created
    pool = ServerPool(tmp_path / "logs", max_running=2)
    try:
        pool.prestart({"late": [spec.replace(startup_timeout=1.5)]})
        (server,) = pool._running["late"]
        with pytest.raises(ServerStartError, match="not healthy"):
            pool.get("late", [spec.replace(startup_timeout=1.5)])
        assert not server.running and pool.running_count() == 0
    finally:
        pool.close()


def test_prestart_makes_room_by_stopping_the_groups_it_does_not_keep(
    tmp_path: Path, stand_in: tuple[ServerSpec, Path]
) -> None:
    spec, go = stand_in
    go.touch()
    pool = ServerPool(tmp_path / "logs", max_running=2)
    try:
        (old,) = pool.get("old", [spec.replace(name="o")])
        (kept,) = pool.get("kept", [spec.replace(name="k")])
        pool.prestart({"new": [spec.replace(name="n")]}, keep=["kept"])
        assert not old.running and kept.running
        (new,) = pool.get("new", [spec.replace(name="n")])
        assert new.running and pool.running_count() == 2
    finally:
        pool.close()


def test_a_prestarted_group_stopped_before_it_is_healthy_ends_its_waiter(
    tmp_path: Path, stand_in: tuple[ServerSpec, Path]
) -> None:
    spec, _go = stand_in  # never healthy within the test
    pool = ServerPool(tmp_path / "logs", max_running=2)
    try:
        pool.prestart({"late": [spec]})
        (server,) = pool._running["late"]
        waiter, errors = pool._pending["late"]
        pool.stop("late")
        assert not waiter.is_alive() and not server.running
        assert "stopped while starting" in str(errors[0])
        assert pool.running_count() == 0 and pool.startups == []
    finally:
        pool.close()
