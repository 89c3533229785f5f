"""rapidkv: KV-cache hand-off for prefill/decode disaggregated vLLM serving."""

__version__ = "0.1.0"
