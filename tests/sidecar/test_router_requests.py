"""Malformed client requests get a 4xx with a clear message and change nothing at the router.

A real router (its HTTP server on a loopback port, its gRPC service) in front of sidecar addresses
where nothing listens: a request that passed validation would try to reach them, so "nothing
changed" is checked as: no request id taken, nothing in flight, no link-model flow started.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from typing import Any

import grpc
import pytest

from pddlink.serving.http import serve_http
from pddlink.serving.rpc import stubs
from router import Router, RouterConfig
from router.api import RouterApi, RouterService
from router.openai_job import completion_job
from router.openai_schema import Endpoint, Limits, RequestRefused

BAD_BODIES = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (
        b'{"prompt": [1, 2], "max_tokens": 4, "repetition_penalty": 1.2}',
        '"repetition_penalty" is not supported by the reference engine',
    ),
    (b'{"prompt": [1, 2], "min_p": 0.1}', '"min_p" is not supported by the reference engine'),
    (b'{"prompt": [1, 2], "logprobs": 2}', '"logprobs" is not supported by the reference engine'),
    (b'{"prompt": [1, 2], "max_tokens": 4, "min_tokens": 5}', '"min_tokens" must be less than or equal'),
    (b'{"prompt": [1, 2], "logit_bias": {"x": 1}}', '"logit_bias": keys must be token ids'),
    (b'{"prompt": [], "max_tokens": 4}', "must not be empty"),
    (b'{"prompt": "", "max_tokens": 4}', "must not be empty"),
    (b'{"max_tokens": 4}', '"prompt" is required'),
    (b'{"prompt": [1, 2], "max_tokens": 10000000}', "max_tokens"),
    (b'{"prompt": [1, 2], "max_tokens": 5000}', "exceeds the limit 4096"),
    (b'{"prompt": [1, 2], "max_tokens": "8"}', '"max_tokens": Input should be a valid integer'),
    (b'{"prompt": [1, 99999]}', "token ids must be in"),
    (b'{"prompt": [1, 2], "temperature": -1}', "temperature"),
    (b'{"prompt": [1, 2], "pipeline": "fastest"}', '"pipeline": Input should be'),
    # issue 16, case 1: these passed the router's checks and hung until the deadline (503)
    (b'{"prompt": [1, 2, 3], "max_tokens": 4, "stop_token_ids": [-5]}', '"stop_token_ids.0"'),
    (b'{"prompt": [1, 2, 3], "max_tokens": 4, "stop_token_ids": [1099511627776]}', '"stop_token_ids.0"'),
    (b'{"prompt": [1, 2, 3], "max_tokens": 4, "top_k": 1099511627776}', '"top_k"'),
    (b'{"prompt": [1, 2, 3], "stop_token_ids": [' + b"7," * 99_999 + b"7]}", '"stop_token_ids"'),
    (b'{"prompt": [1, 2, 3], "stop": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "recursion limit"),
    (b"[" * 100_000 + b"]" * 100_000, "recursion limit"),
    (b'{"prompt": [1, 2], "temperature": NaN}', '"temperature": Input should be a finite number'),
    (b'{"prompt": [1, 2], "n": 2, "temperature": 0}', '"n" must be 1 when using greedy sampling'),
    (b'{"prompt": [1, 2], "best_of": 2}', "best_of"),
    (b'{"prompt": [1, 2], "stop": [' + b", ".join([b'"s"'] * 17) + b"]}", '"stop"'),
]


def _post(port: int, body: bytes, path: str = "/v1/completions", method: str = "POST") -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, path, body=body, headers={"content-type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read() or b"null")
    conn.close()
    return resp.status, data


@pytest.mark.timeout(60)
def test_malformed_requests_get_400_and_change_nothing() -> None:
    async def main() -> None:
        router = Router(RouterConfig(p="127.0.0.1:9", rld="127.0.0.1:10", md="127.0.0.1:11"))
        servers = await serve_http(RouterApi(router).http, host="127.0.0.1", port=0)
        port = servers[0].sockets[0].getsockname()[1]
        ids_before = next(router.ids)
        try:
            for body, needle in BAD_BODIES:
                t0 = time.monotonic()
                status, answer = await asyncio.to_thread(_post, port, body)
                assert status == 400, (body[:80], answer)
                assert needle in answer["error"]["message"], (body[:80], answer)
                assert time.monotonic() - t0 < 5.0  # refused at once, not at the deadline
            status, _ = await asyncio.to_thread(_post, port, b"", "/v1/completions", "GET")
            assert status == 405
            status, _ = await asyncio.to_thread(_post, port, b"", "/nope", "GET")
            assert status == 404
            assert next(router.ids) == ids_before + 1  # no request id was taken
            assert router.in_flight == {} and router.link.estimate(0.0).flows_in_flight == 0
        finally:
            for s in servers:
                s.close()
            await router.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_grpc_generate_refuses_bad_request() -> None:
    pb2, pb2_grpc = stubs()

    async def main() -> None:
        router = Router(RouterConfig(p="127.0.0.1:9", rld="127.0.0.1:10", md="127.0.0.1:11"))
        server = grpc.aio.server()
        pb2_grpc.add_RouterServicer_to_server(RouterService(router), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb2_grpc.RouterStub(ch)
                bad = [
                    pb2.GenerateRequest(prompt=[], sampling=pb2.Sampling(max_tokens=4)),
                    pb2.GenerateRequest(prompt=[1, 2], sampling=pb2.Sampling(max_tokens=100000)),
                    # issue 16, case 1: these failed inside P instead of being refused here
                    pb2.GenerateRequest(
                        request_id="r" * 300, prompt=[1, 2], sampling=pb2.Sampling(max_tokens=4)
                    ),
                    pb2.GenerateRequest(prompt=[1, 2], sampling=pb2.Sampling(stop_token_ids=[7] * 100_000)),
                    pb2.GenerateRequest(prompt=[1, 2], sampling=pb2.Sampling(top_k=2**31)),
                    pb2.GenerateRequest(prompt=[1, 2], sampling=pb2.Sampling(stop_token_ids=[2**31])),
                    pb2.GenerateRequest(request_id="a b\n", prompt=[1, 2]),
                ]
                for req in bad:
                    t0 = time.monotonic()
                    call = stub.Generate(req, timeout=10)
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        async for _ in call:
                            pass
                    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (
                        req.request_id[:20],
                        err.value,
                    )
                    assert time.monotonic() - t0 < 5.0
            assert router.in_flight == {}
        finally:
            await server.stop(0)
            await router.close()

    asyncio.run(main())


def test_string_prompt_without_a_tokenizer_is_refused_and_defaults() -> None:
    """Issue 27, item 5: no tokenizer, no text (it was taken as bytes and answered with empty text)."""
    limits = Limits(2048, 8000, 4096)
    with pytest.raises(RequestRefused, match=r"no tokenizer \(\[api\] tokenizer\)") as err:
        completion_job(b'{"prompt": "AB", "stream": true}', Endpoint.COMPLETIONS, limits, None)
    assert err.value.param == "prompt"
    job = completion_job(b'{"prompt": [66, 67], "stream": true}', Endpoint.COMPLETIONS, limits, None)
    assert job.prompts == ((66, 67),) and job.sampling.max_tokens == 16 and job.stream
    assert job.deadline_s == 0.0 and job.pipeline == "" and job.sampling.temperature == 1.0


def test_schema_pipelines_are_the_routing_pipelines() -> None:
    import typing

    from router.openai_schema import CompletionBody, GenerateBody
    from router.options import FORCEABLE

    for model in (CompletionBody, GenerateBody):
        allowed = set(typing.get_args(model.model_fields["pipeline"].annotation))
        assert allowed == {"", *FORCEABLE}


def test_vllm_fields_at_their_neutral_value_pass_and_unknown_fields_are_ignored_as_vllm_does() -> None:
    """Issue 27: ``vllm bench serve --backend openai`` sends ``repetition_penalty: 1.0`` (it was
    refused as an unknown field); a field vLLM does not know either is ignored, as vLLM does."""
    limits = Limits(2048, 8000, 4096)
    bench = {"prompt": [5, 6], "repetition_penalty": 1.0, "logprobs": None, "max_tokens": 2}
    bench |= {"stream": True, "stream_options": {"include_usage": True, "x": 1}, "temprature": 0.5}
    job = completion_job(json.dumps(bench).encode(), Endpoint.COMPLETIONS, limits, None)
    assert job.prompts == ((5, 6),) and job.sampling.temperature == 1.0 and job.include_usage
    for field, value in (("truncate_prompt_tokens", 5), ("cache_salt", "s"), ("tools", [{}])):
        body = json.dumps({"prompt": [5], field: value}).encode()
        with pytest.raises(RequestRefused, match=f'"{field}" is not supported by pddlink') as err:
            completion_job(body, Endpoint.COMPLETIONS, limits, None)
        assert err.value.param == field
