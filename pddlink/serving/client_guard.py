"""Who may use the router's client API, and how much: API keys, per-client rate limits and
connection caps, and a cap on concurrent requests. Sans-I/O: every decision takes ``now``.

``ApiConfig`` is the ``[api]`` table of the router's TOML file. ``ClientGuard`` answers, for one
request, either a client id or a ``Refusal`` (HTTP status, message, ``Retry-After``): 401 without a
valid bearer key (when keys are configured), 429 when that client's token bucket is empty, 503 when
the router already runs ``max_concurrent_requests``. Refusals are immediate: a request is never
left to fail at its deadline because the router is full. A slot is held until the answer ends:
sent, or cut when its client stops taking it (``pddlink.serving.write_bound``). Keys are compared in
constant time and never logged; a client is named by a short hash of its key (or by its address
when no keys are set).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from pddlink.errors import ConfigError
from pddlink.serving.conn_slots import ConnSlots, SlotRefusal
from pddlink.serving.write_bound import SEND_BUFFER_BYTES, WRITE_STALL_S


@dataclass(frozen=True, slots=True)
class ApiConfig:
    """The router's client-facing settings (``[api]`` in the router's TOML file)."""

    model: str = "pddlink"  # the name /v1/models lists and requests may give as "model"
    tokenizer: str = ""  # model directory with tokenizer.json (+ chat template); "" = token ids only
    api_keys_file: str = ""  # one bearer key per line ('#' comments); "" = no keys required
    http_mtls: bool = False  # HTTP port takes TLS 1.3 with a client certificate of tls_dir's CA
    max_body_bytes: int = 1 << 20  # larger bodies get 413 (checked while reading)
    body_budget_bytes: int = 64 << 20  # request bodies buffered at once over all connections
    header_timeout_s: float = 10.0  # the whole request head must arrive within this
    body_timeout_s: float = 30.0  # the whole body must arrive within this
    idle_timeout_s: float = 60.0  # a keep-alive connection with no request closes after this
    first_byte_timeout_s: float = 5.0  # a new connection that sends nothing closes after this
    write_stall_s: float = WRITE_STALL_S  # an answer's write the client takes nothing of this long is cut
    send_buffer_bytes: int = SEND_BUFFER_BYTES  # kernel send buffer per HTTP connection (SO_SNDBUF)
    max_connections: int = 512  # open client connections (HTTP), over all clients
    max_connections_per_client: int = 64  # per client: its key (with api_keys_file), else its address
    max_concurrent_requests: int = 256  # generating requests (HTTP and gRPC); more get 503
    rate_per_client_s: float = 50.0  # requests per second per client (token bucket); 0 = no limit
    rate_burst: int = 100  # the bucket's size
    retry_after_s: int = 1  # what a 429 / 503 tells the client
    tokenizer_workers: int = 2  # threads that tokenize and detokenize large texts, off the event loop
    # processes that parse (and tokenize) request bodies over 64 kB, so that the GIL they hold is
    # not the router's; over plaintext HTTP they also receive such a body from the client's socket
    # (docs/api.md); 0 = on the tokenizer_workers threads (the event loop waits while they parse)
    parse_processes: int = 2
    max_prompt_bytes: int = 0  # a text prompt's UTF-8 bytes; 0 = what max_prompt_tokens allows at most
    # SIGTERM: how long a stopping router still answers requests on connections opened before, while
    # the load balancer's health checks take it out (HAProxy's ``inter 1s fall 2``: about 2 s); a
    # request refused in that time is replayed only if it fits the balancer's buffer. 0: refuse at once
    stop_notice_s: float = 3.0

    def __post_init__(self) -> None:
        positive = ("max_body_bytes", "body_budget_bytes", "max_connections", "max_connections_per_client")
        if not 4096 <= self.send_buffer_bytes <= 64 << 20:
            raise ConfigError("api.send_buffer_bytes must be in [4096, 64 MiB]")
        at_least_one = ("max_concurrent_requests", "rate_burst", "retry_after_s", "tokenizer_workers")
        for name in (*positive, *at_least_one):
            if getattr(self, name) < 1:
                raise ConfigError(f"api.{name} must be >= 1")
        timeouts = ("header_timeout_s", "body_timeout_s", "idle_timeout_s", "first_byte_timeout_s")
        for name in (*timeouts, "write_stall_s"):
            if not 0 < getattr(self, name) <= 3600:
                raise ConfigError(f"api.{name} must be in (0, 3600]")
        if self.max_prompt_bytes < 0 or self.tokenizer_workers > 64:
            raise ConfigError("api.max_prompt_bytes must be >= 0, api.tokenizer_workers <= 64")
        if not 0 <= self.parse_processes <= 64:
            raise ConfigError("api.parse_processes must be in [0, 64]")
        if not 0 <= self.stop_notice_s <= 60:
            raise ConfigError("api.stop_notice_s must be in [0, 60]")
        if self.rate_per_client_s < 0:
            raise ConfigError("api.rate_per_client_s must be >= 0")
        if self.body_budget_bytes < self.max_body_bytes:
            raise ConfigError("api.body_budget_bytes must be >= api.max_body_bytes")
        if not self.model or len(self.model) > 256:
            raise ConfigError("api.model: 1-256 characters")

    def load_keys(self) -> tuple[bytes, ...]:
        return load_key_file(self.api_keys_file, "api.api_keys_file") if self.api_keys_file else ()


@dataclass(frozen=True, slots=True)
class Refusal:
    status: int  # 401, 429, 503
    message: str
    kind: str  # vLLM-style error type
    retry_after_s: int = 0


def load_key_file(path: str, setting: str) -> tuple[bytes, ...]:
    """The bearer keys of ``path``: one per line, '#' comments, each >= 16 characters.
    ``setting`` names the config key in the error (``api.api_keys_file``, ``admin_keys_file``)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"{setting} {path}: {exc.strerror}") from None
    keys = tuple(ln.strip().encode() for ln in lines if ln.strip() and not ln.lstrip().startswith("#"))
    if not keys:
        raise ConfigError(f"{setting} {path}: no keys in it")
    if any(len(k) < 16 for k in keys):
        raise ConfigError(f"{setting} {path}: keys must be >= 16 characters")
    return keys


