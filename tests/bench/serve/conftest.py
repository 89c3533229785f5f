"""The session's started `rapidkv bench serve` run (`started_serve`)."""

from __future__ import annotations

import pytest
from started_serve import StartedRun, start_run


@pytest.fixture(scope="session")
def started_run(tmp_path_factory: pytest.TempPathFactory) -> StartedRun:
    """`started_serve.start_run`, once a session, for the smoke and the endpoint test."""
    return start_run(tmp_path_factory.mktemp("serve-started"))
