"""Router configuration and the `rapidkv router` command line."""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from fake_vllm import MakeFake

from rapidkv.harness import free_port, wait_until
from rapidkv.router.cli import config_from_args, register
from rapidkv.router.config import Instance, RouterConfig

pytestmark = pytest.mark.unit


def test_instance_parses_url_and_optional_control_address() -> None:
    assert Instance.parse("http://10.0.0.1:8100") == Instance("http://10.0.0.1:8100")
    assert Instance.parse("http://10.0.0.1:8100/=10.0.0.1:7100") == Instance(
        "http://10.0.0.1:8100", "10.0.0.1:7100"
    )
    assert Instance.parse("http://h:1=[::1]:7").control == "[::1]:7"
    assert str(Instance("http://h:1", "h:2")) == "http://h:1=h:2"


@pytest.mark.parametrize(
    "text",
    ["10.0.0.1:8100", "ftp://h:1", "http://h:1?x=1", "http://h:1=nonsense", "http://h:99999"],
)
def test_bad_instances_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        Instance.parse(text)


def test_config_needs_the_instances_its_dispatch_uses() -> None:
    d = (Instance("http://d:1"),)
    with pytest.raises(ValueError, match="decode"):
        RouterConfig(prefill=(Instance("http://p:1"),), decode=())
    with pytest.raises(ValueError, match="prefill"):
        RouterConfig(prefill=(), decode=d)
    with pytest.raises(ValueError, match="prefill"):
        RouterConfig(prefill=(), decode=d, dispatch="serial")
    assert RouterConfig(prefill=(), decode=d, dispatch="local").dispatch == "local"
    with pytest.raises(ValueError, match="dispatch"):
        RouterConfig(prefill=(), decode=d, dispatch="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unique"):
        RouterConfig(prefill=(), decode=d + d, dispatch="local")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser)
    return parser.parse_args(argv)


