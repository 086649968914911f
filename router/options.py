"""The router's side of ship-or-recompute: ``choose_option``'s inputs from what the router knows,
a forced pipeline as an option, and the trace fields that say why a request went where it went.

What the router feeds the policy: the DRC mirror's match and the link estimate with P's backlog
(``RoutingInputs``), P's prefill queue and speed and MD's (``pddlink.routing.books.PrefillBook``, from
P's replies and MD's ready events), RLD's load, and the deadline. The policy's deadline is the
share of the request's deadline P gives the WAN transfer (``sidecar.prefill``), so an admitted
request still has time for a fallback.

The SLO (``slo_ttft_ms``, ``slo_tpot_ms``; 0: none) bounds the choice too: the TTFT half as the
option's first-token deadline, the TPOT half as the decode-speed bound recompute is charged against,
with the requests MD runs now (``md_running``, their ``max_tokens`` and the tokens each has
produced: one bounded shorter than what a stall pushes over counts for certain, one that has
produced that many already not at all) and the output lengths of those that finished lately
(``OutputBook``), by which a recompute's stall is judged; MD's and RLD's time per
token are what the requests each finished saw, fitted against how many were in flight there when
each was admitted and read at the count now (``TpotBook``), and RLD's share of their tokens is
held under ``rld_token_budget`` (``RoutingPolicy``). A request no
option serves within the SLO is refused at once (``router.admission.Overloaded``, reason
``tpot_unreachable`` or ``deadline_unreachable``), as one that misses its deadline is.
"""

from __future__ import annotations

from typing import Any, Protocol

from pddlink.routing import (
    DecisionReason,
    MdRun,
    OptionDecision,
    OptionInputs,
    Pipeline,
    RoutingInputs,
    RoutingPolicy,
    choose_option,
)
from pddlink.routing.books import PrefillBook, TpotBook
from pddlink.routing.link import WAN_SHARE_OF_DEADLINE
from pddlink.routing.options import Option
from pddlink.routing.outputs import OutputBook

FAST_PATH_BYTES_S = 1e9  # the fast path to RLD (RDMA, or TCP inside datacenter A): ~8 Gbit/s
EXTEND_S = 0.02  # MD's extend step for a handoff's token ids (reference engine, tiny model)


class RouterState(Protocol):
    policy: RoutingPolicy
    p_book: PrefillBook
    md_book: PrefillBook
    md_tpot: TpotBook
    outputs: OutputBook

    @property
    def cfg(self) -> Any: ...


def decide_option(
    router: RouterState,
    routing: RoutingInputs,
    deadline_s: float,
    md_running: int = 0,
    md_runs: tuple[MdRun, ...] = (),
) -> OptionDecision:
    """``choose_option`` on what the router knows; ``md_running``: the requests the chosen MD runs,
    ``md_runs``: their output bounds (``max_tokens``) and the tokens each has produced."""
    inputs = option_inputs(router, routing, deadline_s, md_running, md_runs)
    return choose_option(inputs, router.policy)


def option_inputs(
    router: RouterState,
    routing: RoutingInputs,
    deadline_s: float,
    md_running: int = 0,
    md_runs: tuple[MdRun, ...] = (),
) -> OptionInputs:
    cfg = router.cfg
    p = router.p_book
    return OptionInputs(
        routing,
        deadline_s=WAN_SHARE_OF_DEADLINE * deadline_s if cfg.admission else None,
        ttft_deadline_s=cfg.slo_ttft_ms / 1e3 if cfg.slo_ttft_ms else None,
        p_prefill_s=p.queue_s() + p.prefill_s(routing.missing_tokens),
        fast_s=routing.prompt_tokens * routing.kv_bytes_per_token / FAST_PATH_BYTES_S,
        md_prefill=router.md_book.estimate() if cfg.recompute else None,
        md_tpot_s=router.md_tpot.estimate(md_running),
        extend_s=EXTEND_S,
        tpot_bound_s=cfg.slo_tpot_ms / 1e3 if cfg.slo_tpot_ms else None,
        md_running=md_running,
        md_outputs=router.outputs.lengths(),
        md_runs=md_runs,
        rld_token_share=router.outputs.rld_share(),
        rld_miss_share=router.outputs.relay_miss_share(),
    )


FORCEABLE = {
    Pipeline.P_MD.value: Option.SHIP,
    Pipeline.P_RLD_MD.value: Option.RELAY,
    Pipeline.SINGULAR.value: Option.SINGULAR,
    **{o.value: o for o in Option},
}


def forced_option(routing: RoutingInputs, forced: str, policy: RoutingPolicy) -> OptionDecision:
    """The client named the pipeline (its KV-shipping option) or the option: admitted as asked."""
    option = FORCEABLE[forced]
    shipped = routing.wan_bytes if option.ships_kv else 0
    return OptionDecision(
        option, DecisionReason.FORCED, shipped, routing.link.transfer_s(routing.wan_bytes), ()
    )


def option_trace(decision: OptionDecision) -> dict[str, Any]:
    """Why this request went where it went: the option, the reason, and every option's estimate."""
    return {
        "option": decision.option.value if decision.option else "rejected",
        "option_estimates": {
            e.option.value: {
                "ttft_s": round(e.ttft_s, 4),
                "md_ready_s": round(e.md_ready_s, 4) if e.md_ready_s != float("inf") else None,
                "finish_s": round(e.finish_s, 4),
                "rld_tokens": round(e.rld_tokens, 1),
                "tpot_s": round(e.tpot_s, 4),
                "md_batch_tpot_s": round(e.md_batch_tpot_s, 4),
                "md_pushed_over": round(e.md_pushed_over, 3),
            }
            for e in decision.estimates
        },
    }
