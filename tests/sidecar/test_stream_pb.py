"""A decoder's answers through the sidecar protocol (``pddlink.serving.stream_pb``), in memory:
every stream end and handoff outcome, with its reason, comes back as it went; each crosses the wire
as bytes (serialized and parsed); a peer of another wire version is refused with
``WireVersionRefused`` (a typed error, code ``VERSION_MISMATCH``), never misread; the sidecar's
service refuses an Attach or StartHandoff of another version with ``FAILED_PRECONDITION`` before
its decoder sees it."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pddlink.errors import ErrorCode
from pddlink.handoff import HandoffMode
from pddlink.lifecycle import HandoffOutcome, HandoffResult, StreamClosed, StreamEnd
from pddlink.lifecycle.stream import DecodedToken, DecoderEvent, HandoffAnswer, PromptReady, StreamClosing
from pddlink.serving.pb import pb2
from pddlink.serving.stream_pb import (
    WireVersionRefused,
    answer_from_pb,
    answer_to_pb,
    check_wire_version,
    event_from_pb,
    event_to_pb,
)
from pddlink.wire import WIRE_VERSION
from sidecar.service import SidecarService

# what the sidecars say today, and free text (a reason is never parsed)
REASONS = (
    "",
    "deadline_exceeded",
    "engine_error",
    "kv_mismatch: the KV's blocks are not the prompt's",
    "import_failed: no room",
    "recompute_failed: engine gone",
    "expired: the request's deadline passed",
    "failed:deadline_exceeded",  # handoff_refused's detail: how the stream ended here
    "ConnectionError: md0 went away",
    "a:b:c",
)


def _wire(msg: Any) -> Any:
    """``msg`` as the peer reads it: serialized, then parsed into a fresh message."""
    back = type(msg)()
    back.ParseFromString(msg.SerializeToString())
    return back


def _event(ev: DecoderEvent) -> DecoderEvent:
    return event_from_pb(_wire(event_to_pb(ev)))


@pytest.mark.parametrize("end", list(StreamEnd))
@pytest.mark.parametrize("reason", REASONS)
def test_every_stream_end_and_reason_round_trips(end: StreamEnd, reason: str) -> None:
    closing = StreamClosing(StreamClosed(end, reason))
    assert _event(closing) == closing


@pytest.mark.parametrize("mode", list(HandoffMode))
def test_a_handed_off_stream_keeps_its_mode_and_slices(mode: HandoffMode) -> None:
    closing = StreamClosing(StreamClosed(StreamEnd.HANDED_OFF), mode, 7)
    assert _event(closing) == closing


def test_tokens_and_the_ready_event_round_trip() -> None:
    for ev in (DecodedToken(12, 0), DecodedToken(13, 50_000, last=True), PromptReady(0.25, 64)):
        assert _event(ev) == ev


def test_a_token_is_never_read_as_a_closing_event() -> None:
    """A token at position 0 with id 0 (every field at its default but the version) is a token."""
    assert _event(DecodedToken(0, 0)) == DecodedToken(0, 0)


@pytest.mark.parametrize("outcome", list(HandoffOutcome))
@pytest.mark.parametrize("reason", REASONS)
def test_every_handoff_outcome_and_reason_round_trips(outcome: HandoffOutcome, reason: str) -> None:
    answer = HandoffAnswer(HandoffResult(outcome, reason), HandoffMode.CATCH_UP, 3, 140)
    assert answer_from_pb(_wire(answer_to_pb(answer))) == answer


def test_a_handoff_answer_without_a_mode_keeps_none() -> None:
    answer = HandoffAnswer(HandoffResult(HandoffOutcome.FAILED, "no_md_configured"))
    assert answer_from_pb(_wire(answer_to_pb(answer))) == answer


@given(
    st.sampled_from(list(StreamEnd)),
    st.text(max_size=200),
    st.none() | st.sampled_from(list(HandoffMode)),
    st.integers(0, 2**32 - 1),
)
def test_any_closing_event_round_trips(end: StreamEnd, reason: str, mode: HandoffMode | None, n: int) -> None:
    closing = StreamClosing(StreamClosed(end, reason), mode, n)
    assert _event(closing) == closing


def test_the_trace_text_is_what_version_2_carried() -> None:
    """Traces and reports keep their text: the reason renders as ``failed:<why>`` as before."""
    closing = _event(StreamClosing(StreamClosed(StreamEnd.FAILED, "kv_mismatch: x")))
    assert isinstance(closing, StreamClosing) and closing.closed.render() == "failed:kv_mismatch: x"
    answer = answer_from_pb(_wire(answer_to_pb(HandoffAnswer(HandoffResult(HandoffOutcome.FINISHED_ON_RLD)))))
    assert answer.result.render() == "finished_on_rld"


# -- wire versions ------------------------------------------------------------------------------


def _old_closing_event() -> Any:
    """What a version 2 sidecar sent to close a stream: ``end = 4`` as text, no version."""
    raw = b"\x22" + bytes([len(b"failed:kv_mismatch")]) + b"failed:kv_mismatch"
    return pb2.TokenEvent.FromString(raw)


def test_an_old_sidecars_closing_event_is_refused_not_read_as_a_token() -> None:
    old = _old_closing_event()
    assert old.closed == pb2.STREAM_END_NONE and old.position == 0  # what a misread would see
    with pytest.raises(WireVersionRefused) as err:
        event_from_pb(old)
    assert err.value.code is ErrorCode.VERSION_MISMATCH
    assert f"this router speaks {WIRE_VERSION}" in err.value.message
    assert "no wire version" in err.value.message


def test_an_old_sidecars_handoff_answer_is_refused() -> None:
    raw = b"\x0a" + bytes([len(b"handed_off")]) + b"handed_off"  # version 2: outcome = 1 as text
    with pytest.raises(WireVersionRefused):
        answer_from_pb(pb2.HandoffStartReply.FromString(raw))


@pytest.mark.parametrize("version", [0, WIRE_VERSION - 1, WIRE_VERSION + 1])
def test_another_version_is_refused_on_both_sides(version: int) -> None:
    token = event_to_pb(DecodedToken(5, 6))
    token.wire_version = version
    with pytest.raises(WireVersionRefused):
        event_from_pb(token)
    with pytest.raises(WireVersionRefused) as err:
        check_wire_version(version, "sidecar")
    assert f"this sidecar speaks {WIRE_VERSION}" in err.value.message


def test_this_version_passes() -> None:
    check_wire_version(WIRE_VERSION, "router")


class _Refused(Exception):
    pass


class _Context:
    """What the service's calls use of a gRPC context: ``abort`` ends the call (raises)."""

    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)
        raise _Refused(details)


