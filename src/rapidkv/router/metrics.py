"""The router's Prometheus metrics, in a registry of their own (served at ``/metrics``).

Names and labels (``endpoint`` is ``completions`` | ``chat``; ``dispatch`` is
``dual`` | ``serial`` | ``local``; ``role`` is ``prefill`` | ``decode`` (the
part an upstream request plays) or, on per-instance series, also ``both`` (an
instance that may play either, ``--instance``); ``upstream`` is the instance's
base URL (not ``instance``: Prometheus sets that label to the scrape target,
the router, and renames a scraped one ``exported_instance``). Every series is
in docs/metrics.md):

- ``rapidkv_router_requests_total{endpoint,dispatch,outcome}``: requests by
  how they ended (`OUTCOMES`).
- ``rapidkv_router_requests_in_flight``: client requests being served.
- ``rapidkv_router_ttft_seconds{endpoint,dispatch}``: request received → first
  output event relayed to the client (streaming answers only).
- ``rapidkv_router_e2e_seconds{endpoint,dispatch}``: request received → answer
  fully relayed (successful requests only).
- ``rapidkv_router_upstream_errors_total{role,upstream,kind}``: failed upstream
  requests; ``kind`` is ``status`` (an HTTP error answer), ``connect`` (no
  status line: refused, reset, timed out), ``stream`` (the answer broke off) or
  ``discovery`` (a prefill instance did not tell its control address).
  Prefill errors do not fail the client: D recomputes the prompt.
- ``rapidkv_router_outstanding{role,upstream}``: requests in flight per instance
  (what instance choice balances).
- ``rapidkv_router_first_token_total{source}``: streamed dual-dispatch answers
  by where their first token came from, counted once D's first token is known:
  ``prefill`` (P's token opened the stream and D's was the same, `stitch`),
  ``decode`` (D's came first, or the request could not be stitched),
  ``continuation`` (P's opened it, D's differed: D's answer was dropped and the
  rest computed from the prompt plus P's token).
- ``rapidkv_router_instance_up{role,upstream}``: 1 while the router dispatches
  to the instance, 0 from a request that got no answer from it until its
  ``/health`` answers 200 again (`fleet.health`).
- ``rapidkv_router_instance_draining{role,upstream}``: 1 while the instance
  is drained (``POST /admin/drain``): it gets no new request.
- ``rapidkv_router_transfers_degraded{upstream}``: 1 while every TransferKV a
  decode instance sent since the previous check fell back to recompute (a pair
  that is up but not transferring; `fleet.transfers`), else 0.
- ``rapidkv_router_placements_total{kind,reason}``: requests by where they
  ran: ``kind`` ``local`` (one instance), ``pd`` (prompt on one, decode on
  another), ``split`` (the prompt's head on one, the rest and the decode on
  another), ``fetch`` (a split whose head one instance holds cached: its KV
  is sent, the rest computed where it decodes); ``reason`` ``fixed``
  (``--placement fixed``) or the adaptive policy's
  (`placement.policy.Reason`). The same is in each answer's
  ``x-rapidkv-placement`` header.
- ``rapidkv_router_placed_requests_total{placement,outcome}``: requests by
  the placement kind they ran under (``placement`` ``local``, ``pd``,
  ``split``, ``fetch``, or ``none``: ended before one was chosen) and how
  they ended (``outcome``, as in ``rapidkv_router_requests_total``, which
  also counts the requests refused before their body was read and checked:
  those are not here).
- ``rapidkv_router_prefix_tokens_total{kind}``: adaptive placement's prompt
  tokens by what became of them, as placed: ``hit`` (found in the prefix
  cache of the instance computing that part), ``fetched`` (sent from the
  cache of an instance that holds them: a fetch) and ``computed``; the three
  add up to the prompts' tokens (but for the one token vLLM computes of a
  prompt it holds whole, counted both as hit and computed).
- ``rapidkv_router_without_prefill_total``: dual or serial requests served by D
  alone because no prefill instance was up, or the chosen one's control
  address could not be discovered.
- ``rapidkv_router_migrations_total{outcome}``: live migrations (``ok``,
  ``failed``: the request runs on where it was, ``refused``: not started), and
  ``rapidkv_router_migration_downtime_seconds``: the client's gap in each.
- ``rapidkv_router_control_aborts_total{outcome}``: control-plane Aborts sent to
  P after a client disconnect; ``outcome`` is ``ok`` (P answered) or ``failed``.

Invariant: every label set a request can produce is created up front for the
configured instances, so a scrape shows zeros rather than missing series.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rapidkv.router.config import Member, RouterConfig
from rapidkv.router.placement.policy import REASONS
from rapidkv.router.placement.state import KINDS
from rapidkv.router.rewrite import ENDPOINTS

OUTCOMES = (
    "ok",  # D answered 2xx and it was relayed in full
    "upstream_error",  # D answered an error status; relayed to the client
    "unreachable",  # D did not answer at all (502 to the client)
    "stream_error",  # D's answer broke off mid-way (client connection closed)
    "client_abort",  # the client went away first
    "bad_request",  # refused by the router (400/413)
    "unavailable",  # no decode instance was up (503 at once; nothing sent to P)
    "error",  # the router failed, or shut down, while serving it
)
FIRST_TOKEN_SOURCES = ("prefill", "decode", "continuation")
MIGRATION_OUTCOMES = ("ok", "failed", "refused")
UPSTREAM_ERROR_KINDS = ("status", "connect", "stream", "discovery")
PREFIX_TOKEN_KINDS = ("hit", "fetched", "computed")
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class RouterMetrics:
    """The metric objects of one router (one registry each, so routers can coexist)."""

    def __init__(self, config: RouterConfig) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "rapidkv_router_requests",
            "Client requests by endpoint, dispatch mode and outcome",
            ["endpoint", "dispatch", "outcome"],
            registry=r,
        )
        self.in_flight = Gauge(
            "rapidkv_router_requests_in_flight", "Client requests being served", registry=r
        )
        self.ttft = Histogram(
            "rapidkv_router_ttft_seconds",
            "Request received to first output event relayed (streaming answers)",
            ["endpoint", "dispatch"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "rapidkv_router_e2e_seconds",
            "Request received to answer fully relayed (successful requests)",
            ["endpoint", "dispatch"],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "rapidkv_router_upstream_errors",
            "Failed upstream requests by role, upstream instance and kind",
            ["role", "upstream", "kind"],
            registry=r,
        )
        self.outstanding = Gauge(
            "rapidkv_router_outstanding",
            "Upstream requests in flight per instance",
            ["role", "upstream"],
            registry=r,
        )
        self.control_aborts = Counter(
            "rapidkv_router_control_aborts",
            "Control-plane Aborts sent to prefill instances after a client disconnect",
            ["outcome"],
            registry=r,
        )
        self.migrations = Counter(
            "rapidkv_router_migrations",
            "Live migrations ordered (/admin/migrate, /admin/drain) by outcome: ok, "
            "failed (the request runs on where it was), refused (could not start)",
            ["outcome"],
            registry=r,
        )
        for outcome in MIGRATION_OUTCOMES:
            self.migrations.labels(outcome)
        self.migration_downtime = Histogram(
            "rapidkv_router_migration_downtime_seconds",
            "Client-side gap of a migration: the source's last event to the destination's first",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.instance_up = Gauge(
            "rapidkv_router_instance_up",
            "1 while the router dispatches to the instance, 0 while it is down",
            ["role", "upstream"],
            registry=r,
        )
        self.instance_draining = Gauge(
            "rapidkv_router_instance_draining",
            "1 while the instance is drained (no new requests; POST /admin/drain)",
            ["role", "upstream"],
            registry=r,
        )
        self.transfers_degraded = Gauge(
            "rapidkv_router_transfers_degraded",
            "1 while every TransferKV of the decode instance fell back to recompute",
            ["upstream"],
            registry=r,
        )
        self.without_prefill = Counter(
            "rapidkv_router_without_prefill",
            "Dual or serial requests served by a decode instance alone: no prefill instance "
            "up, or its control address unknown",
            registry=r,
        )
        self.split_prefills = Counter(
            "rapidkv_router_split_prefills",
            "Dual-dispatch requests whose prompt P and D computed in two parts at once",
            registry=r,
        )
        self.placements = Counter(
            "rapidkv_router_placements",
            "Requests by where they ran (kind: local, pd, split) and why (reason: fixed, or "
            "the adaptive policy's)",
            ["kind", "reason"],
            registry=r,
        )
        self.prefix_tokens = Counter(
            "rapidkv_router_prefix_tokens",
            "Adaptive placement's prompt tokens by what became of them: hit (in the prefix "
            "cache where computed), fetched (sent from an instance's cache), computed",
            ["kind"],
            registry=r,
        )
        for kind in PREFIX_TOKEN_KINDS:
            self.prefix_tokens.labels(kind)
        self.placed = Counter(
            "rapidkv_router_placed_requests",
            "Requests by the placement kind they ran under (none: refused or failed before "
            "one was chosen) and their outcome",
            ["placement", "outcome"],
            registry=r,
        )
        for kind in (*KINDS, "none"):
            for outcome in OUTCOMES:
                self.placed.labels(kind, outcome)
        self.first_token = Counter(
            "rapidkv_router_first_token",
            "Streamed dual-dispatch answers by the source of their first token",
            ["source"],
            registry=r,
        )
        reasons = ("fixed",) if config.placement == "fixed" else REASONS
        for kind in KINDS:
            for reason in reasons:
                self.placements.labels(kind, reason)
        for source in FIRST_TOKEN_SOURCES:
            self.first_token.labels(source)
        for endpoint in ENDPOINTS:
            self.ttft.labels(endpoint, config.dispatch)
            self.e2e.labels(endpoint, config.dispatch)
            for outcome in OUTCOMES:
                self.requests.labels(endpoint, config.dispatch, outcome)
        for member in config.members:
            self.add_member(member)
        for outcome in ("ok", "failed"):
            self.control_aborts.labels(outcome)

    def remove_member(self, member: Member) -> None:
        """Drop the series `add_member` made for `member` (an instance that
        came back with other roles: its old ``role`` label would stay, stale)."""
        url = member.instance.url
        for gauge in (self.outstanding, self.instance_up, self.instance_draining):
            gauge.remove(member.label, url)  # a no-op for a series never set

    def add_member(self, member: Member) -> None:
        """Series of an instance of the fleet, at their starting values."""
        url = member.instance.url
        self.outstanding.labels(member.label, url).set(0)
        self.instance_up.labels(member.label, url).set(1)
        self.instance_draining.labels(member.label, url).set(0)
        if "decode" in member.roles:
            self.transfers_degraded.labels(url).set(0)
        for role in member.roles:
            for kind in UPSTREAM_ERROR_KINDS:
                self.upstream_errors.labels(role, url, kind)
