"""What ``Router.generate`` yields: the request's merged tokens (``StreamedToken``), then one
``RequestEnd`` with its outcome and trace. Nothing follows a ``RequestEnd``; a ``STOP`` sent into
the generator at a token is answered with it at once.

The trace stays the JSON document the client APIs, the demo reports and the checks read
(``RunTrace.to_dict`` plus the router's choice, placement and stamps); ``RequestEnd.to_dict`` is the
end as such a document (the client APIs' and reports' shape).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pddlink.lifecycle import RunOutcome


@dataclass(frozen=True, slots=True)
class StreamedToken:
    """One token of the merged stream, in order: its absolute position (the first generated token
    sits at ``len(prompt)``), its id, the role that produced it ("rld" | "md") and, with vLLM's
    legs, its logprobs row in vLLM's JSON."""

    position: int
    token_id: int
    source: str
    logprobs: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class RequestEnd:
    """The request's last item. ``request_id``: the client's label; ``request_key``: what the
    sidecars keyed its last run by; ``reason``: why it failed ("" when it finished). vLLM's legs
    add P's prefix hit (``prompt_usage``) and P's prompt logprobs."""

    request_id: str
    request_key: str
    outcome: RunOutcome
    reason: str
    trace: Mapping[str, Any]
    prompt_usage: Mapping[str, int] | None = None
    prompt_logprobs: list[Any] | None = None

    @property
    def finished(self) -> bool:
        return self.outcome is RunOutcome.FINISHED

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "request_id": self.request_id,
            "request_key": self.request_key,
            "outcome": self.outcome.value,
            "reason": self.reason,
            "trace": dict(self.trace),
        }
        if self.prompt_usage is not None:
            out["prompt_usage"] = dict(self.prompt_usage)
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs
        return out


GenerateEvent = StreamedToken | RequestEnd
