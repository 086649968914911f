"""The router's fleet when membership changes at run time (``router.fleet.Fleet.add`` / ``remove``),
in memory: an instance that joins is placed on, one that leaves never again; a record the topology
cannot hold is refused by name; the prefills other routers queued at a P count in its queue."""

from __future__ import annotations

import pytest

from pddlink.errors import InvalidInput
from pddlink.roles import Role
from pddlink.routing import PlacementPolicy
from pddlink.topology import Instance, parse_topology
from router.fleet import Fleet

TOPOLOGY = """
[topology]
[[topology.datacenter]]
name = "dc-a"
p = [{ name = "p-a0", address = "127.0.0.1:1" }, { name = "p-a1", address = "127.0.0.1:2" }]
[[topology.datacenter]]
name = "dc-b"
md = [{ name = "md-b0", address = "127.0.0.1:3" }]
[[topology.link]]
between = ["dc-a", "dc-b"]
line_mbit = 100
rtt_ms = 2
"""
PROMPT = tuple(range(1, 65))


class Holds:
    """An MD mirror that holds the first ``tokens`` of every prompt."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def matched_tokens(self, prompt: tuple[int, ...]) -> int:
        return min(self.tokens, len(prompt))

    def blocks(self) -> int:
        return self.tokens // 16

    def block_tokens(self) -> int | None:
        return 16


def fleet(policy: PlacementPolicy = PlacementPolicy.PREFIX_AWARE) -> Fleet:
    return Fleet(
        parse_topology(TOPOLOGY),
        policy=policy,
        usable=lambda name: True,
        mirrors={"md-b0": Holds(0)},
        kv_bytes_per_token=2048,
        wan_links=2,
        p_prefill_tokens_per_s=1000.0,
    )


def test_a_joined_md_is_placed_on_and_a_departed_one_never_again() -> None:
    f = fleet()
    f.add(Instance(Role.MD, "md-b1", "127.0.0.1:9"), "dc-b", Holds(64))
    route = f.place(PROMPT, now=1.0)
    assert route.md.name == "md-b1" and route.matched_tokens == 64  # it holds the whole prompt
    assert [m.name for m in f.topology.members(Role.MD)] == ["md-b0", "md-b1"]
    f.remove("md-b1", now=2.0)
    assert all(f.place(PROMPT, now=3.0 + i).md.name == "md-b0" for i in range(5))
    assert f.why_out("md-b1", 4.0) == "left" and not f.in_placement("md-b1", 4.0)
    assert "md-b1" not in f.status(5.0, {})["datacenters"][1]["md"].__repr__()
    f.add(Instance(Role.MD, "md-b1", "127.0.0.1:9"), "dc-b", Holds(64))  # back under the same name
    assert f.place(PROMPT, now=6.0).md.name == "md-b1"


def test_round_robin_takes_a_joined_md_in_turn() -> None:
    f = fleet(PlacementPolicy.ROUND_ROBIN)
    f.add(Instance(Role.MD, "md-b1", "127.0.0.1:9"), "dc-b", Holds(0))
    assert {f.place(PROMPT, now=float(i)).md.name for i in range(4)} == {"md-b0", "md-b1"}


@pytest.mark.parametrize(
    ("instance", "datacenter", "why"),
    [
        (Instance(Role.MD, "md-x", "127.0.0.1:9"), "dc-z", "no datacenter"),
        (Instance(Role.MD, "md-b0", "127.0.0.1:9"), "dc-b", "already in the topology"),
        (Instance(Role.MD, "md-x", "127.0.0.1:3"), "dc-b", "duplicate"),  # md-b0's address
        (Instance(Role.MD, "md-x", "127.0.0.1:9"), "dc-a", None),  # beside P: no WAN needed
    ],
)
def test_what_the_topology_cannot_hold_is_refused(
    instance: Instance, datacenter: str, why: str | None
) -> None:
    f = fleet()
    if why is None:
        f.add(instance, datacenter, Holds(0))
        assert instance.name in f.members
        return
    with pytest.raises(InvalidInput, match=why):
        f.add(instance, datacenter, Holds(0))
    assert len(f.topology.members()) == 3 and len(f.members) == 3  # unchanged


def test_prefills_other_routers_queued_at_a_p_count_in_its_queue() -> None:
    f = fleet()
    f.router_name = "router0"
    f.place(PROMPT, now=0.0)  # the mean prefill this router sends: some tokens now
    assert f.mean_prompt_tokens > 0
    f.reported_pending = {"p-a0": frozenset({"router1-aa", "router1-bb", "router0-cc"})}
    assert f.others_queued_tokens("p-a0") == pytest.approx(2 * f.mean_prompt_tokens)
    assert f.others_queued_tokens("p-a1") == 0
    assert all(f.place(PROMPT, now=1.0 + i).p.name == "p-a1" for i in range(3))  # the idle P
    f.reported_pending = {"p-a0": frozenset({"router0-cc"})}  # only its own: its book counts those
    assert f.others_queued_tokens("p-a0") == 0
