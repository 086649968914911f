"""``Router.generate`` in memory, its sidecars replaced by stubs that answer in the sidecar
protocol's messages (``pddlink.serving.stream_pb`` makes them): it yields ``StreamedToken``s in
order and one ``RequestEnd`` whose trace keeps the keys the APIs and reports read; ``asend(STOP)``
at a token is answered with the ``RequestEnd`` at once; an MD of another wire version is refused
(the run fails and says why), never read as tokens."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from engines_adapter.base import SamplingParams
from pddlink.lifecycle import RunOutcome, StreamClosed, StreamEnd
from pddlink.lifecycle.stream import DecodedToken, StreamClosing
from pddlink.serving.pb import pb2
from pddlink.serving.stream_pb import event_to_pb
from pddlink.wire import WIRE_VERSION
from router import STOP, Router, RouterConfig
from router.answer import RequestEnd, StreamedToken
from router.backend import GrpcBackend

pytestmark = [pytest.mark.timeout(60)]

PROMPT = [1, 2, 3]
FIRST = 40  # P's first token, at position len(PROMPT)
CFG = RouterConfig(p="127.0.0.1:9", rld="127.0.0.1:10", md="127.0.0.1:11", deadline_s=10.0)


class Sidecar:
    """P answers its Prefill (MD holds the KV and P's first token); MD streams from the first token
    on and closes ``finished``.
    ``old``: MD speaks wire version 2 (its events carry no version)."""

    def __init__(self, old: bool = False) -> None:
        self.old = old
        self.released: list[str] = []

    async def Prefill(self, req: Any, timeout: float) -> Any:
        return pb2.PrefillReply(first_token=FIRST, prompt_tokens=len(req.prompt), md_ok=True)

    def Attach(self, req: Any, timeout: float) -> AsyncIterator[Any]:
        async def events() -> AsyncIterator[Any]:
            n = req.sampling.max_tokens
            for i in range(n):  # P's first token first (P handed it to MD), then MD's
                pos = len(req.prompt) + i
                ev = event_to_pb(DecodedToken(pos, FIRST + i, last=i == n - 1))
                if self.old:
                    ev.wire_version = 0
                yield ev
                await asyncio.sleep(0.01)
            yield event_to_pb(StreamClosing(StreamClosed(StreamEnd.FINISHED)))

        return events()

    async def Release(self, req: Any, timeout: float = 0.0) -> Any:
        self.released.append(req.request_id)
        return pb2.ReleaseReply(released=True)


async def _with_router(sidecar: Sidecar, body: Any) -> Any:
    r = Router(CFG)
    assert isinstance(r.backend, GrpcBackend)  # its stubs are the ones replaced here
    for name in list(r.backend.stubs):  # type: ignore[attr-defined]
        r.backend.stubs[name] = sidecar  # type: ignore[attr-defined]
    try:
        return await body(r)
    finally:
        await r.close()


def test_generate_yields_typed_tokens_then_one_end_with_the_trace() -> None:
    async def body(r: Router) -> list[Any]:
        return [ev async for ev in r.generate(PROMPT, SamplingParams(max_tokens=5), pipeline="p_md")]

    events = asyncio.run(_with_router(Sidecar(), body))
    *tokens, end = events
    assert all(isinstance(t, StreamedToken) for t in tokens)
    assert [t.position for t in tokens] == list(range(len(PROMPT), len(PROMPT) + 5))
    assert [t.token_id for t in tokens] == [FIRST + i for i in range(5)]
    assert isinstance(end, RequestEnd) and end.outcome is RunOutcome.FINISHED and end.finished
    assert end.reason == "" and end.request_key.startswith(f"{CFG.name}-")
    doc = end.to_dict()
    assert doc["outcome"] == "finished" and doc["request_id"] == end.request_id
    for key in ("pipeline", "ttft_s", "e2e_s", "tokens", "placement", "stamps_s", "outcome", "reason"):
        assert key in end.trace, key
    assert set(end.trace["stamps_s"]) >= {"entered", "placed", "sent", "first_token"}


def test_stop_at_a_token_is_answered_with_the_end_and_nothing_follows() -> None:
    async def body(r: Router) -> tuple[Any, Any, bool]:
        gen = r.generate(PROMPT, SamplingParams(max_tokens=50), pipeline="p_md")
        first = await anext(gen)
        second = await anext(gen)
        end = await gen.asend(STOP)
        try:
            await anext(gen)
            more = True
        except StopAsyncIteration:
            more = False
        assert r.in_flight == {} and not r.labels_in_flight
        return (first, second), end, more

    (first, second), end, more = asyncio.run(_with_router(Sidecar(), body))
    assert isinstance(first, StreamedToken) and isinstance(second, StreamedToken)
    assert isinstance(end, RequestEnd) and not more
    assert end.trace["output_tokens"] < 50  # the run ended at the stop, not at max tokens


def test_an_md_of_another_wire_version_is_refused_not_read() -> None:
    async def body(r: Router) -> list[Any]:
        return [ev async for ev in r.generate(PROMPT, SamplingParams(max_tokens=5), pipeline="p_md")]

    events = asyncio.run(_with_router(Sidecar(old=True), body))
    assert len(events) == 1  # no token: none of the old MD's events was read as one
    end = events[0]
    assert isinstance(end, RequestEnd) and end.outcome is RunOutcome.FAILED
    why = f"no wire version (version 2 or older); this router speaks {WIRE_VERSION}"
    assert why in end.reason, end.reason
