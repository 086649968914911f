"""Sidecar configuration: a TOML file validated into frozen dataclasses; flags override fields.

role = "md"              # p | rld | md
peer_id = "md0"
host = "127.0.0.1"       # address the sidecar binds
grpc_port = 7440         # router- and peer-facing gRPC (Sidecar service)
kv_port = 7450           # KV transport server (RLD and MD)
admin_port = 7460        # admin HTTP (0: off); admin_unix = "/run/x.sock" also serves it on a socket
admin_keys_file = ""     # bearer keys for the admin TCP port (all but /healthz, /readyz need one; the
                         # unix socket needs none); "" = none, refused on a non-loopback host unless
allow_unauthenticated_non_loopback = false   # is set: an explicit operator choice
tls_dir = ""             # this node's PKI directory (pddlink pki issue): its key, its certificate and ca.pem,
                         # never the CA key; TLS 1.3 with mutual authentication on gRPC and the KV data
                         # plane; "" = plaintext everywhere (refused on a non-loopback host unless
allow_plaintext_non_loopback = false   # is set: an explicit operator choice)

[engine]                 # the engine beside this sidecar
name = "torch_ref"; preset = "tiny"; dtype = "float64"; block_size = 16; num_blocks = 8192; seed = 0
mode = "thread"          # thread: a worker thread of this process; process: a child `pddlink engine`
                         # attached over the engine link (pddlink/serving/proto/pddlink_engine.proto)
call_timeout_s = 30.0; attach_timeout_s = 120.0   # process mode: every engine command; the attach

[peers]                  # "host:port" as this sidecar reaches them (across the WAN for MD)
md_grpc = "198.18.0.2:7440"; md_kv = "198.18.0.2:7450"
    rld_grpc = "198.18.0.1:7441"; rld_kv = "198.18.0.1:7451"
md_identity = "md/md0"; rld_identity = "rld/rld0"   # who answers there (checked against TLS certificates)

[data_plane]
wan_transport = "tcp"; fast_transport = "auto"; wan_links = 8; wan_streams = 1; chunk_bytes = 1048576
reserve_lease_s = 10.0
wan_codec = "auto"       # auto: compress bf16/fp16 KV when the line is slower than the codec (measured,
                         # sidecar.wan_codec); raw | planes_zstd force one
wan_line_mbit = 0.0      # the WAN line's rate for that decision (0: unknown, measured from transfers)

[decode]
max_batch = 32; capacity = 8; catch_up_below_load = 0.5; slice_tokens = 64

[membership]             # optional: announce this sidecar in etcd (docs/topology.md); needs tls_dir
etcd = "10.0.0.9:2379"; cluster = "prod"; datacenter = "dc-b"; ttl_s = 5

Beside vLLM the same program serves vLLM's ``PddlinkConnector`` (``sidecar.vllm_kv``): the file says
``engine = "vllm"`` at the top (instead of an ``[engine]`` table, which means the reference engine;
``engine = "reference"`` says so explicitly) and has a ``[vllm]`` table; vLLM itself runs with its
own server command and the arguments ``pddlink sidecar --config F --print-vllm-args`` prints:

engine = "vllm"
role = "md"; peer_id = "md0"; host = "10.0.0.5"; kv_port = 7450; admin_port = 7460; tls_dir = "/tls"
[vllm]
model_id = "my-model"    # the namespace of block hashes: the same string on P, RLD and MD
block_size = 16          # vLLM's --block-size
workdir = "/run/pddlink" # <workdir>/<peer_id>.sock: the connector's control socket (shared with vLLM)
region_bytes = 268435456 # the shared-memory region KV moves through
kv_events_endpoint = "tcp://127.0.0.1:5557"   # RLD/MD: vLLM's KV-cache event publisher (the DRC)
[peers]                  # P: md_kv (across the WAN) and/or rld_kv (the fast path), or topology =
                         # "fleet.toml": every MD and RLD there with a kv address, by name (pools)
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from pddlink.errors import ConfigError, InvalidInput
from pddlink.listen_policy import check_open_http, check_plaintext_exposure
from pddlink.membership.config import MembershipConfig
from pddlink.roles import SIDECAR_ROLES, Role
from pddlink.topology import Topology, load_topology
from pddlink.transport import PeerIdentity

ROLES = tuple(r.value for r in SIDECAR_ROLES)
ENGINE_MODES = ("thread", "process")
ENGINE_KINDS = ("reference", "vllm")


def _hostport(value: str, name: str) -> str:
    if value:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{name} must be 'host:port', got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class EngineConfig:
    name: str = "torch_ref"
    preset: str = "tiny"
    dtype: str = "float64"
    block_size: int = 16
    num_blocks: int = 8192
    seed: int = 0
    mode: str = "thread"  # "thread" | "process" (see the module docstring)
    call_timeout_s: float = 30.0
    attach_timeout_s: float = 120.0
    # > 1: prefill and extend passes take this many times as long (a decode-leaning chip's slower
    # prefill, emulated: ``engines_adapter.torch_ref.paged_engine``); decode steps are unchanged
    prefill_slowdown: float = 1.0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_blocks < 1:
            raise ConfigError("engine.block_size and engine.num_blocks must be >= 1")
        if not 1.0 <= self.prefill_slowdown <= 100.0:
            raise ConfigError(f"engine.prefill_slowdown must be in [1, 100], got {self.prefill_slowdown}")
        if self.mode not in ENGINE_MODES:
            raise ConfigError(f"engine.mode must be one of {', '.join(ENGINE_MODES)}, got {self.mode!r}")
        if self.call_timeout_s <= 0 or self.attach_timeout_s <= 0:
            raise ConfigError("engine.call_timeout_s and engine.attach_timeout_s must be > 0")


@dataclass(frozen=True, slots=True)
class PeersConfig:
    md_grpc: str = ""
    md_kv: str = ""
    rld_grpc: str = ""
    rld_kv: str = ""
    md_identity: str = "md/md0"
    rld_identity: str = "rld/rld0"
    topology: str = ""  # a topology file: every MD (and RLD) with a kv address is a peer by identity

    def __post_init__(self) -> None:
        for f in ("md_grpc", "md_kv", "rld_grpc", "rld_kv"):
            _hostport(getattr(self, f), f"peers.{f}")
        if self.topology:
            self.fleet()  # a malformed topology is refused here, naming its key
        for f in ("md_identity", "rld_identity"):
            try:
                PeerIdentity.parse(getattr(self, f))
            except InvalidInput as exc:
                raise ConfigError(f"peers.{f}: {exc.message}") from None

    @property
    def md(self) -> PeerIdentity:
        return PeerIdentity.parse(self.md_identity)

    def fleet(self) -> Topology | None:
        """The ``topology`` file's pools (None without one)."""
        if not self.topology:
            return None
        try:
            return load_topology(Path(self.topology))
        except InvalidInput as exc:
            raise ConfigError(f"peers.topology: {exc.message}") from None

    @property
    def rld(self) -> PeerIdentity:
        return PeerIdentity.parse(self.rld_identity)

    def kv_peers(self, role: Role) -> tuple[tuple[str, str], ...]:
        """(name, KV address) of each ``role`` instance of the topology file with a ``kv`` address."""
        fleet = self.fleet()
        if fleet is None:
            return ()
        return tuple((m.name, m.instance.kv_address) for m in fleet.members(role) if m.instance.kv_address)


