"""Request identity (issue 25, item 3), in memory: the router mints keys no other router shares,
and a sidecar's keyed tables refuse, typed, whatever would attach one request's tokens or KV to
another. Real float64 engines: P's prefill and KV export, MD's decoder importing it, MD's tokens
compared with one engine generating alone."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import grpc
import pytest

from engines_adapter import EngineAdapter, SamplingParams, load_engine
from engines_adapter.engine_loop import EngineLoop
from pddlink.handoff import HandoffMode, HandoffSlice
from pddlink.kv.codec import CodecId
from pddlink.kv.hashing import BlockHasher
from pddlink.lifecycle import HandoffOutcome, HandoffResult, StreamClosed, StreamEnd
from pddlink.lifecycle.stream import DecodedToken, DecoderEvent, HandoffAnswer, StreamClosing
from pddlink.roles import Role
from pddlink.serving.handoff_wire import slice_to_wire
from pddlink.serving.rpc import stubs
from pddlink.serving.sampling_pb import sampling_to_pb
from pddlink.serving.stream_pb import event_from_pb
from pddlink.transport import PeerIdentity, ReceivedTransfer
from pddlink.wire import WIRE_VERSION, KVLayoutSpec, TransferBegin
from router import mint_request_key
from sidecar.decoder import Decoder, HandoffRefused
from sidecar.prefill import Prefiller, PrefillJob
from sidecar.request_keys import RequestKeyInUse, kv_mismatch
from sidecar.service import SidecarService

pytestmark = pytest.mark.timeout(120)

BLOCK = 16
GREEDY = SamplingParams(max_tokens=12)
SEEDED = SamplingParams(seed=7, temperature=0.9, top_k=40, max_tokens=12)
PROMPT_A = tuple(range(3, 3 + 40))
PROMPT_B = tuple(range(900, 900 + 40))  # as long as A: only the blocks tell them apart


def engine() -> EngineAdapter:
    return load_engine("torch_ref", preset="tiny", dtype="float64", block_size=BLOCK, num_blocks=256)


def alone(prompt: tuple[int, ...], sampling: SamplingParams) -> list[int]:
    e = engine()
    toks = [e.prefill("x", list(prompt), sampling).token_id]
    while not e.is_finished("x"):  # type: ignore[attr-defined]
        toks.append(e.decode(["x"])[0].token_id)
    return toks


class PSide:
    """P's engine: prefill a prompt, export its KV as the transfer MD would receive."""

    def __init__(self) -> None:
        self.engine = engine()
        self.n = 0

    def ship(
        self, key: str, prompt: tuple[int, ...], sampling: SamplingParams
    ) -> tuple[ReceivedTransfer, int]:
        self.n += 1
        rid = f"p{self.n}"
        first = self.engine.prefill(rid, list(prompt), sampling).token_id
        kv = self.engine.export_kv(rid)
        self.engine.release(rid, cache_prefix=False)
        layout = kv.layout
        data = bytes(memoryview(kv.data).cast("B"))
        begin = TransferBegin(
            transfer_id=self.n,
            generation=0,
            request_id=key,
            layout=KVLayoutSpec(**layout.to_dict()),
            first_block=0,
            num_tokens=len(prompt),
            block_hashes=tuple(BlockHasher(layout.model_id, BLOCK).hash_blocks(list(prompt))),
            codec=CodecId.RAW,
            total_bytes=len(data),
            chunk_bytes=len(data),
            deadline_ms=30_000,
        )
        return ReceivedTransfer(PeerIdentity("p", "p0"), begin, [memoryview(data)], 0.01), first


def first_slice(key: str, prompt: tuple[int, ...], first: int, sampling: SamplingParams) -> bytes:
    return slice_to_wire(HandoffSlice(key, len(prompt), (first,), True, HandoffMode.ONE_SHOT), sampling)


async def drain(stream: AsyncIterator[DecoderEvent]) -> tuple[list[int], StreamClosed | None]:
    toks: list[int] = []
    end = None
    async for ev in stream:
        if isinstance(ev, DecodedToken):
            toks.append(ev.token_id)
        elif isinstance(ev, StreamClosing):
            end = ev.closed
    return toks, end


async def with_md(body: Any) -> Any:
    loop = EngineLoop(engine(), max_batch=8)
    loop.start()
    try:
        return await body(Decoder(Role.MD, loop))
    finally:
        await loop.close()


def test_minted_keys_are_unique_across_routers_of_one_name() -> None:
    keys = {mint_request_key("router0") for _ in range(10_000)}
    assert len(keys) == 10_000
    key = next(iter(keys))
    name, _, rand = key.rpartition("-")
    assert name == "router0" and len(rand) == 32 and int(rand, 16) >= 0


