"""The router's client APIs: gRPC ``Router.Generate`` (server streaming) and an HTTP endpoint in
the style of OpenAI's completions API (``POST /v1/completions``, ``"stream": true`` for server-sent
events), plus GET /metrics, /healthz, /status. Malformed requests get a 4xx with a message naming
the problem and change nothing (no request id is taken, no sidecar is contacted).

With ``tls_dir`` the gRPC port takes mutual TLS 1.3 (clients hold a certificate of the
deployment's CA); the unix socket (``--unix``) stays plaintext for local clients, guarded by its
file mode (0600); the HTTP endpoint is plaintext.

Prompts are token ids (a list of ints, as the OpenAI API allows); a string prompt is taken as
UTF-8 bytes, one token per byte (id = byte + 1): there is no tokenizer in the reference engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from engines_adapter import SamplingParams
from pddlink import metrics
from pddlink.errors import InvalidInput
from router import Router, RouterConfig
from sidecar.grpc_tls import bind, new_server
from sidecar.http import Request, Response, error_response, json_response, serve_http
from sidecar.rpc import stubs
from sidecar.sampling_pb import sampling_from_pb

pb2, pb2_grpc = stubs()

COMPLETION_FIELDS = {
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop_token_ids",
    "stream",
    "deadline_s",
    "pipeline",
    "user",
}


def parse_completion(body: bytes) -> tuple[list[int], SamplingParams, bool, float, str]:
    """(prompt ids, sampling, stream, deadline_s, pipeline) from a request body; ``InvalidInput`` else."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise InvalidInput("body must be a JSON object")
    unknown = set(obj) - COMPLETION_FIELDS
    if unknown:
        raise InvalidInput(f"unknown field(s): {', '.join(sorted(unknown))}")
    prompt = obj.get("prompt")
    if isinstance(prompt, str):
        ids = [b + 1 for b in prompt.encode()]
    elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
        ids = list(prompt)
    else:
        raise InvalidInput('"prompt" is required: a string or a list of token ids (ints)')
    if not ids:
        raise InvalidInput('"prompt" must not be empty')

    def num(name: str, kind: type, default: Any) -> Any:
        v = obj.get(name, default)
        if kind is float and type(v) is int:
            v = float(v)
        if type(v) is not kind:
            raise InvalidInput(f'"{name}" must be {kind.__name__}, got {v!r}')
        return v

    stops = obj.get("stop_token_ids", [])
    if not isinstance(stops, list) or not all(type(t) is int for t in stops):
        raise InvalidInput('"stop_token_ids" must be a list of ints')
    sampling = SamplingParams(
        seed=num("seed", int, 0),
        temperature=num("temperature", float, 0.0),
        top_k=num("top_k", int, 0),
        top_p=num("top_p", float, 1.0),
        max_tokens=num("max_tokens", int, 16),
        stop_token_ids=tuple(stops),
    )
    stream = num("stream", bool, False)
    deadline_s = num("deadline_s", float, 0.0)
    pipeline = num("pipeline", str, "")
    return ids, sampling, stream, deadline_s, pipeline


