"""The gRPC ``Sidecar`` service: maps RPCs onto the role's parts (Prefiller on P, Decoder on RLD
and MD, DrcHost on MD). Errors become gRPC status codes with the reason as details; a request key
this sidecar already holds (``sidecar.request_keys``) is ``ALREADY_EXISTS``."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from engines_adapter.drc_host import DrcHost
from pddlink.errors import DeadlineExceeded, InvalidInput, NotFound, PddlinkError
from pddlink.kv.hashing import HashScheme
from pddlink.routing.books import RecomputeMode
from pddlink.serving.backlog import WanBook
from pddlink.serving.rpc import stubs
from pddlink.serving.sampling_pb import sampling_from_pb
from pddlink.serving.stream_pb import WireVersionRefused, answer_to_pb, check_wire_version, event_to_pb
from pddlink.wire import WIRE_VERSION
from sidecar.decoder import Decoder
from sidecar.kv_admission import CapacityRefused, KvAdmission
from sidecar.prefill import Prefiller, PrefillJob
from sidecar.request_keys import RequestKeyInUse

pb2, pb2_grpc = stubs()


_STATUS = {
    InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    RequestKeyInUse: grpc.StatusCode.ALREADY_EXISTS,  # after InvalidInput: the last match wins
    NotFound: grpc.StatusCode.NOT_FOUND,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    CapacityRefused: grpc.StatusCode.RESOURCE_EXHAUSTED,
    WireVersionRefused: grpc.StatusCode.FAILED_PRECONDITION,  # a router of another version
}


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: BaseException) -> None:
    code = grpc.StatusCode.UNAVAILABLE
    for kind, status in _STATUS.items():
        if isinstance(exc, kind):
            code = status
    if isinstance(exc, TimeoutError):
        code = grpc.StatusCode.DEADLINE_EXCEEDED
    text = exc.message if isinstance(exc, PddlinkError) else str(exc) or type(exc).__name__
    await context.abort(code, text)


class SidecarService(pb2_grpc.SidecarServicer):  # type: ignore[misc,name-defined]
    def __init__(
        self,
        *,
        role: str,
        peer_id: str,
        model_id: str,
        tls_identity: str,
        status: Callable[[], dict[str, Any]],
        prefiller: Prefiller | None = None,
        decoder: Decoder | None = None,
        drc: DrcHost | None = None,
        run_in_engine: Callable[..., Any] | None = None,
        admission: KvAdmission | None = None,
        wan_book: WanBook | None = None,
    ) -> None:
        self.admission = admission  # RLD: refuse at Attach what its KV pool cannot hold
        self.role, self.peer_id, self.model_id, self.tls_identity = role, peer_id, model_id, tls_identity
        self.status = status
        self.prefiller, self.decoder, self.drc = prefiller, decoder, drc
        self.run_in_engine = run_in_engine
        self.wan_book = wan_book  # P: what it ships over the WAN (``WatchWan`` streams it)

    async def Prefill(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if self.prefiller is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"role {self.role} does not prefill")
        assert self.prefiller is not None
        try:
            job = PrefillJob(
                request.request_id,
                tuple(request.prompt),
                sampling_from_pb(request.sampling),
                request.ship_to_md,
                request.ship_to_rld,
                request.first_token_to_md,
                request.deadline_s or 30.0,
                md_identity=request.md_identity,
                rld_identity=request.rld_identity,
            )
            reply = await self.prefiller.prefill(job)
        except (PddlinkError, TimeoutError) as exc:
            await _abort(context, exc)
        return pb2.PrefillReply(**reply)

    async def Attach(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        if self.decoder is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"role {self.role} does not decode")
        assert self.decoder is not None
        try:
            check_wire_version(request.wire_version, "sidecar")  # before anything in it is read
            sampling = sampling_from_pb(request.sampling)
        except PddlinkError as exc:
            await _abort(context, exc)
        try:
            self.decoder.check_attachable(request.request_id)  # before admission books anything
        except RequestKeyInUse as exc:
            await _abort(context, exc)
        booking = None
        if self.admission is not None:
            try:
                booking = self.admission.admit(request.request_id, len(request.prompt), sampling.max_tokens)
            except CapacityRefused as exc:
                await _abort(context, exc)
        try:
            stream = self.decoder.attach(
                request.request_id,
                tuple(request.prompt),
                sampling,
                request.deadline_s or 30.0,
                RecomputeMode(request.recompute),
            )
            async for ev in stream:
                yield event_to_pb(ev)
        finally:
            if booking is not None and self.admission is not None:
                self.admission.release(booking)

    async def StartHandoff(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if self.decoder is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"role {self.role} does not decode")
        assert self.decoder is not None
        try:
            check_wire_version(request.wire_version, "sidecar")
        except WireVersionRefused as exc:
            await _abort(context, exc)
        out = await self.decoder.start_handoff(
            request.request_id, request.deadline_s or 10.0, md_identity=request.md_identity
        )
        return answer_to_pb(out)

    async def Handoff(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if self.decoder is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"role {self.role} does not decode")
        assert self.decoder is not None
        try:
            level = await self.decoder.handoff(
                request.handoff, emit_given=request.emit_given, sender_finished=request.sender_finished
            )
        except (PddlinkError, TimeoutError) as exc:
            await _abort(context, exc)
        return pb2.HandoffReply(level_position=level)

    async def Release(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        released = False
        if self.decoder is not None:
            released = await self.decoder.release(request.request_id, request.reason)
        return pb2.ReleaseReply(released=released)

    async def DrcEvents(
        self, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        if self.drc is None or self.run_in_engine is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"role {self.role} holds no DRC")
        assert self.drc is not None and self.run_in_engine is not None
        snapshot = await self.run_in_engine("drc", self.drc.snapshot)
        queue = self.drc.subscribe()
        try:
            yield pb2.DrcEventBatch(snapshot=snapshot)
            while True:
                first = await queue.get()
                batch = [first]
                while not queue.empty() and len(batch) < 256:
                    batch.append(queue.get_nowait())
                yield pb2.DrcEventBatch(events=batch)
        finally:
            self.drc.unsubscribe(queue)

    async def Ping(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return pb2.PingReply(
            nonce=request.nonce,
            role=self.role,
            peer_id=self.peer_id,
            wire_version=WIRE_VERSION,
            hash_scheme=int(HashScheme.XXH3_128_U32LE_V1),
            tls_identity=self.tls_identity,
            model_id=self.model_id,
            payload=os.urandom(min(int(request.payload_bytes), 64 << 20)) if request.payload_bytes else b"",
        )

    async def Status(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return pb2.StatusReply(json=json.dumps(self.status()))

    async def WatchWan(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        if self.wan_book is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"role {self.role} ships nothing over the WAN")
        assert self.wan_book is not None
        async for book in self.wan_book.watch():
            yield pb2.StatusReply(json=json.dumps({"transfers": {"wan": book}}))