@dataclass(frozen=True, slots=True)
class DataPlaneConfig:
    wan_transport: str = "tcp"
    fast_transport: str = "auto"
    wan_streams: int = 1  # striped connections per link
    wan_links: int = 8  # links in the WAN connection pool (a transfer takes the least loaded)
    chunk_bytes: int = 1 << 20
    reserve_lease_s: float = 10.0
    wan_codec: str = "auto"  # auto | raw | planes_zstd (sidecar.wan_codec)
    wan_line_mbit: float = 0.0  # 0: unknown

    def __post_init__(self) -> None:
        if self.wan_codec not in ("auto", "raw", "planes_zstd"):
            raise ConfigError(
                f"data_plane.wan_codec must be auto, raw or planes_zstd, got {self.wan_codec!r}"
            )
        if self.wan_line_mbit < 0:
            raise ConfigError(f"data_plane.wan_line_mbit must be >= 0, got {self.wan_line_mbit}")
        if self.wan_transport not in ("tcp", "quic"):
            raise ConfigError(f"data_plane.wan_transport must be tcp or quic, got {self.wan_transport!r}")
        if self.fast_transport not in ("tcp", "quic", "rdma", "auto"):
            raise ConfigError(
                f"data_plane.fast_transport must be tcp|quic|rdma|auto, got {self.fast_transport!r}"
            )
        if self.wan_streams < 1 or self.wan_links < 1 or self.chunk_bytes < 4096 or self.reserve_lease_s <= 0:
            raise ConfigError(
                "data_plane: wan_streams, wan_links >= 1, chunk_bytes >= 4096, reserve_lease_s > 0"
            )


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    max_batch: int = 32
    capacity: int = 8  # requests at which the load counts as 1.0 (routing and handoff mode)
    catch_up_below_load: float = 0.5
    slice_tokens: int = 64

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.capacity < 1 or self.slice_tokens < 1:
            raise ConfigError("decode: max_batch, capacity and slice_tokens must be >= 1")
        if self.catch_up_below_load < 0:
            raise ConfigError("decode.catch_up_below_load must be >= 0")


