"""The router's config file (`router.config_file`): keys checked, flags over
the file, and `rapidkv router --config` serving from one."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from fake_vllm import MakeFake

from rapidkv.harness import free_port, wait_until
from rapidkv.router.cli import config_from_args, register, settings
from rapidkv.router.config import Instance, RouterConfig
from rapidkv.router.config_file import KEYS, check, merge, read_file, resolve

pytestmark = pytest.mark.unit

FULL = """
prefill = ["http://127.0.0.1:8100=127.0.0.1:7100"]
decode = ["http://127.0.0.1:8200", "http://127.0.0.1:8201/"]
host = "0.0.0.0"
port = 9000
dispatch = "serial"
health_timeout_s = 0.5
probe_interval_s = 3
max_body_bytes = 1048576
shutdown_grace_s = 20
discovery_retry_s = 4.5
upstream_read_timeout_s = 30
split_prefill = false
secret_file = "secret"
admin_token_file = "token"
log_level = "warning"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "router.toml"
    path.write_text(text)
    (tmp_path / "secret").write_text("s3cret\n")
    (tmp_path / "token").write_text("0123456789abcdef-token\n")
    return path


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser)
    return parser.parse_args(argv)


def test_a_file_sets_flags_settings_and_those_only_code_could_set(tmp_path: Path) -> None:
    config = resolve(read_file(write(tmp_path, FULL)))
    assert config.prefill == (Instance("http://127.0.0.1:8100", "127.0.0.1:7100"),)
    assert config.decode == (Instance("http://127.0.0.1:8200"), Instance("http://127.0.0.1:8201"))
    assert (config.host, config.port, config.dispatch) == ("0.0.0.0", 9000, "serial")
    assert (config.health_timeout_s, config.probe_interval_s) == (0.5, 3.0)
    assert isinstance(config.probe_interval_s, float)
    assert (config.max_body_bytes, config.shutdown_grace_s, config.discovery_retry_s) == (
        1 << 20,
        20.0,
        4.5,
    )
    assert (config.upstream_read_timeout_s, config.split_prefill) == (30.0, False)
    # secrets come from their files, relative to the config file's directory
    assert config.secret == b"s3cret"
    assert config.admin_token == "0123456789abcdef-token"
    assert resolve({"decode": ["http://d:1"], "dispatch": "local"}) == RouterConfig(
        decode=(Instance("http://d:1"),), dispatch="local"
    )


def test_every_flag_has_its_key_and_flags_override_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, FULL)
    given = settings(parse(["--config", str(path), "--port", "9100", "--decode", "http://x:1"]))
    assert given["port"] == 9100 and given["decode"] == ["http://x:1"]  # a list flag replaces
    assert given["dispatch"] == "serial" and given["log_level"] == "warning"  # from the file
    assert config_from_args(parse(["--config", str(path)])).port == 9000
    flags = parse(["--no-discover", "--shutdown-grace-s", "7", "--upstream-timeout", "5"])
    assert settings(flags) == {
        "discover": False,
        "shutdown_grace_s": 7.0,
        "upstream_read_timeout_s": 5.0,
    }
    # every option of the command line is a key of the file
    parser = argparse.ArgumentParser()
    register(parser)
    dests = {a.dest for a in parser._actions} - {"help", "config"}
    assert {"instances" if d == "instance" else d for d in dests} <= set(KEYS)
    assert merge({"port": 1, "host": "h"}, {"port": 2}) == {"port": 2, "host": "h"}


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("prot = 9000", "unknown key 'prot' (did you mean 'port'?)"),
        ("port = 'x'", "key 'port': expected an integer, not 'x'"),
        ("port = true", "key 'port': expected an integer"),
        ("probe_interval_s = '1s'", "key 'probe_interval_s': expected a number"),
        ("dispatch = 'fast'", "key 'dispatch': expected one of dual, serial, local"),
        ("split_prefill = 1", "key 'split_prefill': expected true or false"),
        ("decode = 'http://d:1'", "key 'decode': expected a list of strings"),
        ("decode = [1]", "key 'decode': expected a list of strings (1 is not)"),
        ("secret = 'inline'", "key 'secret' may not be set here: write the secret in a file"),
        ("admin_token = 'x'", "key 'admin_token' may not be set here"),
        ("[router]\nport = 1", "unknown key 'router'"),
        ("port = ", "not valid TOML"),
    ],
)
def test_bad_keys_and_values_are_refused_naming_the_key(
    tmp_path: Path, text: str, named: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=r"router\.toml") as caught:
        read_file(path)
    assert named in str(caught.value)


@pytest.mark.parametrize(
    ("settings_", "named"),
    [
        ({"probe_interval_s": 0}, "probe_interval_s must be > 0"),
        ({"health_timeout_s": -1}, "health_timeout_s must be > 0"),
        ({"max_body_bytes": 0}, "max_body_bytes must be > 0"),
        ({"shutdown_grace_s": -1}, "shutdown_grace_s must be >= 0"),
        ({"split_fraction": 1.5}, "split_fraction"),
        ({"tpot_slo_ms": 0}, "tpot_slo_ms"),
        ({"port": 70000}, "port 70000"),
        ({"decode": ["d:1"]}, "decode: instance URL 'd:1'"),
        ({"instances": ["http://a:1=nonsense"]}, "instances: "),
    ],
)
def test_values_out_of_range_are_refused_naming_the_key(
    settings_: dict[str, object], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        resolve({"decode": ["http://d:1"], "dispatch": "local", **check(settings_)})


def test_a_missing_file_or_secret_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config file .*nothere\.toml"):
        read_file(tmp_path / "nothere.toml")
    path = tmp_path / "router.toml"
    path.write_text('decode = ["http://d:1"]\ndispatch = "local"\nsecret_file = "gone"\n')
    with pytest.raises(ValueError, match=r"secret file .*gone"):
        resolve(read_file(path))


def test_rapidkv_router_serves_from_a_config_file_with_flags_over_it(
    tmp_path: Path, make_fake: MakeFake
) -> None:
    d = make_fake("D0", "decode")
    port = free_port()
    path = tmp_path / "router.toml"
    path.write_text(
        f'decode = ["{d.url}"]\ndispatch = "local"\nport = 1\nmax_body_bytes = 100\n'
        'log_level = "warning"\n'
    )
    argv = [sys.executable, "-m", "rapidkv.cli", "router", "--config", str(path)]
    # the port flag over the file's port (1)
    proc = subprocess.Popen([*argv, f"--port={port}"], stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def live() -> bool:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                return httpx.get(f"{url}/livez", trust_env=False).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(live, 60, what="the router process to serve")
        small = {"prompt": [1, 2], "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=small, trust_env=False).status_code == 200
        big = {"prompt": "x" * 200, "max_tokens": 2}  # over the file's max_body_bytes
        assert httpx.post(f"{url}/v1/completions", json=big, trust_env=False).status_code == 413
    finally:
        proc.terminate()
        proc.wait(30)
    path.write_text("prot = 8000\n")
    typo = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert typo.returncode == 2 and "unknown key 'prot' (did you mean 'port'?)" in typo.stderr
