"""`rapidkv bench serve`'s options (`serve/options.py`): the progress units,
the models, and `--netns-link`."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from rapidkv.bench.serve.options import Options


@pytest.mark.unit
def test_progress_counts_the_paired_single_blocks_and_its_warm_up() -> None:
    from rapidkv.bench.serve import register
    from rapidkv.bench.serve.run import total_units

    parser = argparse.ArgumentParser()
    register(parser)

    def units(*argv: str) -> int:
        return total_units(Options.from_args(parser.parse_args(list(argv))))

    base = ["--models", "tiny", "--requests", "10", "--loads", "c1,c4", "--warmup", "2"]
    base += ["--rounds", "3"]
    # the reference (10), then per round: warm-up + 2 loads x 10 per configuration,
    # the same again for each paired configuration's `single` blocks (c1), and the
    # warm-up of `single` when it is no configuration of its own
    assert units(*base, "--configs", "single,dp2") == 10 + 3 * 2 * 22
    # rapidkv's `single` blocks: at c1 only
    assert units(*base, "--configs", "single,rapidkv") == 10 + 3 * (2 * 22 + 10)
    assert units(*base, "--configs", "rapidkv") == 10 + 3 * (22 + 10 + 2)
    assert units(*base, "--configs", "rapidkv", "--pair-block", "0") == 10 + 3 * 22
    with pytest.raises(ValueError, match="pair-block"):
        Options.from_args(parser.parse_args([*base, "--pair-block", "-1"]))


@pytest.mark.unit
def test_a_model_is_a_test_model_by_name_or_a_checkpoints_directory(tmp_path: Path) -> None:
    from rapidkv.bench.serve import register

    parser = argparse.ArgumentParser()
    register(parser)
    (tmp_path / "config.json").write_text("{}")
    opts = Options.from_args(parser.parse_args(["--models", f"tiny,{tmp_path}"]))
    assert opts.models == ("tiny", str(tmp_path))
    for bad in ("huge", str(tmp_path / "nothing-here")):
        with pytest.raises(ValueError, match="unknown model"):
            Options.from_args(parser.parse_args(["--models", bad]))


@pytest.mark.unit
def test_netns_link_places_rapidkv_and_refuses_the_nixl_baselines() -> None:
    """`--netns-link RATE`: by default `single` and `rapidkv`; configurations of
    vLLM's NIXL groups would run on one host and are refused; a bad rate too.
    rapidkv's P binds every interface in namespace A and advertises its link
    address, D binds its own; both data planes get their link address."""
    from types import SimpleNamespace

    from rapidkv.bench.common.groups import _group_plan, rapidkv_control
    from rapidkv.bench.serve import register
    from rapidkv.harness.netns import NetnsLink, Side

    parser = argparse.ArgumentParser()
    register(parser)
    opts = Options.from_args(parser.parse_args(["--quick", "--netns-link", "1gbit"]))
    assert opts.configs == ("single", "rapidkv") and opts.netns_link == "1gbit"
    assert "vllm-nixl" in Options.from_args(parser.parse_args(["--quick"])).configs
    with pytest.raises(ValueError, match="vllm-nixl"):
        Options.from_args(parser.parse_args(["--netns-link", "1gbit", "--configs", "vllm-nixl"]))
    with pytest.raises(ValueError, match="rate"):
        Options.from_args(parser.parse_args(["--netns-link", "1gb"]))

    link = NetnsLink(
        3, Side("ns-a", "10.77.3.1", "rkv3a"), Side("ns-b", "10.77.3.2", "rkv3b"), "1gbit", ()
    )
    keyed, fronts = _group_plan("rapidkv", Path("/m"), Path("/logs"), (), link)
    (_, p), (_, d) = keyed
    assert (p.netns, p.host, d.netns, d.host) == ("ns-a", "10.77.3.1", "ns-b", "10.77.3.2")
    p_extra = p.kv_transfer_config["kv_connector_extra_config"]
    d_extra = d.kv_transfer_config["kv_connector_extra_config"]
    assert p_extra["control_host"] == "0.0.0.0" and p_extra["kvt_host"] == "10.77.3.1"
    assert d_extra["control_host"] == "10.77.3.2" and d_extra["kvt_host"] == "10.77.3.2"
    p_control = rapidkv_control(p.kv_transfer_config)
    assert p_control == f"10.77.3.1:{p_extra['control_port']}"
    servers = {
        "prefill": SimpleNamespace(base_url="http://10.77.3.1:1"),
        "decode": SimpleNamespace(base_url="http://10.77.3.2:2"),
    }
    dual = dict(fronts(SimpleNamespace(servers=servers)))["router-dual"]
    assert dual[dual.index("--prefill") + 1] == f"http://10.77.3.1:1={p_control}"
    local, _ = _group_plan("rapidkv", Path("/m"), Path("/logs"), ())
    assert local[0][1].netns is None and rapidkv_control(local[0][1].kv_transfer_config)[:10] == (
        "127.0.0.1:"
    )


@pytest.mark.unit
def test_by_default_the_test_model_and_the_real_one_each_in_its_own_dtype() -> None:
    from rapidkv.bench.serve import register

    parser = argparse.ArgumentParser()
    register(parser)
    opts = Options.from_args(parser.parse_args([]))
    assert opts.models == ("tiny", "smollm2-135m") and opts.dtype is None
    assert (opts.dtype_of("tiny"), opts.dtype_of("smollm2-135m")) == ("float32", "bfloat16")
    given = Options.from_args(parser.parse_args(["--dtype", "float32"]))
    assert given.dtype_of("smollm2-135m") == "float32"
    with pytest.raises(ValueError, match="one --models"):  # an endpoint serves one model
        Options.from_args(parser.parse_args(["--base-url", "http://127.0.0.1:1"]))
