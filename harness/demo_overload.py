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

TARGET_LOAD = 2.0  # offered suffix bytes / line rate (the issue asks for at least 1.8)


def offered_suffix_bytes_s(
    warm: Sequence[DemoRequest], measured: Sequence[DemoRequest], kv_bytes_per_token: int
) -> float:
    seen: set[tuple[int, ...]] = set()

    def missing(prompt: tuple[int, ...]) -> int:
        full = len(prompt) // BLOCK_TOKENS
        hit = 0
        while hit < full and prompt[: (hit + 1) * BLOCK_TOKENS] in seen:
            hit += 1
        for i in range(1, full + 1):
            seen.add(prompt[: i * BLOCK_TOKENS])
        return len(prompt) - hit * BLOCK_TOKENS

    for r in warm:
        missing(r.prompt)
    total = sum(missing(r.prompt) for r in measured)
    span = max(measured[-1].arrival_s - measured[0].arrival_s, 1.0) if measured else 1.0
    return total * kv_bytes_per_token / span


def overload_line_mbit(suffix_bytes_s: float, load: float = TARGET_LOAD) -> float:
    if load <= 0 or suffix_bytes_s <= 0:
        raise ConfigError(
            f"wan-overload: load and offered suffix rate must be > 0 ({load}, {suffix_bytes_s})"
        )
    return suffix_bytes_s * 8 / 1e6 / load
