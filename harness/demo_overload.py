"""``pddlink demo --scenario wan-overload``: the same replay on a line too thin for the suffixes.

The line is sized from the workload itself: ``offered_suffix_bytes_s`` walks the requests in
arrival order with a prefix cache that holds every earlier prompt (what MD's cache would hold if
it kept everything: the least the WAN must carry), takes the KV bytes of each measured request's
missing full blocks over the measured span, and ``overload_line_mbit`` makes the line carry
``1 / load`` of that. Any ``--trace`` or ``--workload`` replays in the same regime. The baseline
is cross-datacenter PD as before (ship only, no admission); PDD runs with recompute and admission.
"""

from __future__ import annotations

from collections.abc import Sequence

from harness.demo_workload import BLOCK_TOKENS, DemoRequest
from pddlink.errors import ConfigError
from pddlink.sim.demo_overload import offered_suffix_bytes_s as suffix_bytes_s

TARGET_LOAD = 2.0  # offered suffix bytes / line rate (the issue asks for at least 1.8)


def offered_suffix_bytes_s(
    warm: Sequence[DemoRequest], measured: Sequence[DemoRequest], kv_bytes_per_token: int
) -> float:
    """``pddlink.sim.demo_overload.offered_suffix_bytes_s`` on the demo's token prompts."""
    prompts = [(r.arrival_s, r.prompt) for r in measured]
    return suffix_bytes_s([r.prompt for r in warm], prompts, kv_bytes_per_token, BLOCK_TOKENS)


def overload_line_mbit(suffix_bytes_s: float, load: float = TARGET_LOAD) -> float:
    if load <= 0 or suffix_bytes_s <= 0:
        raise ConfigError(
            f"wan-overload: load and offered suffix rate must be > 0 ({load}, {suffix_bytes_s})"
        )
    return suffix_bytes_s * 8 / 1e6 / load
