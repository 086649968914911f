"""Deployments the simulator compares: intra-datacenter PD, cross-datacenter PD and PDD variants.

A ``Deployment`` is frozen configuration: the P pool, the decode pool (D inside datacenter A for
intra-datacenter PD, MainDecode in datacenter B otherwise), the RelayDecode pool (PDD only), the WAN
line and fast path, the per-GPU prefix-cache capacity on the decode side, the routing policy (the
real ``pddlink.routing`` one), the placement policy (``pddlink.routing.place``), the price of the
line, and the deadlines admission checks against (none by default). Its ``cost`` is what BCR
divides by. ``sites`` splits the decode pool over datacenters, each behind its own WAN line from
P's datacenter (a topology: ``pddlink.sim.pools``); without it the whole pool sits behind ``link``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from pddlink.errors import ConfigError
from pddlink.routing import PlacementPolicy, RoutingPolicy
from pddlink.sim.hardware import AFigures, HardwareType, InstanceModel


class Kind(StrEnum):
    INTRA_DC_PD = "intra_dc_pd"  # P and D in one datacenter, KV over the fast path
    CROSS_DC_PD = "cross_dc_pd"  # P in A, MD in B, P->MD only
    PDD = "pdd"  # P and RLD in A, MD in B, the pipeline policy decides


@dataclass(frozen=True, slots=True)
class Pool:
    hw: HardwareType
    gpus_per_instance: int
    instances: int

    def __post_init__(self) -> None:
        if self.gpus_per_instance < 1 or self.instances < 1:
            raise ConfigError(f"pool of {self.hw.name}: gpus_per_instance and instances must be >= 1")

    @property
    def gpus(self) -> int:
        return self.gpus_per_instance * self.instances

    def model(self, fig: AFigures) -> InstanceModel:
        return InstanceModel(self.hw, self.gpus_per_instance, fig)

    @property
    def price(self) -> float:
        return self.gpus * self.hw.price_rel


@dataclass(frozen=True, slots=True)
class Link:
    """The WAN line (only used when P and decode sit in different datacenters) and the fast path."""

    wan_gbps: float = 20.0
    wan_efficiency: float = 0.95  # goodput / line rate (headers, framing)
    rtt_s: float = 0.02
    pool_size: int = 64
    flow_cap_gbps: float = 20.0
    fast_gbps: float = 400.0
    fast_setup_s: float = 0.01
    fifo_pool: bool = False  # a transfer holds one connection, waiting FIFO (else multiplexed)

    def __post_init__(self) -> None:
        if min(self.wan_gbps, self.flow_cap_gbps, self.fast_gbps) <= 0 or not 0 < self.wan_efficiency <= 1:
            raise ConfigError("link rates must be > 0 and wan_efficiency in (0, 1]")
        if self.pool_size < 1 or self.rtt_s < 0 or self.fast_setup_s < 0:
            raise ConfigError("pool_size must be >= 1, rtt_s and fast_setup_s >= 0")

    @property
    def wan_bytes_s(self) -> float:
        return self.wan_gbps * 1e9 / 8 * self.wan_efficiency

    @property
    def flow_cap_bytes_s(self) -> float:
        return self.flow_cap_gbps * 1e9 / 8 * self.wan_efficiency

    def fast_s(self, nbytes: int) -> float:
        return self.fast_setup_s + nbytes * 8 / (self.fast_gbps * 1e9)


@dataclass(frozen=True, slots=True)
class DecodeSite:
    """Decode instances in one datacenter, and the WAN line from P's datacenter to it. ``seen``: the
    line the router's estimate assumes when it is not the one that carries the bytes (``pddlink
    demo --topology``'s loopback lab shapes every connection on its own, while the router models
    one line of the topology's rate); the router still learns the bytes in flight from P."""

    datacenter: str
    names: tuple[str, ...]
    link: Link
    seen: Link | None = None

    def __post_init__(self) -> None:
        if not self.names or len(set(self.names)) != len(self.names):
            raise ConfigError(f"decode site {self.datacenter}: names must be non-empty and unique")


