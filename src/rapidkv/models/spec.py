"""Model specifications for the locally generated test models.

A `ModelSpec` fully determines a model directory's bytes, together with the
corpus shipped in `rapidkv/models/corpus/`, `BUILDER_VERSION` and the versions
of the libraries that draw the weights and train the tokenizer (see
`ModelSpec.digest`). Invariants:

- specs are immutable and hashable; equal specs have equal digests;
- any field change, any corpus byte change, a `BUILDER_VERSION` bump or a
  torch/tokenizers/safetensors version change changes the digest;
- `num_attention_heads * head_dim` need not equal `hidden_size` (Llama allows
  it), but `num_attention_heads` is a multiple of `num_key_value_heads`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from importlib import metadata, resources
from typing import Literal

# Bump whenever the builder's output bytes change for an unchanged spec.
BUILDER_VERSION = 2

DType = Literal["float32", "bfloat16"]
DTYPES: tuple[str, ...] = ("float32", "bfloat16")


@dataclass(frozen=True)
class ModelSpec:
    """Architecture and build parameters of one Llama test model."""

    size: str
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    dtype: DType = "float32"
    seed: int = 0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, int) and f.name != "seed" and v <= 0:
                raise ValueError(f"{f.name} must be positive, got {v}")

    def with_dtype(self, dtype: str) -> ModelSpec:
        """The same model stored in another dtype (same seed, so same draws)."""
        return dataclasses.replace(self, dtype=dtype)  # type: ignore[arg-type]

    def canonical_json(self) -> str:
        """Stable JSON of the fields (sorted keys, no whitespace)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        """Hex sha256 over spec, corpus, builder version and library versions."""
        h = hashlib.sha256()
        h.update(f"builder={BUILDER_VERSION}\n".encode())
        h.update(self.canonical_json().encode() + b"\n")
        for name, data in corpus_files():
            h.update(f"corpus {name} {len(data)}\n".encode())
            h.update(data)
        for dist in ("torch", "tokenizers", "safetensors"):
            h.update(f"{dist}={_version(dist)}\n".encode())
        return h.hexdigest()

    def dir_name(self) -> str:
        """Cache directory name: readable prefix plus a digest prefix."""
        return f"llama-{self.size}-{self.dtype}-{self.digest()[:16]}"


SIZES: dict[str, ModelSpec] = {
    # ~5M parameters: correctness tests, fast everywhere.
    "tiny": ModelSpec(
        size="tiny",
        num_hidden_layers=4,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=768,
        vocab_size=2048,
        max_position_embeddings=2048,
        seed=1234,
    ),
    # Sized so that a 512-token prefill on one core takes roughly 50-150 ms in vLLM.
    "small": ModelSpec(
        size="small",
        num_hidden_layers=8,
        hidden_size=384,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=1024,
        vocab_size=2048,
        max_position_embeddings=2048,
        seed=5678,
    ),
}


def get_spec(size: str = "tiny", dtype: str = "float32") -> ModelSpec:
    """The spec for a named size in the given dtype; ValueError if unknown."""
    try:
        base = SIZES[size]
    except KeyError:
        raise ValueError(f"unknown model size {size!r}; known: {sorted(SIZES)}") from None
    return base.with_dtype(dtype)


def corpus_files() -> list[tuple[str, bytes]]:
    """(name, bytes) of every corpus text file, sorted by name."""
    root = resources.files("rapidkv.models").joinpath("corpus")
    files = [(p.name, p.read_bytes()) for p in root.iterdir() if p.name.endswith(".txt")]
    if not files:
        raise FileNotFoundError("rapidkv/models/corpus/*.txt is missing")
    return sorted(files)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"
