"""Fuzzing the router's gRPC ``Generate`` requests: every request is either a valid job or a typed
refusal (``INVALID_ARGUMENT``), never another exception, a server error or a hang.

In-process, hypothesis draws ``GenerateRequest`` fields (in range and out of the schema's range,
every value protobuf's types allow: NaN and infinite doubles, the largest uint32 and uint64, odd
and oversized request ids, long repeated fields, the submessage left out); each drawn request is
then varied 99 times, at the protobuf level (one field set to an odd value) and byte-wise on its
serialization (bytes flipped, cut, deleted, overlong varints, records inserted with wrong wire
types, unknown fields, invalid UTF-8, bogus lengths). Each variant's bytes go through the service's
own path: its deserializer (``router.api.decode_generate``), its checks (``grpc_job``) and the
router's (``Router.validate``); an accepted job must also convert into the sidecars' messages (the
conversion that raised in issue 16's case 1). ``PDDLINK_FUZZ_CASES`` (default 100,000) sets how
many. Over real sockets, a smaller number goes to a real router's gRPC service, as typed messages
and as raw bytes: each refused one must get ``INVALID_ARGUMENT`` with the same message, each
accepted one must end in time without a server error (the sidecars are not there: it fails fast).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from _fuzz_cases import CASES, TIMEOUT_S, record
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pddlink.errors import InvalidInput
from pddlink.serving.pb import pb2
from pddlink.serving.sampling_pb import sampling_to_pb
from router import Router, RouterConfig
from router.api import RouterService, Undecodable, add_router_service, decode_generate, grpc_job
from router.vllm_legs import sampling_body

MUTATIONS = 99  # variants of each drawn request
EXAMPLES = max(1, CASES // (MUTATIONS + 1))
SOCKET_CASES = 1000
GENERATE = "/pddlink.v1.Router/Generate"

U32_ODD = [0, 1, 2047, 2048, 4096, 4097, 2**20, 2**20 + 1, 2**31, 2**32 - 1]
U64_ODD = [0, 1, 2**63 - 1, 2**63, 2**64 - 1]
DOUBLE_ODD = [
    0.0,
    -0.0,
    1e-300,
    0.5,
    1.0,
    1.5,
    -1.0,
    100.0,
    101.0,
    600.0,
    601.0,
    1e308,
    math.nan,
    math.inf,
    -math.inf,
]
IDS_ODD = [
    "",
    "ok-1",
    "x" * 128,
    "x" * 129,
    "x" * 300,
    "bad id",
    "a/b",
    "é",
    "\x00",
    "req-1\n",
    "😀" * 40,
    "-",
]
PIPELINES = ["", "p_md", "p_rld_md", "singular", "ship", "relay", "recompute", "relay_recompute"]
PIPELINES_ODD = [*PIPELINES, "nope", "P_MD", " p_md", "p_md\x00", "pmd"]


def _rarely(common: st.SearchStrategy[Any], rare: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``rare`` one draw in 20 (huge repeated fields: each costs far more than a common one)."""
    return st.integers(0, 19).flatmap(lambda k: rare if k == 0 else common)


u32 = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from(U32_ODD))
u64 = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from(U64_ODD))
doubles = st.one_of(st.floats(), st.sampled_from(DOUBLE_ODD))
huge_ids = st.tuples(st.sampled_from([65, 4097, 8001, 20_000]), u32).map(lambda t: [t[1]] * t[0])
token_lists = _rarely(
    st.one_of(st.lists(st.integers(0, 2047), max_size=12), st.lists(u32, max_size=12)), huge_ids
)
request_ids = st.one_of(
    st.from_regex(r"[A-Za-z0-9._:-]{0,140}", fullmatch=True), st.text(max_size=16), st.sampled_from(IDS_ODD)
)
odd_sampling = st.builds(
    pb2.Sampling,
    seed=u64,
    temperature=doubles,
    top_k=u32,
    top_p=doubles,
    max_tokens=u32,
    stop_token_ids=token_lists,
)
valid_sampling = st.builds(
    pb2.Sampling,
    seed=st.integers(0, 2**63 - 1),
    temperature=st.floats(0, 100),
    top_k=st.integers(0, 2047),
    top_p=st.floats(0, 1),
    max_tokens=st.integers(0, 64),
    stop_token_ids=st.lists(st.integers(0, 2047), max_size=8),
)
odd_requests = st.builds(
    pb2.GenerateRequest,
    request_id=request_ids,
    prompt=token_lists,
    sampling=st.one_of(st.none(), odd_sampling, valid_sampling),
    deadline_s=doubles,
    pipeline=st.one_of(st.sampled_from(PIPELINES_ODD), st.text(max_size=10)),
)
valid_requests = st.builds(
    pb2.GenerateRequest,
    request_id=st.from_regex(r"[A-Za-z0-9._:-]{0,128}", fullmatch=True),
    prompt=st.lists(st.integers(0, 2047), min_size=1, max_size=16),
    sampling=st.one_of(st.none(), valid_sampling),
    deadline_s=st.floats(0, 600),
    pipeline=st.sampled_from(PIPELINES),
)
requests = st.one_of(valid_requests, odd_requests)


