"""Deterministic random weights and config.json for a Llama test model.

Scale (why not the HF default init): with std 0.02 everywhere greedy decoding
of a random model repeats one token, so "two runs agree" proves nothing. Here
embeddings are N(0, 1) and every linear is N(0, 1/fan_in), which keeps
activations O(1) through the layers and gives logits with std ~1, so greedy
outputs depend on the prompt. Norm weights are 1.

Invariants:
- each tensor is drawn from its own generator seeded by (spec.seed, name), in
  float32, then cast to `spec.dtype`: a bfloat16 model is the rounded float32
  model, and tensor values do not depend on drawing order;
- the `lm_head` rows of the suppressed ids (by default the special tokens; the
  builder passes `tokenizer.untextual_token_ids`: specials, lone UTF-8
  fragment and control bytes) are zero, so their logit is exactly 0 while the
  max of ~2k ordinary logits (std ~1) is ~3 above it: greedy decoding never
  emits them, so it never stops at `</s>` (it runs to `max_tokens`) and its
  text always decodes cleanly;
- `save_weights` output is byte-identical for identical inputs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from rapidkv.models.spec import ModelSpec
from rapidkv.models.tokenizer import BOS_ID, EOS_ID, SPECIAL_TOKENS

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _normal(spec: ModelSpec, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    seed_bytes = hashlib.sha256(f"{spec.seed}:{name}".encode()).digest()[:8]
    gen = torch.Generator().manual_seed(int.from_bytes(seed_bytes, "little") >> 1)
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def _linear(spec: ModelSpec, name: str, out_f: int, in_f: int) -> torch.Tensor:
    return _normal(spec, name, (out_f, in_f), in_f**-0.5)


def make_state_dict(
    spec: ModelSpec, suppressed_ids: Sequence[int] = range(len(SPECIAL_TOKENS))
) -> dict[str, torch.Tensor]:
    """HF `LlamaForCausalLM` parameter names -> contiguous tensors in spec.dtype."""
    h, hd = spec.hidden_size, spec.head_dim
    q_out, kv_out = spec.num_attention_heads * hd, spec.num_key_value_heads * hd
    sd: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": _normal(spec, "embed", (spec.vocab_size, h), 1.0),
        "model.norm.weight": torch.ones(h),
    }
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = torch.ones(h)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(h)
        sd[p + "self_attn.q_proj.weight"] = _linear(spec, p + "q", q_out, h)
        sd[p + "self_attn.k_proj.weight"] = _linear(spec, p + "k", kv_out, h)
        sd[p + "self_attn.v_proj.weight"] = _linear(spec, p + "v", kv_out, h)
        sd[p + "self_attn.o_proj.weight"] = _linear(spec, p + "o", h, q_out)
        sd[p + "mlp.gate_proj.weight"] = _linear(spec, p + "gate", spec.intermediate_size, h)
        sd[p + "mlp.up_proj.weight"] = _linear(spec, p + "up", spec.intermediate_size, h)
        sd[p + "mlp.down_proj.weight"] = _linear(spec, p + "down", h, spec.intermediate_size)
    lm_head = _linear(spec, "lm_head", spec.vocab_size, h)
    lm_head[list(suppressed_ids)] = 0.0
    sd["lm_head.weight"] = lm_head
    dt = _TORCH_DTYPES[spec.dtype]
    return {k: v.to(dt).contiguous() for k, v in sd.items()}


def save_weights(spec: ModelSpec, out: Path, suppressed_ids: Sequence[int]) -> None:
    """Write model.safetensors (tensors sorted by name, fixed metadata)."""
    sd = make_state_dict(spec, suppressed_ids)
    save_file(dict(sorted(sd.items())), str(out / "model.safetensors"), metadata={"format": "pt"})


def config_dict(spec: ModelSpec) -> dict[str, object]:
    """config.json contents that transformers and vLLM read as a LlamaConfig."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "mlp_bias": False,
        "num_attention_heads": spec.num_attention_heads,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_key_value_heads": spec.num_key_value_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_parameters": {"rope_theta": spec.rope_theta, "rope_type": "default"},
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": False,
        "dtype": spec.dtype,
        "torch_dtype": spec.dtype,
        "use_cache": True,
        "vocab_size": spec.vocab_size,
    }


def write_config(spec: ModelSpec, out: Path) -> None:
    """Write config.json and generation_config.json (sorted keys)."""
    for name, obj in (
        ("config.json", config_dict(spec)),
        ("generation_config.json", {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}),
    ):
        (out / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
