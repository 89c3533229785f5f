"""Benchmarks users run: `rapidkv bench kvt` (more arrive with later work)."""
