"""What the requests that finished lately produced: their output lengths (``OutputLengths``, by
which the decode-speed bound judges a recompute's stall, ``pddlink.routing.decode_bound``) and
RelayDecode's share of their tokens (``OutputBook``, which ``RoutingPolicy.rld_token_budget`` caps).
Sans-I/O; the router and the simulator keep one book each."""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from pddlink.errors import ConfigError


@dataclass(frozen=True, slots=True)
class OutputLengths:
    """Output lengths of requests that finished lately, sorted: which share of their output tokens
    belongs to requests shorter than ``n`` (the share of MD's running requests that short, since a
    request runs as long as its output). None known: every share is 1 (a stall counts in full)."""

    sorted_tokens: tuple[int, ...] = ()
    cumulative: tuple[int, ...] = ()  # cumulative[i]: tokens of the i shortest

    @classmethod
    def of(cls, tokens: Iterable[int]) -> OutputLengths:
        ordered = tuple(sorted(max(0, n) for n in tokens))
        return cls(ordered, tuple(itertools.accumulate(ordered, initial=0)))

    def token_share_below(self, n: float) -> float:
        if n <= 1:  # no request is shorter than one token
            return 0.0
        total = self.cumulative[-1] if self.cumulative else 0
        if not total:
            return 1.0
        return self.cumulative[bisect.bisect_left(self.sorted_tokens, n)] / total

    def token_weighted_mean(self) -> float:
        """sum n^2 / sum n: the output length of the request an output token belongs to (1: none)."""
        total = self.cumulative[-1] if self.cumulative else 0
        return max(1.0, sum(n * n for n in self.sorted_tokens) / total) if total else 1.0


def missed_tpot(first_token_s: float, end_s: float, tokens: int, bound_s: float | None) -> bool:
    """Whether a finished request of ``tokens`` output tokens, its first out at ``first_token_s`` and
    its last at ``end_s``, took longer than ``bound_s`` per token after the first (no bound, or one
    token: never)."""
    if bound_s is None or tokens < 2:
        return False
    return (end_s - first_token_s) / (tokens - 1) > bound_s


class OutputBook:
    """What the requests that finished lately produced, over the last ``window``: their output
    lengths (``lengths``, what the TPOT bound judges a recompute's stall by; ``tokens``: their
    token-weighted mean) and RelayDecode's share of their tokens (``rld_share``), which
    ``RoutingPolicy.rld_token_budget`` caps; and of the relayed ones lately (RLD produced some of
    their tokens), the share that missed the SLO's TPOT (``relay_miss_share``: what relaying a
    request is expected to cost, against what recomputing it costs MD's runs). Output bounds say
    little (most are the API's default), so this is what requests produced. The router and the
    simulator keep one each; sans-I/O."""

    RELAY_WINDOW = 64  # the relayed requests the miss share is taken over

    def __init__(self, window: int = 256) -> None:
        if window < 1:
            raise ConfigError(f"window must be >= 1, got {window}")
        self.window = window
        self._order: deque[tuple[int, int]] = deque()  # (output tokens, of them produced on RLD)
        self._sum = self._squares = self._rld = 0
        self._lengths: OutputLengths | None = None  # built on demand, until the next add
        self._relays: deque[bool] = deque(maxlen=self.RELAY_WINDOW)  # each relayed request: missed

    def add(self, output_tokens: int, rld_tokens: int = 0, missed_tpot: bool = False) -> None:
        """A finished request: its output, the tokens RLD produced of it, and whether its TPOT
        missed the SLO's (counted for relayed requests only)."""
        n, rld = max(0, output_tokens), min(max(0, rld_tokens), max(0, output_tokens))
        if rld:
            self._relays.append(missed_tpot)
        self._lengths = None
        self._order.append((n, rld))
        self._sum, self._squares, self._rld = self._sum + n, self._squares + n * n, self._rld + rld
        if len(self._order) > self.window:
            old, old_rld = self._order.popleft()
            self._sum, self._squares = self._sum - old, self._squares - old * old
            self._rld -= old_rld

    def tokens(self) -> float:
        """The token-weighted output length (1 while nothing finished: a stall then counts in full)."""
        return max(1.0, self._squares / self._sum) if self._sum else 1.0

    def lengths(self) -> OutputLengths:
        if self._lengths is None:
            self._lengths = OutputLengths.of(n for n, _ in self._order)
        return self._lengths

    def rld_share(self) -> float:
        return self._rld / self._sum if self._sum else 0.0

    def relay_miss_share(self) -> float:
        """Of the last ``RELAY_WINDOW`` relayed requests, the share that missed the TPOT SLO."""
        return sum(self._relays) / len(self._relays) if self._relays else 0.0