@dataclass(frozen=True, slots=True)
class VllmConfig:
    """``[vllm]``: the sidecar beside a vLLM server (``engine = "vllm"``)."""

    model_id: str = ""  # namespace of the block hashes: the same string on every role
    block_size: int = 16  # vLLM's --block-size
    workdir: str = "/run/pddlink"  # the control socket <workdir>/<peer_id>.sock lives here
    region_bytes: int = 256 << 20  # the shared-memory region the KV moves through
    region_dir: str = ""  # "" = /dev/shm where it has room, else workdir
    kv_events_endpoint: str = ""  # RLD/MD: vLLM's KV-cache event publisher; "" = no DRC feed
    orphan_s: float = 120.0  # RLD/MD: a landed transfer no request loads is freed after this long
    max_model_len: int = 0  # printed as vLLM's --max-model-len (0: vLLM's default)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.region_bytes < (1 << 20) or self.orphan_s <= 0:
            raise ConfigError("vllm: block_size >= 1, region_bytes >= 1 MiB, orphan_s > 0")
        if self.kv_events_endpoint and not self.kv_events_endpoint.startswith(("tcp://", "ipc://")):
            raise ConfigError(
                "vllm.kv_events_endpoint must be tcp://host:port or ipc://path, "
                f"got {self.kv_events_endpoint!r}"
            )


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    role: str
    peer_id: str = ""
    host: str = "127.0.0.1"
    grpc_port: int = 0
    kv_port: int = 0
    admin_port: int = 0
    admin_unix: str = ""
    admin_keys_file: str = ""  # bearer keys for the admin TCP port (pddlink.serving.admin_access)
    tls_dir: str = ""
    allow_plaintext_non_loopback: bool = False  # plaintext on a non-loopback host: said explicitly
    allow_unauthenticated_non_loopback: bool = False  # a keyless admin port there: said explicitly
    engine_kind: str = "reference"  # the TOML's top-level ``engine = "reference" | "vllm"``
    engine: EngineConfig = field(default_factory=EngineConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)
    peers: PeersConfig = field(default_factory=PeersConfig)
    data_plane: DataPlaneConfig = field(default_factory=DataPlaneConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    membership: MembershipConfig = field(default_factory=MembershipConfig)  # announce in etcd; off: ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        self.membership.check_for(f"sidecar {self.role}", tls=bool(self.tls_dir), sidecar=True)
        for f in ("grpc_port", "kv_port", "admin_port"):
            if not 0 <= getattr(self, f) < 65536:
                raise ConfigError(f"{f} must be in [0, 65535]")
        check_plaintext_exposure(
            self.host, tls=bool(self.tls_dir), allowed=self.allow_plaintext_non_loopback, who="sidecar"
        )
        if self.admin_port:
            check_open_http(
                self.host,
                guarded=bool(self.admin_keys_file),
                allowed=self.allow_unauthenticated_non_loopback,
                who="sidecar admin port",
                remedy="admin_keys_file (--admin-keys-file)",
            )
        if self.engine_kind not in ENGINE_KINDS:
            raise ConfigError(f"engine must be one of {', '.join(ENGINE_KINDS)}, got {self.engine_kind!r}")
        if self.engine_kind == "vllm":
            self._check_vllm()
            return
        if self.role == "p" and not (self.peers.md_kv and self.peers.md_grpc) and not self.peers.topology:
            raise ConfigError("role p needs peers.md_kv and peers.md_grpc (or peers.topology)")
        if self.role == "rld" and not self.peers.md_grpc and not self.peers.topology:
            raise ConfigError("role rld needs peers.md_grpc (the handoff goes there)")

    def _check_vllm(self) -> None:
        if not self.vllm.model_id:
            raise ConfigError("engine vllm needs vllm.model_id (the same string on P, RLD and MD)")
        if self.role != "p":
            return
        named = {key: self.peers.kv_peers(role) for key, role in (("md", Role.MD), ("rld", Role.RLD))}
        if self.peers.topology and not any(named.values()):
            raise ConfigError("peers.topology: no md or rld instance with a kv address (P ships to those)")
        if not (self.peers.md_kv or self.peers.rld_kv or self.peers.topology):
            raise ConfigError("role p beside vLLM needs peers.md_kv and/or peers.rld_kv (or peers.topology)")
        if not self.tls_dir:  # P dials out: its peers' hosts must be loopback too
            dialled = [(f"peers.{key}", getattr(self.peers, key)) for key in ("md_kv", "rld_kv")]
            dialled += [(f"peers.topology {name}", kv) for peers in named.values() for name, kv in peers]
            for who, addr in dialled:
                host = addr.rpartition(":")[0]
                if host:
                    check_plaintext_exposure(
                        host, tls=False, allowed=self.allow_plaintext_non_loopback, who=f"sidecar {who}"
                    )

    @property
    def name(self) -> str:
        return self.peer_id or f"{self.role}0"


_SECTIONS: dict[str, type[Any]] = {
    "engine": EngineConfig,
    "vllm": VllmConfig,
    "peers": PeersConfig,
    "data_plane": DataPlaneConfig,
    "decode": DecodeConfig,
    "membership": MembershipConfig,
}


def _build(cls: type[Any], table: dict[str, Any], where: str) -> Any:
    known = {f.name: f for f in fields(cls)}
    unknown = set(table) - set(known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        if key in _SECTIONS and cls is SidecarConfig:
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: [{key}] must be a table")
            kwargs[key] = _build(_SECTIONS[key], value, f"{where} [{key}]")
            continue
        expected = known[key].type
        kwargs[key] = _coerce(value, str(expected), f"{where}: {key}")
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _coerce(value: Any, type_name: str, where: str) -> Any:
    kinds: dict[str, type | tuple[type, ...]] = {"int": int, "float": (int, float), "str": str, "bool": bool}
    kind = kinds.get(type_name)
    if kind is not None and (not isinstance(value, kind) or (type_name == "int" and isinstance(value, bool))):
        raise ConfigError(f"{where} must be {type_name}, got {value!r}")
    return float(value) if type_name == "float" else value


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> SidecarConfig:
    """The file's configuration (or defaults) with ``overrides`` ("engine.dtype" style keys) applied."""
    table: dict[str, Any] = {}
    where = "flags"
    if path is not None:
        where = str(path)
        try:
            table = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    if isinstance(table.get("engine"), str):  # engine = "reference" | "vllm"; a table: the reference engine's
        table["engine_kind"] = table.pop("engine")
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        section, _, name = key.rpartition(".")
        target = table.setdefault(section, {}) if section else table
        target[name] = value
    if isinstance(table.get("engine"), str):  # the same, given as an override
        table["engine_kind"] = table.pop("engine")
    if "role" not in table:
        raise ConfigError(f"{where}: role is required (p, rld or md)")
    peers = table.get("peers")
    if path is not None and isinstance(peers, dict) and isinstance(peers.get("topology"), str):
        peers["topology"] = str(Path(path).parent / peers["topology"])  # relative to this file

    cfg: SidecarConfig = _build(SidecarConfig, table, where)
    return cfg