class _Decoder:
    """A decoder that must not be reached by a refused call."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the decoder was called ({name}) for a refused request")


def _service() -> SidecarService:
    return SidecarService(
        role="rld",
        peer_id="rld0",
        model_id="m",
        tls_identity="",
        status=dict,
        decoder=_Decoder(),  # type: ignore[arg-type]
    )


def test_the_service_refuses_an_old_routers_attach_before_its_decoder_sees_it() -> None:
    async def attach() -> _Context:
        ctx = _Context()
        req = pb2.AttachRequest(request_id="r", prompt=[1, 2, 3], sampling=pb2.Sampling(max_tokens=4))
        with pytest.raises(_Refused):
            async for _ in _service().Attach(req, ctx):  # type: ignore[arg-type]
                pass
        return ctx

    ctx = asyncio.run(attach())
    assert ctx.aborted is not None and ctx.aborted[0] is grpc.StatusCode.FAILED_PRECONDITION
    assert f"this sidecar speaks {WIRE_VERSION}" in ctx.aborted[1]


def test_the_service_refuses_an_old_routers_start_handoff() -> None:
    async def start() -> _Context:
        ctx = _Context()
        with pytest.raises(_Refused):
            await _service().StartHandoff(pb2.HandoffStart(request_id="r", deadline_s=1.0), ctx)  # type: ignore[arg-type]
        return ctx

    ctx = asyncio.run(start())
    assert ctx.aborted is not None and ctx.aborted[0] is grpc.StatusCode.FAILED_PRECONDITION
