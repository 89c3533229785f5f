"""kvt: the KV transfer data plane. Imports nothing from vLLM."""
