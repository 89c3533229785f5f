"""What the harness reads of a model's config.json: the KV size per token and
the longest sequence (`kv_bytes_per_token`, `model_max_len`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rapidkv.harness.server import kv_bytes_per_token, model_max_len


def _model(tmp_path: Path, **config: object) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.unit
def test_kv_bytes_per_token_counts_k_and_v_of_every_layer_in_the_dtype(tmp_path: Path) -> None:
    m = _model(
        tmp_path,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        hidden_size=256,
        torch_dtype="float32",
        max_position_embeddings=2048,
    )
    assert kv_bytes_per_token(m) == 4 * 2 * 2 * 64 * 4
    assert kv_bytes_per_token(m, "bfloat16") == 4 * 2 * 2 * 64 * 2
    assert model_max_len(m) == 2048
    with pytest.raises(ValueError, match="int8"):
        kv_bytes_per_token(m, "int8")


@pytest.mark.unit
def test_head_dim_and_kv_heads_default_as_in_llama(tmp_path: Path) -> None:
    m = _model(
        tmp_path, num_hidden_layers=2, num_attention_heads=8, hidden_size=512, dtype="bfloat16"
    )
    assert kv_bytes_per_token(m) == 2 * 2 * 8 * 64 * 2
    assert model_max_len(m) is None
    assert model_max_len(tmp_path / "missing") is None