def write_key_file(path: Path) -> str:
    """A new random key in a new file at ``path``, mode 0600 whatever the umask; returns the key.
    Generated at setup, like the dev PKI: deployments never ship a key."""
    key = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, key.encode() + b"\n")
    finally:
        os.close(fd)
    return key


def bearer_client(keys: tuple[bytes, ...], authorization: str | None) -> str | Refusal:
    """The client id of a valid ``Authorization: Bearer KEY`` header (a short hash of the key),
    or a 401. Every key is compared, in constant time, so timing does not tell which one matched."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return Refusal(401, "missing API key: send 'Authorization: Bearer KEY'", "AuthenticationError")
    given = token.strip().encode()
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(given, key)
    if not ok:
        return Refusal(401, "invalid API key", "AuthenticationError")
    return "key:" + hashlib.sha256(given).hexdigest()[:12]


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


@dataclass(slots=True)
class ClientGuard:
    cfg: ApiConfig
    keys: tuple[bytes, ...] = ()
    active: int = 0  # requests generating now
    buckets: dict[str, _Bucket] = field(default_factory=dict)
    slots: ConnSlots = field(init=False)

    def __post_init__(self) -> None:
        self.slots = ConnSlots(self.cfg.max_connections, self.cfg.max_connections_per_client)

    @classmethod
    def from_config(cls, cfg: ApiConfig) -> ClientGuard:
        return cls(cfg, cfg.load_keys())

    # -- who ------------------------------------------------------------------------------------

    def authenticate(self, authorization: str | None, peer: str) -> str | Refusal:
        """The client's id from its ``Authorization: Bearer KEY`` header, or a 401."""
        if not self.keys:
            return f"addr:{peer}"
        return bearer_client(self.keys, authorization)

    # -- how much -------------------------------------------------------------------------------

    def admit(self, client: str, now: float) -> Refusal | None:
        """Take one request slot for ``client`` (``release`` gives it back) or refuse at once.
        A refused request costs the client nothing from its rate."""
        cfg = self.cfg
        bucket = None
        if cfg.rate_per_client_s > 0:
            bucket = self.buckets.get(client)
            if bucket is None:
                self._forget_full(now)
                bucket = self.buckets[client] = _Bucket(float(cfg.rate_burst), now)
            bucket.tokens = min(
                float(cfg.rate_burst), bucket.tokens + (now - bucket.at) * cfg.rate_per_client_s
            )
            bucket.at = now
            if bucket.tokens < 1.0:
                wait = max(1, math.ceil((1.0 - bucket.tokens) / cfg.rate_per_client_s))
                return Refusal(
                    429, f"rate limit: {cfg.rate_per_client_s:g} requests/s", "RateLimitError", wait
                )
        if self.active >= cfg.max_concurrent_requests:
            return Refusal(
                503,
                f"the router is at its limit of {cfg.max_concurrent_requests} concurrent requests",
                "ServiceUnavailableError",
                cfg.retry_after_s,
            )
        if bucket is not None:
            bucket.tokens -= 1.0
        self.active += 1
        return None

    def release(self) -> None:
        self.active = max(0, self.active - 1)

    def _forget_full(self, now: float) -> None:
        """Drop buckets that have refilled (bounded memory however many clients come and go)."""
        if len(self.buckets) < 4096:
            return
        rate, burst = self.cfg.rate_per_client_s, float(self.cfg.rate_burst)
        for c in [c for c, b in self.buckets.items() if b.tokens + (now - b.at) * rate >= burst]:
            del self.buckets[c]

    # -- connections ----------------------------------------------------------------------------

    def owner_of(self, authorization: str | None, peer: str) -> str:
        """Whom a connection's slot counts against once its request head names a client: the
        key's client with a valid key, else its address (``pddlink.serving.conn_slots``)."""
        if self.keys:
            client = bearer_client(self.keys, authorization)
            if not isinstance(client, Refusal):
                return client
        return f"addr:{peer}"

    def open_connection(self, conn: int, peer: str, now: float) -> tuple[int, ...] | Refusal:
        """A slot for a new connection from ``peer``: the connections to close for it, or a refusal."""
        got = self.slots.open(conn, f"addr:{peer}", now)
        return got if isinstance(got, tuple) else self._slot_refusal(got)

    def connection_headed(
        self, conn: int, authorization: str | None, peer: str, now: float
    ) -> Refusal | None:
        refused = self.slots.headed(conn, self.owner_of(authorization, peer), now)
        return None if refused is None else self._slot_refusal(refused)

    def connection_idle(self, conn: int, now: float) -> None:
        self.slots.idle(conn, now)

    def close_connection(self, conn: int) -> None:
        self.slots.close(conn)

    def _slot_refusal(self, r: SlotRefusal) -> Refusal:
        kind = "RateLimitError" if r.status == 429 else "ServiceUnavailableError"
        return Refusal(r.status, r.message, kind, self.cfg.retry_after_s)
