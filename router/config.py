"""The router's configuration: which kind of engine serves the roles and where they are, the
pipeline policy's knobs, the limits on a client request, and the TLS identities (``RouterConfig``,
validated on construction). ``engine = "reference"``: ``p``, ``rld``, ``md`` are the sidecars' gRPC
addresses (a topology of one each), or ``topology`` is a whole topology (the file's ``[topology]``
table or ``topology = "path.toml"``: datacenters with pools of P, RLD and MD, WAN links;
``pddlink.topology``), placed per request by ``placement`` (``pddlink.routing.placement``);
``engine = "vllm"``: vLLM's OpenAI servers, each running beside its pddlink vLLM sidecar
(``sidecar.vllm_kv``): the ``[vllm]`` table (``VllmEngineConfig``) names one of each (``p_url``,
``md_url``, ``rld_url``, ``md_kv_events``: a topology of one each), or ``topology`` names pools
of vLLM instances (each its ``api_url``; an MD its ``kv_events``) and ``[vllm]`` keeps only what
all share (``model``, ``wan_share``, ``rld_gets_kv``, ``api_key_file``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pddlink.errors import InvalidInput
from pddlink.membership.config import MembershipConfig
from pddlink.roles import SIDECAR_ROLES, Role
from pddlink.routing.placement import PlacementPolicy
from pddlink.topology import Engine, Topology, topology_from_addresses
from pddlink.topology.model import check_address
from pddlink.transport import PeerIdentity, TlsConfig, load_node

ENGINES = ("reference", "vllm")
# what ``placement`` may name (``oracle`` knows every cache: the simulator's bound, not a router's)
PLACEMENTS = tuple(p.value for p in PlacementPolicy if p is not PlacementPolicy.ORACLE)


@dataclass(frozen=True, slots=True)
class VllmEngineConfig:
    """The ``[vllm]`` table: the roles as vLLM OpenAI servers (``router.vllm_legs``)."""

    # p_url, md_url, rld_url, md_kv_events: one server each (a topology of one each; none of them
    # beside a [topology], whose instances name their own)
    p_url: str = ""  # http://host:port of P's vLLM (its connector is a kv_producer)
    md_url: str = ""  # MD's vLLM (kv_consumer), across the WAN from P
    rld_url: str = ""  # RLD's vLLM beside P; "" = no RelayDecode (P->MD only)
    model: str = ""  # the model name the servers serve (the body's "model")
    wan_share: float = 0.6  # share of the request's time left that P's transfer to MD may take
    rld_gets_kv: bool = False  # P ships the prompt's KV to RLD (else RLD prefills it itself)
    md_kv_events: str = ""  # MD vLLM's KV-event publisher (its --kv-events-config endpoint): the DRC mirror
    api_key_file: str = ""  # the key vLLM's servers were started with (--api-key / VLLM_API_KEY); "" = none

    def api_headers(self) -> dict[str, str]:
        """What the router sends every vLLM server: its key, where they take one."""
        if not self.api_key_file:
            return {}
        try:
            key = Path(self.api_key_file).read_text().strip()
        except OSError as exc:
            raise InvalidInput(f"router [vllm]: api_key_file {self.api_key_file}: {exc.strerror}") from None
        return {"Authorization": f"Bearer {key}"}

    def __post_init__(self) -> None:
        if not 0 < self.wan_share < 1:
            raise InvalidInput(f"router [vllm]: wan_share must be in (0, 1), got {self.wan_share}")

    def one_each(self) -> list[str]:
        """The keys given that name one server each (``p_url``, ..., ``md_kv_events``)."""
        return [k for k in ("p_url", "md_url", "rld_url", "md_kv_events") if getattr(self, k)]


@dataclass(frozen=True, slots=True)
class RouterConfig:
    p: str = ""
    rld: str = ""
    md: str = ""
    engine: str = "reference"
    relay_enabled: bool = True
    relay_min_wan_s: float = 0.15
    rld_capacity: int = 8
    rld_max_load: float = 1.0
    rld_token_budget: float = 1.0  # no relay while RLD made this share of the recent output tokens (1: none)
    rld_tpot_s: float = 0.02
    singular_max_tokens: int = 4  # singular only for very short outputs (published: 3-4% of requests)
    line_mbit: float = 100.0
    rtt_ms: float = 30.0
    deadline_s: float = 30.0
    max_tokens_limit: int = 4096
    max_prompt_tokens: int = 8000
    vocab_size: int = 2048
    kv_bytes_per_token: int = 2048
    wan_links: int = 8  # P's WAN connection pool toward MD (a transfer holds one link)
    recompute: bool = True  # MD may prefill the missing suffix itself (ship or recompute)
    admission: bool = True  # reject at once what no option can end before its deadline
    p_prefill_tokens_per_s: float = 3300.0  # starting figures; the replies refine them
    md_prefill_tokens_per_s: float = 3300.0
    md_tpot_s: float = 0.02
    slo_ttft_ms: float = 0.0  # the SLO's time to first token; options that miss it are not taken (0: none)
    slo_tpot_ms: float = 0.0  # the SLO's time per output token: the policy's decode-speed bound (0: none)
    tls_dir: str = ""  # dev PKI: mutual TLS 1.3 to the sidecars and on the gRPC port; "" = plaintext
    name: str = "router0"  # this router's identity is router/<name>
    p_identity: str = "p/p0"  # who must answer at p, rld, md (checked against their certificates)
    rld_identity: str = "rld/rld0"
    md_identity: str = "md/md0"
    vllm: VllmEngineConfig = field(default_factory=VllmEngineConfig)
    topology: Topology | None = None  # the [topology] table (or file); None: p, rld, md, one each
    placement: str = PlacementPolicy.PREFIX_AWARE.value  # which MD (and P, RLD) serves a request
    # [membership]: instances that announce themselves in etcd join the topology's datacenters
    membership: MembershipConfig = field(default_factory=MembershipConfig)

    def __post_init__(self) -> None:
        for key in ("p", "rld", "md", "engine", "tls_dir", "name", "placement"):
            value = getattr(self, key)
            if not isinstance(value, str):  # a list for p (several instances) is a topology's job
                raise InvalidInput(f"router: {key}: expected a string, got {type(value).__name__} {value!r}")
        if self.engine not in ENGINES:
            raise InvalidInput(f"router: engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.placement not in PLACEMENTS:
            raise InvalidInput(
                f"router: placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}"
            )
        if self.topology is not None:
            self._check_fleet()
        if self.membership.enabled:
            self.membership.check_for("router", tls=bool(self.tls_dir), sidecar=False)
            if self.engine != "reference":
                raise InvalidInput(
                    "router: [membership] serves the reference engine's pools, not engine vllm"
                )
        for key in ("p", "rld", "md"):
            if getattr(self, key):  # one address each (several instances are a topology's job)
                check_address(getattr(self, key), key)
        if self.engine == "reference" and self.topology is None and not (self.p and self.rld and self.md):
            raise InvalidInput("router: p, rld and md (the sidecars' gRPC addresses) are required")
        if self.engine == "vllm":
            self._check_vllm()
        if self.rld_capacity < 1 or self.line_mbit <= 0 or self.rtt_ms < 0 or self.deadline_s <= 0:
            raise InvalidInput("router: rld_capacity >= 1, line_mbit > 0, rtt_ms >= 0, deadline_s > 0")
        if (
            self.wan_links < 1
            or min(self.p_prefill_tokens_per_s, self.md_prefill_tokens_per_s, self.md_tpot_s) <= 0
        ):
            raise InvalidInput("router: prefill speeds and md_tpot_s must be > 0")
        if not 0 < self.rld_token_budget <= 1:
            raise InvalidInput(f"router: rld_token_budget must be in (0, 1], got {self.rld_token_budget}")
        if self.slo_ttft_ms < 0 or self.slo_tpot_ms < 0:
            raise InvalidInput("router: slo_ttft_ms and slo_tpot_ms must be >= 0 (0: no bound)")
        for ident in (self.p_identity, self.rld_identity, self.md_identity):
            PeerIdentity.parse(ident)
        PeerIdentity(Role.ROUTER.value, self.name)

    def _check_fleet(self) -> None:
        assert self.topology is not None
        given = [key for key in ("p", "rld", "md") if getattr(self, key)]
        if given:
            raise InvalidInput(f"router: {given[0]}: not with a [topology] (its instances name the sidecars)")
        one = self.vllm.one_each()
        if one:
            raise InvalidInput(
                f"router: vllm.{one[0]}: not with a [topology] (its instances name the servers)"
            )
        want = Engine(self.engine)
        for i, dc in enumerate(self.topology.datacenters):
            for role in SIDECAR_ROLES:
                for j, inst in enumerate(dc.pool(role)):
                    if inst.engine is not want:
                        raise InvalidInput(
                            f"router: topology.datacenter[{i}].{role.value}[{j}].engine: expected "
                            f'"{want.value}" (the router\'s engine), got "{inst.engine.value}"'
                        )

    def _check_vllm(self) -> None:
        if not self.vllm.model:
            raise InvalidInput("router: engine vllm needs [vllm] model")
        if self.topology is not None:
            return
        if not (self.vllm.p_url and self.vllm.md_url):
            raise InvalidInput("router: engine vllm needs [vllm] p_url, md_url and model (or a [topology])")
        try:
            self.deployment()
        except InvalidInput as exc:
            raise InvalidInput(f"router: vllm.{exc.message}") from None

    def deployment(self) -> Topology:
        """The deployment: ``topology`` when the file gave one, else the three addresses (with engine
        vllm: ``[vllm]``'s three servers) as a topology of one P, one RLD and one MD
        (``pddlink.topology``)."""
        if self.topology is not None:
            return self.topology
        if self.engine == "vllm":
            v = self.vllm
            return topology_from_addresses(
                "", "", "", line_mbit=self.line_mbit, rtt_ms=self.rtt_ms, engine=Engine.VLLM,
                p_url=v.p_url, rld_url=v.rld_url, md_url=v.md_url, md_kv_events=v.md_kv_events,
            )  # fmt: skip
        return topology_from_addresses(
            self.p,
            self.rld,
            self.md,
            line_mbit=self.line_mbit,
            rtt_ms=self.rtt_ms,
            p_identity=self.p_identity,
            rld_identity=self.rld_identity,
            md_identity=self.md_identity,
        )

    @property
    def identity(self) -> PeerIdentity:
        return PeerIdentity(Role.ROUTER.value, self.name)

    def sidecars(self) -> tuple[tuple[Role, str, str], ...]:
        """(role, address, expected identity) of each sidecar of the topology."""
        return tuple((m.role, m.instance.address, m.instance.identity) for m in self.deployment().members())

    @property
    def placement_policy(self) -> PlacementPolicy:
        return PlacementPolicy(self.placement)

    def load_tls(self) -> TlsConfig | None:
        """This router's credentials from its node directory ``tls_dir`` (read only, never minted)."""
        return load_node(Path(self.tls_dir), self.identity) if self.tls_dir else None
