"""Building a ``Topology``: from a TOML ``[topology]`` table, or from the old three-address form.

The TOML shape (``docs/topology.md``; ``examples/topology/three-dc.toml``)::

    [topology]
    engine = "reference"              # optional: every instance's default engine

    [[topology.datacenter]]
    name = "dc-a"
    [[topology.datacenter.p]]         # also .rld and .md; each an array of tables
    name = "p-a0"
    address = "127.0.0.1:7101"        # the sidecar's gRPC host:port
    identity = "p/p-a0"               # optional, default "<role>/<name>"
    admin = "127.0.0.1:9101"          # optional admin HTTP host:port
    kv = "127.0.0.1:7151"             # RLD, MD: optional KV server host:port (where P ships)
    engine = "vllm"                   # optional, overrides [topology] engine
    api_url = "http://127.0.0.1:8101" # engine "vllm": its OpenAI server
    kv_events = "tcp://127.0.0.1:5557" # engine "vllm", MD: its vLLM's KV-event publisher

    [[topology.link]]
    between = ["dc-a", "dc-b"]
    line_mbit = 100.0
    rtt_ms = 20.0

Every refusal is ``InvalidInput`` whose message starts with the exact key, e.g.
``topology.datacenter[1].md[0].address: expected "host:port", got "a:1,b:2"``; unknown keys are
refused too (a typo must not silently drop an instance).
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from pddlink.errors import InvalidInput
from pddlink.roles import SIDECAR_ROLES, Role
from pddlink.topology.model import Datacenter, Engine, Instance, Topology, WanLink

T = TypeVar("T")
_INSTANCE_KEYS = frozenset({"name", "address", "identity", "admin", "engine", "api_url", "kv", "kv_events"})
_DC_KEYS = frozenset({"name", *(r.value for r in SIDECAR_ROLES)})
_LINK_KEYS = frozenset({"between", "line_mbit", "rtt_ms"})
_TOP_KEYS = frozenset({"engine", "datacenter", "link"})


def load_topology(path: Path) -> Topology:
    """Read ``path`` (TOML with a ``[topology]`` table)."""
    try:
        text = path.read_text()
    except OSError as e:
        raise InvalidInput(f"{path}: {e.strerror or e}") from None
    return parse_topology(text, str(path))


def parse_topology(text: str, source: str = "<topology>") -> Topology:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InvalidInput(f"{source}: not TOML: {e}") from None
    if "topology" not in doc:
        raise InvalidInput(f"{source}: no [topology] table")
    return topology_from_table(doc["topology"])


def topology_from_table(table: object, key: str = "topology") -> Topology:
    """The parsed ``[topology]`` table (as ``tomllib`` returns it) as a ``Topology``."""
    top = _table(table, key, _TOP_KEYS)
    engine = _engine(top.get("engine", Engine.REFERENCE.value), f"{key}.engine")
    dcs = tuple(
        _datacenter(d, f"{key}.datacenter[{i}]", engine)
        for i, d in enumerate(_array(top.get("datacenter"), f"{key}.datacenter", required=True))
    )
    links = tuple(_link(k, f"{key}.link[{i}]") for i, k in enumerate(_array(top.get("link"), f"{key}.link")))
    return Topology(dcs, links)


def topology_from_addresses(
    p: str,
    rld: str,
    md: str,
    *,
    line_mbit: float,
    rtt_ms: float,
    p_identity: str = "p/p0",
    rld_identity: str = "rld/rld0",
    md_identity: str = "md/md0",
    engine: Engine = Engine.REFERENCE,
    p_url: str = "",
    rld_url: str = "",
    md_url: str = "",
    md_kv_events: str = "",
) -> Topology:
    """The old router form as a topology of one each: P and RLD in "dc-a", MD in "dc-b", one link
    (one address may serve several roles, as the old form allowed).
    An empty ``rld`` (and ``rld_url``) means no RelayDecode. Errors name the old keys (``p``,
    ``md_identity``, ``line_mbit``, ``md_kv_events``, ...)."""

    def one(role: Role, address: str, identity: str, url: str, events: str = "") -> Instance:
        name = identity.partition("/")[2] or f"{role.value}0"
        keys = {
            "address": role.value, "identity": f"{role.value}_identity", "api_url": f"{role.value}_url",
            "kv_events": f"{role.value}_kv_events",
        }  # fmt: skip
        return _build(
            lambda: Instance(role, name, address, identity, engine=engine, api_url=url, kv_events=events),
            lambda msg: _rename(msg, keys),
        )

    relay = (one(Role.RLD, rld, rld_identity, rld_url),) if rld or rld_url else ()
    link = _build(lambda: WanLink("dc-a", "dc-b", line_mbit, rtt_ms), lambda msg: msg)
    a = Datacenter("dc-a", p=(one(Role.P, p, p_identity, p_url),), rld=relay)
    b = Datacenter("dc-b", md=(one(Role.MD, md, md_identity, md_url, md_kv_events),))
    return Topology((a, b), (link,), shared_addresses=True)


def _rename(msg: str, keys: Mapping[str, str]) -> str:
    field, sep, rest = msg.partition(":")
    return f"{keys.get(field, field)}{sep}{rest}"


def _build(make: Callable[[], T], reword: Callable[[str], str]) -> T:
    try:
        return make()
    except InvalidInput as e:
        raise InvalidInput(reword(e.message)) from None


def _datacenter(value: object, key: str, engine: Engine) -> Datacenter:
    t = _table(value, key, _DC_KEYS)
    name = _str(t.get("name"), f"{key}.name", required=True)
    pools = {
        r: tuple(
            _instance(x, f"{key}.{r.value}[{j}]", r, engine)
            for j, x in enumerate(_array(t.get(r.value), f"{key}.{r.value}"))
        )
        for r in SIDECAR_ROLES
    }
    return _build(
        lambda: Datacenter(name, pools[Role.P], pools[Role.RLD], pools[Role.MD]), lambda m: f"{key}.{m}"
    )


def _instance(value: object, key: str, role: Role, engine: Engine) -> Instance:
    t = _table(value, key, _INSTANCE_KEYS)
    s = {k: _str(t.get(k), f"{key}.{k}", required=k == "name") for k in _INSTANCE_KEYS - {"engine"}}
    own = _engine(t["engine"], f"{key}.engine") if "engine" in t else engine
    return _build(
        lambda: Instance(
            role,
            s["name"],
            s["address"],
            s["identity"],
            s["admin"],
            own,
            s["api_url"],
            s["kv"],
            s["kv_events"],
        ),
        lambda m: f"{key}.{m}",
    )


def _link(value: object, key: str) -> WanLink:
    t = _table(value, key, _LINK_KEYS)
    between = t.get("between")
    ends = _array(between, f"{key}.between", required=True)
    if len(ends) != 2 or not all(isinstance(x, str) for x in ends):
        raise InvalidInput(f'{key}.between: expected two datacenter names, e.g. ["dc-a", "dc-b"]')
    a, b = (str(x) for x in ends)
    rate = _number(t.get("line_mbit"), f"{key}.line_mbit")
    rtt = _number(t.get("rtt_ms"), f"{key}.rtt_ms")
    return _build(lambda: WanLink(a, b, rate, rtt), lambda m: f"{key}.{m}")


def _kind(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    names = {list: "a list", dict: "a table", int: "an integer", float: "a number", str: "a string"}
    return names.get(type(value), type(value).__name__)


def _table(value: object, key: str, allowed: frozenset[str]) -> dict[str, object]:
    if not isinstance(value, dict):
        raise InvalidInput(f"{key}: expected a table, got {_kind(value)}")
    for k in sorted(value):
        if k not in allowed:
            raise InvalidInput(f"{key}.{k}: unknown key (expected one of {', '.join(sorted(allowed))})")
    return value


def _array(value: object, key: str, *, required: bool = False) -> list[object]:
    if value is None:
        if required:
            raise InvalidInput(f"{key}: missing")
        return []
    if not isinstance(value, list):
        raise InvalidInput(f"{key}: expected a list, got {_kind(value)}")
    return value


def _str(value: object, key: str, *, required: bool = False) -> str:
    if value is None:
        if required:
            raise InvalidInput(f"{key}: missing")
        return ""
    if not isinstance(value, str):
        raise InvalidInput(f"{key}: expected a string, got {_kind(value)}")
    return value


def _number(value: object, key: str) -> float:
    if value is None:
        raise InvalidInput(f"{key}: missing")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(f"{key}: expected a number, got {_kind(value)}")
    return float(value)


def _engine(value: object, key: str) -> Engine:
    text = _str(value, key)
    try:
        return Engine(text)
    except ValueError:
        raise InvalidInput(f'{key}: expected "reference" or "vllm", got "{text}"') from None
