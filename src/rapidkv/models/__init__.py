"""Locally built test models: random-weight Llama + a BPE tokenizer, offline.

    from rapidkv.models import ensure_model
    path = ensure_model("tiny")            # float32, cached, built on first use
    path = ensure_model("small", "bfloat16")
    ids = text_token_ids(path)             # ids greedy decoding can emit

Nothing here downloads anything. See `spec` (sizes, cache key), `build`
(atomic cached build), `weights` (init scale), `tokenizer`.
"""

from rapidkv.models.build import default_cache_dir, ensure_model, model_path, text_token_ids
from rapidkv.models.spec import SIZES, ModelSpec, get_spec

__all__ = [
    "SIZES",
    "ModelSpec",
    "default_cache_dir",
    "ensure_model",
    "get_spec",
    "model_path",
    "text_token_ids",
]
