"""`bench simulate`'s fit: the defaults' derivation and `--fit PATH`, tolerant."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from rapidkv.bench.simulate.fit import DEFAULT_FIT, Fit, Measurements, fit_from, load_fit

pytestmark = pytest.mark.unit


def test_the_default_fit_comes_from_the_measurements() -> None:
    m = Measurements()
    f = fit_from(m)
    assert f == DEFAULT_FIT
    assert f.step_ms_per_seq == pytest.approx((7.6 - 5.4) / 3)
    assert f.step_time(1, 0) == pytest.approx(5.4)
    assert f.step_time(4, 0) == pytest.approx(7.6)
    assert f.single_ttft(514) == pytest.approx(54.9)
    assert f.router_ms == pytest.approx(59.2 - 54.9)
    assert f.nixl_transfer_ms == pytest.approx(75.6 - 54.9 - 4.3 - 5.4)
    assert f.transfer_time(1000) == pytest.approx(f.transfer_ms_per_token * 1000)
    assert f.transfer_time(0, "nixl") == pytest.approx(f.nixl_transfer_ms)


def test_a_fit_refuses_negative_or_impossible_parameters() -> None:
    with pytest.raises(ValueError):
        dataclasses.replace(DEFAULT_FIT, step_ms=-1.0)
    with pytest.raises(ValueError):
        dataclasses.replace(DEFAULT_FIT, max_num_seqs=0)
    with pytest.raises(ValueError):
        dataclasses.replace(DEFAULT_FIT, split_fraction=1.0)
    # derived values are floored at 0, never negative
    odd = fit_from(Measurements(single_c4_tpot_p50=4.0, routed_c1_ttft_p50=50.0))
    assert odd.step_ms_per_seq == 0.0 and odd.router_ms == 0.0


def serve_json(path: Path, **loads: dict) -> Path:
    def load(ttft: float, tpot: float) -> dict:
        return {"ttft_ms": {"p50": ttft, "p99": 3 * ttft}, "tpot_ms": {"p50": tpot}}

    configs = {
        "single": {"loads": {"c1": load(40.0, 4.0), "c4": load(120.0, 6.1)}},
        "rapidkv-whole": {"loads": {"c1": load(45.0, 4.2)}},
        "vllm-nixl": {"loads": {"c1": load(60.0, 4.1)}},
    }
    configs.update(loads)
    path.write_text(json.dumps({"meta": {"prompt_len": {"mean": 500.0}}, "configs": configs}))
    return path


def test_a_serve_json_gives_its_figures(tmp_path: Path) -> None:
    fit, warnings = load_fit(serve_json(tmp_path / "serve.json"))
    assert warnings == []
    m = fit.measurements
    assert (m.single_c1_ttft_p50, m.single_c1_tpot_p50, m.single_c4_tpot_p50) == (40.0, 4.0, 6.1)
    assert (m.routed_c1_ttft_p50, m.nixl_c1_ttft_p50, m.prompt_mean) == (45.0, 60.0, 500.0)
    assert fit.single_ttft(500) == pytest.approx(40.0)
    assert fit.step_time(4, 0) == pytest.approx(6.1)
    assert fit.source.endswith("serve.json")


def test_missing_figures_keep_their_defaults_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "partial.json"
    data = {"results": {"single": {"c1": {"ttft_ms": {"p50": 50.0}, "tpot_ms": {"p50": 5.0}}}}}
    path.write_text(json.dumps(data))
    fit, warnings = load_fit(path)
    assert fit.measurements.single_c1_ttft_p50 == 50.0  # found under another shape
    assert fit.measurements.single_c4_tpot_p50 == Measurements().single_c4_tpot_p50
    text = "\n".join(warnings)
    for missing in ("single c4 tpot_ms", "rapidkv-whole/rapidkv c1", "vllm-nixl c1", "prompt_len"):
        assert missing in text


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"configs": {}}'])
def test_an_unusable_file_gives_the_default_fit(tmp_path: Path, content: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    fit, warnings = load_fit(path)
    assert fit == DEFAULT_FIT
    assert warnings and "default fit" in warnings[-1]


def test_a_missing_file_gives_the_default_fit(tmp_path: Path) -> None:
    fit, warnings = load_fit(tmp_path / "nowhere.json")
    assert fit == DEFAULT_FIT and "unreadable" in warnings[0]


def test_a_simulate_json_gives_its_fit_back(tmp_path: Path) -> None:
    mine = dataclasses.replace(DEFAULT_FIT, step_ms=3.0, max_num_seqs=16)
    path = tmp_path / "sim.json"
    path.write_text(json.dumps({"bench": "simulate", "fit": {**mine.as_dict(), "warnings": []}}))
    fit, warnings = load_fit(path)
    assert warnings == []
    assert dataclasses.replace(fit, source=mine.source) == mine
    assert isinstance(fit, Fit)


def test_a_goodput_json_gives_single_c1_and_the_prompt_range(tmp_path: Path) -> None:
    single_c1 = {"ttft_ms": {"p50": 50.0}, "tpot_ms": {"p50": 6.0}}
    chat_c1 = {"ttft_ms": {"p50": 48.0}, "tpot_ms": {"p50": 5.9}}
    data = {
        "workloads": {
            "chat": {"prompt_len": [100, 900], "single_c1": chat_c1, "configs": {}},
            "prefill-heavy": {
                "prompt_len": [128, 900],
                "single_c1": single_c1,
                "configs": {"single": {"attainment": {"2": 1.0}}},
            },
        }
    }
    path = tmp_path / "goodput.json"
    path.write_text(json.dumps(data))
    fit, warnings = load_fit(path)
    m = fit.measurements
    assert (m.single_c1_ttft_p50, m.single_c1_tpot_p50, m.prompt_mean) == (50.0, 6.0, 514.0)
    assert m.single_c4_tpot_p50 == Measurements().single_c4_tpot_p50
    assert any("single c4" in w for w in warnings)
    assert not any("prompt_len" in w for w in warnings)


def test_the_smollm2_preset_is_fitted_from_its_documented_figures() -> None:
    from rapidkv.bench.simulate.check import fit_check, measured_from
    from rapidkv.bench.simulate.fit import PRESETS, load_fit

    fit, warnings = load_fit("smollm2")
    assert fit is PRESETS["smollm2"] and warnings == []
    assert fit.cache_blocks == 90  # 256 MiB of bf16 SmolLM2 KV in 128-token blocks, less one
    assert fit.single_tpot() == pytest.approx(43.3)
    assert fit.single_ttft(514) == pytest.approx(274.3)
    rows = {(r["config"], r["load"]): r for r in fit_check(fit, measured_from("smollm2"))}
    assert rows[("single", "c4")]["measured_ttft_p50_ms"] == 881.5
    assert rows[("single", "c1")]["ttft_p50_ms"] == pytest.approx(274.3)


def test_a_serve_json_of_one_model_gives_that_model_s_kv_a_token(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    config = {
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "num_hidden_layers": 30,
        "torch_dtype": "bfloat16",
    }
    (model / "config.json").write_text(json.dumps(config))
    path = serve_json(tmp_path / "serve.json")
    data = json.loads(path.read_text())
    data["meta"].update(models={"smollm2-135m": str(model)}, dtype={"smollm2-135m": "bfloat16"})
    path.write_text(json.dumps(data))
    fit, warnings = load_fit(path)
    assert warnings == []
    assert fit.kv_bytes_per_token == 23040  # 30 layers x (K, V) x 3 heads x 64 x 2 bytes
    assert fit.cache_blocks == 90
    assert fit.transfer_ms_per_token == pytest.approx(23040 / 4e9 * 1000)
    data["meta"]["dtype"] = {"smollm2-135m": "float32"}
    path.write_text(json.dumps(data))
    assert load_fit(path)[0].kv_bytes_per_token == 46080


def test_a_serve_json_whose_model_is_not_here_keeps_the_default_kv_with_a_warning(
    tmp_path: Path,
) -> None:
    path = serve_json(tmp_path / "serve.json")
    data = json.loads(path.read_text())
    data["meta"]["models"] = {"smollm2-135m": str(tmp_path / "elsewhere")}
    path.write_text(json.dumps(data))
    fit, warnings = load_fit(path)
    assert fit.kv_bytes_per_token == DEFAULT_FIT.kv_bytes_per_token
    assert fit.transfer_ms_per_token == DEFAULT_FIT.transfer_ms_per_token
    assert any("smollm2-135m's KV a token is not readable" in w for w in warnings)
    data["meta"]["models"] = {"tiny": str(tmp_path), "smollm2-135m": str(tmp_path)}
    path.write_text(json.dumps(data))
    fit, warnings = load_fit(path)
    assert fit.kv_bytes_per_token == DEFAULT_FIT.kv_bytes_per_token
    assert any("2 models" in w for w in warnings)
