"""The vLLM KV connector (in progress): the only package that may import vLLM.

So far it holds `plan`, the pure block/token planning of P-side sends; the
connector class itself is not built yet.
"""
