"""Run only as a child pytest session by test_harness_teardown.py (not collected otherwise).

Starts the shared server fixture named by $RAPIDKV_CHILD_SERVER, writes its pids to
$RAPIDKV_CHILD_INFO, then waits to be signalled.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from rapidkv.harness import VLLMServer, get_watchdog

pytestmark = pytest.mark.e2e


@pytest.mark.skipif("RAPIDKV_CHILD_INFO" not in os.environ, reason="child session only")
@pytest.mark.timeout(0)
def test_hold_server_until_signalled(request: pytest.FixtureRequest) -> None:
    single_server: VLLMServer = request.getfixturevalue(os.environ["RAPIDKV_CHILD_SERVER"])
    # A runner started in the background of a non-interactive shell inherits
    # SIGINT ignored, and Python keeps it so: take it back, as a terminal's
    # Ctrl-C would find it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    out = Path(os.environ["RAPIDKV_CHILD_INFO"])
    info = {
        "pid": single_server.pid,
        "pgid": single_server.pgid,
        "port": single_server.port,
        "watchdog": get_watchdog().pid,
        "runner": os.getpid(),
        "tmp_dir": str(single_server.tmp_dir),
    }
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, out)
    # Block until the parent test signals us (SIGINT raises KeyboardInterrupt here).
    threading.Event().wait(600)
    pytest.fail("the parent test never signalled this session")
