"""Request bodies over 64 kB are parsed in worker processes (``router.parse_pool``, issue 27): the
answers are the ones the router's own parse gives (same status, same error body), and a worker
killed mid-parse gives its request a typed 503 while the next request is parsed by its replacement;
an idle worker's death costs no request, and a worker killed holding a client's socket leaves no
descriptor of it in the router.

In memory (``RouterApi.http`` with a stand-in router), with real worker processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import uvloop
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from harness import edge_bench as eb
from pddlink.serving.client_guard import ApiConfig
from pddlink.serving.http import Request, Response, serve_http
from router.api import RouterApi
from router.openai_schema import Endpoint
from router.openai_text import TextCodec
from router.parse_pool import PROCESS_BYTES, ParsePool

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]


def _codec() -> TextCodec:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        [" ".join(eb.WORDS)] * 10, trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet)
    )
    return TextCodec(tok, "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")


def _api(processes: int, max_prompt_tokens: int = 8000) -> RouterApi:
    """A router API whose router is a stand-in: every answer here comes before any generating."""
    cfg = SimpleNamespace(
        vocab_size=2048, max_prompt_tokens=max_prompt_tokens, max_tokens_limit=16, deadline_s=5.0
    )
    router: Any = SimpleNamespace(cfg=cfg, backend=SimpleNamespace(), validate=lambda *a: None)
    return RouterApi(router, ApiConfig(parse_processes=processes), _codec())


@pytest.fixture(scope="module", params=["asyncio", "uvloop"])
def loop(request: pytest.FixtureRequest) -> Iterator[asyncio.AbstractEventLoop]:
    """Both loops: the router runs on uvloop, whose sockets and readers differ from asyncio's."""
    loop = uvloop.new_event_loop() if request.param == "uvloop" else asyncio.new_event_loop()
    yield loop
    loop.close()


def _post(
    loop: asyncio.AbstractEventLoop, api: RouterApi, body: bytes, path: str = "/v1/completions"
) -> Response:
    return loop.run_until_complete(api.http(Request("POST", path, "", body, (), "")))


def _padded(obj: dict[str, Any]) -> bytes:
    """``obj`` as JSON with trailing whitespace: over the process threshold, the same request."""
    body = json.dumps(obj).encode()
    return body + b" " * max(0, PROCESS_BYTES + 1 - len(body))