@dataclass(frozen=True, slots=True)
class Deployment:
    name: str
    kind: Kind
    prefill: Pool
    decode: Pool
    relay: Pool | None = None
    link: Link = field(default_factory=Link)
    policy: RoutingPolicy = field(default_factory=RoutingPolicy)
    fig: AFigures = field(default_factory=AFigures)
    relay_fig: AFigures | None = None  # RLD's own figures (batch limit), default ``fig``
    kv_bytes_per_token: int = 4400
    drc_tokens_per_gpu: int = 32_000_000
    line_price: float = 0.33  # the line's cost in A-GPU units over the same period
    balance_tpot_s: float | None = None  # decode routing avoids instances whose step time reached this
    deadline_s: float | None = None  # admission: reject what no option ends within (None: admit all)
    deadline_per_token_s: float = 0.0  # ... plus this per output token of the request's bound
    ttft_deadline_s: float | None = None  # admission: the first token must be out by then
    placement: PlacementPolicy = PlacementPolicy.PREFIX_AWARE
    sites: tuple[DecodeSite, ...] = ()  # () = one site, every decode instance behind ``link``
    prefill_datacenter: str = "dc-a"  # where P and RLD sit (placement's view)
    tpot_bound_s: float | None = None  # the policy's decode-speed bound (``OptionInputs.tpot_bound_s``)
    md_chunk_tokens: int | None = None  # MD's chunked-prefill budget per step (None: ``md_lane``'s headroom)
    # each P's own prefix cache, in blocks: P prefills what it lacks itself (None: P's cache is taken
    # to hold what the chosen decode instance holds, so P prefills MD's missing suffix)
    p_cache_blocks: int | None = None
    # placement counts an MD's load as the router does (its requests placed and not over yet,
    # wherever they are: P, the WAN, RLD) instead of what runs on it
    router_loads: bool = False
    whole_blocks: bool = False  # P ships MD every block it lacks whole, the prompt's last partial one too
    # RelayDecode runs on P's chips (the demo: P, RLD and the router share CPUs, MD has its own):
    # each P prefill batch holds every RLD's decode for its compute time
    rld_shares_p_chips: bool = False

    def deadline_for(self, max_tokens: int) -> float | None:
        """The request's end-to-end deadline (the SLA's TTFT bound plus its TPOT bound per token)."""
        return None if self.deadline_s is None else self.deadline_s + max_tokens * self.deadline_per_token_s

    def __post_init__(self) -> None:
        if self.kind is Kind.PDD and self.relay is None:
            raise ConfigError(f"deployment {self.name}: PDD needs a relay (RLD) pool")
        if self.md_chunk_tokens is not None and self.md_chunk_tokens < 1:
            raise ConfigError(f"deployment {self.name}: md_chunk_tokens must be >= 1 or None")
        if self.p_cache_blocks is not None and self.p_cache_blocks < 1:
            raise ConfigError(f"deployment {self.name}: p_cache_blocks must be >= 1 or None")
        if self.kv_bytes_per_token < 1 or self.drc_tokens_per_gpu < 1 or self.line_price < 0:
            raise ConfigError(f"deployment {self.name}: kv_bytes_per_token and drc capacity must be >= 1")
        if self.sites and sum(len(x.names) for x in self.sites) != self.decode.instances:
            raise ConfigError(f"deployment {self.name}: the sites must name every decode instance once")
        if any(x.datacenter == self.prefill_datacenter for x in self.sites):
            raise ConfigError(f"deployment {self.name}: a decode site in P's datacenter needs no WAN line")

    def decode_sites(self) -> tuple[DecodeSite, ...]:
        """Where the decode instances sit: ``sites``, or one site of them all behind ``link``."""
        if self.sites:
            return self.sites
        names = tuple(f"d{i}" for i in range(self.decode.instances))
        here = self.prefill_datacenter
        far = "dc-b" if here != "dc-b" else "dc-md"
        return (DecodeSite(far if self.crosses_wan else here, names, self.link),)

    @property
    def crosses_wan(self) -> bool:
        return self.kind is not Kind.INTRA_DC_PD

    @property
    def cost(self) -> float:
        gpus = self.prefill.price + self.decode.price + (self.relay.price if self.relay else 0.0)
        return gpus + (self.line_price if self.crosses_wan else 0.0)

    @property
    def gpus(self) -> int:
        return self.prefill.gpus + self.decode.gpus + (self.relay.gpus if self.relay else 0)
