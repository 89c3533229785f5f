"""What a router is configured with: its instances, where it listens, how it dispatches.

Invariants (checked on construction, so a running router never meets a bad value):
- an `Instance` URL is an ``http(s)://host[:port][/prefix]`` base URL with no
  trailing slash, query or fragment (OpenAI paths such as ``/v1/completions``
  are appended to it), and its control address, when given, parses as
  ``host:port``;
- a `RouterConfig` has at least one instance that may decode, and at least
  one that may prefill unless it dispatches `local`, unless it follows etcd
  (its instances may all come from there, later);
- URLs are unique within each list (`prefill`, `decode`, `instances`); a URL
  given in several lists is one `Member` with every role they give it, and at
  most one control address.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Literal, get_args
from urllib.parse import urlsplit

from rapidkv.control.address import parse_address

SPLIT_MIN_TOKENS = 32
"""`RouterConfig.split_min_tokens` by default (`split.split_point`)."""

Dispatch = Literal["dual", "serial", "local"]
DISPATCH_MODES: tuple[str, ...] = get_args(Dispatch)
Placement = Literal["fixed", "adaptive"]
PLACEMENTS: tuple[str, ...] = get_args(Placement)
Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = get_args(Role)


@dataclass(frozen=True)
class Instance:
    """One vLLM instance: its HTTP base URL and, when known, its rapidkv control address."""

    url: str
    control: str | None = None
    block_size: int | None = None  # a prefill instance's KV block size, once discovered
    max_num_seqs: int | None = None  # its engine's, from its etcd record (else discovered)

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"instance URL {self.url!r} is not an http(s)://host[:port] URL")
        if parts.query or parts.fragment or self.url.endswith("/"):
            raise ValueError(
                f"instance URL {self.url!r} must be a base URL (no query, fragment or "
                "trailing slash)"
            )
        try:
            parts.port  # noqa: B018 (raises ValueError on a bad port)
        except ValueError as e:
            raise ValueError(f"instance URL {self.url!r}: {e}") from None
        if self.control is not None:
            parse_address(self.control)

    @classmethod
    def parse(cls, text: str) -> Instance:
        """``URL`` or ``URL=CONTROL_ADDR`` (the last ``=`` splits); a trailing slash is dropped."""
        url, sep, control = text.rpartition("=")
        if not sep:
            url, control = text, ""
        return cls(url=url.strip().rstrip("/"), control=control.strip() or None)

    def __str__(self) -> str:
        return self.url if self.control is None else f"{self.url}={self.control}"


@dataclass(frozen=True)
class Member:
    """One instance of the fleet and the roles the router may give it: a
    ``--prefill`` or ``--decode`` instance is pinned to that role, an
    ``--instance`` (connector as ``kv_both``) takes either, per request."""

    instance: Instance
    roles: frozenset[Role]

    @property
    def label(self) -> str:
        """``prefill``, ``decode`` or ``both`` (the ``role`` label of its metrics)."""
        return "both" if len(self.roles) > 1 else next(iter(self.roles))


def _members(lists: tuple[tuple[tuple[Instance, ...], frozenset[Role]], ...]) -> tuple[Member, ...]:
    """Instances merged by URL, in order of first appearance."""
    merged: dict[str, Member] = {}
    for instances, roles in lists:
        for inst in instances:
            known = merged.get(inst.url)
            if known is None:
                merged[inst.url] = Member(inst, roles)
                continue
            a, b = known.instance.control, inst.control
            if a is not None and b is not None and a != b:
                raise ValueError(f"instance {inst.url} is given two control addresses: {a}, {b}")
            inst = inst if a is None else known.instance
            merged[inst.url] = Member(inst, known.roles | roles)
    return tuple(merged.values())


# settings that must be > 0 (`RouterConfig`)
_POSITIVE = (
    "keep_alive_s",
    "upstream_keep_alive_s",
    "probe_interval_s",
    "discovery_retry_s",
    "connect_timeout_s",
    "upstream_read_timeout_s",
    "health_timeout_s",
    "abort_timeout_s",
    "max_body_bytes",
)


@dataclass(frozen=True)
class RouterConfig:
    """Everything `rapidkv router` needs. Timeouts are in seconds.

    `upstream_read_timeout_s` bounds the wait for each piece of an upstream
    answer (the first byte of a queued request, then each streamed chunk), not
    the whole request. `secret` authenticates control-plane messages (Abort).

    Idle keep-alive connections: the side that closes one must be the side
    that would reuse it, or a request sent just as the other side closes is
    reset (the client sees a `ReadError` and the request is lost before the
    router or vLLM ever reads it). So the router keeps its clients' idle
    connections for `keep_alive_s` (75 s), longer than HTTP clients keep
    theirs (httpx 5 s, aiohttp 15 s, browsers about 60 s): they close first.
    And it drops its own idle connections to an instance after
    `upstream_keep_alive_s` (2 s), before vLLM's server closes them (its
    `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`, 5 s by default).
    """

    prefill: tuple[Instance, ...] = ()
    decode: tuple[Instance, ...] = ()
    # instances that may prefill or decode (their connector runs as kv_both)
    instances: tuple[Instance, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    dispatch: Dispatch = "dual"
    # fixed: the decoder by least outstanding, P among the others (split while
    # idle); adaptive: `placement.placer` picks local / PD / split per request, for the
    # lowest predicted TTFT within the TPOT SLO (dual dispatch only)
    placement: Placement = "fixed"
    ttft_slo_ms: float = 1000.0
    tpot_slo_ms: float = 100.0
    ttft_headroom: float = 0.5  # adaptive: TTFTs below this fraction of the SLO tie
    tpot_margin: float = 0.6  # adaptive: ties go first to TPOTs within a step + this of the slack
    # adaptive: instances that may do anything specialise (half prefill, half
    # decode) while prompts landing beside decodes would break the TPOT SLO
    # (`placement.shape`)
    specialize: bool = True
    # adaptive: PD and split compute a prompt on an instance of role any only
    # while it holds no request (`Policy.idle_crossings`)
    idle_crossings: bool = True
    # adaptive: follow the instances' vLLM KV events (those whose discovery
    # names a publisher) and place each request knowing what each instance
    # holds in its prefix cache (`fleet.prefix_caches`)
    prefix_index: bool = True
    # adaptive with the index: a prefix one instance holds may be sent to the
    # decoder (a fetch: `Policy.fetch`)
    prefix_fetch: bool = True
    # the tokenizer's directory for text and chat prompts (None: the model
    # directory an instance's /v1/models names, when it exists on this host)
    tokenizer: str | None = None
    # ask prefill instances configured without a control address for it
    discover: bool = True
    # dual dispatch: P's first token opens the client's stream when it may (see `stitch`)
    prefill_first_token: bool = True
    # dual dispatch: while P and D are idle, P computes a head of the prompt and D
    # the tail at the same time (`split`); the head is about this fraction of it,
    # and neither part is under `split_min_tokens` tokens (else no split)
    split_prefill: bool = True
    split_fraction: float = 0.55
    split_min_tokens: int = SPLIT_MIN_TOKENS
    # test hook: treat D's first token as different from P's (exercises the continuation)
    debug_first_token_mismatch: bool = False
    secret: bytes | None = None
    # the /admin routes exist only with a token, and require it (`admin`)
    admin_token: str | None = None
    # etcd endpoints (base URLs): the instances registered under
    # `<etcd_prefix>instances/` join the fleet and leave it with their lease
    # (`membership_follower`), beside the instances configured here
    etcd: tuple[str, ...] = ()
    etcd_prefix: str = "/rapidkv/"
    connect_timeout_s: float = 10.0
    upstream_read_timeout_s: float = 600.0
    health_timeout_s: float = 2.0
    # a down instance's /health is asked this often until it answers 200
    probe_interval_s: float = 1.0
    # a failed discovery (control address, block size) is tried again on next
    # use, at most this often (`fleet.addresses`)
    discovery_retry_s: float = 10.0
    # decode instances with a control address: their connector's counters are
    # read this often, to tell a pair that is up but not transferring (0: never)
    transfer_check_interval_s: float = 2.0
    abort_timeout_s: float = 5.0
    max_connections: int = 1024
    max_body_bytes: int = 64 << 20
    keep_alive_s: float = 75.0
    upstream_keep_alive_s: float = 2.0
    # on SIGTERM (`shutdown`): new requests are refused (503) while the running
    # ones get this long to finish; then the rest are cancelled and it exits
    shutdown_grace_s: float = 3.0
    # where the router's spans go (OTLP; `tracing`); None: to the tracer
    # provider the process set up, if any (no spans without one)
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "etcd", tuple(self.etcd))
        for name in ("prefill", "decode", "instances"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
            urls = [i.url for i in getattr(self, name)]
            if len(set(urls)) != len(urls):
                raise ValueError(f"{name} URLs must be unique: {urls}")
        if self.dispatch not in DISPATCH_MODES:
            raise ValueError(f"dispatch must be one of {DISPATCH_MODES}, not {self.dispatch!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, not {self.placement!r}")
        if self.placement == "adaptive" and self.dispatch != "dual":
            raise ValueError("adaptive placement needs dual dispatch")
        if not (self.ttft_slo_ms > 0 and self.tpot_slo_ms > 0):
            raise ValueError(
                f"the TTFT and TPOT SLOs (ttft_slo_ms, tpot_slo_ms) must be > 0 ms: "
                f"{self.ttft_slo_ms}, {self.tpot_slo_ms}"
            )
        if not 0 <= self.tpot_margin <= 1:
            raise ValueError(f"tpot_margin must be in [0, 1], not {self.tpot_margin}")
        if not 0 <= self.ttft_headroom <= 1:
            raise ValueError(f"ttft_headroom must be in [0, 1], not {self.ttft_headroom}")
        decoders = self.pool("decode")  # `members` raises for conflicting control addresses
        if not decoders and not self.etcd:
            raise ValueError("a router needs at least one instance that may decode (or etcd)")
        if not self.pool("prefill") and self.dispatch != "local" and not self.etcd:
            raise ValueError(f"dispatch {self.dispatch!r} needs at least one prefill instance")
        if self.etcd and not self.etcd_prefix.endswith("/"):
            raise ValueError(f"etcd_prefix must end with '/', not {self.etcd_prefix!r}")
        for url in self.etcd:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"an etcd endpoint is an http(s):// URL, not {url!r}")
        if not self.host:
            raise ValueError("give the host to bind explicitly (0.0.0.0 for every interface)")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} out of range")
        if not 0 < self.split_fraction < 1:
            raise ValueError(f"split_fraction must be between 0 and 1, not {self.split_fraction}")
        if self.split_min_tokens < 0:
            raise ValueError(f"split_min_tokens must be >= 0, not {self.split_min_tokens}")
        for name in _POSITIVE:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, not {getattr(self, name)}")
        for name in ("transfer_check_interval_s", "shutdown_grace_s", "max_connections"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, not {getattr(self, name)}")
        if self.otlp_traces_endpoint is not None and not self.otlp_traces_endpoint:
            raise ValueError("otlp_traces_endpoint is a URL (leave it out for none)")
        if self.admin_token is not None and (
            len(self.admin_token) < 16 or not self.admin_token.isprintable()
        ):
            raise ValueError("the admin token must be at least 16 printable characters")
        if self.secret is not None and not self.secret:
            raise ValueError("an empty shared secret authenticates nothing; use None")

    @functools.cached_property
    def members(self) -> tuple[Member, ...]:
        """Every instance once (merged by URL), in configuration order: the
        indices the router's health, balancing and placement use."""
        return _members(
            (
                (self.prefill, frozenset({"prefill"})),
                (self.decode, frozenset({"decode"})),
                (self.instances, frozenset(ROLES)),
            )
        )

    def pool(self, role: Role) -> tuple[int, ...]:
        """Indices (into `members`) of the instances that may play `role`."""
        return tuple(i for i, m in enumerate(self.members) if role in m.roles)

    def role_instances(self, role: Role) -> tuple[Instance, ...]:
        """The instances that may play `role`, in `pool` order."""
        return tuple(self.members[i].instance for i in self.pool(role))

    def replace(self, **changes: object) -> RouterConfig:
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
