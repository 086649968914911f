"""vLLM pools at the router, in memory (issue 26, items 1, 3 and 6 for ``engine = "vllm"``): a
topology of vLLM instances (each its ``api_url``; an MD its ``kv_events``) is refused with one
message naming the key when malformed, and accepted by the router; ``[vllm]``'s three servers stay
a topology of one each. ``VllmBackend`` places over the pools (round robin: both MDs get requests),
runs each request's legs on its route's servers and names its MD to P; an MD whose ``/health``
fails is out of placement at once and back when it answers; each MD has a mirror of its own (fed
vLLM's event objects), and prefix-aware placement follows it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pddlink.errors import InvalidInput
from pddlink.roles import Role
from pddlink.topology import Engine, load_topology, parse_topology
from router.config import RouterConfig, VllmEngineConfig

POOLS = """
[topology]
engine = "vllm"

[[topology.datacenter]]
name = "dc-a"
[[topology.datacenter.p]]
name = "p-a0"
api_url = "http://127.0.0.1:{p}"

[[topology.datacenter]]
name = "dc-b"
[[topology.datacenter.md]]
name = "md-b0"
api_url = "http://127.0.0.1:{md0}"
kv = "127.0.0.1:7201"
kv_events = "ipc:///tmp/md-b0.ipc"
[[topology.datacenter.md]]
name = "md-b1"
api_url = "http://127.0.0.1:{md1}"
kv = "127.0.0.1:7202"
kv_events = "tcp://127.0.0.1:5602"