def test_a_second_attach_of_a_held_key_is_refused_and_the_holder_finishes_exact() -> None:
    p = PSide()

    async def body(md: Decoder) -> None:
        key = "router0/aa"
        first_stream = md.attach(key, PROMPT_A, SEEDED, 30.0)
        first = asyncio.ensure_future(drain(first_stream))
        await asyncio.sleep(0.05)  # the holder is attached and waits for its KV
        t0 = time.monotonic()
        with pytest.raises(RequestKeyInUse):
            await drain(md.attach(key, PROMPT_B, GREEDY, 30.0))
        assert time.monotonic() - t0 < 1.0  # at once, not at a deadline
        kv, tok = p.ship(key, PROMPT_A, SEEDED)
        await md.on_transfer(kv)
        await md.handoff(first_slice(key, PROMPT_A, tok, SEEDED), emit_given=True, sender_finished=False)
        toks, end = await asyncio.wait_for(first, 30.0)
        assert end == StreamClosed(StreamEnd.FINISHED) and toks == alone(PROMPT_A, SEEDED)
        with pytest.raises(RequestKeyInUse):  # and once it ended, the key is not taken again
            await drain(md.attach(key, PROMPT_A, SEEDED, 30.0))
        assert md.refused["key_in_use"] == 2

    asyncio.run(with_md(body))


def test_kv_of_another_prompt_is_never_imported() -> None:
    p = PSide()

    async def body(md: Decoder) -> None:
        key = "router0/bb"
        stream = asyncio.ensure_future(drain(md.attach(key, PROMPT_A, GREEDY, 30.0)))
        kv_b, _ = p.ship(key, PROMPT_B, GREEDY)  # another request's KV under the held key
        await md.on_transfer(kv_b)
        toks, end = await asyncio.wait_for(stream, 10.0)
        assert toks == [] and end is not None and end.end is StreamEnd.FAILED
        assert end.detail.startswith("kv_mismatch"), end
        assert md.refused["kv_mismatch"] == 1

    asyncio.run(with_md(body))


def test_kv_that_came_first_is_checked_against_the_attach() -> None:
    p = PSide()

    async def body(md: Decoder) -> None:
        key = "router0/cc"
        kv_b, _ = p.ship(key, PROMPT_B, GREEDY)
        await md.on_transfer(kv_b)  # an orphan holding B's KV
        toks, end = await asyncio.wait_for(drain(md.attach(key, PROMPT_A, GREEDY, 30.0)), 10.0)
        assert toks == [] and end is not None and end.end is StreamEnd.FAILED
        assert end.detail.startswith("kv_mismatch"), end

    asyncio.run(with_md(body))


def test_a_second_kv_for_a_key_is_dropped_and_the_first_decides() -> None:
    p = PSide()

    async def body(md: Decoder) -> None:
        key = "router0/dd"
        stream = asyncio.ensure_future(drain(md.attach(key, PROMPT_A, GREEDY, 30.0)))
        kv_a, tok = p.ship(key, PROMPT_A, GREEDY)
        kv_b, _ = p.ship(key, PROMPT_B, GREEDY)
        await md.on_transfer(kv_a)
        await md.on_transfer(kv_b)
        await md.handoff(first_slice(key, PROMPT_A, tok, GREEDY), emit_given=True, sender_finished=False)
        toks, end = await asyncio.wait_for(stream, 30.0)
        assert end == StreamClosed(StreamEnd.FINISHED) and toks == alone(PROMPT_A, GREEDY)
        assert md.refused["duplicate_kv"] == 1

    asyncio.run(with_md(body))


def test_a_slice_drawn_with_other_sampling_is_refused() -> None:
    p = PSide()

    async def body(md: Decoder) -> None:
        key = "router0/ee"
        stream = asyncio.ensure_future(drain(md.attach(key, PROMPT_A, SEEDED, 30.0)))
        kv_a, tok = p.ship(key, PROMPT_A, SEEDED)
        await md.on_transfer(kv_a)
        other = SamplingParams(seed=8, temperature=0.9, top_k=40, max_tokens=12)
        with pytest.raises(HandoffRefused, match="handoff_mismatch"):
            await md.handoff(first_slice(key, PROMPT_A, tok, other), emit_given=True, sender_finished=False)
        await md.handoff(first_slice(key, PROMPT_A, tok, SEEDED), emit_given=True, sender_finished=False)
        toks, end = await asyncio.wait_for(stream, 30.0)
        assert end == StreamClosed(StreamEnd.FINISHED) and toks == alone(PROMPT_A, SEEDED)
        with pytest.raises(HandoffRefused, match="already ended"):  # a slice for a key that ended here
            await md.handoff(first_slice(key, PROMPT_A, tok, SEEDED), emit_given=True, sender_finished=False)

    asyncio.run(with_md(body))