def _exchange(port: int, parts: list[bytes], answers: int, pause_s: float = 0.0) -> tuple[bytes, float]:
    """``parts`` sent on one connection, ``pause_s`` apart: what comes back until ``answers`` answers
    (or the server closes), and the seconds that took."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        t0 = time.monotonic()
        for i, part in enumerate(parts):
            time.sleep(pause_s if i else 0.0)
            s.sendall(part)
        got = b""
        while got.count(b"HTTP/1.1 ") < answers or not got.endswith(b"}\n"):
            if not (data := s.recv(65536)):
                break
            got += data
        return got, time.monotonic() - t0


BODIES = {
    "over the byte limit": json.dumps({"prompt": eb.text(1_000_000, 1), "max_tokens": 2}).encode(),
    "over the token limit": json.dumps({"prompt": eb.text(120_000, 1), "max_tokens": 2}).encode(),
    "escapes": json.dumps({"prompt": "é\n" * 30_000, "max_tokens": 2}, ensure_ascii=True).encode(),
    "a bad field": _padded({"prompt": [1, 2, 3], "max_tokens": -1}),
    "an unknown sampling field": _padded({"prompt": [1, 2, 3], "temperature": "hot"}),
    "not JSON": b"{" + b" " * PROCESS_BYTES,
    "chat without messages": _padded({"messages": []}),
}


@pytest.mark.parametrize("name", sorted(BODIES))
def test_a_worker_process_answers_as_the_router_would(loop: asyncio.AbstractEventLoop, name: str) -> None:
    body = BODIES[name]
    assert len(body) > PROCESS_BYTES
    path = "/v1/chat/completions" if name.startswith("chat") else "/v1/completions"
    in_process, in_workers = _api(0), _api(1)
    loop.run_until_complete(in_workers.start())
    assert in_workers.parsers is not None and in_workers.parsers.ready
    try:
        here = _post(loop, in_process, body, path)
        there = _post(loop, in_workers, body, path)
    finally:
        in_workers.close()
    assert (there.status, there.body) == (here.status, here.body)
    assert there.status == 400, there.body


def test_a_valid_large_body_gives_the_same_job(loop: asyncio.AbstractEventLoop) -> None:
    api = _api(1)
    loop.run_until_complete(api.start())
    bodies = [
        ({"prompt": eb.text(12_000, 3), "max_tokens": 4, "seed": 7}, Endpoint.COMPLETIONS),
        (
            {"prompt": [eb.text(12_000, 4), eb.text(9_000, 6)], "stop": ["relay"], "n": 2, "seed": 1},
            Endpoint.COMPLETIONS,
        ),
        (
            {"messages": [{"role": "user", "content": eb.text(12_000, 5)}], "max_tokens": 3, "seed": 2},
            Endpoint.CHAT,
        ),
    ]
    try:
        for obj, endpoint in bodies:
            body = _padded(obj)
            here = api.parse(body, endpoint)
            req = Request("POST", "/v1/completions", "", body, (), "")
            there = loop.run_until_complete(api.parsed(req, endpoint))
            assert there == here and len(here.prompts[0]) > 1000
    finally:
        api.close()


def test_a_first_large_body_is_parsed_on_a_thread_and_wakes_workers(loop: asyncio.AbstractEventLoop) -> None:
    api = _api(1)
    assert api.parsers is not None and not api.parsers.ready  # nothing spawned with the router
    body = BODIES["over the byte limit"]
    try:
        first = _post(loop, api, body, "/v1/completions")
        assert first.status == 400 and api.parsers.spawning  # answered; a worker spawning

        async def ready() -> None:
            while not api.parsers.ready:  # type: ignore[union-attr]
                await asyncio.sleep(0.05)

        loop.run_until_complete(asyncio.wait_for(ready(), 60))
        then = _post(loop, api, body, "/v1/completions")
        assert (then.status, then.body) == (first.status, first.body)
    finally:
        api.close()


@dataclass(frozen=True)
class _StuckCodec:
    """A tokenizer that never finishes: it marks ``entered`` (a file) and sleeps. Pickled by
    reference to this module, which the worker process imports (pytest's ``sys.path`` is its)."""

    codec: TextCodec
    entered: str

    @property
    def max_token_bytes(self) -> int:
        return self.codec.max_token_bytes

    def encode(self, text: str) -> list[int]:
        Path(self.entered).touch()
        time.sleep(3600)
        return []


def test_a_worker_killed_mid_parse_gives_a_typed_503_and_the_next_request_is_parsed(
    loop: asyncio.AbstractEventLoop, tmp_path: Path
) -> None:
    entered = tmp_path / "entered"
    api = _api(2)
    api.parsers = ParsePool(2, api.limits, _StuckCodec(_codec(), str(entered)), None)  # type: ignore[arg-type]
    loop.run_until_complete(api.start())
    slow = _padded({"prompt": "prefill decode", "max_tokens": 2})

    async def killed() -> Response:
        answer = asyncio.ensure_future(api.http(Request("POST", "/v1/completions", "", slow, (), "")))
        for _ in range(600):  # the worker is in the tokenizer: mid-parse
            await asyncio.sleep(0.05)
            if entered.exists():
                break
        assert entered.exists() and not answer.done()
        for child in multiprocessing.active_children():
            os.kill(child.pid or 0, signal.SIGKILL)
        return await asyncio.wait_for(answer, 10)

    try:
        lost = loop.run_until_complete(killed())
        error = json.loads(lost.body)["error"]  # type: ignore[arg-type]
        assert lost.status == 503 and error["type"] == "ServiceUnavailableError", lost
        assert ("retry-after", "1") in lost.headers and "send it again" in error["message"]
        over = BODIES["over the byte limit"]  # refused on its bytes, before the tokenizer
        again = loop.run_until_complete(
            asyncio.wait_for(api.http(Request("POST", "/v1/completions", "", over, (), "")), 60)
        )
        assert again.status == 400 and b"bytes of text" in again.body  # type: ignore[operator]
    finally:
        api.close()


_POOL_OWNER = """
import asyncio, multiprocessing, sys
from router.openai_schema import Limits
from router.parse_pool import ParsePool
async def main():
    pool = ParsePool(2, Limits(2048, 8000, 16), None, None)
    await pool.start()
    print(" ".join(str(c.pid) for c in multiprocessing.active_children()), flush=True)
    await asyncio.sleep(3600)
if __name__ == "__main__":
    asyncio.run(main())
"""


def test_the_workers_end_with_a_router_killed_outright(tmp_path: Path) -> None:
    script = tmp_path / "owner.py"
    script.write_text(_POOL_OWNER)
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        workers = [int(pid) for pid in owner.stdout.readline().split()]
        assert len(workers) == 2 and all(_alive(pid) for pid in workers)
    finally:
        owner.kill()
        owner.wait(10)
    until = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < until:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in workers)


