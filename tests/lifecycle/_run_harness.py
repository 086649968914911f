"""An in-memory router run: a ``RequestRun`` on an injected clock, fed by hand like the sidecars
would, recording every command it gives. No processes, no sockets, no asyncio."""

from __future__ import annotations

from dataclasses import dataclass, field

from engines_adapter.base import SamplingParams
from pddlink.handoff import HandoffMode
from pddlink.lifecycle import (
    Emit,
    HandoffDone,
    HandoffResult,
    MdReady,
    PrefillDone,
    PrefillReport,
    RequestRun,
    RunCommand,
    RunEvent,
    RunSpec,
    RunTrace,
    StreamClosed,
    StreamEnded,
    TokenArrived,
)
from pddlink.roles import Role
from pddlink.routing import Option, Pipeline

PROMPT = (11, 12, 13, 14)  # the first generated token sits at position 4
BASE = len(PROMPT)


def tok(position: int) -> int:
    """The token id every instance samples at ``position`` (sampling is a function of position)."""
    return 1000 + position


@dataclass
class Run:
    pipeline: Pipeline
    max_tokens: int = 6
    deadline_s: float = 10.0
    rld_usable: bool = True
    rld_reachable: bool | None = None  # None: as rld_usable
    now: float = 100.0
    option: Option = Option.SHIP
    spares: frozenset[Role] = frozenset()  # roles with another instance in placement (pools)
    log: list[RunCommand] = field(default_factory=list)

    def __post_init__(self) -> None:
        spec = RunSpec(
            "r",
            PROMPT,
            SamplingParams(seed=7, temperature=0.8, max_tokens=self.max_tokens),
            self.deadline_s,
            self.pipeline,
            "test",
            0.5,
            option=self.option,
        )
        reachable = None if self.rld_reachable is None else (lambda now: bool(self.rld_reachable))
        self.m = RequestRun(
            spec,
            now=self.now,
            rld_usable=lambda now: self.rld_usable,
            rld_reachable=reachable,
            spare=lambda role, now: role in self.spares,
        )
        self.log += self.m.start(self.now)

    # -- feeding -------------------------------------------------------------------------------

    def feed(self, event: RunEvent, dt: float = 0.01) -> list[RunCommand]:
        self.now += dt
        out = self.m.handle(event, self.now)
        self.log += out
        return out

    def timer(self, at: float) -> list[RunCommand]:
        self.now = at
        out = self.m.handle_timer(at)
        self.log += out
        return out

    def cancel(self) -> list[RunCommand]:
        out = self.m.cancel(self.now)
        self.log += out
        return out

    def prefill(
        self, sid: str = "r", *, md_ok: bool = True, rld_ok: bool = True, **kw: object
    ) -> list[RunCommand]:
        first = BASE + len(self.emitted())
        report = PrefillReport(first_token=tok(first), md_ok=md_ok, rld_ok=rld_ok, wan_bytes=100, **kw)  # type: ignore[arg-type]
        return self.feed(PrefillDone(sid, report))

    def tokens(self, source: Role, positions: range | list[int], sid: str = "r") -> list[RunCommand]:
        out: list[RunCommand] = []
        last = BASE + self.max_tokens - 1
        for p in positions:
            out += self.feed(TokenArrived(sid, source, p, tok(p), last=p == last))
        return out

    def stream_end(
        self, source: Role, how: str, sid: str = "r", mode: HandoffMode | None = None
    ) -> list[RunCommand]:
        return self.feed(StreamEnded(sid, source, StreamClosed.parse(how), mode))

    def handoff(self, outcome: str, sid: str = "r", mode: HandoffMode | None = None) -> list[RunCommand]:
        return self.feed(HandoffDone(sid, HandoffResult.parse(outcome), mode))

    def md_ready(self, sid: str = "r", *, recompute_s: float = 0.05, cached: int = 0) -> list[RunCommand]:
        return self.feed(MdReady(sid, recompute_s, cached))

    # -- reading ---------------------------------------------------------------------------------

    def emitted(self) -> list[tuple[int, int, str]]:
        return [(c.token.position, c.token.token_id, c.token.source) for c in self.log if isinstance(c, Emit)]

    def of(self, kind: type) -> list[RunCommand]:
        return [c for c in self.log if isinstance(c, kind)]

    @property
    def trace(self) -> RunTrace:
        assert self.m.trace is not None, "the run has not ended"
        return self.m.trace

    def exact(self) -> bool:
        """Every output position once, in order, with the one-engine token."""
        want = [(p, tok(p)) for p in range(BASE, BASE + self.max_tokens)]
        return [(p, t) for p, t, _ in self.emitted()] == want
