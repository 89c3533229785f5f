"""Unit tests for the locally built test models (spec, cache, bytes, tokenizer)."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from rapidkv.models import build as build_mod
from rapidkv.models import ensure_model, get_spec, model_path, text_token_ids
from rapidkv.models import spec as spec_mod
from rapidkv.models.build import STAMP, build_into
from rapidkv.models.spec import SIZES, ModelSpec
from rapidkv.models.tokenizer import BOS_ID, EOS_ID, SPECIAL_TOKENS, UNK_ID
from rapidkv.models.weights import make_state_dict

pytestmark = pytest.mark.unit

FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
    STAMP,
}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny float32 model built twice, independently, into two directories."""
    spec = get_spec("tiny")
    a = build_into(spec, tmp_path_factory.mktemp("a") / "model")
    b = build_into(spec, tmp_path_factory.mktemp("b") / "model")
    return a, b


# --- spec hashing ---------------------------------------------------------------


def test_equal_specs_have_equal_digests() -> None:
    assert get_spec("tiny") == get_spec("tiny", "float32")
    assert get_spec("tiny").digest() == get_spec("tiny").digest()
    assert get_spec("tiny").digest() != get_spec("small").digest()
    assert get_spec("tiny").digest() != get_spec("tiny", "bfloat16").digest()


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(ModelSpec)])
def test_every_field_changes_the_digest(field: str) -> None:
    base = get_spec("tiny")
    value = getattr(base, field)
    new: object
    if field == "dtype":
        new = "bfloat16"
    elif field == "size":
        new = "other"
    elif field == "num_key_value_heads":
        new = 1  # must still divide num_attention_heads
    elif field == "num_attention_heads":
        new = value + base.num_key_value_heads
    elif isinstance(value, float):
        new = value * 2
    else:
        new = value + 1
    changed = dataclasses.replace(base, **{field: new})
    assert changed.digest() != base.digest()


def test_corpus_and_builder_version_change_the_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = get_spec("tiny")
    before = spec.digest()
    files = spec_mod.corpus_files()
    name, data = files[0]
    monkeypatch.setattr(spec_mod, "corpus_files", lambda: [(name, data + b"x"), *files[1:]])
    assert spec.digest() != before
    monkeypatch.undo()
    assert spec.digest() == before
    monkeypatch.setattr(spec_mod, "BUILDER_VERSION", spec_mod.BUILDER_VERSION + 1)
    assert spec.digest() != before


def test_spec_validation_and_sizes() -> None:
    with pytest.raises(ValueError):
        get_spec("huge")
    with pytest.raises(ValueError):
        get_spec("tiny", "float16")
    with pytest.raises(ValueError):
        dataclasses.replace(get_spec("tiny"), num_key_value_heads=3)
    tiny = SIZES["tiny"]
    assert (tiny.num_hidden_layers, tiny.hidden_size, tiny.num_key_value_heads) == (4, 256, 2)
    assert tiny.dtype == "float32"
    assert get_spec("small").num_hidden_layers > tiny.num_hidden_layers


def test_model_path_is_keyed_by_digest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = get_spec("small", "bfloat16")
    p = model_path("small", "bfloat16", cache_dir=tmp_path)
    assert p == tmp_path / spec.dir_name()
    assert spec.digest()[:16] in p.name
    assert not p.exists()  # model_path builds nothing
    monkeypatch.setenv("RAPIDKV_CACHE", str(tmp_path / "root"))
    assert model_path("tiny") == tmp_path / "root" / "models" / get_spec("tiny").dir_name()


# --- built bytes ----------------------------------------------------------------


