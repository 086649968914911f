"""The fleet as data: datacenters, their P / RLD / MD pools, and the WAN links between them.

Frozen, slotted dataclasses validated on construction. ``Instance`` checks its own fields (messages
start with the field's key, e.g. ``address: expected "host:port", got "a:1,b:2"``); ``Topology``
checks what spans instances (unique names, identities and addresses; links between known,
distinct datacenters, at most one per pair; every MD datacenter reachable from every P datacenter;
RLD beside a P) and names the offending key as the TOML file spells it
(``topology.datacenter[1].md[0].name``). Every error is ``pddlink.errors.InvalidInput``.
Pure: no I/O (``pddlink.topology.load`` reads files).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from pddlink.errors import InvalidInput
from pddlink.roles import SIDECAR_ROLES, Role

# host:port with a DNS name or IPv4 literal, or [IPv6]:port; nothing else (no lists, no schemes).
_HOST_PORT = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252}[A-Za-z0-9])?):(\d{1,5})$")
_URL = re.compile(r"^https?://(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(\d{1,5})(?:/\S*)?$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# a ZMQ endpoint vLLM publishes KV-cache events on (its --kv-events-config endpoint)
_EVENTS = re.compile(r"^(?:tcp://(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.*-]+):(\d{1,5})|ipc://\S+)$")


class Engine(StrEnum):
    REFERENCE = "reference"  # a driven engine behind a pddlink sidecar (gRPC ``address``)
    VLLM = "vllm"  # a vLLM OpenAI server (``api_url``) beside its pddlink vLLM sidecar


def check_address(value: str, key: str) -> None:
    """``value`` must be one ``host:port`` (port 1-65535); raises naming ``key``."""
    m = _HOST_PORT.match(value)
    if m is None or not 1 <= int(m.group(1)) <= 65535:
        raise InvalidInput(f'{key}: expected "host:port", got "{value}"')


def check_name(value: str, key: str) -> None:
    if not _NAME.match(value):
        raise InvalidInput(f'{key}: expected 1-64 letters, digits, ".", "_" or "-", got "{value}"')


@dataclass(frozen=True, slots=True)
class Instance:
    """One engine instance with its sidecar. ``identity`` is what its certificate must say
    (``role/name``); ``admin_address`` its admin HTTP endpoint ("" = none)."""

    role: Role
    name: str
    address: str = ""  # the sidecar's gRPC host:port (required for engine "reference")
    identity: str = ""  # "" = "<role>/<name>"
    admin_address: str = ""
    engine: Engine = Engine.REFERENCE
    api_url: str = ""  # engine "vllm": http://host:port of its OpenAI server (required there)
    kv_address: str = ""  # RLD, MD: its KV server's host:port, where P ships (the sidecars' peers)
    kv_events: str = ""  # engine "vllm", MD: its vLLM's KV-event publisher (the router's DRC mirror)

    def __post_init__(self) -> None:
        if self.role not in SIDECAR_ROLES:
            raise InvalidInput(f"role: expected one of p, rld, md, got {self.role.value!r}")
        check_name(self.name, "name")
        if not self.identity:
            object.__setattr__(self, "identity", f"{self.role.value}/{self.name}")
        if self.engine is Engine.REFERENCE or self.address:
            check_address(self.address, "address")
        if self.admin_address:
            check_address(self.admin_address, "admin")
        if self.kv_address:
            check_address(self.kv_address, "kv")
        if self.engine is Engine.VLLM or self.api_url:
            m = _URL.match(self.api_url)
            if m is None or not 1 <= int(m.group(1)) <= 65535:
                raise InvalidInput(f'api_url: expected "http://host:port", got "{self.api_url}"')
        if self.kv_events:
            self._check_kv_events()
        role, sep, name = self.identity.partition("/")
        if not sep or role != self.role.value or not name or "/" in name or not name.isprintable():
            raise InvalidInput(f'identity: expected "{self.role.value}/<name>", got "{self.identity}"')

    def _check_kv_events(self) -> None:
        if self.role is not Role.MD or self.engine is not Engine.VLLM:
            raise InvalidInput(
                f"kv_events: only a vllm md instance's KV events are followed, not a {self.engine.value} "
                f"{self.role.value}'s"
            )
        m = _EVENTS.match(self.kv_events)
        if m is None or (m.group(1) is not None and not 1 <= int(m.group(1)) <= 65535):
            raise InvalidInput(
                f'kv_events: expected "tcp://host:port" or "ipc://path", got "{self.kv_events}"'
            )


@dataclass(frozen=True, slots=True)
class Datacenter:
    name: str
    p: tuple[Instance, ...] = ()
    rld: tuple[Instance, ...] = ()
    md: tuple[Instance, ...] = ()

    def __post_init__(self) -> None:
        check_name(self.name, "name")
        for role in SIDECAR_ROLES:
            for j, inst in enumerate(self.pool(role)):
                if inst.role is not role:
                    raise InvalidInput(
                        f"{role.value}[{j}].role: expected {role.value}, got {inst.role.value}"
                    )

    def pool(self, role: Role) -> tuple[Instance, ...]:
        if role is Role.P:
            return self.p
        if role is Role.RLD:
            return self.rld
        if role is Role.MD:
            return self.md
        raise InvalidInput(f"no pool for role {role.value}")


@dataclass(frozen=True, slots=True)
class WanLink:
    """The WAN line between two datacenters (either direction)."""

    a: str
    b: str
    line_mbit: float
    rtt_ms: float

    def __post_init__(self) -> None:
        if isinstance(self.line_mbit, bool) or not self.line_mbit > 0:
            raise InvalidInput(f"line_mbit: expected a number > 0, got {self.line_mbit!r}")
        if isinstance(self.rtt_ms, bool) or not self.rtt_ms >= 0:
            raise InvalidInput(f"rtt_ms: expected a number >= 0, got {self.rtt_ms!r}")

    @property
    def line_bytes_per_s(self) -> float:
        return self.line_mbit * 1e6 / 8

    @property
    def rtt_s(self) -> float:
        return self.rtt_ms / 1e3

    def joins(self, x: str, y: str) -> bool:
        return {self.a, self.b} == {x, y}


@dataclass(frozen=True, slots=True)
class Member:
    """An instance with where it sits: what placement and membership iterate over."""

    datacenter: str
    instance: Instance

    @property
    def role(self) -> Role:
        return self.instance.role

    @property
    def name(self) -> str:
        return self.instance.name


@dataclass(frozen=True, slots=True)
class Topology:
    datacenters: tuple[Datacenter, ...]
    links: tuple[WanLink, ...] = ()
    # the router's old three-address form: one address may stand for several roles (a dummy peer
    # in tests); a topology file's instances each have their own
    shared_addresses: bool = False

    def __post_init__(self) -> None:
        _check_unique_names(self.datacenters, addresses=not self.shared_addresses)
        _check_links(self.datacenters, self.links)
        _check_roles(self)

    def members(self, role: Role | None = None) -> tuple[Member, ...]:
        roles = SIDECAR_ROLES if role is None else (role,)
        return tuple(Member(dc.name, inst) for r in roles for dc in self.datacenters for inst in dc.pool(r))

    def member(self, name: str) -> Member:
        for m in self.members():
            if m.name == name:
                return m
        raise InvalidInput(f"no instance named {name!r} in the topology")

    def link(self, a: str, b: str) -> WanLink | None:
        """The line between datacenters ``a`` and ``b``; None inside one datacenter or when unlinked."""
        return next((k for k in self.links if k.joins(a, b)), None) if a != b else None


_KEY = "topology.datacenter"


def _check_unique_names(dcs: tuple[Datacenter, ...], *, addresses: bool = True) -> None:
    seen_dc: set[str] = set()
    seen: dict[str, dict[str, str]] = {
        k: {} for k in ("name", "identity", "address", "admin", "kv", "api_url", "kv_events")
    }
    for i, dc in enumerate(dcs):
        if dc.name in seen_dc:
            raise InvalidInput(f'{_KEY}[{i}].name: duplicate datacenter "{dc.name}"')
        seen_dc.add(dc.name)
        for role in SIDECAR_ROLES:
            for j, inst in enumerate(dc.pool(role)):
                at = f"{_KEY}[{i}].{role.value}[{j}]"
                values = {
                    "name": inst.name, "identity": inst.identity, "address": inst.address,
                    "admin": inst.admin_address, "kv": inst.kv_address, "api_url": inst.api_url,
                    "kv_events": inst.kv_events,
                }  # fmt: skip
                for key, value in values.items():
                    if not value or (key in ("address", "api_url") and not addresses):
                        continue
                    if value in seen[key]:
                        raise InvalidInput(f'{at}.{key}: duplicate "{value}" (also {seen[key][value]})')
                    seen[key][value] = f"{at}.{key}"


def _check_links(dcs: tuple[Datacenter, ...], links: tuple[WanLink, ...]) -> None:
    names = {dc.name for dc in dcs}
    for k, link in enumerate(links):
        for end in (link.a, link.b):
            if end not in names:
                raise InvalidInput(f'topology.link[{k}].between: unknown datacenter "{end}"')
        if link.a == link.b:
            raise InvalidInput(
                f'topology.link[{k}].between: a link joins two datacenters, got "{link.a}" twice'
            )
        for earlier in links[:k]:
            if earlier.joins(link.a, link.b):
                raise InvalidInput(f'topology.link[{k}].between: a second link "{link.a}"-"{link.b}"')


def _check_roles(topo: Topology) -> None:
    if not topo.members(Role.P):
        raise InvalidInput(f"{_KEY}: no p instance in any datacenter")
    if not topo.members(Role.MD):
        raise InvalidInput(f"{_KEY}: no md instance in any datacenter")
    p_dcs = [dc.name for dc in topo.datacenters if dc.p]
    for i, dc in enumerate(topo.datacenters):
        if dc.rld and not dc.p:
            raise InvalidInput(f'{_KEY}[{i}].rld: RLD takes KV over the fast path, but "{dc.name}" has no p')
        if not dc.md:
            continue
        for p_dc in p_dcs:
            if p_dc != dc.name and topo.link(p_dc, dc.name) is None:
                raise InvalidInput(f'{_KEY}[{i}].md: no topology.link from "{p_dc}" (its p) to "{dc.name}"')
