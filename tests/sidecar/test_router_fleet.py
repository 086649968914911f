"""``router.fleet``: the router's per-instance bookkeeping over a topology, in memory (issue 26).
Placement reads each MD's own mirror; an unhealthy, stalled or drained instance leaves placement at
once (counted, once per loss) and comes back when healthy; no usable MD still yields a route marked
so (the router's MD-unavailable paths); /status shows every instance."""

from __future__ import annotations

from pathlib import Path

import pytest

from pddlink.errors import NotFound
from pddlink.roles import Role
from pddlink.routing.placement import PlacementPolicy
from pddlink.topology import load_topology
from router.fleet import Fleet

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "topology" / "three-dc.toml"
PROMPT = tuple(range(1, 161))  # 10 blocks of 16


class FakeMirror:
    def __init__(self, held: int = 0) -> None:
        self.held = held

    def matched_tokens(self, prompt: tuple[int, ...]) -> int:
        return min(self.held, len(prompt))

    def blocks(self) -> int:
        return self.held // 16

    def block_tokens(self) -> int | None:
        return 16


def _fleet(
    policy: PlacementPolicy = PlacementPolicy.PREFIX_AWARE,
) -> tuple[Fleet, dict[str, FakeMirror], set[str]]:
    topo = load_topology(EXAMPLE)
    mirrors = {m.name: FakeMirror() for m in topo.members() if m.role.value == "md"}
    down: set[str] = set()
    fleet = Fleet(
        topo,
        policy=policy,
        usable=lambda name: name not in down,
        mirrors=mirrors,
        kv_bytes_per_token=2048,
        wan_links=4,
        p_prefill_tokens_per_s=3300.0,
    )
    return fleet, mirrors, down


def test_a_request_goes_to_the_md_whose_own_mirror_holds_its_prefix() -> None:
    fleet, mirrors, _ = _fleet()
    mirrors["md-c1"].held = 160  # the slow link's MD holds the whole prompt: no WAN bytes at all
    route = fleet.place(PROMPT, now=0.0)
    assert route.md.name == "md-c1" and route.matched_tokens == 160 and route.md_usable
    assert route.p.datacenter == "dc-a" and route.rld is not None and route.rld.datacenter == "dc-a"
    assert route.link is fleet.links[frozenset(("dc-a", "dc-c"))]  # its own link's model


def test_an_unreachable_md_leaves_placement_at_once_and_comes_back() -> None:
    fleet, mirrors, down = _fleet()
    mirrors["md-b0"].held = 160
    assert fleet.place(PROMPT, 0.0).md.name == "md-b0"
    down.add("md-b0")
    route = fleet.place(PROMPT, 0.1)
    assert route.md.name != "md-b0" and route.md_usable
    fleet.place(PROMPT, 0.2)
    assert fleet.outs["md-b0"] == 1  # counted once per loss, not per placement
    assert fleet.status(0.2, {})["datacenters"][1]["md"][0]["out_because"] == "unreachable"
    down.clear()
    assert fleet.place(PROMPT, 0.3).md.name == "md-b0"


def test_a_stalled_md_is_avoided_until_it_streams_again() -> None:
    fleet, mirrors, _ = _fleet()
    mirrors["md-b1"].held = 160
    fleet.stalled("md-b1", now=1.0)
    assert fleet.place(PROMPT, 1.1).md.name != "md-b1"
    assert fleet.why_out("md-b1", 1.1) == "stalled"
    fleet.streamed("md-b1")
    assert fleet.place(PROMPT, 1.2).md.name == "md-b1"


def test_drain_takes_an_instance_out_and_back() -> None:
    fleet, mirrors, _ = _fleet()
    mirrors["md-b0"].held = 160
    fleet.drain("md-b0", 0.0)
    assert fleet.place(PROMPT, 0.0).md.name != "md-b0"
    fleet.drain("p-a0", 0.0)
    assert {fleet.place(PROMPT, 0.0).p.name for _ in range(4)} == {"p-a1"}
    fleet.undrain("md-b0", 0.0)
    assert fleet.place(PROMPT, 0.0).md.name == "md-b0"
    with pytest.raises(NotFound, match="md-x9"):
        fleet.drain("md-x9", 0.0)


def test_no_usable_md_still_routes_marked_so() -> None:
    fleet, _, down = _fleet()
    down.update({"md-b0", "md-b1", "md-c0", "md-c1"})
    route = fleet.place(PROMPT, 0.0)
    assert not route.md_usable and route.reason == "no_healthy_md" and route.rld is not None


