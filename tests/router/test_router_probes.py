"""The router's probes (`router.probes`): /livez ignores the backends, /readyz
is 200 while a request would be served (D alone will do), /health keeps its
detail and is 503 only when nothing could serve."""

from __future__ import annotations

from urllib.parse import urlsplit

import httpx
import pytest
from fake_vllm import MakeFake, MakeRouter

from rapidkv.harness import free_port, wait_until

pytestmark = pytest.mark.unit

COMPLETION = {"prompt": [1, 2, 3], "max_tokens": 2}


def test_with_p_dead_the_router_is_ready_and_health_says_degraded_not_503(
    make_fake: MakeFake, make_router: MakeRouter, http: httpx.Client
) -> None:
    d = make_fake("D0", "decode")
    p_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    router = make_router([p_url], [d])
    assert http.post(f"{router.url}/v1/completions", json=COMPLETION).status_code == 200
    health = http.get(f"{router.url}/health")
    assert health.status_code == 200  # it serves on D alone
    report = health.json()
    assert report["status"] == "degraded"
    assert report["reasons"] == [
        "no prefill instance answers /health: decode instances compute prompts"
    ]
    assert [c["healthy"] for c in report["prefill"]] == [False]
    ready = http.get(f"{router.url}/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"ready": True, "decode": [d.url], "prefill": []}  # P marked down
    assert http.get(f"{router.url}/livez").json() == {"live": True}


def test_with_no_decode_up_readyz_is_503_naming_why_and_livez_stays_200(
    make_fake: MakeFake, make_router: MakeRouter, http: httpx.Client
) -> None:
    p, d = make_fake("P0", "prefill"), make_fake("D0", "decode")
    router = make_router([p], [d], probe_interval_s=0.1)
    assert http.get(f"{router.url}/readyz").status_code == 200
    assert http.get(f"{router.url}/health").json()["status"] == "ok"
    port = urlsplit(d.url).port
    d.stop()
    assert http.post(f"{router.url}/v1/completions", json=COMPLETION).status_code == 502
    ready = http.get(f"{router.url}/readyz")  # D is marked down: nothing would serve
    assert ready.status_code == 503
    assert ready.json()["ready"] is False
    assert ready.json()["reason"].startswith("no decode instance is up and not draining: ")
    assert d.url in ready.json()["reason"]
    health = http.get(f"{router.url}/health")
    assert health.status_code == 503
    assert health.json()["status"] == "unavailable"
    assert health.json()["reasons"] == ["no decode instance answers /health"]
    assert http.get(f"{router.url}/livez").status_code == 200  # the process serves HTTP
    make_fake("D0", "decode", port)  # back on its address: probed, up, ready again
    wait_until(lambda: http.get(f"{router.url}/readyz").status_code == 200, 10, what="ready again")


def test_a_fleet_whose_only_decoder_drains_is_not_ready(
    make_fake: MakeFake, make_router: MakeRouter, http: httpx.Client
) -> None:
    d = make_fake("D0", "decode")
    token = "0123456789abcdef-token"
    router = make_router([], [d], dispatch="local", admin_token=token)
    auth = {"authorization": f"Bearer {token}"}
    assert http.post(f"{router.url}/admin/drain", json={"instance": d.url}, headers=auth).is_success
    ready = http.get(f"{router.url}/readyz")
    assert ready.status_code == 503 and "draining" in ready.json()["reason"]
    assert http.post(
        f"{router.url}/admin/undrain", json={"instance": d.url}, headers=auth
    ).is_success
    assert http.get(f"{router.url}/readyz").status_code == 200
