"""What the router's run decides under a fault, without processes: the simulator's view of fallbacks.

``predict`` drives the real ``RequestRun`` against a scripted world: P answers every Prefill at
once (MD and RLD reached as ``Faults`` says), the decoder that holds the request streams its
tokens one by one, RLD hands over to MD after ``handoff_after`` tokens, and a decoder is lost after
the number of tokens ``Faults`` gives. The world reacts to the machine's commands (new legs,
takeovers, cancels) the way the sidecars do, so the prediction is the machine's own decision: which
fallbacks, which decoder produced which tokens, how the request ends.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pddlink.lifecycle.events import (
    CancelStreams,
    HandoffDone,
    OpenStream,
    PrefillDone,
    PrefillReport,
    RunCommand,
    RunEvent,
    SendPrefill,
    StartHandoff,
    StreamEnded,
    TakeOver,
    TokenArrived,
)
from pddlink.lifecycle.outcomes import (
    FailReason,
    Fallback,
    HandoffOutcome,
    HandoffResult,
    RunOutcome,
    StreamClosed,
    StreamEnd,
)
from pddlink.lifecycle.run import RequestRun, RunState
from pddlink.lifecycle.trace import RunSpec
from pddlink.roles import Role
from pddlink.routing import Pipeline
from pddlink.sampling import SamplingParams

LOST = StreamClosed(StreamEnd.FAILED, "unavailable")
STEP_S = 0.01  # one event per step of the scripted world


@dataclass(frozen=True, slots=True)
class Faults:
    md_reachable: bool = True  # P's WAN shipment arrives (False: unreachable, or past its deadline)
    rld_reachable: bool = True  # P's fast-path shipment arrives
    rld_usable: bool = True  # the router's view of RLD
    handoff_ok: bool = True  # RLD's StartHandoff succeeds
    handoff_after: int = 2  # tokens RLD streams before it hands over
    md_lost_after: int | None = None  # MD's stream breaks after this many of its tokens
    rld_lost_after: int | None = None


@dataclass(frozen=True, slots=True)
class Prediction:
    outcome: RunOutcome
    reason: FailReason | None
    fallbacks: tuple[Fallback, ...]
    tokens: tuple[tuple[str, int], ...]  # (decoder, tokens it streamed) as the client saw them
    legs: int


class _World:
    """The sidecars, scripted by ``Faults``: which streams are open, who holds the KV, who is dead."""

    def __init__(self, run: RequestRun, faults: Faults, prompt_len: int) -> None:
        self.run, self.f, self.base = run, faults, prompt_len
        self.pending: list[RunEvent] = []
        self.open: dict[Role, str] = {}  # decoder -> the sid of its open stream
        self.has_kv: set[Role] = set()
        self.dead: set[Role] = set()
        self.streamed: Counter[Role] = Counter()
        self.handoff_due = False

    def apply(self, cmds: list[RunCommand]) -> None:
        for c in cmds:
            if isinstance(c, OpenStream):
                self.open[c.on] = c.leg.sid
                self.has_kv.discard(c.on)
                if c.on in self.dead:
                    self._lose(c.on)
            elif isinstance(c, SendPrefill):
                md_ok = not c.ship_to_md or (self.f.md_reachable and Role.MD not in self.dead)
                rld_ok = not c.ship_to_rld or (self.f.rld_reachable and Role.RLD not in self.dead)
                for role, ok, ships in ((Role.MD, md_ok, c.ship_to_md), (Role.RLD, rld_ok, c.ship_to_rld)):
                    if ok and ships:
                        self.has_kv.add(role)
                first = self.base + self.run.merger.generated
                self.pending.append(PrefillDone(c.leg.sid, PrefillReport(1000 + first, md_ok, rld_ok)))
            elif isinstance(c, StartHandoff):
                self.handoff_due = True
            elif isinstance(c, TakeOver):
                self.has_kv.add(Role.MD)
            elif isinstance(c, CancelStreams):
                self.open.pop(c.on, None)

    def _lose(self, role: Role) -> None:
        self.dead.add(role)
        sid = self.open.pop(role)
        self.pending.append(StreamEnded(sid, role, LOST))

    def _producer(self) -> Role | None:
        for role in (Role.RLD, Role.MD):
            if role in self.open and role in self.has_kv:
                return role
        return None

    def next_event(self) -> RunEvent | None:
        if self.pending:
            return self.pending.pop(0)
        p, f = self._producer(), self.f
        if p is None:
            return None
        if p is Role.RLD and self.handoff_due and self.streamed[Role.RLD] >= f.handoff_after:
            self.handoff_due = False
            sid = self.open[Role.RLD]
            if not f.handoff_ok:
                return HandoffDone(sid, HandoffResult(HandoffOutcome.FAILED, "timeout"))
            self.open.pop(Role.RLD)
            self.pending.append(StreamEnded(sid, Role.RLD, StreamClosed(StreamEnd.HANDED_OFF)))
            return HandoffDone(sid, HandoffResult(HandoffOutcome.HANDED_OFF))
        lost_after = f.md_lost_after if p is Role.MD else f.rld_lost_after
        if lost_after is not None and self.streamed[p] >= lost_after:
            self._lose(p)
            return self.pending.pop(0)
        self.streamed[p] += 1
        m = self.run.merger
        position = self.base + m.generated
        return TokenArrived(self.open[p], p, position, 1000 + position, last=m.generated + 1 >= m.max_tokens)


def predict(
    pipeline: Pipeline, faults: Faults, *, prompt_tokens: int = 64, max_tokens: int = 16
) -> Prediction:
    """Run one request through ``RequestRun`` in the scripted world (see the module docstring)."""
    spec = RunSpec("sim", tuple(range(1, prompt_tokens + 1)), SamplingParams(max_tokens=max_tokens), 30.0,
                   pipeline, "sim", 0.0)  # fmt: skip
    run = RequestRun(spec, now=0.0, rld_usable=lambda now: faults.rld_usable)
    world, now = _World(run, faults, prompt_tokens), 0.0
    world.apply(run.start(now))
    while run.state is not RunState.ENDED:
        event = world.next_event()
        now += STEP_S
        if event is None:  # nothing comes any more: the machine's timer (deadline or grace) fires
            now = max(now, run.get_timer() or now)
            world.apply(run.handle_timer(now))
        else:
            world.apply(run.handle(event, now))
    trace = run.trace
    assert trace is not None
    return Prediction(trace.outcome, trace.reason, trace.fallbacks, trace.tokens, run.legs)
