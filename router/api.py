"""The router's client APIs: gRPC ``Router.Generate`` (server streaming) and an HTTP API in the
shape of vLLM's OpenAI-compatible server (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``; ``"stream": true`` for server-sent events), plus GET /metrics, /healthz, /readyz,
/status, /memory. /readyz (open, like /healthz) answers 503 with the problems when the router is
misconfigured in a way that serving hides: an MD's KV-event endpoint (``[vllm] md_kv_events``, a
vLLM topology's ``kv_events``) where no publisher has been connected for a while
(``router.mirror.PublisherWatch``).

Every request is validated whole by one schema (``router.openai_schema``) before any work starts:
a bad field gets 400 (gRPC ``INVALID_ARGUMENT``) naming it, and nothing changes (no request id is
taken, no sidecar is contacted); so do gRPC request bytes that decode to no message
(``add_router_service``). Then ``ClientGuard`` (``[api]`` settings) admits it or refuses it at
once: 401 without a valid API key (gRPC ``UNAUTHENTICATED``), 429 over the client's rate, 503 when
the router runs its limit of concurrent requests (gRPC ``RESOURCE_EXHAUSTED`` / ``UNAVAILABLE``),
with ``Retry-After``. Responses are built by ``router.openai_api``.

With ``tls_dir`` the gRPC port takes mutual TLS 1.3 (clients hold a certificate of the
deployment's CA) and, with ``api.http_mtls``, so does the HTTP port. The unix sockets (``--unix``)
stay plaintext and keyless for local clients, guarded by their file mode (0600).

Prompts are token ids or text; text needs ``api.tokenizer`` (a model directory), else it is
refused (400, naming the setting). A text prompt longer in bytes than the prompt token limit
allows is refused before it is tokenized; a large body is parsed and tokenized off the event loop:
over 64 kB in worker processes (``router.parse_pool``, ``api.parse_processes``; a worker that dies
answers its requests 503), else on threads (``router.openai_text.TextWorkers``,
``api.tokenizer_workers``). Over plaintext HTTP such a body is not even received by the router: the
worker reads it from the client's socket (``pddlink.serving.http_lent``); a body that misses its
deadline there is answered 408.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from pddlink import metrics
from pddlink.errors import ConfigError, InvalidInput, NotFound
from pddlink.serving.client_guard import ApiConfig, ClientGuard, Refusal
from pddlink.serving.grpc_tls import bind, new_server
from pddlink.serving.http import ConnectionGate, HttpLimits, Request, Response, json_response, serve_http
from pddlink.serving.malloc_trim import (
    fix_mmap_threshold,
    freeze_startup,
    heap_stats,
    trim_every,
    types_asked,
)
from pddlink.serving.rpc import stubs
from pddlink.serving.write_bound import WriteBound
from router import Router, RouterConfig
from router.admission import Overloaded, grpc_rejection, http_rejection
from router.answer import GenerateEvent, RequestEnd
from router.openai_api import Responder, error_body, models_body
from router.openai_job import Job, completion_job, generate_job
from router.openai_schema import Endpoint, Limits, RequestRefused
from router.openai_text import TextCodec, TextWorkers
from router.parse_pool import PROCESS_BYTES, BodyNotReceived, NoParser, ParsePool, ParserLost

pb2, pb2_grpc = stubs()

PATHS = {"/v1/completions": Endpoint.COMPLETIONS, "/v1/chat/completions": Endpoint.CHAT}


def limits_of(cfg: RouterConfig, api: ApiConfig | None = None) -> Limits:
    prompt_bytes = api.max_prompt_bytes if api is not None else 0
    return Limits(cfg.vocab_size, cfg.max_prompt_tokens, cfg.max_tokens_limit, prompt_bytes)


def _error(
    status: int, message: str, kind: str, param: str | None = None, retry_after_s: int = 0
) -> Response:
    headers = (("retry-after", str(retry_after_s)),) if retry_after_s else ()
    return json_response(status, error_body(message, kind, status, param or None), headers)


def _refused(r: Refusal) -> Response:
    extra = (("www-authenticate", "Bearer"),) if r.status == 401 else ()
    resp = _error(r.status, r.message, r.kind, retry_after_s=r.retry_after_s)
    return Response(resp.status, resp.body, resp.content_type, resp.headers + extra)


class RouterApi:
    def __init__(
        self,
        router: Router,
        api: ApiConfig | None = None,
        codec: TextCodec | None = None,
        guard: ClientGuard | None = None,
    ) -> None:
        self.router = router
        self.api = api or ApiConfig()
        self.codec = codec
        self.guard = guard or ClientGuard(self.api)
        self.limits = limits_of(router.cfg, self.api)
        self.eos = codec.eos_token_id if codec is not None else None
        self.created = int(time.time())
        self.workers = TextWorkers(self.api.tokenizer_workers)  # large bodies parse off the loop
        n = self.api.parse_processes  # processes spawn at ``start`` (or the first body over 64 kB)
        self.parsers = ParsePool(n, self.limits, codec, self.eos) if n else None
        self.stopping = False  # SIGTERM: /readyz 503, every answer closes its connection
        self.refusing = False  # SIGTERM + ``api.stop_notice_s``: new requests get 503 (retried elsewhere)
        self.admitting = 0  # requests read but not yet running (parsed, admitted): not in ``in_flight``

    def http_limits(self) -> HttpLimits:
        a = self.api
        return HttpLimits(
            max_body_bytes=a.max_body_bytes,
            body_budget_bytes=a.body_budget_bytes,
            header_timeout_s=a.header_timeout_s,
            body_timeout_s=a.body_timeout_s,
            idle_timeout_s=a.idle_timeout_s,
            retry_after_s=a.retry_after_s,
            write_stall_s=a.write_stall_s,
            send_buffer_bytes=a.send_buffer_bytes,
            first_byte_timeout_s=a.first_byte_timeout_s,
            # bodies the parse workers receive themselves, on the endpoints that read them that way
            lend_body_bytes=PROCESS_BYTES + 1 if self.parsers is not None else 0,
            lend_paths=tuple(PATHS),
        )

    @property
    def gate(self) -> ConnectionGate:
        return _Gate(self.guard)

    async def http(self, req: Request) -> Response:
        resp = await self._answer(req)
        if not self.stopping:
            return resp
        # stopping: the connection ends with this answer, so a load balancer's pool drops it
        return Response(resp.status, resp.body, resp.content_type, (*resp.headers, ("connection", "close")),
                        resp.send_by)  # fmt: skip

    async def _answer(self, req: Request) -> Response:
        if req.method == "GET" and req.path == "/healthz":
            return json_response(200, {"ok": True})
        if req.method == "GET" and req.path == "/readyz":
            problems = ["stopping: finishing the requests in flight"] if self.stopping else self.problems()
            return json_response(503 if problems else 200, {"ready": not problems, "problems": problems})
        client = self.guard.authenticate(req.header("authorization"), req.peer) if req.peer else "local"
        if isinstance(client, Refusal):
            metrics.CLIENT_ERRORS.labels(api="http").inc()
            return _refused(client)
        if req.method == "GET" and req.path == "/metrics":
            body, ctype = metrics.render()
            return Response(200, body, ctype)
        if req.method == "GET" and req.path == "/status":
            return json_response(200, self.router.status())
        if req.path in ("/admin/drain", "/admin/undrain"):
            return self._drain(req)
        if req.method == "GET" and req.path == "/memory":
            return json_response(200, heap_stats(top_types=types_asked(req.query)))
        if req.path == "/v1/models":
            if req.method != "GET":
                return _error(405, "use GET for /v1/models", "MethodNotAllowed")
            cfg = self.router.cfg
            root = self.api.tokenizer or self.api.model
            return json_response(
                200,
                models_body(self.api.model, root, cfg.max_prompt_tokens + cfg.max_tokens_limit, self.created),
            )
        endpoint = PATHS.get(req.path)
        if endpoint is not None and self.refusing:  # on a connection opened before SIGTERM
            why = "the router is stopping; send the request to another"
            return _error(503, why, "ServiceUnavailableError", retry_after_s=1)
        if endpoint is not None:
            if req.method != "POST":
                return _error(405, f"use POST for {req.path}", "MethodNotAllowed")
            self.admitting += 1  # a stop waits for it (``_stop_gracefully``) before the router closes
            try:
                return await self._generate(req, endpoint, client)
            finally:
                self.admitting -= 1
        return _error(404, f"no such endpoint: {req.method} {req.path}", "NotFoundError")

    def _drain(self, req: Request) -> Response:
        """``POST /admin/drain {"instance": NAME}``: no new request goes to NAME, those on it end
        normally; ``/admin/undrain`` puts it back (``router.fleet``)."""
        if req.method != "POST":
            return _error(405, f"use POST for {req.path}", "MethodNotAllowed")
        try:
            body = json.loads(req.body or b"{}")
        except ValueError:
            return _error(400, 'the body must be JSON: {"instance": NAME}', "BadRequestError")
        name = body.get("instance") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name:
            return _error(400, "instance: expected an instance name", "BadRequestError", "instance")
        try:
            return json_response(200, self.router.drain(name, undo=req.path == "/admin/undrain"))
        except NotFound as exc:
            return _error(404, exc.message, "NotFoundError", "instance")

    def problems(self) -> list[str]:
        """What makes this router not ready to serve as configured ([] when nothing does)."""
        problems = getattr(self.router.backend, "problems", None)  # the vLLM backend's KV-event mirrors
        return list(problems()) if problems is not None else []

    async def start(self) -> None:
        """Spawn the parsing processes (each loads the tokenizer once) and wait for them; the served
        router does not: its first large body wakes them (``parsed``)."""
        if self.parsers is not None:
            await self.parsers.start()

    def close(self) -> None:
        self.workers.close()
        if self.parsers is not None:
            self.parsers.close()

    def parse(self, body: bytes, endpoint: Endpoint) -> Job:
        """The validated job, or ``RequestRefused`` / ``InvalidInput`` (both answer 400). Runs on a
        ``TextWorkers`` thread for a large body: it reads only the router's configuration."""
        return self.validated(completion_job(body, endpoint, self.limits, self.codec, self.eos))

    def validated(self, job: Job) -> Job:
        """``job`` once the router's own checks pass (``InvalidInput`` else)."""
        deadline_s = job.deadline_s or self.router.cfg.deadline_s
        for prompt in job.prompts:
            self.router.validate(list(prompt), job.sampling, deadline_s, job.pipeline)
        return job

    async def parsed(self, req: Request, endpoint: Endpoint) -> Job:
        """``parse`` where it costs the event loop least: a body over 64 kB in a worker process
        (the router's checks of its job here: they read the router), a smaller one on a thread or,
        a few kB, here and now (a large one too until the workers run: the first wakes them). A
        body the server left on the socket (``req.lent``) is received by the worker, or here while
        no worker runs. ``ParserLost`` when the worker process died, ``BodyNotReceived`` or
        ``TimeoutError`` when the body did not arrive whole."""
        lent, job = req.lent, None
        if lent is not None and self.parsers is not None and self.parsers.ready:
            with contextlib.suppress(NoParser):  # every worker died meanwhile: received here
                job = await self.parsers.job_lent(lent, endpoint)
            if job is not None:
                return self.validated(job)  # (None: a slow client's body, given back part-way)
        try:
            body = req.body if lent is None else await lent.read()
        except ConnectionError as exc:
            raise BodyNotReceived(f"the client left mid-body: {exc}") from None
        if self.parsers is not None and len(body) > PROCESS_BYTES:
            if self.parsers.ready:
                with contextlib.suppress(NoParser):  # as above: parsed on a thread
                    return self.validated(await self.parsers.job(body, endpoint))
            self.parsers.wake()  # this body on a thread, the next ones in the workers once they run
        return await self.workers.run(lambda: self.parse(body, endpoint), len(body))

    async def _generate(self, req: Request, endpoint: Endpoint, client: str) -> Response:
        try:
            job = await self.parsed(req, endpoint)
        except ParserLost as exc:
            return _error(503, exc.message, "ServiceUnavailableError", retry_after_s=self.api.retry_after_s)
        except BodyNotReceived as exc:
            return _error(408, exc.message, "RequestTimeout")
        except TimeoutError:
            return _error(408, "request body not received in time", "RequestTimeout")
        except InvalidInput as exc:
            metrics.CLIENT_ERRORS.labels(api="http").inc()
            return _error(400, exc.message, "BadRequestError", getattr(exc, "param", None))
        if job.model and job.model != self.api.model:
            return _error(
                404,
                f"The model `{job.model}` does not exist. Valid aliases: {self.api.model}.",
                "NotFoundError",
                "model",
            )
        started = time.monotonic()
        refusal = self.guard.admit(client, started)
        if refusal is not None:
            return _refused(refusal)
        deadline_s = job.deadline_s or self.router.cfg.deadline_s
        send_by = WriteBound.for_request(self.api.write_stall_s, started, deadline_s).send_by
        trace = (req.header("pddlink-trace") or "").lower() in ("1", "true")
        responder = Responder(self.router, job, self.api.model, self.codec, self.eos, trace)
        try:
            await responder.admit()  # the router's admission answers before any byte of the reply
        except Overloaded as exc:
            self.guard.release()
            return http_rejection(exc)
        except InvalidInput as exc:  # the router's own checks (after the schema's), before any work
            self.guard.release()
            return _error(400, exc.message, "BadRequestError")
        except BaseException:
            self.guard.release()
            raise
        if job.stream:  # the slot is freed when the stream ends: sent, or cut (``send_by``)
            return Response(200, self._released(responder.events()), "text/event-stream", send_by=send_by)
        try:
            status, obj = await responder.body()
        finally:
            self.guard.release()
        resp = json_response(status, obj)
        return Response(resp.status, resp.body, resp.content_type, resp.headers, send_by)

    async def _released(self, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            async for chunk in events:
                yield chunk
        finally:
            await events.aclose()  # type: ignore[attr-defined]
            self.guard.release()


@dataclass(frozen=True, slots=True)
class _Gate:
    """The HTTP server's ``ConnectionGate`` over ``ClientGuard``'s connection slots."""

    guard: ClientGuard

    def opened(self, conn: int, peer: str, now: float) -> tuple[int, ...] | Response:
        got = self.guard.open_connection(conn, peer, now)
        return _refused(got) if isinstance(got, Refusal) else got

    def headed(self, conn: int, peer: str, authorization: str | None, now: float) -> Response | None:
        refusal = self.guard.connection_headed(conn, authorization, peer, now)
        return None if refusal is None else _refused(refusal)

    def idled(self, conn: int, now: float) -> None:
        self.guard.connection_idle(conn, now)

    def closed(self, conn: int) -> None:
        self.guard.close_connection(conn)


_GRPC_REFUSAL = {401: grpc.StatusCode.UNAUTHENTICATED, 429: grpc.StatusCode.RESOURCE_EXHAUSTED}


class RouterService(pb2_grpc.RouterServicer):  # type: ignore[misc,name-defined]
    def __init__(self, router: Router, guard: ClientGuard | None = None) -> None:
        self.router = router
        self.guard = guard or ClientGuard(ApiConfig())
        self.limits = limits_of(router.cfg)

    async def _who(self, context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
        """The client id, or None after aborting with UNAUTHENTICATED (unix-socket callers are local)."""
        peer = context.peer() or ""
        if peer.startswith("unix:"):
            return "local"
        meta = dict(context.invocation_metadata() or ())
        client = self.guard.authenticate(meta.get("authorization"), peer.rpartition(":")[0])
        if isinstance(client, Refusal):
            metrics.CLIENT_ERRORS.labels(api="grpc").inc()
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, client.message)
            return None
        return client

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Streams the run's events with ``context.write``, each write bounded (``WriteBound``): a
        client that stops reading (HTTP/2 flow control holds the write) is cut with
        ``DEADLINE_EXCEEDED`` and its run cancelled, rather than holding them until it reads."""
        arrived = time.monotonic()  # the deadline counts from here, not from after the checks
        client = await self._who(context)
        if client is None:
            return
        try:
            job = grpc_job(request, self.limits)
        except RequestRefused as exc:
            metrics.CLIENT_ERRORS.labels(api="grpc").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
            return
        refusal = self.guard.admit(client, time.monotonic())
        if refusal is not None:
            context.set_trailing_metadata((("retry-after", str(refusal.retry_after_s)),))
            await context.abort(
                _GRPC_REFUSAL.get(refusal.status, grpc.StatusCode.UNAVAILABLE), refusal.message
            )
            return
        deadline_s = job.deadline_s or self.router.cfg.deadline_s
        bound = WriteBound.for_request(self.guard.cfg.write_stall_s, arrived, deadline_s)
        gen = self.router.generate(
            list(job.prompts[0]),
            job.sampling,
            deadline_s=job.deadline_s,
            pipeline=job.pipeline,
            request_id=job.request_id,
            arrived=arrived,
        )
        try:
            try:
                ev = await gen.__anext__()  # the router's own checks happen before the first event
            except InvalidInput as exc:
                metrics.CLIENT_ERRORS.labels(api="grpc").inc()
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
                return
            except Overloaded as exc:
                await grpc_rejection(context, exc)
                return
            while True:
                if not await _write(context, _event(ev), bound):
                    return  # cut: the finally below cancels the run
                if isinstance(ev, RequestEnd):
                    return
                ev = await gen.__anext__()
        finally:
            await gen.aclose()  # a run not ended is cancelled everywhere
            self.guard.release()

    async def Status(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if await self._who(context) is None:
            return pb2.StatusReply()
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return pb2.StatusReply(json=json.dumps(self.router.status()))


def _event(ev: GenerateEvent) -> Any:
    if isinstance(ev, RequestEnd):
        return pb2.GenerateEvent(
            done=True, outcome=ev.outcome.value, reason=ev.reason, trace_json=json.dumps(ev.trace)
        )
    return pb2.GenerateEvent(position=ev.position, token_id=ev.token_id, source=ev.source)


async def _write(context: grpc.aio.ServicerContext[Any, Any], msg: Any, bound: WriteBound) -> bool:
    """Write ``msg`` within the bound; False (the status set, nothing awaited) when it was cut. No
    ``abort``: it would wait behind the unread messages for as long as the client does not read."""
    try:
        async with asyncio.timeout(bound.left(time.monotonic())):
            await context.write(msg)
    except TimeoutError:
        metrics.WRITES_CUT.labels(api="grpc").inc()
        context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
        context.set_details(f"answer cut: {bound.reason(time.monotonic())}")
        return False
    return True


def _generate_fields(r: Any) -> dict[str, Any]:
    s = r.sampling
    return {
        "request_id": r.request_id,
        "prompt": list(r.prompt),
        "seed": int(s.seed),
        "temperature": float(s.temperature),
        "top_k": int(s.top_k),
        "top_p": float(s.top_p),
        "max_tokens": int(s.max_tokens),
        "stop_token_ids": [int(t) for t in s.stop_token_ids],
        "deadline_s": float(r.deadline_s),
        "pipeline": r.pipeline,
    }


@dataclass(frozen=True, slots=True)
class Undecodable:
    """Request bytes that are no message of the method's type (``add_router_service``)."""

    message: str


def _tolerant(message_type: Any) -> Callable[[bytes], Any]:
    """``message_type``'s deserializer, answering ``Undecodable`` instead of raising: gRPC's own
    answer to a deserializer that raises is ``UNKNOWN`` naming a Python class, a server error for
    what is the client's (measured: mutated ``GenerateRequest`` bytes)."""

    def decode(raw: bytes) -> Any:
        try:
            return message_type.FromString(raw)
        except DecodeError as exc:
            return Undecodable(f"the request is not a valid {message_type.DESCRIPTOR.name}: {exc}")

    return decode


def add_router_service(server: grpc.aio.Server, service: RouterService) -> None:
    """The ``Router`` service on ``server`` (as the generated ``add_RouterServicer_to_server``), its
    requests decoded by ``_tolerant``: undecodable bytes are refused ``INVALID_ARGUMENT``."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate,
            request_deserializer=_tolerant(pb2.GenerateRequest),
            response_serializer=pb2.GenerateEvent.SerializeToString,
        ),
        "Status": grpc.unary_unary_rpc_method_handler(
            service.Status,
            request_deserializer=_tolerant(pb2.StatusRequest),
            response_serializer=pb2.StatusReply.SerializeToString,
        ),
    }
    name = pb2.DESCRIPTOR.services_by_name["Router"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))


def decode_generate(raw: bytes) -> Any:
    """A ``GenerateRequest``'s bytes as the service's deserializer decodes them (or ``Undecodable``)."""
    return _tolerant(pb2.GenerateRequest)(raw)


def grpc_job(request: Any, limits: Limits) -> Job:
    """The service's checks of a decoded ``GenerateRequest`` before any work: the job, or
    ``RequestRefused`` (``INVALID_ARGUMENT``); the router's own checks follow in ``generate``."""
    if isinstance(request, Undecodable):
        raise RequestRefused(request.message)
    return generate_job(_generate_fields(request), limits)


def load_codec(api: ApiConfig) -> TextCodec | None:
    return TextCodec.load(api.tokenizer) if api.tokenizer else None


async def serve_router(
    cfg: RouterConfig, *, host: str, grpc_port: int, http_port: int, unix: str, api: ApiConfig | None = None
) -> None:
    api = api or ApiConfig()
    codec = load_codec(api)  # before binding anything: a bad tokenizer directory is a config error
    guard = ClientGuard.from_config(api)
    router = Router(cfg)
    if api.http_mtls and router.tls is None:
        raise ConfigError("api.http_mtls needs tls_dir (the deployment's PKI)")
    # the router's own process: request bodies and streams' buffers go back to the OS when freed
    # (a process-wide malloc setting, so here and not in Router, which others embed)
    fix_mmap_threshold()
    await router.start()
    server, router.caller_check = new_server(router.tls, local_plaintext=bool(unix))
    add_router_service(server, RouterService(router, guard))
    bound = bind(server, f"{host}:{grpc_port}", router.tls)
    if unix:  # local clients (the demo, outside the lab's namespaces): guarded by file permissions
        bind(server, f"unix:{unix}.grpc", None)
    await server.start()
    if unix:
        os.chmod(f"{unix}.grpc", 0o600)
    rapi = RouterApi(router, api, codec, guard)  # its parsing processes start at the first large body
    tls = router.tls.server_context() if api.http_mtls and router.tls is not None else None
    http = await serve_http(
        rapi.http,
        host=host,
        port=http_port or None,
        unix=unix,
        limits=rapi.http_limits(),
        tls=tls,
        gate=rapi.gate,
    )
    http_bound = http[0].sockets[0].getsockname()[1] if http_port else 0
    sys.stdout.write(
        "READY " + json.dumps({"role": "router", "grpc_port": bound, "http_port": http_bound}) + "\n"
    )
    sys.stdout.flush()
    freeze_startup()  # full GC collections walk only what serving makes (pddlink.serving.malloc_trim)
    # freed heap back to the OS, a full GC collection before each trim: process-wide, so here and
    # not in Router (a host embedding one, as the vLLM demo does beside torch and vLLM, would stop
    # for a collection over its whole heap every few seconds)
    trimmer = asyncio.get_running_loop().create_task(trim_every())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        await _stop_gracefully(router, rapi, server, http, cfg.deadline_s)
    finally:
        trimmer.cancel()
        await asyncio.gather(trimmer, return_exceptions=True)
        for s in http:
            s.close()
        await server.stop(grace=0.5)
        await router.close()
        rapi.close()


async def _stop_gracefully(
    router: Router, rapi: RouterApi, server: grpc.aio.Server, http: list[asyncio.Server], bound_s: float
) -> None:
    """SIGTERM: stop accepting (listeners closed, /readyz 503, gRPC refuses new calls); for
    ``api.stop_notice_s`` still answer what comes on connections opened before (a load balancer's pooled
    ones), each answer closing its connection, while the balancer's health checks take this
    router out; then refuse those too (503); let the requests in flight end, within ``bound_s``
    (the default request deadline; each request ends by its own), then return: the caller closes
    what is left."""
    rapi.stopping = True
    for s in http:
        s.close()
    loop = asyncio.get_running_loop()
    grpc_done = loop.create_task(server.stop(grace=bound_s))  # refuses new RPCs, lets the running end
    until = loop.time() + bound_s
    await asyncio.sleep(min(rapi.api.stop_notice_s, bound_s))
    rapi.refusing = True
    while (router.in_flight or rapi.admitting) and loop.time() < until:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)  # the last events of the streams that just ended reach their clients
    left = len(router.in_flight)
    if left:
        sys.stderr.write(f"router: stopping with {left} request(s) still in flight after {bound_s:.0f} s\n")
    await asyncio.wait({grpc_done}, timeout=1.0)  # the caller's stop(grace=0.5) ends what is left