# -- byte-level variants ----------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # a negative value as protobuf writes it: ten bytes
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _record(rng: random.Random) -> bytes:
    """One field record, often of the wrong wire type for its field, sometimes no valid record."""
    field = rng.choice([1, 2, 3, 4, 5, 6, 7, 15, 16, 2**29 - 1, 0])
    wire = rng.randrange(8)
    tag = _varint(field << 3 | wire)
    if wire == 0:
        return tag + _varint(rng.choice([0, 1, 2**31, 2**32, 2**63, 2**64 - 1, -1, rng.getrandbits(64)]))
    if wire == 1:
        return tag + rng.randbytes(8)  # a double of any bits: NaN payloads, infinities
    if wire == 5:
        return tag + rng.randbytes(4)
    if wire == 2:
        payload = rng.choice(
            [
                b"\xff\xfe",  # invalid UTF-8 in a string
                b"x" * rng.choice([129, 300, 5000]),
                b"".join(
                    _varint(rng.choice([*U32_ODD, 2**40, 2**64 - 1])) for _ in range(rng.randint(0, 80))
                ),
                _record(rng) + _record(rng),  # a submessage of odd records
                rng.randbytes(rng.randint(0, 12)),
            ]
        )
        length = len(payload) if rng.random() < 0.9 else rng.choice([len(payload) + 1, 2**31, 2**64 - 1])
        return tag + _varint(length) + payload
    return tag + rng.randbytes(rng.randint(0, 4))  # groups (3, 4) and the invalid wire types 6, 7


def _mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(len(b) + 1)
        op = rng.randrange(8)
        if op == 0 and b:
            b[min(at, len(b) - 1)] = rng.randrange(256)
        elif op == 1 and b:
            b[min(at, len(b) - 1)] ^= 1 << rng.randrange(8)
        elif op == 2:
            b[at:at] = _record(rng)  # anywhere: inside another record too
        elif op == 3:
            b += _record(rng)  # at a record boundary: unknown fields, repeated fields, last one wins
        elif op == 4:
            del b[at : at + rng.randint(1, 8)]
        elif op == 5:
            b = b[:at]
        elif op == 6:
            b[at:at] = b"\xff" * rng.randint(9, 12)  # an overlong varint
        else:
            b[at:at] = b[rng.randrange(len(b) + 1) :][: rng.randint(1, 16)]  # a splice of itself
    return bytes(b)


def _perturb(msg: Any, rng: random.Random) -> bytes:
    """The request with one field set to an odd value (still a valid message)."""
    out = pb2.GenerateRequest()
    out.CopyFrom(msg)
    field = rng.randrange(10)
    s = out.sampling
    if field == 0:
        out.request_id = rng.choice(IDS_ODD)
    elif field == 1:
        out.prompt.extend([rng.choice(U32_ODD)] * rng.choice([1, 3, 8001]))
    elif field == 2:
        out.ClearField("sampling" if rng.random() < 0.5 else "prompt")
    elif field == 3:
        out.deadline_s = rng.choice(DOUBLE_ODD)
    elif field == 4:
        out.pipeline = rng.choice(PIPELINES_ODD)
    elif field == 5:
        s.seed = rng.choice(U64_ODD)
    elif field == 6:
        s.temperature, s.top_p = rng.choice(DOUBLE_ODD), rng.choice(DOUBLE_ODD)
    elif field == 7:
        s.top_k = rng.choice(U32_ODD)
    elif field == 8:
        s.max_tokens = rng.choice(U32_ODD)
    else:
        s.stop_token_ids.extend([rng.choice(U32_ODD)] * rng.choice([1, 64, 65]))
    return bytes(out.SerializeToString())


# -- the verdict --------------------------------------------------------------------------------------


def judge(service: RouterService, raw: bytes) -> tuple[str, str]:
    """(kind, message): "ok", "refused" or "undecodable" with the refusal's message, by the path
    the service takes; anything else raised fails the test."""
    request = decode_generate(raw)
    kind = "undecodable" if isinstance(request, Undecodable) else "refused"
    router = service.router
    try:
        job = grpc_job(request, service.limits)
        deadline_s = job.deadline_s or router.cfg.deadline_s
        router.validate(list(job.prompts[0]), job.sampling, deadline_s, job.pipeline)
    except InvalidInput as exc:
        assert exc.message
        return kind, exc.message
    assert kind == "refused"  # never a job from bytes that decode to no message
    # what the legs make of it must not raise (issue 16, case 1: a conversion raised in a leg)
    prompt = list(job.prompts[0])
    pb2.AttachRequest(request_id=job.request_id or "r", prompt=prompt, sampling=sampling_to_pb(job.sampling))
    sampling_body(job.sampling)
    return "ok", ""


