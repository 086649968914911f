"""Fuzzing the router's request bodies: every body is either a valid job or a typed refusal (400 /
INVALID_ARGUMENT), never another exception, a 5xx or a hang.

In-process, hypothesis draws request bodies (fields of the right and of the wrong kind, nesting,
huge numbers, NaN) and each drawn body is also mutated byte-wise, so one example checks many
cases; ``PDDLINK_FUZZ_CASES`` (default 100,000; ``pddlink bench fuzz --cases N`` for more) sets
how many. An accepted job must also convert into the sidecars' messages (issue 16's case 1: a
conversion raised in a leg). Over real sockets, a smaller number of the same bodies goes to a real
router's HTTP port: each refused body must be answered 400 with the same message, each accepted
one must not get a 500 and must end in time (the sidecars are not there, so it fails fast with a
typed 503). The gRPC requests have their own fuzz (``test_router_fuzz_grpc``).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _fuzz_cases import CASES, TIMEOUT_S, record
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pddlink.errors import InvalidInput
from pddlink.serving.http import serve_http
from pddlink.serving.pb import pb2
from pddlink.serving.sampling_pb import sampling_to_pb
from router import Router, RouterConfig
from router.api import RouterApi
from router.openai_job import Job
from router.openai_schema import Endpoint
from router.openai_text import TextCodec
from router.vllm_legs import sampling_body

MUTATIONS = 99  # byte-wise variants of each drawn body
EXAMPLES = max(1, CASES // (MUTATIONS + 1))

FIELDS = [
    "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
    "stream", "stream_options", "n", "user", "frequency_penalty", "presence_penalty", "logit_bias",
    "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "return_token_ids", "min_tokens",
    "deadline_s", "pipeline", "best_of", "echo", "logprobs", "suffix", "messages", "max_completion_tokens",
]  # fmt: skip

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-3, max_value=5000),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from(["p_md", "singular", "", "tiny", "pddlink", "user", "assistant"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
prompts = st.one_of(
    st.lists(st.integers(min_value=-2, max_value=2100), max_size=8),
    st.text(max_size=20),
    st.lists(st.lists(st.integers(min_value=0, max_value=2047), min_size=1, max_size=4), max_size=3),
    values,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "bot"]), "content": st.text(max_size=10)}
    ),
    max_size=3,
)
VALID = {
    "model": st.sampled_from(["pddlink", None]),
    "max_tokens": st.integers(1, 64),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.one_of(st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=4)),
    "stop_token_ids": st.lists(st.integers(0, 2047), max_size=8),
    "stream": st.booleans(),
    "n": st.just(1),
    "ignore_eos": st.booleans(),
    "deadline_s": st.floats(0.5, 60),
    "pipeline": st.sampled_from(["", "p_md", "p_rld_md", "singular"]),
    "return_token_ids": st.booleans(),
}
valid_bodies = st.fixed_dictionaries(
    {
        "prompt": st.one_of(
            st.lists(st.integers(0, 2047), min_size=1, max_size=8), st.text(min_size=1, max_size=20)
        )
    },
    optional=VALID,
)
valid_chats = st.fixed_dictionaries(
    {
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=10)}),
            min_size=1,
            max_size=3,
        )
    },
    optional=VALID,
)
random_bodies = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), values, max_size=6).flatmap(
    lambda extra: st.fixed_dictionaries({}, optional={"prompt": prompts, "messages": messages}).map(
        lambda base: {**extra, **base}
    )
)
bodies = st.one_of(valid_bodies, valid_chats, random_bodies)


def _mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(5)
        at = rng.randrange(len(b) + 1)
        if op == 0 and b:
            b[min(at, len(b) - 1)] = rng.randrange(256)
        elif op == 1:
            b[at:at] = rng.choice(
                [b"[", b"{", b'"', b"1e999", b"-", b"9" * 30, b"NaN", b"\\u0000", b",", b"\xff"]
            )
        elif op == 2:
            del b[at : at + rng.randint(1, 8)]
        elif op == 3:
            b = b[:at]
        else:
            b[at:at] = b"[" * rng.randint(1, 300)
    return bytes(b)


ODD = [
    None,
    -1,
    0,
    1,
    3,
    2**31,
    2**40,
    -(2**63),
    0.5,
    -0.0,
    1e308,
    "",
    "x",
    "p_md",
    [],
    [1, -5],
    [[1]],
    {},
    True,
]


def _perturb(body: dict[str, Any], rng: random.Random) -> bytes:
    """The body with one field set to an odd value, or removed (JSON stays valid)."""
    out = dict(body)
    key = rng.choice(FIELDS)
    if key in out and rng.random() < 0.3:
        del out[key]
    else:
        out[key] = rng.choice(ODD)
    return json.dumps(out).encode()


def _judge(api: RouterApi, body: bytes, endpoint: Endpoint) -> str:
    """'ok' or the refusal's message; anything else raised fails the test."""
    try:
        job = api.parse(body, endpoint)
    except InvalidInput as exc:
        assert exc.message
        return exc.message
    assert isinstance(job, Job) and job.prompts and all(job.prompts)
    for prompt in job.prompts:  # what the legs make of it must not raise (issue 16, case 1)
        pb2.AttachRequest(request_id="r", prompt=list(prompt), sampling=sampling_to_pb(job.sampling))
    sampling_body(job.sampling)
    return "ok"


