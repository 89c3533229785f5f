"""Fixtures of the router tests: fake vLLM upstreams and in-process routers.

Everything here is stopped at the end of the test that made it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_vllm import FakeVLLM, MakeFake, MakeRouter

from rapidkv.router import Instance, RouterConfig, RunningRouter, start_router


@pytest.fixture
def make_fake() -> Iterator[MakeFake]:
    """`make_fake(name, role)` starts a `FakeVLLM` on a free loopback port."""
    fakes: list[FakeVLLM] = []

    def make(name: str, role: str) -> FakeVLLM:
        fake = FakeVLLM(name, role)
        fakes.append(fake)
        return fake

    yield make
    for fake in fakes:
        fake.stop()


@pytest.fixture
def make_router() -> Iterator[MakeRouter]:
    """`make_router(prefill, decode, dispatch="dual", **config)` starts a router on a
    free port; `prefill`/`decode` list `Instance`s, URLs, or servers (`.base_url`/`.url`).
    Control-address discovery is off unless asked for: these instances run no connector."""
    routers: list[RunningRouter] = []

    def make(prefill: list[object], decode: list[object], **config: object) -> RunningRouter:
        cfg = RouterConfig(
            prefill=tuple(_instance(x) for x in prefill),
            decode=tuple(_instance(x) for x in decode),
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