def test_kv_mismatch_checks_count_and_blocks() -> None:
    p = PSide()
    kv, _ = p.ship("k", PROMPT_A, GREEDY)
    begin = cast(TransferBegin, kv.begin)
    hasher = BlockHasher(begin.layout.model_id, BLOCK)
    assert kv_mismatch(begin, PROMPT_A, hasher) == ""
    assert "tokens" in kv_mismatch(begin, (*PROMPT_A, 5), hasher)
    assert "blocks" in kv_mismatch(begin, PROMPT_B, hasher)
    # the same whole blocks but another tail inside the partial last block: the count still matches,
    # the hashes cover whole blocks only (what the transfer names); the key refusals cover this case
    assert kv_mismatch(begin, (*PROMPT_A[:-1], 1), hasher) == ""


def test_a_second_prefill_of_a_key_in_flight_is_refused_and_the_first_goes_on() -> None:
    async def body() -> None:
        loop = EngineLoop(engine(), max_batch=8)
        loop.start()
        none = cast(Any, None)
        prefiller = Prefiller(
            loop, md_kv=none, md=none, rld_kv=None, rld=None, chunk_bytes=1 << 20, lease_s=5.0
        )
        try:
            job = PrefillJob("router0/ff", PROMPT_A, GREEDY, False, False, False, 30.0)
            first = asyncio.ensure_future(prefiller.prefill(job))
            await asyncio.sleep(0)  # the first is in flight (in P's engine gate or engine)
            with pytest.raises(RequestKeyInUse):
                await prefiller.prefill(PrefillJob("router0/ff", PROMPT_B, GREEDY, False, False, False, 30.0))
            reply = await asyncio.wait_for(first, 30.0)
            assert reply["first_token"] == alone(PROMPT_A, GREEDY)[0]
            again = await prefiller.prefill(job)  # once it answered, the key is free on P again
            assert again["first_token"] == reply["first_token"]
        finally:
            await loop.close()

    asyncio.run(body())


def test_the_service_answers_already_exists() -> None:
    pb2, pb2_grpc = stubs()

    async def body(md: Decoder) -> None:
        service = SidecarService(
            role="md", peer_id="md0", model_id="m", tls_identity="", status=dict, decoder=md
        )
        server = grpc.aio.server()
        pb2_grpc.add_SidecarServicer_to_server(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb2_grpc.SidecarStub(ch)
                req = pb2.AttachRequest(
                    request_id="router0/gg",
                    prompt=list(PROMPT_A),
                    sampling=sampling_to_pb(GREEDY),
                    deadline_s=20,
                    wire_version=WIRE_VERSION,
                )
                holder = stub.Attach(req, timeout=30)
                for _ in range(100):
                    if "router0/gg" in md.slots:
                        break
                    await asyncio.sleep(0.02)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Attach(req, timeout=5):
                        pass
                assert err.value.code() is grpc.StatusCode.ALREADY_EXISTS
                assert "in use" in (err.value.details() or "")
                assert md.slots["router0/gg"].seq.prompt == PROMPT_A  # the holder is untouched
                await stub.Release(pb2.ReleaseRequest(request_id="router0/gg", reason="test"))
                ends = [ev async for ev in holder if ev.closed != pb2.STREAM_END_NONE]
                assert [event_from_pb(ev) for ev in ends] == [StreamClosing(StreamClosed(StreamEnd.RELEASED))]
        finally:
            await server.stop(None)

    asyncio.run(with_md(body))


def test_start_handoff_of_a_request_that_ended_here_answers_how_it_ended() -> None:
    """RLD's StartHandoff for a key it no longer holds answers typed: finished here ->
    ``FINISHED_ON_RLD``, failed here -> ``FAILED`` with how, unknown -> ``unknown_request``."""

    async def body(d: Decoder) -> list[HandoffAnswer]:
        d.ended_recently["done"] = StreamClosed(StreamEnd.FINISHED)
        d.ended_recently["late"] = StreamClosed(StreamEnd.FAILED, "deadline_exceeded")
        return [await d.start_handoff(k, 1.0) for k in ("done", "late", "never")]

    done, late, never = asyncio.run(with_md(body))
    assert done == HandoffAnswer(HandoffResult(HandoffOutcome.FINISHED_ON_RLD))
    assert late == HandoffAnswer(HandoffResult(HandoffOutcome.FAILED, "failed:deadline_exceeded"))
    assert never == HandoffAnswer(HandoffResult(HandoffOutcome.FAILED, "unknown_request"))