def _codec() -> TextCodec:
    """A small byte-level BPE trained here, with a chat template: text prompts and chat parse."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        ["prefill decode relay main wan"] * 10, trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet)
    )
    return TextCodec(tok, "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")


@pytest.fixture(scope="module")
def api() -> Iterator[RouterApi]:
    loop = asyncio.new_event_loop()  # the router's gRPC channels belong to a loop (never run here)
    asyncio.set_event_loop(loop)
    cfg = RouterConfig(p="127.0.0.1:9", rld="127.0.0.1:10", md="127.0.0.1:11")
    router = Router(cfg)
    yield RouterApi(router, codec=_codec())
    loop.run_until_complete(router.close())
    asyncio.set_event_loop(None)
    loop.close()


@pytest.mark.timeout(TIMEOUT_S)
def test_fuzz_request_bodies_in_process(api: RouterApi) -> None:
    seen = {"ok": 0, "refused": 0}

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(body=bodies, seed=st.integers(0, 2**32), swap=st.integers(0, 9))
    def check(body: dict[str, Any], seed: int, swap: int) -> None:
        chat = ("messages" in body) != (swap == 0)  # mostly the body's own endpoint, sometimes the other
        endpoint = Endpoint.CHAT if chat else Endpoint.COMPLETIONS
        data = json.dumps(body).encode()
        rng = random.Random(seed)
        variants = [_mutate(data, rng) if i % 2 else _perturb(body, rng) for i in range(MUTATIONS)]
        for raw in [data, *variants]:
            verdict = _judge(api, raw, endpoint)
            seen["ok" if verdict == "ok" else "refused"] += 1

    t0 = time.monotonic()
    check()
    record("http", seen, time.monotonic() - t0)
    assert sum(seen.values()) >= CASES
    assert seen["refused"] > CASES // 100 and seen["ok"] > CASES // 100  # both sides of the schema


def _post(port: int, body: bytes, path: str) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    try:
        conn.request("POST", path, body=body, headers={"content-type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


@pytest.mark.timeout(300)
def test_fuzz_request_bodies_over_sockets() -> None:
    """The same bodies through a real router's HTTP port: same verdicts, no 5xx for a refused
    body, no 500 and no hang for an accepted one."""
    rng = random.Random(16)

    async def main() -> None:
        cfg = RouterConfig(p="127.0.0.1:9", rld="127.0.0.1:10", md="127.0.0.1:11", deadline_s=2.0)
        router = Router(cfg)
        api = RouterApi(router)
        servers = await serve_http(api.http, host="127.0.0.1", port=0)
        port = servers[0].sockets[0].getsockname()[1]
        try:
            cases = 0
            for i in range(300):
                body = {"prompt": [rng.randrange(-2, 2100) for _ in range(rng.randrange(0, 4))]}
                for f in rng.sample(FIELDS, 3):
                    body[f] = rng.choice(
                        [None, -1, 0, 1, 2**40, 0.5, "x", [1, -5], {"include_usage": True}, True]
                    )
                data = json.dumps(body).encode()
                raw = data if i % 2 else _mutate(data, rng)
                path, endpoint = ("/v1/completions", Endpoint.COMPLETIONS)
                if i % 7 == 0:
                    path, endpoint = ("/v1/chat/completions", Endpoint.CHAT)
                verdict = _judge(api, raw, endpoint)
                status, answer = await asyncio.wait_for(asyncio.to_thread(_post, port, raw, path), 20)
                if verdict == "ok":
                    assert status != 500 and status in (200, 503), (raw[:100], status, answer)
                else:
                    assert status == 400 and answer["error"]["message"] == verdict, (raw[:100], answer)
                cases += 1
            assert cases == 300
            assert router.in_flight == {}
        finally:
            for s in servers:
                s.close()
            await router.close()

    asyncio.run(main())
