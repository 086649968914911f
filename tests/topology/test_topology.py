"""The topology: the example file loads, malformed input is refused naming the exact key, and the
old three-address form becomes a topology of one each."""

from __future__ import annotations

from pathlib import Path

import pytest

from pddlink.errors import InvalidInput
from pddlink.roles import Role
from pddlink.topology import (
    Datacenter,
    Engine,
    Instance,
    Topology,
    WanLink,
    load_topology,
    parse_topology,
    topology_from_addresses,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "topology" / "three-dc.toml"

BASE = """
[topology]
[[topology.datacenter]]
name = "dc-a"
[[topology.datacenter.p]]
name = "p0"
address = "127.0.0.1:7001"
[[topology.datacenter]]
name = "dc-b"
[[topology.datacenter.md]]
name = "md0"
address = "127.0.0.1:7002"
[[topology.link]]
between = ["dc-a", "dc-b"]
line_mbit = 100
rtt_ms = 20
"""


def test_the_example_has_three_datacenters_and_two_different_links() -> None:
    topo = load_topology(EXAMPLE)
    assert [dc.name for dc in topo.datacenters] == ["dc-a", "dc-b", "dc-c"]
    assert [m.name for m in topo.members(Role.P)] == ["p-a0", "p-a1"]
    assert [m.name for m in topo.members(Role.RLD)] == ["rld-a0", "rld-a1"]
    assert [(m.datacenter, m.name) for m in topo.members(Role.MD)] == [
        ("dc-b", "md-b0"), ("dc-b", "md-b1"), ("dc-c", "md-c0"), ("dc-c", "md-c1"),
    ]  # fmt: skip
    ab, ac = topo.link("dc-a", "dc-b"), topo.link("dc-c", "dc-a")
    assert ab is not None and ac is not None
    assert (ab.line_mbit, ab.rtt_ms) != (ac.line_mbit, ac.rtt_ms)
    assert ab.line_bytes_per_s == 2e6 and ab.rtt_s == 0.02
    assert topo.link("dc-b", "dc-c") is None and topo.link("dc-a", "dc-a") is None
    md = topo.member("md-b0").instance
    assert (md.identity, md.admin_address, md.engine) == ("md/md-b0", "127.0.0.1:9201", Engine.REFERENCE)
    assert topo.member("p-a0").instance.identity == "p/p-a0"  # the default identity


def test_base_loads() -> None:
    assert len(parse_topology(BASE).members()) == 2


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        (
            'address = "127.0.0.1:7002"',
            'address = "a:1,b:2"',
            'topology.datacenter[1].md[0].address: expected "host:port", got "a:1,b:2"',
        ),
        (
            'address = "127.0.0.1:7001"',
            'address = ["127.0.0.1:7001", "127.0.0.1:7003"]',
            "topology.datacenter[0].p[0].address: expected a string, got a list",
        ),
        (
            'address = "127.0.0.1:7002"',
            'address = "127.0.0.1:70000"',
            'topology.datacenter[1].md[0].address: expected "host:port", got "127.0.0.1:70000"',
        ),
        (
            'name = "md0"',
            'name = "p0"',
            'topology.datacenter[1].md[0].name: duplicate "p0" (also topology.datacenter[0].p[0].name)',
        ),
        ('name = "dc-b"', 'name = "dc-a"', 'topology.datacenter[1].name: duplicate datacenter "dc-a"'),
        (
            'between = ["dc-a", "dc-b"]',
            'between = ["dc-a", "dc-x"]',
            'topology.link[0].between: unknown datacenter "dc-x"',
        ),
        (
            'between = ["dc-a", "dc-b"]',
            'between = ["dc-a", "dc-a"]',
            'topology.link[0].between: a link joins two datacenters, got "dc-a" twice',
        ),
        ("line_mbit = 100", "line_mbit = 0", "topology.link[0].line_mbit: expected a number > 0, got 0.0"),
        ("rtt_ms = 20", 'rtt_ms = "20"', "topology.link[0].rtt_ms: expected a number, got a string"),
        (
            'name = "md0"',
            'name = "md0"\nadress = "x:1"',
            "topology.datacenter[1].md[0].adress: unknown key "
            "(expected one of address, admin, api_url, engine, identity, kv, kv_events, name)",
        ),
        (
            'name = "md0"',
            'name = "md0"\nidentity = "p/md0"',
            'topology.datacenter[1].md[0].identity: expected "md/<name>", got "p/md0"',
        ),
        (
            'name = "md0"',
            'name = "md0"\nengine = "sglang"',
            'topology.datacenter[1].md[0].engine: expected "reference" or "vllm", got "sglang"',
        ),
        (
            'name = "md0"',
            'name = "md0"\nengine = "vllm"',
            'topology.datacenter[1].md[0].api_url: expected "http://host:port", got ""',
        ),
        (
            'name = "md0"',
            'name = "md 0"',
            'topology.datacenter[1].md[0].name: expected 1-64 letters, digits, ".", "_" or "-", got "md 0"',
        ),
    ],
)
def test_malformed_topologies_name_the_key(old: str, new: str, message: str) -> None:
    assert old in BASE
    with pytest.raises(InvalidInput) as err:
        parse_topology(BASE.replace(old, new, 1))
    assert err.value.message == message