class RouterApi:
    def __init__(self, router: Router) -> None:
        self.router = router

    async def http(self, req: Request) -> Response:
        if req.method == "GET" and req.path == "/metrics":
            body, ctype = metrics.render()
            return Response(200, body, ctype)
        if req.method == "GET" and req.path == "/healthz":
            return json_response(200, {"ok": True})
        if req.method == "GET" and req.path == "/status":
            return json_response(200, self.router.status())
        if req.path == "/v1/completions":
            if req.method != "POST":
                return error_response(405, "use POST for /v1/completions")
            return await self._completion(req)
        return error_response(404, f"no such endpoint: {req.method} {req.path}")

    async def _completion(self, req: Request) -> Response:
        try:
            prompt, sampling, stream, deadline_s, pipeline = parse_completion(req.body)
            self.router.validate(prompt, sampling, deadline_s or self.router.cfg.deadline_s, pipeline)
        except InvalidInput as exc:
            metrics.CLIENT_ERRORS.labels(api="http").inc()
            return error_response(400, exc.message)
        gen = self.router.generate(prompt, sampling, deadline_s=deadline_s, pipeline=pipeline)
        created = int(time.time())
        if stream:
            return Response(200, self._sse(gen, created), "text/event-stream")
        tokens: list[int] = []
        final: dict[str, Any] = {}
        async for ev in gen:
            if ev.get("done"):
                final = ev
            else:
                tokens.append(ev["token_id"])
        status = 200 if final.get("outcome") == "finished" else 503
        return json_response(
            status,
            {
                "id": final.get("request_id"),
                "object": "text_completion",
                "created": created,
                "model": "pddlink",
                "choices": [{"index": 0, "token_ids": tokens, "text": "", "finish_reason": _finish(final)}],
                "pddlink": final.get("trace", {}),
            },
        )

    async def _sse(self, gen: AsyncIterator[dict[str, Any]], created: int) -> AsyncIterator[bytes]:
        async for ev in gen:
            if ev.get("done"):
                chunk = {
                    "id": ev["request_id"],
                    "object": "text_completion",
                    "created": created,
                    "choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": _finish(ev)}],
                    "pddlink": ev["trace"],
                }
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
                return
            chunk = {
                "object": "text_completion",
                "created": created,
                "choices": [
                    {
                        "index": 0,
                        "text": "",
                        "token_ids": [ev["token_id"]],
                        "position": ev["position"],
                        "source": ev["source"],
                        "finish_reason": None,
                    }
                ],
            }
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"


def _finish(final: dict[str, Any]) -> str:
    return "stop" if final.get("outcome") == "finished" else f"error: {final.get('reason', '')}"


class RouterService(pb2_grpc.RouterServicer):  # type: ignore[misc,name-defined]
    def __init__(self, router: Router) -> None:
        self.router = router

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        try:
            sampling = sampling_from_pb(request.sampling)
            gen = self.router.generate(
                list(request.prompt),
                sampling,
                deadline_s=request.deadline_s,
                pipeline=request.pipeline,
                request_id=request.request_id,
            )
            first = await gen.__anext__()  # validation happens before the first event
        except InvalidInput as exc:
            metrics.CLIENT_ERRORS.labels(api="grpc").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
            return
        ev = first
        while True:
            if ev.get("done"):
                yield pb2.GenerateEvent(
                    done=True, outcome=ev["outcome"], reason=ev["reason"], trace_json=json.dumps(ev["trace"])
                )
                return
            yield pb2.GenerateEvent(position=ev["position"], token_id=ev["token_id"], source=ev["source"])
            ev = await gen.__anext__()

    async def Status(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return pb2.StatusReply(json=json.dumps(self.router.status()))


async def serve_router(cfg: RouterConfig, *, host: str, grpc_port: int, http_port: int, unix: str) -> None:
    router = Router(cfg)
    await router.start()
    server, router.caller_check = new_server(router.tls, local_plaintext=bool(unix))
    pb2_grpc.add_RouterServicer_to_server(RouterService(router), server)
    bound = bind(server, f"{host}:{grpc_port}", router.tls)
    if unix:  # local clients (the demo, outside the lab's namespaces): guarded by file permissions
        bind(server, f"unix:{unix}.grpc", None)
    await server.start()
    if unix:
        os.chmod(f"{unix}.grpc", 0o600)
    api = RouterApi(router)
    http = await serve_http(api.http, host=host, port=http_port or None, unix=unix)
    sys.stdout.write(
        "READY " + json.dumps({"role": "router", "grpc_port": bound, "http_port": http_port}) + "\n"
    )
    sys.stdout.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for s in http:
            s.close()
        await server.stop(grace=0.5)
        await router.close()
