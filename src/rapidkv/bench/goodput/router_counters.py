"""`rapidkv bench goodput`: what a rapidkv router's /metrics count, read
before and after a rate.

- `rapidkv_router_placements_total{kind, reason}`: requests placed, by kind
  (`local`, `pd`, `split`, `fetch`: a prefix fetched from the instance that
  holds it) and by the policy's reason (`fixed` for a fixed router);
- `rapidkv_router_prefix_tokens_total{kind}`: prompt tokens by where the
  placement found them (`hit`: in the prefix cache of the instance that
  computes the prompt, `fetched`: pulled from another instance's,
  `computed`); a router without a prefix index counts none (0, not missing);
- `rapidkv_router_model_*_seconds{term}`: an adaptive router's learned costs,
  as they are now (not a counter), reported in ms as the placement policy
  keeps them (`learned["step_ms"]` from `rapidkv_router_model_step_seconds`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PLACEMENT_KINDS = ("local", "pd", "split", "fetch")
PREFIX_TOKEN_KINDS = ("hit", "fetched", "computed")
MODEL_PREFIX = "rapidkv_router_model_"


@dataclass(frozen=True)
class RouterCounters:
    kinds: dict[str, float] = field(default_factory=dict)  # placements by kind
    reasons: dict[str, float] = field(default_factory=dict)  # placements by reason
    prefix_tokens: dict[str, float] = field(default_factory=dict)  # hit, fetched, computed
    learned: dict[str, Any] = field(default_factory=dict)  # {"step_ms": {url: {term: v}}, ...}

    def since(self, before: RouterCounters) -> RouterCounters:
        """The counts from `before` to these (`learned`: these)."""

        def minus(now: dict[str, float], then: dict[str, float]) -> dict[str, float]:
            return {k: v - then.get(k, 0.0) for k, v in now.items()}

        return RouterCounters(
            minus(self.kinds, before.kinds),
            minus(self.reasons, before.reasons),
            minus(self.prefix_tokens, before.prefix_tokens),
            self.learned,
        )


def parse(metrics: dict[tuple[str, Any], float]) -> RouterCounters:
    """The counters in a router's parsed /metrics (`harness.get_metrics`)."""
    kinds = dict.fromkeys(PLACEMENT_KINDS, 0.0)
    reasons: dict[str, float] = {}
    tokens = dict.fromkeys(PREFIX_TOKEN_KINDS, 0.0)
    learned: dict[str, Any] = {}
    for (name, labels), v in metrics.items():
        lab = dict(labels)
        if name == "rapidkv_router_placements_total":
            kinds[lab["kind"]] = kinds.get(lab["kind"], 0.0) + v
            reasons[lab["reason"]] = reasons.get(lab["reason"], 0.0) + v
        elif name == "rapidkv_router_prefix_tokens_total":
            tokens[lab["kind"]] = tokens.get(lab["kind"], 0.0) + v
        elif name.startswith(MODEL_PREFIX) and name.endswith("_seconds") and "term" in lab:
            where = lab.get("upstream") or f"{lab.get('prefill')} -> {lab.get('decode')}"
            key = name.removeprefix(MODEL_PREFIX).removesuffix("_seconds") + "_ms"
            learned.setdefault(key, {}).setdefault(where, {})[lab["term"]] = v * 1000
    return RouterCounters(kinds, reasons, tokens, learned)


def read(router_url: str) -> RouterCounters:
    """A rapidkv router's counters now."""
    from rapidkv.harness import get_metrics

    return parse(get_metrics(router_url))