def test_round_robin_and_load_bookkeeping() -> None:
    fleet, _, _ = _fleet(PlacementPolicy.ROUND_ROBIN)
    routes = [fleet.place(PROMPT, 0.0) for _ in range(4)]
    assert sorted(r.md.name for r in routes) == ["md-b0", "md-b1", "md-c0", "md-c1"]
    fleet.begin(routes[0], relayed=True)
    assert fleet.running[routes[0].md.name] == 1 and fleet.running[routes[0].p.name] == 1
    assert routes[0].rld is not None and fleet.running[routes[0].rld.name] == 1
    status = fleet.status(0.0, {})
    assert status["placement"] == "round_robin" and len(status["links"]) == 2
    md = next(i for dc in status["datacenters"] for i in dc["md"] if i["name"] == routes[0].md.name)
    assert md["running"] == 1 and md["placed"] == 1 and md["mirror_blocks"] == 0
    fleet.end(routes[0], relayed=True)
    assert fleet.running[routes[0].md.name] == 0


def test_the_router_drains_over_http_and_shows_the_pools() -> None:
    """``POST /admin/drain {"instance": NAME}`` on the router's HTTP API; ``pddlink drain`` posts it."""
    import asyncio
    import json

    from pddlink.serving.client_guard import ApiConfig, ClientGuard
    from pddlink.serving.http import fetch, serve_http
    from router import Router, RouterConfig
    from router.api import RouterApi

    def calls(port: int) -> None:
        at = f"127.0.0.1:{port}"
        code, body = fetch(at, "POST", "/admin/drain", json.dumps({"instance": "md-c1"}).encode())
        assert code == 200 and json.loads(body) == {"instance": "md-c1", "draining": True, "running": 0}
        code, body = fetch(at, "GET", "/status")
        pools = json.loads(body)["topology"]
        c1 = next(i for dc in pools["datacenters"] for i in dc["md"] if i["name"] == "md-c1")
        assert c1["out_because"] == "drained" and c1["draining"] and not c1["in_placement"]
        assert fetch(at, "POST", "/admin/drain", b'{"instance": "md-x9"}')[0] == 404
        assert fetch(at, "POST", "/admin/drain", b"[1]")[0] == 400
        assert fetch(at, "GET", "/admin/drain")[0] == 405
        code, body = fetch(at, "POST", "/admin/undrain", b'{"instance": "md-c1"}')
        assert code == 200 and not json.loads(body)["draining"]

    async def main() -> None:
        router = Router(RouterConfig(topology=load_topology(EXAMPLE)))
        api_cfg = ApiConfig()
        api = RouterApi(router, api_cfg, guard=ClientGuard.from_config(api_cfg))
        servers = await serve_http(
            api.http, host="127.0.0.1", port=0, limits=api.http_limits(), gate=api.gate
        )
        try:
            await asyncio.to_thread(calls, servers[0].sockets[0].getsockname()[1])
        finally:
            for s in servers:
                s.close()
            await router.close()

    asyncio.run(main())


def _failed(reason: object) -> object:
    import dataclasses

    from pddlink.lifecycle import RunOutcome, RunTrace

    blank: dict[str, object] = {f.name: None for f in dataclasses.fields(RunTrace)}
    blank.update(request_id="r1", outcome=RunOutcome.FAILED, reason=reason, reason_detail="lost")
    return RunTrace(**blank)  # type: ignore[arg-type]


def test_a_run_that_lost_its_p_or_md_before_a_token_is_placed_again_elsewhere() -> None:
    """``Router.replacement``: P unavailable -> another P; MD lost -> another MD (its breaker opens at
    once, before its channel says so); any other failure, or too little time left: no second run."""
    import asyncio
    import time

    from engines_adapter import SamplingParams
    from pddlink.lifecycle import FailReason
    from router import Router, RouterConfig

    async def main() -> None:
        router = Router(RouterConfig(topology=load_topology(EXAMPLE), relay_enabled=False))
        prompt, sampling, now = list(PROMPT), SamplingParams(max_tokens=4), time.monotonic()
        _, _, route = router.decide_route(tuple(prompt), 4, "", 10.0)
        again = router.replacement(_failed(FailReason.P_UNAVAILABLE), route, prompt, sampling, 10.0, now)  # type: ignore[arg-type]
        assert again is not None and again[2].p.name != route.p.name
        assert router.fleet.why_out(route.p.name, time.monotonic()) == "failed"
        _, _, route = router.decide_route(tuple(prompt), 4, "", 10.0)
        again = router.replacement(_failed(FailReason.MD_LOST), route, prompt, sampling, 10.0, now)  # type: ignore[arg-type]
        assert again is not None and again[2].md.name != route.md.name
        late = time.monotonic() - 9.5  # half a second left: not worth a second run
        assert router.replacement(_failed(FailReason.MD_LOST), route, prompt, sampling, 10.0, late) is None  # type: ignore[arg-type]
        assert (
            router.replacement(_failed(FailReason.DEADLINE_EXCEEDED), again[2], prompt, sampling, 10.0, now)
            is None
        )  # type: ignore[arg-type]
        await router.close()

    asyncio.run(main())