def test_an_md_datacenter_without_a_link_from_p_is_refused() -> None:
    text = BASE.split("[[topology.link]]")[0]
    with pytest.raises(InvalidInput) as err:
        parse_topology(text)
    assert err.value.message == 'topology.datacenter[1].md: no topology.link from "dc-a" (its p) to "dc-b"'


def test_rld_without_p_and_roles_missing_are_refused() -> None:
    rld = BASE.replace("[[topology.datacenter.md]]", '[[topology.datacenter.rld]]\nname = "r0"\n'
                       'address = "127.0.0.1:7009"\n[[topology.datacenter.md]]')  # fmt: skip
    with pytest.raises(InvalidInput) as err:
        parse_topology(rld)
    assert err.value.message == (
        'topology.datacenter[1].rld: RLD takes KV over the fast path, but "dc-b" has no p'
    )
    with pytest.raises(InvalidInput) as err:
        parse_topology("[topology]\ndatacenter = []\n")
    assert err.value.message == "topology.datacenter: no p instance in any datacenter"
    with pytest.raises(InvalidInput) as err:
        parse_topology("[topology]\ndatacenter = 3\n")
    assert err.value.message == "topology.datacenter: expected a list, got an integer"
    with pytest.raises(InvalidInput) as err:
        parse_topology("[router]\n")
    assert err.value.message == "<topology>: no [topology] table"


def test_a_second_link_between_the_same_pair_is_refused() -> None:
    text = BASE + '[[topology.link]]\nbetween = ["dc-b", "dc-a"]\nline_mbit = 5\nrtt_ms = 1\n'
    with pytest.raises(InvalidInput) as err:
        parse_topology(text)
    assert err.value.message == 'topology.link[1].between: a second link "dc-b"-"dc-a"'


def test_the_old_three_address_form_is_one_of_each() -> None:
    topo = topology_from_addresses(
        "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3", line_mbit=100.0, rtt_ms=30.0, md_identity="md/mdx"
    )
    assert [(m.datacenter, m.role, m.name, m.instance.identity) for m in topo.members()] == [
        ("dc-a", Role.P, "p0", "p/p0"),
        ("dc-a", Role.RLD, "rld0", "rld/rld0"),
        ("dc-b", Role.MD, "mdx", "md/mdx"),
    ]
    assert topo.links == (WanLink("dc-a", "dc-b", 100.0, 30.0),)
    no_rld = topology_from_addresses("127.0.0.1:1", "", "127.0.0.1:3", line_mbit=1.0, rtt_ms=0.0)
    assert no_rld.members(Role.RLD) == ()


def test_the_old_form_names_the_old_keys() -> None:
    with pytest.raises(InvalidInput) as err:
        topology_from_addresses("a:1,b:2", "127.0.0.1:2", "127.0.0.1:3", line_mbit=100.0, rtt_ms=30.0)
    assert err.value.message == 'p: expected "host:port", got "a:1,b:2"'
    with pytest.raises(InvalidInput) as err:
        topology_from_addresses(
            "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3", line_mbit=100.0, rtt_ms=30.0, md_identity="rld/x"
        )
    assert err.value.message == 'md_identity: expected "md/<name>", got "rld/x"'
    with pytest.raises(InvalidInput) as err:
        topology_from_addresses("127.0.0.1:1", "", "127.0.0.1:3", line_mbit=-1.0, rtt_ms=30.0)
    assert err.value.message == "line_mbit: expected a number > 0, got -1.0"


def test_the_old_vllm_form_uses_urls() -> None:
    topo = topology_from_addresses(
        "", "", "", line_mbit=100.0, rtt_ms=30.0, engine=Engine.VLLM,
        p_url="http://127.0.0.1:8001", md_url="http://127.0.0.1:8002",
    )  # fmt: skip
    assert [m.instance.api_url for m in topo.members()] == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    with pytest.raises(InvalidInput) as err:
        topology_from_addresses("", "", "", line_mbit=1.0, rtt_ms=1.0, engine=Engine.VLLM, md_url="x")
    assert err.value.message == 'p_url: expected "http://host:port", got ""'


def test_direct_construction_validates_too() -> None:
    with pytest.raises(InvalidInput) as err:
        Instance(Role.MD, "m0", "localhost")
    assert err.value.message == 'address: expected "host:port", got "localhost"'
    p = Instance(Role.P, "p0", "[::1]:7000")
    md = Instance(Role.MD, "m0", "localhost:7001")
    with pytest.raises(InvalidInput) as err:
        Datacenter("a", p=(md,))
    assert err.value.message == "p[0].role: expected p, got md"
    topo = Topology((Datacenter("a", p=(p,), md=(md,)),))  # MD beside P: no link needed
    assert topo.link("a", "a") is None
