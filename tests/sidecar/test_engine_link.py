"""The engine link over real engine processes: exactness, typed errors, deadlines, engine death.

Engines run as ``pddlink engine`` child processes attached to an EngineLink server whose event loop
runs in a background thread, as in the sidecar (RemoteEngine is called from another thread, the
way the sidecar's engine worker thread calls it). The reference is a direct in-process engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from engines_adapter import (
    InvalidBlocks,
    InvalidRequest,
    InvalidTokens,
    KVBlocks,
    LayoutMismatch,
    SamplingParams,
    UnknownRequest,
)
from engines_adapter.base import EngineAdapter
from engines_adapter.link_client import serve_engine
from engines_adapter.link_server import (
    EngineExpectation,
    EngineGone,
    EngineLinkServer,
    EngineTimeout,
    RemoteEngine,
)
from engines_adapter.torch_ref import TorchRefEngine
from pddlink.errors import ConfigError, DeadlineExceeded, Unavailable
from sidecar.config import EngineConfig
from sidecar.engine_process import EngineProcessTimeouts, engine_process

pytestmark = [pytest.mark.process, pytest.mark.timeout(60)]
T = TypeVar("T")
CFG = EngineConfig(preset="tiny", dtype="float64", block_size=4, num_blocks=512, seed=7)


class LoopThread:
    """An event loop in a daemon thread (the sidecar's loop); ``run`` waits on a coroutine there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@contextlib.contextmanager
def remote(lt: LoopThread, call_s: float = 10.0) -> Iterator[RemoteEngine]:
    cm = engine_process(CFG, EngineProcessTimeouts(attach_s=45.0, call_s=call_s), sidecar="test/t0")
    engine = lt.run(cm.__aenter__(), 50.0)
    try:
        yield engine
    finally:
        lt.run(cm.__aexit__(None, None, None), 20.0)


def direct() -> TorchRefEngine:
    return TorchRefEngine(
        CFG.preset, dtype=CFG.dtype, block_size=CFG.block_size, num_blocks=CFG.num_blocks, seed=CFG.seed
    )


@pytest.fixture(scope="module")
def lt() -> Iterator[LoopThread]:
    loop_thread = LoopThread()
    yield loop_thread
    loop_thread.close()


@pytest.fixture(scope="module")
def engines(lt: LoopThread) -> Iterator[dict[str, EngineAdapter]]:
    with remote(lt) as p, remote(lt) as md:
        yield {"p": p, "rld": direct(), "md": md, "alone": direct()}


def alone(engine: EngineAdapter, rid: str, prompt: list[int], sp: SamplingParams) -> list[int]:
    out = engine.prefill(rid, prompt, sp)
    while not out.finished:
        out = engine.decode([rid])[0]
    tokens = engine.tokens(rid)
    engine.release(rid, cache_prefix=False)
    return tokens


def pdd(
    e: dict[str, EngineAdapter], rid: str, prompt: list[int], sp: SamplingParams, held_n: int
) -> list[int]:
    """P (remote) prefills and hands KV out; RLD (direct) takes it in and decodes ``held_n`` tokens;
    MD (remote) takes the missing suffix in, extends with RLD's tokens and decodes the rest."""
    p, rld, md = e["p"], e["rld"], e["md"]
    t0 = p.prefill(rid, prompt, sp)
    whole = p.export_kv(rid)
    block = p.layout.block_size
    cached = min(md.cached_prefix_tokens(prompt), len(prompt) // block * block)
    suffix = p.export_kv(rid, first_block=cached // block)
    p.release(rid)
    rld.import_kv(rid, prompt, [whole], sp)
    held = [t0.token_id]
    out = rld.extend(rid, held)
    while len(held) < held_n:
        held.append(out.token_id)
        out = rld.decode([rid])[0]
    rld.release(rid)
    md.import_kv(rid, prompt, [suffix], sp, reuse_prefix_tokens=cached)
    out = md.extend(rid, held)
    while not out.finished:
        out = md.decode([rid])[0]
    tokens = md.tokens(rid)
    md.release(rid)
    return tokens


CASES = [
    ("greedy", list(range(5, 47)), SamplingParams(max_tokens=12), 3),
    (
        "sampled",
        [(i * 37) % 2000 + 1 for i in range(61)],
        SamplingParams(seed=11, temperature=0.9, top_k=50, max_tokens=14),
        5,
    ),
    # shares the first case's prefix: MD reuses its cached blocks, only the suffix crosses
    (
        "prefix-hit",
        [*range(5, 45), 900, 901, 902],
        SamplingParams(seed=3, temperature=0.7, top_p=0.9, max_tokens=10),
        4,
    ),
]


@pytest.mark.parametrize(("name", "prompt", "sp", "held_n"), CASES, ids=[c[0] for c in CASES])
def test_pdd_over_the_link_matches_one_engine(
    engines: dict[str, EngineAdapter], name: str, prompt: list[int], sp: SamplingParams, held_n: int
) -> None:
    if name == "prefix-hit":
        assert engines["md"].cached_prefix_tokens(prompt) >= 40, "the greedy case should have cached it"
    expected = alone(engines["alone"], name, prompt, sp)
    assert pdd(engines, name, prompt, sp, held_n) == expected
    assert len(expected) == len(prompt) + sp.max_tokens


def test_kv_handed_out_is_the_engines_own(engines: dict[str, EngineAdapter]) -> None:
    p, ref = engines["p"], engines["alone"]
    prompt, sp = list(range(100, 130)), SamplingParams(max_tokens=5)
    p.prefill("kv", prompt, sp)
    ref.prefill("kv", prompt, sp)
    try:
        got, want = p.export_kv("kv", 2, 3), ref.export_kv("kv", 2, 3)
        assert (got.first_block, got.num_blocks, got.num_tokens) == (2, 3, 12)
        assert bytes(got.data) == bytes(want.data) and got.layout == want.layout
    finally:
        p.release("kv", cache_prefix=False)
        ref.release("kv", cache_prefix=False)


def test_bad_input_errors_cross_the_link_typed_and_change_nothing(engines: dict[str, EngineAdapter]) -> None:
    p = engines["p"]
    sp = SamplingParams(max_tokens=50)
    p.prefill("live", [1, 2, 3, 4, 5, 6], sp)
    before = p.tokens("live")
    vocab = p.vocab_size
    refused: list[tuple[Any, type[Exception]]] = [
        (lambda: p.extend("nobody", [1]), UnknownRequest),
        (lambda: p.prefill("live", [1, 2], sp), InvalidRequest),
        (lambda: p.prefill("oov", [1, vocab + 5], sp), InvalidTokens),
        (lambda: p.prefill("neg", [1, -3], sp), InvalidTokens),
        (lambda: p.extend("live", [before[-1], vocab]), InvalidTokens),
        (lambda: p.export_kv("live", 50, 1), InvalidBlocks),
        (lambda: p.decode(["live", "live"]), InvalidRequest),
    ]
    other = direct_layout_kv(p)
    refused.append((lambda: p.import_kv("imp", [1, 2, 3, 4], [other], sp), LayoutMismatch))
    for call, kind in refused:
        with pytest.raises(kind) as info:
            call()
        assert type(info.value) is kind and str(info.value)
        assert p.tokens("live") == before
    with pytest.raises(UnknownRequest):
        p.tokens("imp")
    assert p.decode(["live"])[0].position == len(before)  # still serves
    assert p.evict_prefix_blocks([2**127 + 5, 0]) == 0  # 128-bit hashes cross; none cached
    p.release("live", cache_prefix=False)


def direct_layout_kv(engine: EngineAdapter) -> KVBlocks:
    from dataclasses import replace

    lay = replace(engine.layout, model_id="another-model")
    return KVBlocks(lay, 0, 1, 4, bytes(lay.bytes_per_block))


def test_attach_is_refused_with_a_wrong_token_or_layout(lt: LoopThread) -> None:
    eng = direct()

    async def start(expect: EngineExpectation) -> EngineLinkServer:
        server = EngineLinkServer("right-token", expect)
        await server.start("127.0.0.1:0")
        return server

    for token, expect, why in [
        ("wrong", EngineExpectation(), "token"),
        ("right-token", EngineExpectation(dtype="float32"), "dtype"),
        ("right-token", EngineExpectation(block_size=16), "block_size"),
    ]:
        server = lt.run(start(expect))
        try:
            with pytest.raises(ConfigError, match=why):
                serve_engine(eng, f"127.0.0.1:{server.port}", token, connect_timeout_s=5)
        finally:
            lt.run(server.stop())
    with pytest.raises(Unavailable, match="no sidecar"):
        serve_engine(eng, "unix:/nonexistent/link.sock", "t", connect_timeout_s=0.5)


def test_hung_engine_times_out_and_a_dead_one_fails_every_call_fast(lt: LoopThread) -> None:
    with remote(lt, call_s=2.0) as eng:
        pid = int(eng.session.hello.pid)
        eng.prefill("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=100))
        os.kill(pid, signal.SIGSTOP)  # a wedged engine: alive, silent
        t0 = time.monotonic()
        with pytest.raises(EngineTimeout) as info:
            eng.decode(["r"])
        assert isinstance(info.value, DeadlineExceeded)
        assert 1.9 < time.monotonic() - t0 < 4.0
        in_flight: list[BaseException] = []

        def call() -> None:
            try:
                eng.decode(["r"])
            except BaseException as exc:  # collected for the assertion below
                in_flight.append(exc)

        worker = threading.Thread(target=call)
        worker.start()
        time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic()
        worker.join(5)
        assert in_flight and type(in_flight[0]) is EngineGone, in_flight
        assert time.monotonic() - t_kill < 1.5, "an in-flight call must fail when the engine dies"
        assert isinstance(in_flight[0], Unavailable)
        assert "exited" in in_flight[0].message or "closed" in in_flight[0].message
        t1 = time.monotonic()
        with pytest.raises(EngineGone):
            eng.tokens("r")
        assert time.monotonic() - t1 < 0.5 and not eng.alive
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped: no zombie, no orphan


def test_calling_on_the_event_loop_thread_is_refused(
    engines: dict[str, EngineAdapter], lt: LoopThread
) -> None:
    remote_engine = engines["p"]

    async def on_loop() -> str:
        try:
            remote_engine.tokens("x")
        except Exception as exc:
            return type(exc).__name__
        return "no error"

    assert lt.run(on_loop(), 5.0) == "EngineError"


def test_engine_loop_awaits_a_remote_engine_on_the_event_loop(
    engines: dict[str, EngineAdapter], lt: LoopThread
) -> None:
    """The sidecar's EngineLoop drives a RemoteEngine without its worker thread (``call_async``),
    batched decode included, and gets the same tokens as a direct engine."""
    from engines_adapter.engine_loop import EngineLoop

    md, ref = engines["md"], engines["alone"]
    sp = SamplingParams(seed=5, temperature=0.8, max_tokens=9)
    prompts = {"loop-a": [7, 8, 9, 10, 11], "loop-b": list(range(300, 333))}

    async def drive() -> tuple[dict[str, list[int]], int]:
        loop = EngineLoop(md, max_batch=8)
        loop.start()
        done = {rid: asyncio.get_running_loop().create_future() for rid in prompts}
        try:
            for rid, prompt in prompts.items():
                out = await loop.call("prefill", md.prefill, rid, prompt, sp)
                assert not out.finished

                def sink(o: Any, rid: str = rid) -> None:
                    if o is None or o.finished:
                        done[rid].set_result(o)

                loop.decode_in_batch(rid, sink)
            await asyncio.wait_for(asyncio.gather(*done.values()), 20)
            got = {rid: await loop.call("tokens", md.tokens, rid) for rid in prompts}
            for rid in prompts:
                await loop.call("release", md.release, rid, cache_prefix=False)
            # the worker pool starts its thread on first use: none means no call went through it
            return got, len(loop._pool._threads)
        finally:
            await loop.close()

    got, worker_threads = lt.run(drive(), 40.0)
    assert worker_threads == 0
    for rid, prompt in prompts.items():
        assert got[rid] == alone(ref, rid, prompt, sp)


def test_engine_mode_configuration_is_validated() -> None:
    from sidecar.config import load_config

    assert load_config(None, {"role": "md"}).engine.mode == "thread"
    cfg = load_config(None, {"role": "md", "engine.mode": "process", "engine.call_timeout_s": 5})
    assert (cfg.engine.mode, cfg.engine.call_timeout_s) == ("process", 5.0)
    for bad in ({"engine.mode": "fork"}, {"engine.call_timeout_s": 0}, {"engine.attach_timeout_s": -1}):
        with pytest.raises(ConfigError, match="engine"):
            load_config(None, {"role": "md", **bad})
    with pytest.raises(ConfigError):
        EngineProcessTimeouts(call_s=0)