def test_tiny_builds_are_byte_identical(tiny_dirs: tuple[Path, Path]) -> None:
    a, b = tiny_dirs
    names = {p.name for p in a.iterdir()}
    assert names == FILES
    assert names == {p.name for p in b.iterdir()}
    for name in sorted(names):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_config_matches_spec(tiny_dirs: tuple[Path, Path]) -> None:
    spec = get_spec("tiny")
    cfg = json.loads((tiny_dirs[0] / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == spec.num_hidden_layers
    assert cfg["hidden_size"] == spec.hidden_size
    assert cfg["num_key_value_heads"] == spec.num_key_value_heads
    assert cfg["vocab_size"] == spec.vocab_size
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (BOS_ID, EOS_ID)
    stamp = json.loads((tiny_dirs[0] / STAMP).read_text())
    assert stamp["digest"] == spec.digest()


def test_weights_scale_and_special_rows() -> None:
    spec = get_spec("tiny")
    f32 = make_state_dict(spec)
    bf16 = make_state_dict(spec.with_dtype("bfloat16"))
    assert f32.keys() == bf16.keys()
    for name, t in f32.items():
        assert t.dtype == torch.float32
        assert bf16[name].dtype == torch.bfloat16
        assert torch.equal(t.to(torch.bfloat16), bf16[name]), name  # bf16 = rounded f32
    # Not the HF default init (std 0.02): embeddings N(0,1), linears N(0, 1/fan_in).
    assert 0.95 < f32["model.embed_tokens.weight"].std().item() < 1.05
    q = f32["model.layers.0.self_attn.q_proj.weight"]
    assert abs(q.std().item() * spec.hidden_size**0.5 - 1.0) < 0.05
    # Different tensors get different draws.
    assert not torch.equal(q, f32["model.layers.1.self_attn.q_proj.weight"])
    lm_head = f32["lm_head.weight"]
    assert torch.count_nonzero(lm_head[: len(SPECIAL_TOKENS)]) == 0
    assert torch.count_nonzero(lm_head[len(SPECIAL_TOKENS) :]) > 0


def test_untextual_ids_cannot_be_generated(tiny_dirs: tuple[Path, Path]) -> None:
    path = tiny_dirs[0]
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    ok = text_token_ids(path)
    bad = sorted(set(range(tok.get_vocab_size())) - set(ok))
    # Specials, the 128 lone non-ASCII bytes and the ASCII control bytes (not \n, \t).
    assert set(range(len(SPECIAL_TOKENS))) <= set(bad)
    assert 128 + 3 < len(bad) < 200
    for i in ok:
        text = tok.decode([i])
        assert text and "\ufffd" not in text, (i, text)
        assert all(c.isprintable() or c in "\n\t" for c in text), (i, text)
    assert "\ufffd" in tok.decode([bad[-1]]) or not tok.decode([bad[-1]]).isprintable()
    lm_head = load_file(str(path / "model.safetensors"))["lm_head.weight"]
    assert torch.count_nonzero(lm_head[bad]) == 0
    assert bool((lm_head[ok].abs().sum(dim=1) > 0).all())


# --- cache behaviour -------------------------------------------------------------


def test_ensure_model_caches_and_builds_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []
    real = build_mod._write_model

    def counting(spec: ModelSpec, digest: str, out: Path) -> None:
        calls.append(out)
        real(spec, digest, out)

    monkeypatch.setattr(build_mod, "_write_model", counting)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_model("tiny", cache_dir=tmp_path)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert len(results) == 3 and len(set(results)) == 1
    path = results[0]
    assert path == model_path("tiny", cache_dir=tmp_path)
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_model("tiny", cache_dir=tmp_path) == path
    assert len(calls) == 1
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    # No temporary directories left behind.
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [path.name]


def test_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(spec: ModelSpec, digest: str, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("boom")

    monkeypatch.setattr(build_mod, "_write_model", boom)
    with pytest.raises(RuntimeError):
        ensure_model("tiny", cache_dir=tmp_path)
    assert not any(p.is_dir() for p in tmp_path.iterdir())


def test_build_into_refuses_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        build_into(get_spec("tiny"), tmp_path / "x")
    assert (tmp_path / "x" / "keep.txt").read_text() == "mine"


# --- tokenizer -------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "The old harbour was quiet at dawn.",
        "  leading spaces, tabs\tand\nnewlines\n\n",
        "Zebra 1234.56 coins; WHY? naïve café — 東京 🚀",
        "",
    ],
)
def test_tokenizer_round_trip(tiny_dirs: tuple[Path, Path], text: str) -> None:
    tok = Tokenizer.from_file(str(tiny_dirs[0] / "tokenizer.json"))
    assert tok.get_vocab_size() == get_spec("tiny").vocab_size
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [UNK_ID, BOS_ID, EOS_ID]
    ids = tok.encode(text).ids
    assert ids[0] == BOS_ID and BOS_ID not in ids[1:]
    assert UNK_ID not in ids
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_learned_words(tiny_dirs: tuple[Path, Path]) -> None:
    tok = Tokenizer.from_file(str(tiny_dirs[0] / "tokenizer.json"))
    # Common corpus words are single tokens: the merges did something.
    assert len(tok.encode(" harbour", add_special_tokens=False).ids) == 1
    assert len(tok.encode("The quiet village", add_special_tokens=False).ids) <= 4