def test_a_run_that_lost_its_md_or_p_moves_within_the_role_keeping_the_rest() -> None:
    """``Fleet.spare`` / ``Fleet.moved`` (a run's mid-request move, issue 26): never back to the
    lost instance (even while its channel still looks healthy), nor to one the run lost before;
    the roles not lost stay; no spare left: no move."""
    fleet, mirrors, down = _fleet()
    mirrors["md-b0"].held = 160
    route = fleet.place(PROMPT, 0.0)
    assert route.md.name == "md-b0" and fleet.spare("md-b0", 0.0)
    moved = fleet.moved(route, Role.MD, PROMPT, 0.1, frozenset({"md-b0"}))
    assert moved is not None and moved.md.name != "md-b0"
    assert (moved.p, moved.rld) == (route.p, route.rld)
    assert moved.link is fleet.links[frozenset(("dc-a", moved.md.datacenter))]
    other_p = fleet.moved(route, Role.P, PROMPT, 0.2, frozenset({route.p.name}))
    assert other_p is not None and other_p.p.name != route.p.name and other_p.md == route.md
    assert other_p.rld is not None and other_p.rld.datacenter == other_p.p.datacenter
    down.update({"md-b1", "md-c0"})  # only md-c1 left besides the lost md-b0
    assert fleet.spare("md-b0", 0.3) and not fleet.spare("md-b0", 0.3, frozenset({"md-c1"}))
    assert fleet.moved(route, Role.MD, PROMPT, 0.3, frozenset({"md-b0", "md-c1"})) is None
    before = fleet.running["md-c1"], fleet.placed["md-c1"]
    fleet.begin(route, relayed=False)
    fleet.shift(route.md, fleet.member("md-c1"))
    assert fleet.running["md-b0"] == 0 and (fleet.running["md-c1"], fleet.placed["md-c1"]) == (
        before[0] + 1,
        before[1] + 1,
    )


def test_a_pool_instance_back_after_its_channel_was_lost_is_placed_on_at_once() -> None:
    """Its runs' reports of the old process opened the breaker many times (up to 30 s); once its
    channel is lost and back (a restart) a pool's instance is in placement again at once."""
    fleet, _, down = _fleet()
    for k in range(6):
        fleet.stalled("md-b0", now=1.0 + 0.1 * k)  # six runs saw it go
    assert fleet.why_out("md-b0", 2.0) == "stalled" and fleet.stalls["md-b0"].down_until > 20.0
    down.add("md-b0")
    assert fleet.why_out("md-b0", 3.0) == "unreachable"
    down.clear()
    assert fleet.why_out("md-b0", 4.0) == "" and fleet.in_placement("md-b0", 4.0)


def test_an_md_back_in_placement_gets_the_next_request_once() -> None:
    """A restarted MD holds nothing: prefix-aware placement alone would leave it idle while the
    others hold the prompts' prefixes; it gets the next request (a half-open probe), then
    placement goes on as before."""
    fleet, mirrors, down = _fleet()
    for name in ("md-b1", "md-c0", "md-c1"):
        mirrors[name].held = 160
    assert fleet.place(PROMPT, 0.0).md.name != "md-b0"
    down.add("md-b0")
    fleet.place(PROMPT, 0.1)
    down.clear()
    probe = fleet.place(PROMPT, 0.2)
    assert probe.md.name == "md-b0" and probe.reason == "rejoin_probe"
    assert fleet.place(PROMPT, 0.3).md.name != "md-b0"  # once


def test_placement_reads_each_ps_own_mirror_once_it_is_synced() -> None:
    """A P whose mirror holds the prompt gets it over an idle P that holds nothing; a P mirror not
    synced yet (``block_tokens`` None: an older P, or before its first snapshot) counts as unknown,
    so placement falls back to the least-queued P."""

    class Unsynced(FakeMirror):
        def block_tokens(self) -> int | None:
            return None

    topo = load_topology(EXAMPLE)
    mirrors = {m.name: FakeMirror(160) for m in topo.members(Role.MD)}
    p_mirrors = {"p-a0": FakeMirror(0), "p-a1": FakeMirror(160)}
    fleet = Fleet(
        topo,
        policy=PlacementPolicy.PREFIX_AWARE,
        usable=lambda name: True,
        mirrors=mirrors,
        p_mirrors=p_mirrors,
        kv_bytes_per_token=2048,
        wan_links=4,
        p_prefill_tokens_per_s=3300.0,
    )
    assert {fleet.place(PROMPT, now=0.1 * k).p.name for k in range(4)} == {"p-a1"}  # every time
    view = fleet.view({}, 16, 1.0, {"p-a0": 0, "p-a1": 10})
    assert {s.name: s.matched_blocks for s in view.p} == {"p-a0": 0, "p-a1": 10}
    fleet.p_mirrors = {"p-a0": FakeMirror(0), "p-a1": Unsynced(160)}
    assert {fleet.place(PROMPT, now=2.0 + 0.1 * k).p.name for k in range(4)} == {
        "p-a0",
        "p-a1",
    }  # ties go round
    status = fleet.status(3.0, {})["datacenters"][0]["p"]
    assert [p.get("mirror_blocks") for p in status] == [0, 10]
