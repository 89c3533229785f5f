"""Fixtures of the router tests: fake vLLM upstreams and in-process routers.

Everything here is stopped at the end of the test that made it.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from fake_vllm import FakeVLLM, MakeFake, MakeRouter

from rapidkv.router import Instance, RouterConfig, RunningRouter, start_router


@pytest.fixture
def pd(make_fake: MakeFake) -> tuple[FakeVLLM, FakeVLLM]:
    """A fake prefill instance "P0" and a fake decode instance "D0"."""
    return make_fake("P0", "prefill"), make_fake("D0", "decode")


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    """A synchronous HTTP client that never goes through a proxy (120 s timeout)."""
    with httpx.Client(timeout=120, trust_env=False) as client:
        yield client


@pytest.fixture
def make_fake() -> Iterator[MakeFake]:
    """`make_fake(name, role)` starts a `FakeVLLM` on a free loopback port."""
    fakes: list[FakeVLLM] = []

    def make(name: str, role: str, port: int = 0) -> FakeVLLM:
        fake = FakeVLLM(name, role, port)
        fakes.append(fake)
        return fake

    yield make
    for fake in fakes:
        fake.stop()


@pytest.fixture
def make_router() -> Iterator[MakeRouter]:
    """`make_router(prefill, decode, dispatch="dual", **config)` starts a router on a
    free port; `prefill`/`decode` (and `instances=`, either role) list `Instance`s,
    URLs, or servers (`.base_url`/`.url`).
    Control-address discovery is off unless asked for: these instances run no connector."""
    routers: list[RunningRouter] = []

    def make(prefill: list[object], decode: list[object], **config: object) -> RunningRouter:
        instances = config.pop("instances", ())
        cfg = RouterConfig(
            prefill=tuple(_instance(x) for x in prefill),
            decode=tuple(_instance(x) for x in decode),
            instances=tuple(_instance(x) for x in instances),  # type: ignore[attr-defined]
            port=0,
            **{"discover": False, **config},  # type: ignore[arg-type]
        )
        router = start_router(cfg)
        routers.append(router)
        return router

    yield make
    for router in routers:
        router.stop()


def _instance(x: object) -> Instance:
    if isinstance(x, Instance):
        return x
    if isinstance(x, str):
        return Instance(x)
    return Instance(getattr(x, "base_url", None) or x.url)  # type: ignore[attr-defined]
