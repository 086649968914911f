"""One request at the router, as a sans-I/O machine: legs, merge, fallbacks, deadline.

Theory of operation. ``start(now)`` opens the first leg: Attach streams on the decoders of its
pipeline (MD for P->MD, RLD and MD for P->RLD->MD, RLD for singular) and P's Prefill, which ships
the prompt's KV to them. The driver turns each command into an RPC and feeds back what the
sidecars answer as events (``handle(event, now)``); ``handle_timer(now)`` at ``get_timer()``. Tokens
from every leg go through one ``StreamMerger`` (each position once, in order) and come out as
``Emit`` commands. P's reply says which shipments arrived; on P->RLD->MD the run then asks RLD to
hand the request to MD. Whatever goes wrong is a ``Loss``, and the table in
``pddlink.lifecycle.fallbacks`` picks the recovery; each fallback taken is a ``FallbackTaken``
command and a line of the trace.

Ship or recompute (``RunSpec.option``): a recomputing first leg (``Leg.recompute``) asks MD to
prefill the prompt itself and P ships it nothing; MD's ``MdReady`` says it holds the KV. On relay
+ recompute the run asks RLD to hand over only once P replied *and* MD is ready; if MD is not
ready by ``HANDOFF_MARGIN_S`` before the deadline, the handoff counts as failed
(``md_recompute_late``) and RLD finishes. A WAN shipment that lost to its deadline is
``Loss.MD_CONGESTED`` (``wan_congested_*`` fallbacks), any other missed shipment
``Loss.MD_UNREACHABLE``.

MD stalls (``pddlink.lifecycle.stall``): while MD owes the request tokens (P's reply said it holds
the KV, its recompute is ready, RLD handed over, or MD took over) a ``StallWatch`` runs; no token
from MD for ``RunSpec.md_stall_s`` is ``Loss.MD_STALLED``: MD's stream is cancelled, ``MdStalled``
tells the router to keep new requests off MD, and the table's row recovers (a new leg on RLD from
the merged position while P holds the KV) or fails the run ``md_stalled`` -- before its deadline.
A WAN outage silences every MD stream at once, so the router then sends every other run
``MdSuspected``: a stream silent for ``stall.SUSPECT_S`` then counts as stalled too, at once
rather than a full bound later each (MD's next token ends the suspicion).

States (``RUN_TRANSITIONS``)::

    RUNNING --merged stream complete--> AWAITING_P_REPLY --P's reply or 1 s--> ENDED
    RUNNING --complete (P already replied) | failure | deadline | cancel--> ENDED
    AWAITING_P_REPLY --cancel | deadline--> ENDED

Pools (issue 26): ``spare(role, now)`` says whether the router has another instance of ``role``
in placement than the one this run uses. With one, a lost MD (unreachable, lost, stalled) or a
lost P (its Prefill failed before replying: ``Loss.P_LOST``) is
re-placed within its role: ``MoveOff(role)``, then a new leg from the merged position on (the
table's ``NEW_LEG_OTHER_*`` rows). Without one (a topology of one each) nothing changes.

A call of the run that raised unexpectedly (``LegCrashed``, posted by the driver when a leg's task
dies) fails the run at once, ``leg_crashed: <task>: <exception>``; no fallback is tried.

``AWAITING_P_REPLY``: on P->MD, MD can finish a short output before P's reply (bytes, RTT for the
trace) is in; it is moments away, so the run waits for it briefly. Events of a superseded leg other
than tokens are ignored; after ``ENDED`` every event is. ``RunEnded`` is the last command; ``trace``
then holds the frozen ``RunTrace``.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from pddlink.handoff import MergedToken, StreamMerger
from pddlink.lifecycle.events import (
    CancelStreams,
    DetachHandoff,
    Emit,
    FallbackTaken,
    HandoffDone,
    Leg,
    LegCrashed,
    MdReady,
    MdStalled,
    MdSuspected,
    MoveOff,
    OpenStream,
    PrefillDone,
    PrefillFailed,
    ReleaseRldSlot,
    RunCommand,
    RunEnded,
    RunEvent,
    SendPrefill,
    StartHandoff,
    StreamEnded,
    TakeOver,
    TakeoverFailed,
    TokenArrived,
)
from pddlink.lifecycle.fallbacks import Recovery, Situation, choose
from pddlink.lifecycle.outcomes import (
    FailReason,
    Fallback,
    HandoffOutcome,
    HandoffResult,
    Loss,
    RunOutcome,
    StreamEnd,
)
from pddlink.lifecycle.stall import StallWatch
from pddlink.lifecycle.trace import RunSpec, RunTrace, TraceBuilder
from pddlink.roles import Role
from pddlink.routing import Pipeline, RecomputeMode, md_miss_label

P_REPLY_GRACE_S = 1.0  # how long a finished P->MD run waits for P's reply (its trace fields)
HANDOFF_MARGIN_S = 0.1  # relay + recompute: MD must be ready this long before the deadline

USES_MD = frozenset({Pipeline.P_MD, Pipeline.P_RLD_MD})
USES_RLD = frozenset({Pipeline.P_RLD_MD, Pipeline.SINGULAR})


class RunState(Enum):
    RUNNING = "running"
    AWAITING_P_REPLY = "awaiting_p_reply"
    ENDED = "ended"


RUN_TRANSITIONS: dict[RunState, frozenset[RunState]] = {
    RunState.RUNNING: frozenset({RunState.AWAITING_P_REPLY, RunState.ENDED}),
    RunState.AWAITING_P_REPLY: frozenset({RunState.ENDED}),
    RunState.ENDED: frozenset(),
}

_LOSS_REASON = {
    Loss.MD_UNREACHABLE: FailReason.MD_UNREACHABLE,
    Loss.MD_CONGESTED: FailReason.MD_CONGESTED,
    Loss.RLD_UNREACHABLE: FailReason.RLD_UNREACHABLE,
    Loss.RLD_LOST: FailReason.RLD_LOST,
    Loss.MD_LOST: FailReason.MD_LOST,
    Loss.MD_STALLED: FailReason.MD_STALLED,
    Loss.P_LOST: FailReason.P_UNAVAILABLE,
}


class RequestRun:
    """The run of one request; see the module docstring. ``rld_usable(now)`` is the router's
    current view of RLD (relay enabled and not marked down); ``rld_reachable(now)`` (default: the
    same) whether RLD can take a rescue after MD is lost: a cool-down that keeps new requests off
    RLD after one failed there must not turn a request MD has already lost into a certain failure
    (issue 16, chaos: in a long outage on a loaded host one slow fast-path transfer marked RLD down,
    and MD's losses then failed with no fallback). ``spare(role, now)`` (default: never): another
    instance of P or MD than the run's own is in placement, so a loss of it re-places the run."""

    def __init__(
        self,
        spec: RunSpec,
        *,
        now: float,
        rld_usable: Callable[[float], bool],
        rld_reachable: Callable[[float], bool] | None = None,
        spare: Callable[[Role, float], bool] | None = None,
    ) -> None:
        self.spec = spec
        self.spare = spare or (lambda role, now: False)
        self.rld_usable = rld_usable
        self.rld_reachable = rld_reachable or rld_usable
        self.t_start = now
        self.deadline = now + spec.deadline_s
        self.base = len(spec.prompt)
        self.merger = StreamMerger(self.base, spec.sampling.max_tokens)
        self.state = RunState.RUNNING
        self.legs = 0
        self.leg: Leg | None = None
        self.first_token: int | None = None  # the current leg's, from P's reply
        self.md_ok: bool | None = None  # the current leg's shipments, from P's reply
        self.rld_ok: bool | None = None
        self.md_alive = False
        self.rld_alive = False
        self.rld_handed_off = False
        self.md_ready = False  # a recomputing leg: MD's ready event arrived (it holds the prompt)
        self.handoff_waits_until: float | None = None  # P replied; StartHandoff waits for MD's ready
        self.handoff_asked = False  # StartHandoff went out for the current leg
        self.md_watch = StallWatch(spec.md_stall_s)  # armed while MD owes the request tokens
        self.notes = TraceBuilder(spec)
        self.reason: FailReason | None = None
        self.detail = ""
        self.trace: RunTrace | None = None
        self._grace_until = 0.0
        self._out: list[RunCommand] = []

    # -- inputs ----------------------------------------------------------------------------------

    def start(self, now: float) -> list[RunCommand]:
        self._start_leg(self.spec.pipeline)
        return self._drain()

    def get_timer(self) -> float | None:
        if self.state is RunState.RUNNING:
            timers = (self.deadline, self.handoff_waits_until, self.md_watch.due())
            return min(t for t in timers if t is not None)
        if self.state is RunState.AWAITING_P_REPLY:
            return self._grace_until
        return None

    def handle_timer(self, now: float) -> list[RunCommand]:
        if self.state is RunState.AWAITING_P_REPLY and now >= self._grace_until:
            self._end(now)
        elif self.state is not RunState.RUNNING:
            pass
        elif now >= self.deadline:
            self._fail(FailReason.DEADLINE_EXCEEDED)
            self._end(now)
        elif self.handoff_waits_until is not None and now >= self.handoff_waits_until:
            assert self.leg is not None  # MD's recompute is late: RLD finishes the request
            self.handoff_waits_until = None
            late = HandoffDone(self.leg.sid, HandoffResult(HandoffOutcome.FAILED, "md_recompute_late"))
            self._on_handoff(late, now)
            self._after(now)
        elif self.md_watch.stalled(now):
            self._md_stalled(now)
            self._after(now)
        return self._drain()

    def cancel(self, now: float) -> list[RunCommand]:
        """The client went away: the run ends at once (``cancelled`` unless already complete)."""
        if self.state is not RunState.ENDED:
            self._end(now)
        return self._drain()

    def handle(self, event: RunEvent, now: float) -> list[RunCommand]:
        if self.state is RunState.ENDED:
            return []
        if isinstance(event, StreamEnded) and event.handoff_mode is not None:
            self.notes.handoff_mode = event.handoff_mode  # whichever leg's stream says it
        if isinstance(event, MdSuspected):
            if self.state is RunState.RUNNING and self.md_alive:
                self.md_watch.suspected(now)
                if self.md_watch.stalled(now):
                    self._md_stalled(now, broadcast=False)
                    self._after(now)
            return self._drain()
        if self.state is RunState.AWAITING_P_REPLY:
            current = self.leg is not None and event.sid == self.leg.sid
            if isinstance(event, PrefillDone) and current:
                self._on_prefill(event)
                self._end(now)
            elif isinstance(event, LegCrashed) and current:
                self._end(now)  # P's reply will not come: the output is complete, end now
            return self._drain()
        if not isinstance(event, TokenArrived) and self.leg is not None and event.sid != self.leg.sid:
            return []  # a superseded leg: its tokens still count (positions), nothing else does
        _HANDLERS[type(event)](self, event, now)
        self._after(now)
        return self._drain()

    # -- event handlers ------------------------------------------------------------------------

    def _on_token(self, ev: TokenArrived, now: float) -> None:
        out: list[MergedToken] = self.merger.offer(ev.position, ev.token_id, ev.source.value, last=ev.last)
        if ev.source is Role.MD and self.md_alive and self.leg is not None and ev.sid == self.leg.sid:
            self.md_watch.arm(now)  # MD streams: it owes the next token within the bound
        if out and self.notes.ttft_s is None:
            self.notes.ttft_s = now - self.t_start
        self._out.extend(Emit(t) for t in out)

    def _on_stream_end(self, ev: StreamEnded, now: float) -> None:
        end = ev.closed.end
        if ev.source is Role.RLD:
            self._rld_gone()
            if end in (StreamEnd.HANDED_OFF, StreamEnd.FINISHED) or self.merger.finished:
                return
            self._loss(Loss.RLD_LOST, ev.closed.render(), now)
            return
        self.md_alive = False
        self.md_watch.disarm()
        if end in (StreamEnd.FINISHED, StreamEnd.RELEASED) or self.merger.finished:
            return
        self._loss(Loss.MD_LOST, ev.closed.render(), now)

    def _on_prefill(self, ev: PrefillDone, now: float = 0.0) -> None:
        r = ev.report
        recompute = self.leg is not None and self.leg.recompute is not RecomputeMode.NONE
        self.first_token, self.rld_ok = r.first_token, r.rld_ok
        self.md_ok = r.md_ok or recompute  # a recomputing MD prefills the prompt itself
        self.notes.on_prefill(r, recompute=recompute)
        if self.merger.finished or self.state is not RunState.RUNNING:
            return  # only the trace fields matter now
        assert self.leg is not None
        pipeline = self.leg.pipeline
        if pipeline in USES_MD and not self.md_ok:
            self._cancel(Role.MD)
            congested = md_miss_label(r.md_error) == FailReason.MD_CONGESTED.value  # a full line
            self._loss(Loss.MD_CONGESTED if congested else Loss.MD_UNREACHABLE, r.md_error, now)
        elif pipeline is Pipeline.P_RLD_MD and (not r.rld_ok or not self.rld_alive):
            self._loss(Loss.RLD_UNREACHABLE, r.rld_error, now)
        elif pipeline is Pipeline.P_RLD_MD and recompute and not self.md_ready:
            self.handoff_waits_until = self.deadline - HANDOFF_MARGIN_S  # hand over once MD is ready
        elif pipeline is Pipeline.P_RLD_MD:
            self._start_handoff(self.leg.sid)
        elif pipeline is Pipeline.SINGULAR and not r.rld_ok:
            self._loss(Loss.RLD_UNREACHABLE, r.rld_error, now)
        if pipeline is Pipeline.P_MD and self.md_alive and r.md_ok and not recompute:
            self.md_watch.arm(now)  # MD holds the KV: its tokens are due

    def _start_handoff(self, sid: str) -> None:
        self.handoff_asked = True
        self._out.append(StartHandoff(sid))

    def _on_md_ready(self, ev: MdReady, now: float) -> None:
        self.md_ready = True
        if self.md_alive and self.leg is not None and self.leg.pipeline is Pipeline.P_MD:
            self.md_watch.arm(now)  # MD holds the prompt's KV (its own prefill): its tokens are due
        self.notes.md_recompute_s = ev.recompute_s
        self.notes.md_cached_tokens = ev.cached_tokens
        if self.handoff_waits_until is not None and self.leg is not None:
            self.handoff_waits_until = None
            if self.rld_alive and not self.merger.finished:
                self._start_handoff(self.leg.sid)

    def _on_prefill_failed(self, ev: PrefillFailed, now: float) -> None:
        self._loss(Loss.P_LOST, ev.detail, now)

    def _on_handoff(self, ev: HandoffDone, now: float) -> None:
        self.notes.handoff = ev.result
        if ev.mode is not None:
            self.notes.handoff_mode = ev.mode
        outcome = ev.result.outcome
        if outcome is HandoffOutcome.HANDED_OFF:
            self.rld_handed_off = True
            if self.md_alive:
                self.md_watch.arm(now)  # MD continues the request: its tokens are due
            return
        if outcome is not HandoffOutcome.FINISHED_ON_RLD:
            self._fallback(Fallback.HANDOFF_FAILED_RLD_FINISHES)
        self._cancel(Role.MD)

    def _on_takeover_failed(self, ev: TakeoverFailed, now: float) -> None:
        self._loss(Loss.MD_LOST, f"md_takeover_failed:{ev.detail}", now)

    def _on_leg_crashed(self, ev: LegCrashed, now: float) -> None:
        # no fallback: a call that raised is a fault of the router's own (or an answer it cannot
        # read), which another leg would meet again; the deadline is no time to wait for it
        self._fail(FailReason.LEG_CRASHED, f"{ev.task}: {ev.error}")

    # -- losses and recoveries -----------------------------------------------------------------

    def situation(self, now: float) -> Situation:
        assert self.leg is not None
        return Situation(
            pipeline=self.leg.pipeline,
            md_ok=self.md_ok,
            rld_ok=self.rld_ok,
            md_alive=self.md_alive,
            rld_alive=self.rld_alive,
            rld_handed_off=self.rld_handed_off,
            rld_usable=self.rld_usable(now),
            rld_reachable=self.rld_reachable(now),
            legs=self.legs,
            md_spare=self.spare(Role.MD, now),
            p_spare=self.spare(Role.P, now),
        )

    def _loss(self, loss: Loss, detail: str, now: float) -> None:
        if loss is Loss.MD_LOST:
            self.md_alive = False
            self.md_watch.disarm()
        fallback, recovery = choose(loss, self.situation(now))
        if fallback is not None:
            self._fallback(fallback)
        _RECOVERIES[recovery](self, loss, detail)
        if recovery is Recovery.MD_TAKES_OVER:
            self.md_watch.arm(now)  # MD continues the request: its tokens are due

    def _md_stalled(self, now: float, *, broadcast: bool = True) -> None:
        """``broadcast``: tell the router (``MdStalled``), which suspects MD in every other run; a
        stall found by that suspicion is not told again (one stall, not a cascade of them)."""
        silent = now - (self.md_watch.since or now)
        self.md_watch.disarm()
        if broadcast:
            self._out.append(MdStalled(silent))
        self._cancel(Role.MD)
        self._loss(Loss.MD_STALLED, f"no token from MD for {silent:.1f} s", now)

    def _rld_finishes(self, loss: Loss, detail: str) -> None:
        if loss in (Loss.MD_LOST, Loss.MD_STALLED):
            self._out.append(DetachHandoff())

    def _md_takes_over(self, loss: Loss, detail: str) -> None:
        assert self.leg is not None
        leg = self.leg
        if loss is Loss.RLD_UNREACHABLE:
            self._cancel(Role.RLD)
        given = list(self.merger.emitted) or ([self.first_token] if self.first_token is not None else [])
        first = len(leg.prompt)
        ids = tuple(given[first - self.base :])
        self._out.append(TakeOver(leg, first, ids, emit_given=not self.merger.emitted))

    def _wait_for_p(self, loss: Loss, detail: str) -> None:
        self.rld_ok = False  # MD takes over once P's reply says it holds the KV

    def _new_leg_p_rld(self, loss: Loss, detail: str) -> None:
        self._start_leg(Pipeline.SINGULAR)

    def _new_leg_p_md(self, loss: Loss, detail: str) -> None:
        self._start_leg(Pipeline.P_MD)

    def _new_leg_other_md(self, loss: Loss, detail: str) -> None:
        """Another MD: P->MD from the merged position (RLD's stream, if any, is released: the
        request ends on an MD)."""
        self._cancel(Role.MD)
        self._cancel(Role.RLD)
        self._out.append(DetachHandoff())  # a handoff to the lost MD in progress: no longer ours
        self._out.append(MoveOff(Role.MD))
        self._start_leg(Pipeline.P_MD)

    def _new_leg_other_p(self, loss: Loss, detail: str) -> None:
        """Another P: the same pipeline; the decoders of this leg wait for KV the lost P will not
        send, so they are released and the new leg opens its own."""
        assert self.leg is not None
        pipeline = self.leg.pipeline
        if pipeline in USES_MD:
            self._cancel(Role.MD)
        if pipeline in USES_RLD:
            self._cancel(Role.RLD)
        self._out.append(MoveOff(Role.P))
        self._start_leg(pipeline)

    def _fail_with(self, loss: Loss, detail: str) -> None:
        self._fail(_LOSS_REASON[loss], detail)

    # -- plumbing ----------------------------------------------------------------------------------

    def _start_leg(self, pipeline: Pipeline) -> None:
        """A (sub-)request from the merged position on: prompt + tokens already streamed."""
        self.legs += 1
        done = tuple(self.merger.emitted)
        s = self.spec.sampling
        sampling = s.after(len(done))  # every field carried: vLLM's too
        rid = self.spec.request_id
        sid = rid if self.legs == 1 else f"{rid}#{self.legs}"
        # ship or recompute: only the first leg recomputes (a fallback leg ships KV as before)
        recompute = RecomputeMode.of(self.spec.option) if self.legs == 1 else RecomputeMode.NONE
        leg = self.leg = Leg(sid, self.spec.prompt + done, sampling, pipeline, recompute)
        self.first_token = self.md_ok = self.rld_ok = None
        self.md_ready, self.handoff_waits_until, self.handoff_asked = False, None, False
        self.md_watch.disarm()
        if recompute is RecomputeMode.AND_DECODE:
            # MD prefills and streams itself; P prefills too, shipping nothing, so its own prefix
            # cache keeps seeing every prompt (P's and MD's caches stay aligned)
            self.md_ok = True
        if pipeline in USES_MD:
            self.md_alive = True
            self._out.append(OpenStream(Role.MD, leg))
        if pipeline in USES_RLD:
            self.rld_alive = True
            self._out.append(OpenStream(Role.RLD, leg))
        ships = pipeline in USES_MD and recompute is RecomputeMode.NONE
        uses_rld = pipeline in USES_RLD
        self._out.append(
            SendPrefill(leg, ships, uses_rld, first_token_to_md=pipeline is Pipeline.P_MD and ships)
        )

    def _cancel(self, role: Role) -> None:
        self._out.append(CancelStreams(role))
        if role is Role.MD:
            self.md_alive = False
            self.md_watch.disarm()
        else:
            self._rld_gone()

    def _rld_gone(self) -> None:
        if self.rld_alive:
            self.rld_alive = False
            self._out.append(ReleaseRldSlot())

    def _fallback(self, fallback: Fallback) -> None:
        self.notes.fallbacks.append(fallback)
        self._out.append(FallbackTaken(fallback))

    def _fail(self, reason: FailReason, detail: str = "") -> None:
        if self.reason is None:
            self.reason, self.detail = reason, detail

    def _after(self, now: float) -> None:
        if self.reason is not None:
            self._end(now)
        elif self.merger.finished:
            if self.leg is not None and self.leg.pipeline is Pipeline.P_MD and self.md_ok is None:
                self._to(RunState.AWAITING_P_REPLY)
                self._grace_until = now + min(P_REPLY_GRACE_S, max(self.deadline - now, 0.0))
            else:
                self._end(now)

    def _to(self, state: RunState) -> None:
        if state not in RUN_TRANSITIONS[self.state]:
            raise AssertionError(f"run {self.spec.request_id}: {self.state.name} -> {state.name}")
        self.state = state

    def _end(self, now: float) -> None:
        self._to(RunState.ENDED)
        self._rld_gone()
        finished = self.merger.finished
        if not finished and self.reason is None:
            self.reason = FailReason.CANCELLED
        if self.spec.pipeline is Pipeline.P_RLD_MD and self.notes.handoff is None:
            # no answer to StartHandoff came: RLD finished before MD was ready, or (asked) before
            # the handoff it had begun was through (a catch-up whose last slice was not yet due)
            asked = self.handoff_asked
            self.notes.handoff = HandoffResult(
                HandoffOutcome.FINISHED_ON_RLD if asked else HandoffOutcome.NOT_STARTED
            )
        outcome = RunOutcome.FINISHED if finished else RunOutcome.FAILED
        self.trace = self.notes.freeze(
            outcome=outcome,
            reason=None if finished else self.reason,
            detail="" if finished else self.detail,
            e2e_s=now - self.t_start,
            tokens=dict(self.merger.by_source),
            output_tokens=self.merger.generated,
            divergences=self.merger.divergences,
        )
        self._out.append(RunEnded(outcome))

    def _drain(self) -> list[RunCommand]:
        out, self._out = self._out, []
        return out


_HANDLERS: dict[type, Callable[[RequestRun, object, float], None]] = {
    TokenArrived: RequestRun._on_token,  # type: ignore[dict-item]
    StreamEnded: RequestRun._on_stream_end,  # type: ignore[dict-item]
    PrefillDone: RequestRun._on_prefill,  # type: ignore[dict-item]
    PrefillFailed: RequestRun._on_prefill_failed,  # type: ignore[dict-item]
    HandoffDone: RequestRun._on_handoff,  # type: ignore[dict-item]
    TakeoverFailed: RequestRun._on_takeover_failed,  # type: ignore[dict-item]
    MdReady: RequestRun._on_md_ready,  # type: ignore[dict-item]
    LegCrashed: RequestRun._on_leg_crashed,  # type: ignore[dict-item]
}

_RECOVERIES: dict[Recovery, Callable[[RequestRun, Loss, str], None]] = {
    Recovery.RLD_FINISHES: RequestRun._rld_finishes,
    Recovery.MD_TAKES_OVER: RequestRun._md_takes_over,
    Recovery.WAIT_FOR_P: RequestRun._wait_for_p,
    Recovery.NEW_LEG_P_RLD: RequestRun._new_leg_p_rld,
    Recovery.NEW_LEG_P_MD: RequestRun._new_leg_p_md,
    Recovery.NEW_LEG_OTHER_MD: RequestRun._new_leg_other_md,
    Recovery.NEW_LEG_OTHER_P: RequestRun._new_leg_other_p,
    Recovery.FAIL: RequestRun._fail_with,
}
