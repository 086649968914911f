"""Ship or recompute, the sidecar side: how MD is asked to prefill a prompt itself, and what the
router learns from it.

``RecomputeMode`` is the Attach request's ``recompute`` field (values fixed by the proto): NONE (the
KV arrives from P), AND_DECODE (``Option.RECOMPUTE``: MD prefills, streams the first token and
decodes) or FOR_HANDOFF (``Option.RELAY_RECOMPUTE``: MD prefills while RLD streams; RLD's token ids
follow as in any handoff). MD answers with a ``ready`` event on the Attach stream once it holds
the prompt's KV, carrying the prefill's time and how much of the prompt its own cache supplied.

``PrefillBook`` is the router's view of MD's prefill (and of P's): its cost (a fixed time plus a
per-token rate fitted to what the ready events report, the configured rate until then) and the work
it has queued (recomputes sent and not yet ready), which ``pddlink.routing.MdPrefill`` turns into a
queue time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pddlink.errors import InvalidInput
from pddlink.routing import MdPrefill, RecomputeMode

__all__ = ["LineFit", "PrefillBook", "RecomputeMode", "StallLedger", "TpotBook"]


# The prefill fit's memory and its conditions: each prefill weighs PREFILL_WEIGHT against what
# came before; ``seconds = fixed + tokens / rate`` is fitted once PREFILL_MIN_SAMPLES were seen with
# a spread of prompt lengths of at least PREFILL_SPREAD (their variance: 64 tokens' deviation).
PREFILL_WEIGHT = 1 / 32
PREFILL_MIN_SAMPLES = 8
PREFILL_SPREAD = 64.0**2


@dataclass(slots=True)
class LineFit:
    """``y = a + b * x`` by exponentially weighted least squares (each sample weighs ``weight``
    against the decayed sum of those before it), with ``b >= 0``; ``a >= 0`` too when asked
    (``nonnegative_intercept``: the line through the origin then). None until ``min_samples`` were
    seen with a variance of ``x`` of at least ``min_var``. Sans-I/O; what ``TpotBook`` (TPOT against
    MD's running count) and ``PrefillBook`` (prefill seconds against tokens) both fit."""

    weight: float
    min_samples: int
    min_var: float
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # weighted n, x, y, xx, xy
    _samples: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.weight <= 1 or self.min_samples < 2 or self.min_var <= 0:
            raise InvalidInput("line fit: weight in (0, 1], min_samples >= 2 and min_var > 0 required")

    def add(self, x: float, y: float) -> None:
        keep = 1 - self.weight
        self._sums = [keep * s + v for s, v in zip(self._sums, (1.0, x, y, x * x, x * y), strict=True)]
        self._samples += 1

    def line(self, nonnegative_intercept: bool = False) -> tuple[float, float] | None:
        """``(a, b)``, or None while the samples are too few or too alike to fit."""
        w, sx, sy, sxx, sxy = self._sums
        if self._samples < self.min_samples or w <= 0:
            return None
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        if var < self.min_var:
            return None
        b = max(0.0, (sxy / w - mx * my) / var)
        a = my - b * mx
        if nonnegative_intercept and a < 0:
            a, b = 0.0, max(0.0, sxy / sxx)  # the constrained optimum sits on a = 0
        return a, b


@dataclass(slots=True)
class PrefillBook:
    """A prefill engine's speed and queued work as the router sees them (MD's recomputes, P's
    prefills). Sans-I/O.

    A prefill's time is a fixed cost plus a per-token one: in wan-overload (2026-12-04) MD's small
    recomputes (17-42 tokens) took 12-20 ms, large ones ~3,700 tokens/s. A mean of tokens / seconds
    mixes the two, so the small ones pulled MD's rate to ~2,000 tokens/s and a 644-token prompt was
    estimated at 0.30 s against 0.17 s measured. So the book fits ``seconds = fixed_s + tokens /
    rate`` to what the replies report (``LineFit``: exponentially weighted, ``fixed_s >= 0``, rate
    > 0); until that fit holds (enough prefills of spread lengths) ``tokens_per_s``, the exponentially
    weighted mean of tokens / seconds starting from the configured figure, stands alone."""

    tokens_per_s: float
    ewma_weight: float = 0.3
    _queued: dict[str, int] = field(default_factory=dict)  # request id -> tokens it must prefill
    _fit: LineFit = field(
        default_factory=lambda: LineFit(PREFILL_WEIGHT, PREFILL_MIN_SAMPLES, PREFILL_SPREAD)
    )

    def __post_init__(self) -> None:
        if self.tokens_per_s <= 0 or not 0 < self.ewma_weight <= 1:
            raise InvalidInput("md prefill: tokens_per_s > 0 and ewma_weight in (0, 1] required")

    def start(self, request_id: str, tokens: int) -> None:
        self._queued[request_id] = max(0, tokens)

    def ready(self, request_id: str, prefilled_tokens: int, seconds: float) -> None:
        """That prefill is done (MD's ready event, P's reply); its time teaches the fit (and its
        rate the mean)."""
        self._queued.pop(request_id, None)
        if prefilled_tokens >= 1 and seconds > 0:
            self._fit.add(float(prefilled_tokens), seconds)
        if prefilled_tokens >= 16 and seconds > 0:
            w = self.ewma_weight
            self.tokens_per_s = (1 - w) * self.tokens_per_s + w * (prefilled_tokens / seconds)

    def finish(self, request_id: str) -> None:
        self._queued.pop(request_id, None)

    def cost(self) -> tuple[float, float]:
        """``(fixed_s, tokens_per_s)``: the fit where it holds (a per-token rate > 0), else no
        fixed cost and the mean rate."""
        line = self._fit.line(nonnegative_intercept=True)
        if line is None or line[1] <= 0:
            return 0.0, self.tokens_per_s
        return line[0], 1.0 / line[1]

    def prefill_s(self, tokens: int) -> float:
        """How long prefilling ``tokens`` takes there (0 tokens: nothing to do)."""
        if tokens <= 0:
            return 0.0
        fixed, rate = self.cost()
        return fixed + tokens / rate

    @property
    def queued_tokens(self) -> int:
        return sum(self._queued.values())

    def queue_s(self) -> float:
        """The queued prefills' time, each paying the fixed cost."""
        fixed, rate = self.cost()
        return sum(fixed + t / rate for t in self._queued.values() if t > 0)

    def estimate(self) -> MdPrefill:
        fixed, rate = self.cost()
        return MdPrefill(rate, self.queue_s(), fixed_s=fixed)


# The batch model's memory: each finished request weighs this much against what came before (about
# the last 1 / BATCH_WEIGHT requests count); it fits only once this many have been seen and MD's
# in-flight count varied among them by at least BATCH_SPREAD (its variance).
BATCH_WEIGHT = 1 / 32
BATCH_MIN_SAMPLES = 8
BATCH_SPREAD = 0.25


@dataclass(slots=True)
class TpotBook:
    """An instance's time per output token as the router sees it: an exponentially weighted mean over
    the requests whose every token it decoded (``source``: "md", or "rld" for relayed requests RLD
    finished; their stream's time after the first token per token), so a starved MD makes shipping
    and recompute look as slow as they are against the deadline and the TPOT bound.

    ``estimate(running)``: what a new request would get with ``running`` requests already in flight
    there. A request's TPOT follows how many share the instance with it: in wan-overload (demo run
    of 2026-12-04, unbounded recompute) requests that found 0 others on MD decoded at 5.4 ms per
    token, 1-3 others 7.7-8.3 ms, 4-5 others 11.4-12.8 ms, where the mean over all was 8.5 ms; a
    mean alone refused requests at an idle MD after a busy spell and admitted them at a full one.
    So each finished request's trace also says how many were in flight on its instance when it was
    admitted (``md_running``, the router's count, what ``estimate`` is asked with), and the book
    fits ``tpot = a + b * running`` to those pairs (exponentially weighted least squares, ``b >=
    0``); until it has enough spread to fit, the mean stands. The stalls MD's recomputes put
    into a request's decode (``md_stall_s``, from ``StallLedger``) are taken out: the book is MD's
    decode speed, as the simulator's is, and the TPOT bound charges each recompute's stall on top of
    it (a book that kept past stalls in charged them twice: wan-overload's bounded router refused
    16 requests predicting 7-11 ms where unbounded recompute measured 5.0 ms). An instance running
    nothing decodes at its unloaded speed (at most the configured ``tpot_s`` it started from),
    whatever the last requests saw: without that, a bound that keeps every request off a slow
    instance would never see it recover, since only finished requests teach the book."""

    tpot_s: float
    ewma_weight: float = 0.2
    source: str = "md"
    idle_tpot_s: float = 0.0  # set from tpot_s on construction
    _fit: LineFit = field(default_factory=lambda: LineFit(BATCH_WEIGHT, BATCH_MIN_SAMPLES, BATCH_SPREAD))

    def __post_init__(self) -> None:
        if self.tpot_s <= 0 or not 0 < self.ewma_weight <= 1 or self.source not in ("md", "rld"):
            raise InvalidInput("tpot book: tpot_s > 0, ewma_weight in (0, 1], source md or rld required")
        self.idle_tpot_s = self.idle_tpot_s or self.tpot_s

    def observe(self, trace: dict[str, object]) -> None:
        tokens = trace.get("tokens")
        ttft, e2e, n = trace.get("ttft_s"), trace.get("e2e_s"), trace.get("output_tokens")
        if trace.get("outcome") != "finished" or not isinstance(tokens, dict):
            return
        other = "rld" if self.source == "md" else "md"
        if tokens.get(other) or not tokens.get(self.source):
            return
        if not (isinstance(ttft, float) and isinstance(e2e, float) and isinstance(n, int)) or n < 4:
            return
        stalled = trace.get("md_stall_s") if self.source == "md" else None  # RLD recomputes nothing
        stall = float(stalled) if isinstance(stalled, (int, float)) and stalled > 0 else 0.0
        sample = (e2e - ttft - stall) / (n - 1)
        if sample <= 0:
            return
        self.tpot_s = (1 - self.ewma_weight) * self.tpot_s + self.ewma_weight * sample
        running = trace.get(f"{self.source}_running")
        if isinstance(running, int) and running >= 0:
            self._fit.add(float(running), sample)

    def per_request_s(self) -> float | None:
        """What one more request in flight adds to a request's TPOT there (the fitted ``b``), or
        None until the book has seen enough spread to fit it."""
        line = self._fit.line()
        return None if line is None else line[1]

    def estimate(self, running: int, prior_per_request_s: float | None = None) -> float:
        """``prior_per_request_s``: what one more request adds while this book has no fit of its
        own (RLD's book, fed by the few relays RLD finishes, borrows MD's slope: the same engine;
        flat, wan-overload's conversation trace of 2026-12-04 relayed into an RLD running 3-5
        others at an estimated 6-8 ms per token and got 11-18 ms, 9 requests over the bound)."""
        line = self._fit.line()
        if line is not None:
            tpot = max(1e-4, line[0] + line[1] * running)
        else:
            tpot = self.tpot_s + (prior_per_request_s or 0.0) * running
        return tpot if running > 0 else min(tpot, self.idle_tpot_s)


@dataclass(slots=True)
class StallLedger:
    """The prefill time each decode instance spent on recomputes (what its ready events report),
    summed since the router started: a request's ``md_stall_s`` is what its MD's sum grew by between
    the request's first token and its end, the time its decode stood still for other prompts.
    Sans-I/O; a prefill counts when its ready event arrives, so one that began before a request's
    first token and ended after it counts whole."""

    _seconds: dict[str, float] = field(default_factory=dict)

    def add(self, instance: str, seconds: float) -> None:
        if seconds > 0:
            self._seconds[instance] = self._seconds.get(instance, 0.0) + seconds

    def total(self, instance: str) -> float:
        return self._seconds.get(instance, 0.0)
