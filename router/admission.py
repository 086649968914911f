"""Honest admission: when no option can end a request before its deadline (or within the SLO's
TTFT and TPOT), say so at once.

The router's ``choose_option`` (``pddlink.routing``) returns a rejection with a typed reason and a
retry hint instead of an option; the router raises ``Overloaded`` before it contacts any sidecar.
The client APIs turn it into HTTP 503 with ``Retry-After`` (whole seconds), a JSON error of type
``overloaded`` in vLLM's shape and the reason in the header ``pddlink-reject-reason``, or gRPC
``RESOURCE_EXHAUSTED`` with the reason in the details and ``retry-after`` /
``pddlink-reject-reason`` in the trailing metadata.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import grpc

from pddlink import metrics
from pddlink.errors import ErrorCode, LocalError
from pddlink.routing import OptionDecision, RejectReason
from pddlink.serving.http import Response, json_response


class Overloaded(LocalError):
    """No option meets the request's deadline right now; nothing was started."""

    code = ErrorCode.CAPACITY

    def __init__(self, reason: RejectReason, retry_after_s: float, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s

    @classmethod
    def of(cls, decision: OptionDecision, deadline_s: float) -> Overloaded:
        assert isinstance(decision.reason, RejectReason)
        best = min((e.finish_s for e in decision.estimates), default=math.inf)
        message = (
            f"no option ends within the {deadline_s:.1f} s deadline (earliest: {best:.1f} s; "
            f"the WAN alone needs {decision.wan_estimate_s:.1f} s for the missing KV)"
        )
        if decision.reason is RejectReason.TPOT_UNREACHABLE:
            own = min((e.tpot_s for e in decision.estimates), default=math.inf)
            pushed = min((e.md_pushed_over for e in decision.estimates if e.option.recomputes), default=0.0)
            message = (
                "every option that meets the deadline breaks the TPOT SLO (its own, at best"
                f" {own * 1e3:.1f} ms per token, or MD's running requests': recompute would push"
                f" {pushed:.2f} of them over it)"
            )
        metrics.REJECTED.labels(reason=decision.reason.value).inc()
        return cls(decision.reason, decision.retry_after_s, message)

    @property
    def retry_after(self) -> str:
        return str(max(1, math.ceil(self.retry_after_s)))


def http_rejection(exc: Overloaded) -> Response:
    """503 in vLLM's error shape; the typed reason in the header ``pddlink-reject-reason``."""
    body = {"error": {"message": exc.message, "type": "overloaded", "param": None, "code": 503}}
    r = json_response(503, body)
    headers = (("Retry-After", exc.retry_after), ("pddlink-reject-reason", exc.reason.value))
    return Response(r.status, r.body, r.content_type, headers)


async def grpc_rejection(context: Any, exc: Overloaded) -> None:
    context.set_trailing_metadata(
        (("retry-after", exc.retry_after), ("pddlink-reject-reason", exc.reason.value))
    )
    await context.abort(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"{exc.reason.value}: {exc.message}; retry after {exc.retry_after} s",
    )


T = TypeVar("T")


async def primed(gen: AsyncIterator[T]) -> AsyncIterator[T]:
    """Run ``gen`` up to its first item now (so its admission error surfaces here), then yield
    that item and the rest."""
    first = await gen.__anext__()

    async def chained() -> AsyncIterator[T]:
        yield first
        async for item in gen:
            yield item

    return chained()
