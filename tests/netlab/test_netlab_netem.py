"""``netlab.netem``: a profile as ``tc netem`` commands, for hosts whose kernel has sch_netem.

(The compose lab does not use it: this kernel has no netem, so the lab's WAN is netlab's relay in a
container; see docker/README.md.)
"""

from __future__ import annotations

from netlab.netem import tc_command
from netlab.profile import builtin_profiles, load_profile


def test_every_builtin_profile_becomes_a_root_netem_qdisc() -> None:
    for name in builtin_profiles():
        assert tc_command(load_profile(name), "a_to_b", "eth1")[5:7] == ["root", "netem"]
