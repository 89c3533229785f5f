"""`bench/common/groups.py`: where the client and the fronts run."""

from __future__ import annotations


def test_the_client_and_fronts_share_core_0_except_with_the_stock_nixl_setup() -> None:
    from rapidkv.bench.common.groups import CONFIGS, helper_cpus

    for name in ("single", "dp2", "vllm-nixl", "rapidkv", "single-noop-connector"):
        assert helper_cpus(CONFIGS[name].group) == {0}, name
    for name in ("vllm-nixl-stock", "vllm-nixl-push-stock"):
        assert helper_cpus(CONFIGS[name].group) is None, name