[[topology.link]]
between = ["dc-a", "dc-b"]
line_mbit = 100
rtt_ms = 10
"""
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "topology" / "vllm-pools.toml"
PORTS = {"p": 8100, "md0": 8200, "md1": 8201}
MODEL = VllmEngineConfig(model="tiny")


def pools(**ports: int) -> str:
    return POOLS.format(**{**PORTS, **ports})


def test_a_vllm_topology_parses_with_each_mds_kv_events() -> None:
    topo = parse_topology(pools())
    mds = topo.members(Role.MD)
    assert [m.instance.engine for m in topo.members()] == [Engine.VLLM] * 3
    assert [m.instance.kv_events for m in mds] == ["ipc:///tmp/md-b0.ipc", "tcp://127.0.0.1:5602"]
    assert [m.instance.kv_address for m in mds] == ["127.0.0.1:7201", "127.0.0.1:7202"]
    example = load_topology(EXAMPLE)  # the shipped example: what the router and P's sidecar read
    assert RouterConfig(engine="vllm", topology=example, vllm=MODEL).deployment() is example
    assert [m.instance.kv_events for m in example.members(Role.MD)] == [
        "tcp://127.0.0.1:5601",
        "tcp://127.0.0.1:5602",
    ]


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        (
            'kv_events = "ipc:///tmp/md-b0.ipc"',
            'kv_events = "md-b0.ipc"',
            'topology.datacenter[1].md[0].kv_events: expected "tcp://host:port" or "ipc://path", '
            'got "md-b0.ipc"',
        ),
        (
            'kv_events = "tcp://127.0.0.1:5602"',
            'kv_events = "tcp://127.0.0.1:99999"',
            'topology.datacenter[1].md[1].kv_events: expected "tcp://host:port" or "ipc://path", '
            'got "tcp://127.0.0.1:99999"',
        ),
        (
            'kv_events = "tcp://127.0.0.1:5602"',
            'kv_events = "ipc:///tmp/md-b0.ipc"',
            'topology.datacenter[1].md[1].kv_events: duplicate "ipc:///tmp/md-b0.ipc" '
            "(also topology.datacenter[1].md[0].kv_events)",
        ),
        (
            'kv_events = "tcp://127.0.0.1:5602"',
            "kv_events = 5602",
            "topology.datacenter[1].md[1].kv_events: expected a string, got an integer",
        ),
        (
            'kv_events = "tcp://127.0.0.1:5602"',
            'kv_event = "tcp://127.0.0.1:5602"',
            "topology.datacenter[1].md[1].kv_event: unknown key "
            "(expected one of address, admin, api_url, engine, identity, kv, kv_events, name)",
        ),
        (
            'name = "p-a0"',
            'name = "p-a0"\nkv_events = "ipc:///tmp/p.ipc"',
            "topology.datacenter[0].p[0].kv_events: only a vllm md instance's KV events are followed, "
            "not a vllm p's",
        ),
        (
            'api_url = "http://127.0.0.1:8201"',
            'api_url = "http://127.0.0.1:8200"',
            'topology.datacenter[1].md[1].api_url: duplicate "http://127.0.0.1:8200" '
            "(also topology.datacenter[1].md[0].api_url)",
        ),
        (
            'api_url = "http://127.0.0.1:8201"',
            'api_url = "127.0.0.1:8201"',
            'topology.datacenter[1].md[1].api_url: expected "http://host:port", got "127.0.0.1:8201"',
        ),
    ],
)
def test_a_malformed_vllm_topology_names_the_key(old: str, new: str, message: str) -> None:
    text = pools()
    assert old in text
    with pytest.raises(InvalidInput) as err:
        parse_topology(text.replace(old, new, 1))
    assert err.value.message == message


def test_the_router_takes_a_vllm_topology_and_refuses_what_does_not_fit() -> None:
    topo = parse_topology(pools())
    cfg = RouterConfig(engine="vllm", topology=topo, vllm=MODEL)
    assert cfg.deployment() is topo
    refusals = [
        (
            dict(engine="vllm", topology=topo, vllm=VllmEngineConfig(model="tiny", md_url="http://h:1")),
            "router: vllm.md_url: not with a [topology] (its instances name the servers)",
        ),
        (
            dict(engine="vllm", topology=topo, vllm=VllmEngineConfig(model="tiny", md_kv_events="ipc:///e")),
            "router: vllm.md_kv_events: not with a [topology] (its instances name the servers)",
        ),
        (dict(engine="vllm", topology=topo), "router: engine vllm needs [vllm] model"),
        (
            dict(engine="reference", topology=topo),
            'router: topology.datacenter[0].p[0].engine: expected "reference" (the router\'s engine), '
            'got "vllm"',
        ),
        (
            dict(
                engine="vllm",
                topology=parse_topology(
                    pools().replace(
                        'kv_events = "tcp://127.0.0.1:5602"',
                        'engine = "reference"\naddress = "127.0.0.1:7300"',
                    )
                ),
                vllm=MODEL,
            ),
            'router: topology.datacenter[1].md[1].engine: expected "vllm" (the router\'s engine), '
            'got "reference"',
        ),
        (
            dict(engine="vllm", vllm=VllmEngineConfig(model="tiny", p_url="http://h:1")),
            "router: engine vllm needs [vllm] p_url, md_url and model (or a [topology])",
        ),
        (
            dict(engine="vllm", vllm=VllmEngineConfig(model="t", p_url="http://h:1", md_url="h:2")),
            'router: vllm.md_url: expected "http://host:port", got "h:2"',
        ),
        (
            dict(
                engine="vllm",
                vllm=VllmEngineConfig(model="t", p_url="http://h:1", md_url="http://h:2", md_kv_events="x"),
            ),
            'router: vllm.md_kv_events: expected "tcp://host:port" or "ipc://path", got "x"',
        ),
    ]
    for kwargs, message in refusals:
        with pytest.raises(InvalidInput) as err:
            RouterConfig(**kwargs)  # type: ignore[arg-type]
        assert err.value.message == message


def test_the_three_url_form_is_a_topology_of_one_each() -> None:
    from router.vllm_backend import VllmBackend

    v = VllmEngineConfig(
        model="tiny", p_url="http://h:1", md_url="http://h:2", rld_url="http://h:1", md_kv_events="ipc:///e"
    )
    backend = VllmBackend(RouterConfig(engine="vllm", vllm=v))
    topo = backend.fleet.topology
    assert [(m.role, m.name, m.instance.api_url) for m in topo.members()] == [
        (Role.P, "p0", "http://h:1"),
        (Role.RLD, "rld0", "http://h:1"),
        (Role.MD, "md0", "http://h:2"),
    ]
    assert not backend.pools and list(backend.mirrors) == ["md0"] and backend.mirror is backend.mirrors["md0"]
    st = backend.status()
    assert set(st["roles"]) == {"p", "rld", "md"} and st["drc_mirror"]["block_size"] is None
    asyncio.run(backend.http.aclose())


class FakeVllm:
    """An HTTP server answering ``/health`` with ``status`` (what the backend's watch polls)."""

    def __init__(self) -> None:
        self.status = 200
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(
                f"HTTP/1.1 {self.status} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".encode()
            )
            await writer.drain()
            writer.close()

        self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


async def _until(cond: Any, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.05)


def test_round_robin_places_over_both_mds_each_run_calls_its_route_and_names_its_md_to_p() -> None:
    from router.leg_driver import LegRun
    from router.vllm_backend import VllmBackend
    from router.vllm_legs import VllmCalls

    backend = VllmBackend(
        RouterConfig(engine="vllm", topology=parse_topology(pools()), vllm=MODEL, placement="round_robin")
    )
    try:
        assert backend.pools and set(backend.mirrors) == {"md-b0", "md-b1"}
        now = time.monotonic()
        routes = [backend.fleet.place((1, 2, 3, i), now) for i in range(4)]
        assert [r.md.name for r in routes] == ["md-b0", "md-b1", "md-b0", "md-b1"]
        for route in routes:
            calls = VllmCalls(LegRun(None, now + 10), backend, route)  # type: ignore[arg-type]
            assert (calls.p_url, calls.md_url, calls.rld_url) == (
                "http://127.0.0.1:8100",
                route.md.instance.api_url,
                "",
            )
            assert calls._destinations(rld=False, md=True) == {"to": ["md"], "md": route.md.name}
        st = backend.status()
        names = [i["name"] for dc in st["topology"]["datacenters"] for i in dc["md"]]
        assert names == ["md-b0", "md-b1"] and set(st["drc_mirrors"]) == {"md-b0", "md-b1"}
        assert st["topology"]["datacenters"][1]["md"][1]["api_url"] == "http://127.0.0.1:8201"
    finally:
        asyncio.run(backend.http.aclose())


def test_a_relayed_route_calls_its_rld_and_names_it_to_p_too() -> None:
    from router.leg_driver import LegRun
    from router.vllm_backend import VllmBackend
    from router.vllm_legs import VllmCalls

    rld = (
        '[[topology.datacenter.rld]]\nname = "rld-a0"\napi_url = "http://127.0.0.1:8110"\n'
        'kv = "127.0.0.1:7111"\n'
    )
    text = pools().replace(
        '[[topology.datacenter]]\nname = "dc-b"', rld + '\n[[topology.datacenter]]\nname = "dc-b"'
    )
    v = VllmEngineConfig(model="tiny", rld_gets_kv=True)
    backend = VllmBackend(RouterConfig(engine="vllm", topology=parse_topology(text), vllm=v))
    try:
        route = backend.fleet.place((1, 2, 3), time.monotonic())
        assert route.rld is not None and route.rld.name == "rld-a0"
        calls = VllmCalls(LegRun(None, time.monotonic() + 10), backend, route)  # type: ignore[arg-type]
        assert calls.rld_url == "http://127.0.0.1:8110"
        assert calls._destinations(rld=True, md=True) == {"to": ["rld", "md"], "md": "md-b0", "rld": "rld-a0"}
    finally:
        asyncio.run(backend.http.aclose())


@pytest.fixture
def fakes() -> Iterator[dict[str, FakeVllm]]:
    servers = {"p": FakeVllm(), "md0": FakeVllm(), "md1": FakeVllm()}
    yield servers
    for s in servers.values():
        s.close()


def test_an_md_whose_health_fails_is_out_of_placement_at_once_and_back_when_it_answers(
    fakes: dict[str, FakeVllm],
) -> None:
    from router.vllm_backend import HEALTH_INTERVAL_S, VllmBackend

    async def go() -> None:
        ports = {k: await s.start() for k, s in fakes.items()}
        # no kv_events: a mirror's start imports vLLM's event types (seconds, on this loop)
        text = "\n".join(line for line in pools(**ports).splitlines() if not line.startswith("kv_events"))
        topo = parse_topology(text)
        backend = VllmBackend(RouterConfig(engine="vllm", topology=topo, vllm=MODEL, placement="round_robin"))
        await backend.start()
        try:
            fakes["md1"].status = 503
            await _until(lambda: not backend.usable("md-b1"))
            now = time.monotonic()
            placed = {backend.fleet.place((5, 6, i), now).md.name for i in range(4)}
            assert placed == {"md-b0"}
            assert backend.usable("md") and backend.usable("p-a0")
            st = backend.status()["topology"]["datacenters"][1]["md"][1]
            assert st["in_placement"] is False and st["out_because"] == "unreachable"
            assert st["health"]["error"] == "health 503" and st["health"]["losses"] == 1
            fakes["md1"].status = 200
            await _until(lambda: backend.usable("md-b1"), 3 * HEALTH_INTERVAL_S + 2)
            now = time.monotonic()
            placed = {backend.fleet.place((7, 8, i), now).md.name for i in range(4)}
            assert placed == {"md-b0", "md-b1"}
        finally:
            await backend.close()

    asyncio.run(go())


def _stored(hashes: list[int], parent: int | None, tokens: list[int], bs: int) -> Any:
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(
        block_hashes=list[bytes | int](hashes),
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=bs,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


@pytest.mark.vllm  # vLLM's own event objects
def test_each_md_has_its_own_mirror_and_prefix_aware_placement_follows_it() -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed here (pip install 'pddlink[vllm]')")
    from router.vllm_backend import VllmBackend

    backend = VllmBackend(RouterConfig(engine="vllm", topology=parse_topology(pools()), vllm=MODEL))
    try:
        prompt = tuple(range(10, 10 + 4 * 16 + 3))  # four 16-token blocks
        backend.mirrors["md-b1"].apply([_stored([1, 2, 3, 4], None, list(prompt[:64]), 16)])
        now = time.monotonic()
        route = backend.fleet.place(prompt, now)
        assert (route.md.name, route.matched_tokens) == ("md-b1", 64)
        assert backend.matched_tokens(prompt) == 64
        assert backend.fleet.place(tuple(range(500, 570)), now).md.name == "md-b0"  # no prefix: the first
        st = backend.status()["drc_mirrors"]
        assert st["md-b1"]["blocks"] == 4 and st["md-b0"]["blocks"] == 0 and st["md-b1"]["block_size"] == 16
        backend.health["md-b1"].set(False, "health 503", now)  # what the watch does when it fails
        assert backend.fleet.place(prompt, now).md.name == "md-b0"
        assert backend.matched_tokens(prompt) == 0  # a dead MD's mirror answers nothing
    finally:
        asyncio.run(backend.http.aclose())