def test_command_line_builds_the_config(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    args = parse(
        [
            "--prefill=http://127.0.0.1:8100=127.0.0.1:7100",
            "--prefill=http://127.0.0.1:8101",
            "--decode=http://127.0.0.1:8200",
            "--port=9000",
            "--dispatch=serial",
            f"--secret-file={secret}",
        ]
    )
    config = config_from_args(args)
    assert config.prefill == (
        Instance("http://127.0.0.1:8100", "127.0.0.1:7100"),
        Instance("http://127.0.0.1:8101"),
    )
    assert config.decode == (Instance("http://127.0.0.1:8200"),)
    assert (config.host, config.port, config.dispatch) == ("127.0.0.1", 9000, "serial")
    assert config.secret == b"s3cret"


def test_secret_file_must_not_be_empty(tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("\n")
    args = parse(["--decode=http://127.0.0.1:8200", f"--secret-file={tmp_path / 'empty'}"])
    with pytest.raises(ValueError, match="empty"):
        config_from_args(args)


def test_rapidkv_router_is_a_subcommand_and_refuses_a_bad_config() -> None:
    run = [sys.executable, "-m", "rapidkv.cli", "router"]
    out = subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--dispatch" in out.stdout
    bad = subprocess.run([*run, "--decode", "http://127.0.0.1:1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "needs at least one prefill" in bad.stderr


def test_router_imports_neither_vllm_nor_torch() -> None:
    code = (
        "import sys\n"
        "import rapidkv.router, rapidkv.router.app, rapidkv.router.cli\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch'))\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_rapidkv_router_serves_until_sigterm(make_fake: MakeFake) -> None:
    d = make_fake("D0", "decode")
    port = free_port()
    argv = [sys.executable, "-m", "rapidkv.cli", "router", f"--decode={d.url}"]
    argv += ["--dispatch=local", f"--port={port}", "--log-level=warning"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                return httpx.get(f"{url}/health", trust_env=False).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, 60, what="the router process to serve")
        body = {"prompt": [1, 2], "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body, trust_env=False).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_instances_merge_by_url_into_members_with_the_roles_they_were_given() -> None:
    p, d, both = Instance("http://p:1"), Instance("http://d:1", "d:7"), Instance("http://b:1")
    config = RouterConfig(prefill=(p, Instance("http://d:1")), decode=(d,), instances=(both,))
    assert [(m.instance, m.label) for m in config.members] == [
        (p, "prefill"),
        (d, "both"),  # given as --prefill and --decode: one instance, its control kept
        (both, "both"),
    ]
    assert config.pool("prefill") == (0, 1, 2)
    assert config.pool("decode") == (1, 2)
    assert config.role_instances("decode") == (d, both)
    with pytest.raises(ValueError, match="two control addresses"):
        RouterConfig(prefill=(Instance("http://d:1", "d:8"),), decode=(d,))


def test_a_fleet_of_instances_alone_is_a_valid_config_for_every_dispatch() -> None:
    for dispatch in ("dual", "serial", "local"):
        config = RouterConfig(instances=(Instance("http://a:1"),), dispatch=dispatch)
        assert config.pool("prefill") == config.pool("decode") == (0,)
    with pytest.raises(ValueError, match="unique"):
        RouterConfig(instances=(Instance("http://a:1"), Instance("http://a:1")))


def test_instance_flags_reach_the_config() -> None:
    args = parse(
        ["--instance", "http://a:1=a:7", "--instance", "http://b:1", "--decode", "http://c:1"]
    )
    config = config_from_args(args)
    assert [(str(m.instance), m.label) for m in config.members] == [
        ("http://c:1", "decode"),
        ("http://a:1=a:7", "both"),
        ("http://b:1", "both"),
    ]


def test_adaptive_placement_needs_dual_dispatch_and_positive_slos() -> None:
    fleet = (Instance("http://a:1"), Instance("http://b:1"))
    assert RouterConfig(instances=fleet, placement="adaptive").placement == "adaptive"
    with pytest.raises(ValueError, match="dual"):
        RouterConfig(instances=fleet, placement="adaptive", dispatch="serial")
    with pytest.raises(ValueError, match="SLO"):
        RouterConfig(instances=fleet, tpot_slo_ms=0)
    args = parse(["--instance", "http://a:1", "--placement", "adaptive", "--tpot-slo-ms", "20"])
    config = config_from_args(args)
    assert (config.placement, config.tpot_slo_ms, config.ttft_slo_ms) == ("adaptive", 20, 1000)
    assert config.specialize is True
    argv = ["--instance", "http://a:1", "--placement", "adaptive", "--no-specialize"]
    assert config_from_args(parse(argv)).specialize is False
    assert config.idle_crossings is True
    argv = ["--instance", "http://a:1", "--placement", "adaptive", "--busy-crossings"]
    assert config_from_args(parse(argv)).idle_crossings is False


def test_the_adaptive_options_reach_the_routers_placement_policy() -> None:
    from rapidkv.router.proxy import Router

    argv = ["--instance", "http://a:1", "--instance", "http://b:1", "--placement", "adaptive"]
    extra = ["--busy-crossings", "--ttft-headroom", "0.2", "--tpot-margin", "0.8"]
    for args, want in ((argv, (True, 0.5, 0.6)), (argv + extra, (False, 0.2, 0.8))):
        router = Router(config_from_args(parse(args)))
        try:
            assert router._placer is not None
            policy = router._placer.policy
            assert (policy.idle_crossings, policy.ttft_headroom, policy.tpot_margin) == want
        finally:
            asyncio.run(router.close())


def test_an_admin_token_is_long_and_printable_and_read_from_a_file(tmp_path: Path) -> None:
    d = (Instance("http://d:1"),)
    for bad in ("short", "x" * 15, "a\nb" * 8):
        with pytest.raises(ValueError, match="admin token"):
            RouterConfig(decode=d, dispatch="local", admin_token=bad)
    token = tmp_path / "token"
    token.write_text("0123456789abcdef-token\n")
    args = parse(
        ["--decode", "http://d:1", "--dispatch", "local", "--admin-token-file", str(token)]
    )
    assert config_from_args(args).admin_token == "0123456789abcdef-token"