def _alive(pid: int) -> bool:
    """``pid`` runs and is not a zombie (the test's own children are reaped by no one else)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_a_body_left_on_the_socket_is_received_by_a_worker(loop: asyncio.AbstractEventLoop) -> None:
    """Over real HTTP (plaintext): a 1 MB body is received by the worker from the client's socket
    (the router holds only what came with the head), answered as the router's own parse answers it,
    and the request after it on the same connection is served; a body that stops arriving gets 408
    by its deadline and the connection ends."""
    api = _api(1)
    api.api = ApiConfig(parse_processes=1, body_timeout_s=1.5)
    big = BODIES["over the byte limit"]
    small = json.dumps({"prompt": [1, 2], "max_tokens": -1}).encode()  # refused on the loop
    want = [_post(loop, _api(0), b).body for b in (big, small)]
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n"
    lent: list[tuple[bool, str, int]] = []

    async def handler(req: Request) -> Response:
        resp = await api.http(req)
        if req.lent is not None:
            lent.append((req.lent.lent_out, req.lent.state.value, len(req.lent.first)))
        return resp

    async def main() -> None:
        await api.start()
        servers = await serve_http(handler, host="127.0.0.1", port=0, limits=api.http_limits())
        port = servers[0].sockets[0].getsockname()[1]
        try:
            wire = head % len(big) + big + head % len(small) + small
            got, _ = await asyncio.to_thread(_exchange, port, [wire], 2)
            assert got.count(b"HTTP/1.1 400") == 2, got[:400]
            assert all(isinstance(w, bytes) and w in got for w in want)
            assert len(lent) == 1 and lent[0][:2] == (True, "read") and lent[0][2] < len(big) // 2
            stalled, took = await asyncio.to_thread(_exchange, port, [head % len(big) + big[:200_000]], 1)
            assert b"HTTP/1.1 408" in stalled and b"connection: close" in stalled.lower()
            assert 1.0 < took < 5, took
            assert lent[1][:2] == (True, "lost")
        finally:
            for s in servers:
                s.close()
            api.close()

    loop.run_until_complete(main())


def test_a_slow_client_gives_its_worker_back(loop: asyncio.AbstractEventLoop) -> None:
    """A client that sends part of its 1 MB body and pauses holds the one worker no longer than
    ``give_back_s``: the worker gives back what it received, the router receives the rest, and the
    answer is the router's own; meanwhile another client's 1 MB body is answered by the freed worker."""
    api = _api(1)
    big = BODIES["over the byte limit"]
    want = _post(loop, _api(0), big).body
    assert isinstance(want, bytes)
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(big)

    async def main() -> None:
        await api.start()
        assert api.parsers is not None
        api.parsers.give_back_s = 0.3
        servers = await serve_http(api.http, host="127.0.0.1", port=0, limits=api.http_limits())
        port = servers[0].sockets[0].getsockname()[1]
        try:
            parts = [head + big[:200_000], big[200_000:]]
            slow = asyncio.ensure_future(asyncio.to_thread(_exchange, port, parts, 1, 1.5))
            await asyncio.sleep(0.1)  # the slow body is with the worker
            fast, fast_s = await asyncio.to_thread(_exchange, port, parts, 1)
            (slow_got, slow_s) = await slow
            assert want in fast and fast_s < 1.2, fast_s  # not behind the slow client's 1.5 s pause
            assert want in slow_got and slow_s >= 1.5
        finally:
            for s in servers:
                s.close()
            api.close()

    loop.run_until_complete(main())


def test_an_idle_worker_killed_costs_no_request(loop: asyncio.AbstractEventLoop) -> None:
    """A worker killed while idle is seen at once (its socket ends): the requests after it go to
    the live worker, none gets 503, and a replacement joins."""
    api = _api(2)
    body = BODIES["over the byte limit"]

    async def main() -> None:
        await api.start()
        pool = api.parsers
        assert pool is not None and len(pool.live) == 2
        victim = next(iter(pool.live)).proc
        os.kill(victim.pid or 0, signal.SIGKILL)
        await _until(lambda: len(pool.live) == 1, 2.0)
        assert all(w.proc is not victim for w in pool.live)
        answers = await asyncio.gather(
            *(api.http(Request("POST", "/v1/completions", "", body, (), "")) for _ in range(4))
        )
        assert [a.status for a in answers] == [400] * 4, [a.body for a in answers]
        await _until(lambda: len(pool.live) == 2, 30.0)  # the replacement loads

    try:
        loop.run_until_complete(asyncio.wait_for(main(), 60))
    finally:
        api.close()


def test_a_worker_killed_holding_a_lent_socket_leaves_no_descriptor(loop: asyncio.AbstractEventLoop) -> None:
    """A worker killed while it receives a lent body: the client gets an answer and its connection
    is closed, the router holds no descriptor of that connection afterwards, and the next lent
    body is received by the replacement."""
    api = _api(1)
    api.api = ApiConfig(parse_processes=1, body_timeout_s=3.0)
    big = BODIES["over the byte limit"]
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(big)

    def sockets() -> int:
        """The router's sockets (the test's own pipes and files vary: not counted)."""
        names = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
                names.append(os.readlink(f"/proc/self/fd/{fd}"))
        return sum(name.startswith("socket:") for name in names)

    async def main() -> None:
        await api.start()
        pool = api.parsers
        assert pool is not None
        servers = await serve_http(api.http, host="127.0.0.1", port=0, limits=api.http_limits())
        port = servers[0].sockets[0].getsockname()[1]
        try:
            before = sockets()
            stalled = asyncio.ensure_future(asyncio.to_thread(_exchange, port, [head + big[:300_000]], 1))
            await asyncio.sleep(0.3)  # the worker holds the socket, waiting for the rest
            (worker,) = pool.live
            os.kill(worker.proc.pid or 0, signal.SIGKILL)
            got, took = await stalled
            assert got.startswith(b"HTTP/1.1 ") and b"connection: close" in got.lower(), got[:300]
            assert took < 3.0, took
            await _until(lambda: bool(pool.live), 30.0)
            await asyncio.sleep(0.2)
            assert sockets() == before  # the replacement's for the old worker's; none of the client's
            whole, _ = await asyncio.to_thread(_exchange, port, [head + big], 1)
            assert b"HTTP/1.1 400" in whole and b"bytes of text" in whole
        finally:
            for s in servers:
                s.close()

    try:
        loop.run_until_complete(asyncio.wait_for(main(), 60))
    finally:
        api.close()


def test_closing_the_pool_answers_a_busy_request(loop: asyncio.AbstractEventLoop, tmp_path: Path) -> None:
    """The router stopping while a worker is stuck in a parse: that request gets its 503 at once
    (it does not wait on the worker; on asyncio's loop a closed socket it still read left it
    waiting for good)."""
    entered = tmp_path / "entered"
    api = _api(1)
    api.parsers = ParsePool(1, api.limits, _StuckCodec(_codec(), str(entered)), None)  # type: ignore[arg-type]
    slow = _padded({"prompt": "prefill decode", "max_tokens": 2})

    async def main() -> tuple[Response, list[int]]:
        await api.start()
        pids = [w.proc.pid or 0 for w in api.parsers.live]  # type: ignore[union-attr]
        answer = asyncio.ensure_future(api.http(Request("POST", "/v1/completions", "", slow, (), "")))
        await _until(entered.exists, 30.0)
        assert not answer.done()
        api.close()
        return await asyncio.wait_for(answer, 5), pids

    lost, pids = loop.run_until_complete(main())
    assert lost.status == 503, lost.body
    for pid in pids:  # stuck in the tokenizer for an hour: killed, unless it saw the router go first
        with contextlib.suppress(ProcessLookupError):  # (a worker exits when the router's end closes)
            os.kill(pid, signal.SIGKILL)


async def _until(condition: Callable[[], bool], within_s: float) -> None:
    """Poll ``condition`` until it holds; fail the test if it does not within ``within_s``."""
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {within_s} s"
        await asyncio.sleep(0.02)
