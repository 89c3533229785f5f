"""Build model directories atomically and cache them by spec digest.

Invariants:
- a model directory is only ever seen complete: it is built in a temporary
  sibling directory and renamed into place; a directory holding `STAMP` with
  the expected digest is complete and is reused, never rewritten;
- concurrent builders (threads or processes) of one target serialise on an
  exclusive `flock` of `<target>.lock`; the loser finds the winner's result;
- the same spec gives byte-identical files (see `spec.ModelSpec.digest`).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rapidkv.models.spec import BUILDER_VERSION, ModelSpec, corpus_files, get_spec

STAMP = "rapidkv_model.json"


def default_cache_dir() -> Path:
    """`$RAPIDKV_CACHE/models`, else `~/.cache/rapidkv/models`."""
    root = os.environ.get("RAPIDKV_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "rapidkv"
    return base / "models"


def model_path(size: str = "tiny", dtype: str = "float32", cache_dir: Path | None = None) -> Path:
    """Where `ensure_model` keeps this model (it may not exist yet)."""
    spec = get_spec(size, dtype)
    return Path(cache_dir or default_cache_dir()) / spec.dir_name()


def ensure_model(size: str = "tiny", dtype: str = "float32", cache_dir: Path | None = None) -> Path:
    """Return the HF model directory for (size, dtype), building it on first use."""
    spec = get_spec(size, dtype)
    target = Path(cache_dir or default_cache_dir()) / spec.dir_name()
    return build_into(spec, target)


def build_into(spec: ModelSpec, target: Path) -> Path:
    """Make `target` a complete model directory for `spec` and return it.

    Reuses `target` if it already holds this spec; raises FileExistsError if it
    exists with anything else in it (an empty directory is replaced).
    """
    target = Path(target).absolute()
    digest = spec.digest()
    if _is_complete(target, digest):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with locked(target.parent / f".{target.name}.lock"):
        if _is_complete(target, digest):
            return target
        if target.exists():
            if target.is_dir() and not any(target.iterdir()):
                target.rmdir()
            else:
                raise FileExistsError(f"{target} exists and is not a model for {spec}")
        publish(target, lambda tmp: _write_model(spec, digest, tmp))
    return target


def publish(target: Path, write: Callable[[Path], None]) -> None:
    """`write` a directory's files into a temporary sibling of `target`, then
    rename it into place (readable by all); on any failure nothing is left."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(tmp)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        os.chmod(tmp, 0o755)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_model(spec: ModelSpec, digest: str, out: Path) -> None:
    # Imported here so `import rapidkv.models` stays light (no torch).
    from rapidkv.models.tokenizer import train_tokenizer, untextual_token_ids, write_tokenizer
    from rapidkv.models.weights import save_weights, write_config

    texts = [data.decode("utf-8") for _, data in corpus_files()]
    tok = train_tokenizer(texts, spec.vocab_size)
    suppressed = untextual_token_ids(tok)
    write_tokenizer(tok, out, spec.max_position_embeddings)
    write_config(spec, out)
    save_weights(spec, out, suppressed)
    stamp = {
        "builder_version": BUILDER_VERSION,
        "digest": digest,
        "spec": json.loads(spec.canonical_json()),
        "suppressed_token_ids": suppressed,
    }
    # Written last: its presence (after the rename) marks a complete model.
    (out / STAMP).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")


def text_token_ids(model_dir: Path) -> list[int]:
    """Ids that greedy decoding can emit: each decodes alone to printable text.

    Use them to draw random token-id prompts: a prompt made of them decodes
    cleanly (vLLM's incremental detokenizer mis-reports the output text after
    prompts that end in lone UTF-8 fragment bytes).
    """
    stamp = json.loads((Path(model_dir) / STAMP).read_text())
    suppressed = set(stamp["suppressed_token_ids"])
    return [i for i in range(stamp["spec"]["vocab_size"]) if i not in suppressed]


def _is_complete(target: Path, digest: str) -> bool:
    try:
        stamp = json.loads((target / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return stamp.get("digest") == digest


@contextmanager
def locked(path: Path) -> Iterator[None]:
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
