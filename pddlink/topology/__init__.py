"""The deployment as a topology: datacenters, pools of P / RLD / MD instances, WAN links.

``Topology`` (``model``) is the validated, frozen description; ``load_topology(path)`` /
``parse_topology(text)`` / ``topology_from_table(table)`` build it from a TOML ``[topology]``
table, and ``topology_from_addresses(p, rld, md, line_mbit=, rtt_ms=, ...)`` from the router's old
three-address form (one of each; P and RLD in "dc-a", MD in "dc-b"). Placement over it is
``pddlink.routing.placement``. Malformed input raises ``pddlink.errors.InvalidInput`` naming the key.
"""

from pddlink.topology.load import load_topology, parse_topology, topology_from_addresses, topology_from_table
from pddlink.topology.model import (
    Datacenter,
    Engine,
    Instance,
    Member,
    Topology,
    WanLink,
    check_address,
)

__all__ = [
    "Datacenter",
    "Engine",
    "Instance",
    "Member",
    "Topology",
    "WanLink",
    "check_address",
    "load_topology",
    "parse_topology",
    "topology_from_addresses",
    "topology_from_table",
]