@pytest.fixture(scope="module")
def service() -> Iterator[RouterService]:
    loop = asyncio.new_event_loop()  # the router's gRPC channels belong to a loop (never run here)
    asyncio.set_event_loop(loop)
    router = Router(RouterConfig(p="127.0.0.1:9", rld="127.0.0.1:10", md="127.0.0.1:11"))
    yield RouterService(router)
    loop.run_until_complete(router.close())
    asyncio.set_event_loop(None)
    loop.close()


@pytest.mark.timeout(TIMEOUT_S)
def test_fuzz_generate_requests_in_process(service: RouterService) -> None:
    seen = {"ok": 0, "refused": 0, "undecodable": 0}

    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(msg=requests, seed=st.integers(0, 2**32))
    def check(msg: Any, seed: int) -> None:
        data = bytes(msg.SerializeToString())
        rng = random.Random(seed)
        variants = [_perturb(msg, rng) if i % 3 == 0 else _mutate(data, rng) for i in range(MUTATIONS)]
        for raw in [data, *variants]:
            seen[judge(service, raw)[0]] += 1

    t0 = time.monotonic()
    check()
    record("grpc", seen, time.monotonic() - t0)
    assert sum(seen.values()) >= CASES
    assert all(n > CASES // 100 for n in seen.values()), seen  # every side of the checks is reached


def _socket_case(rng: random.Random, i: int) -> tuple[bytes, Any]:
    """Raw bytes to send, and the message they were made from (None: send the bytes as they are).
    Each field is odd with a chance of 0.15, so that about a fifth of the typed messages pass."""

    def pick(good: list[Any], odd: list[Any]) -> Any:
        return rng.choice(odd if rng.random() < 0.15 else good)

    s = pb2.Sampling(
        seed=pick([0, 7, 2**63 - 1], U64_ODD),
        temperature=pick([0.0, 1.0], [101.0, math.nan, -1.0]),
        top_k=pick([0, 5], [2**21, 2**32 - 1]),
        top_p=pick([0.0, 0.5, 1.0], [1.5, math.inf]),
        max_tokens=pick([0, 4], [5000, 2**32 - 1]),
        stop_token_ids=[pick([1, 2047], [2048, 2**32 - 1])] * pick([0, 1], [65]),
    )
    msg = pb2.GenerateRequest(
        request_id=pick(["", "ok-1", "x" * 128], IDS_ODD),
        prompt=[pick([1, 2047], [2048, 2**32 - 1]) for _ in range(pick([1, 3], [0, 8001]))],
        sampling=s,
        deadline_s=pick([0.0, 1.0], [601.0, math.inf, -1.0]),
        pipeline=pick(["", "p_md"], ["nope", "P_MD"]),
    )
    data = bytes(msg.SerializeToString())
    if i % 2:
        return data, msg
    return (_perturb(msg, rng) if i % 4 == 0 else _mutate(data, rng)), None


@pytest.mark.timeout(300)
def test_fuzz_generate_requests_over_sockets() -> None:
    """Typed messages and raw bytes through a real router's gRPC service: the same verdicts,
    ``INVALID_ARGUMENT`` with the same message for a refused one, an accepted one ends in time
    (a typed failure: the sidecars are not there) and never with a server error."""
    rng = random.Random(16)

    async def main() -> None:
        cfg = RouterConfig(p="127.0.0.1:9", rld="127.0.0.1:10", md="127.0.0.1:11", deadline_s=2.0)
        router = Router(cfg)
        service = RouterService(router)
        server = grpc.aio.server()
        add_router_service(server, service)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        seen = {"ok": 0, "refused": 0, "undecodable": 0}
        t0 = time.monotonic()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                raw_call = ch.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)
                typed_call = ch.unary_stream(
                    GENERATE,
                    request_serializer=pb2.GenerateRequest.SerializeToString,
                    response_deserializer=pb2.GenerateEvent.FromString,
                )
                for i in range(SOCKET_CASES):
                    raw, msg = _socket_case(rng, i)
                    kind, message = judge(service, raw)
                    seen[kind] += 1
                    call = typed_call(msg, timeout=20) if msg is not None else raw_call(raw, timeout=20)
                    events = 0
                    try:
                        async for _ in call:
                            events += 1
                    except grpc.aio.AioRpcError as exc:
                        if kind == "ok":  # admission may refuse, typed; never a server error or a hang
                            assert exc.code() in (
                                grpc.StatusCode.UNAVAILABLE,
                                grpc.StatusCode.RESOURCE_EXHAUSTED,
                            ), exc
                        else:
                            assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT, (raw[:80], exc)
                            assert exc.details() == message, (raw[:80], exc.details(), message)
                        continue
                    assert kind == "ok" and events >= 1, (raw[:80], kind, message)
                status = ch.unary_unary("/pddlink.v1.Router/Status", request_serializer=None)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await status(b"\xff\xff\xff", timeout=5)  # Status's bytes are decoded the same way
                assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT, refused.value
            assert sum(seen.values()) == SOCKET_CASES and all(seen.values()), seen
            assert router.in_flight == {}
        finally:
            await server.stop(0)
            await router.close()
        record("grpc_sockets", seen, time.monotonic() - t0)

    asyncio.run(main())
