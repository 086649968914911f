"""Two routers in front of the same reference sidecars (an operator's first try at high
availability, both named ``router0``), sent the same client ``request_id`` at once with different
prompts (issue 25, item 3). Real processes on loopback: P, RLD, MD and two routers, mutual TLS.

Every answer is exact (the tokens its own prompt gives on one float64 engine alone) or refused
typed (a reason, never ``finished`` with other tokens); none hangs (each call is bounded by its
deadline plus a margin, and must end before it). The routers key their requests apart (each
answer's trace names its own request key) while the answer keeps the client's id.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from engines_adapter import SamplingParams, load_engine
from harness.cluster import Cluster, ClusterSpec, NoWan, free_port
from harness.demo_load import RequestResult, replay
from harness.demo_workload import DemoRequest

pytestmark = [pytest.mark.fleet, pytest.mark.e2e, pytest.mark.process, pytest.mark.timeout(900)]

PAIRS = 120
WAVE = 6  # pairs sent at once (12 requests in flight over 2 routers)
DEADLINE_S = 30.0
PIPELINES = ("", "p_md", "p_rld_md", "singular")
HUNG_S = 0.8 * DEADLINE_S  # a failure this late waited for something that never came


@dataclass
class SecondRouter:
    proc: subprocess.Popen[str]
    target: str


def start_second_router(cluster: Cluster, run_dir: Path) -> SecondRouter:
    """The same router command line (same name, same TLS identity) on its own port and socket."""
    argv = cluster._argv("router")
    unix = str(run_dir / "router2.sock")
    argv[argv.index("--grpc-port") + 1] = str(free_port())
    argv[argv.index("--unix") + 1] = unix
    log = open(run_dir / "router2.log", "a")  # noqa: SIM115 (the process keeps it)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 120.0
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("READY "):
            return SecondRouter(proc, f"unix:{unix}.grpc")
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"the second router did not start: {(run_dir / 'router2.log').read_text()[-2000:]}")


@pytest.fixture(scope="module")
def routers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, SecondRouter]]:
    run_dir = tmp_path_factory.mktemp("tworouters")
    spec = ClusterSpec(run_dir, relay=True, slice_tokens=4, rld_capacity=8, tls=True, deadline_s=DEADLINE_S)
    with Cluster(NoWan(), spec) as cluster:
        second = start_second_router(cluster, run_dir)
        try:
            yield cluster, second
        finally:
            second.proc.terminate()
            try:
                second.proc.wait(10)
            except subprocess.TimeoutExpired:
                second.proc.kill()
                second.proc.wait(5)


def make_pairs(n: int, seed: int) -> tuple[list[DemoRequest], list[DemoRequest]]:
    """Pair i: two requests of one index (so one client id) with different prompts and sampling."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 2048) for _ in range(32)]

    def one(i: int) -> DemoRequest:
        prompt = tuple(shared + [rng.randrange(1, 2048) for _ in range(rng.randrange(8, 90))])
        temperature = 0.0 if rng.random() < 0.5 else 0.9
        sampling = SamplingParams(
            seed=rng.randrange(1000), temperature=temperature, top_k=50, max_tokens=rng.randrange(6, 20)
        )
        return DemoRequest(i, 0.0, prompt, sampling)

    a, b = [], []
    for i in range(n):
        a.append(one(i))
        b.append(one(i))
    return a, b


def alone(reqs: list[DemoRequest]) -> list[list[int]]:
    engine = load_engine("torch_ref", preset="tiny", dtype="float64", block_size=16, num_blocks=1024)
    out = []
    for r in reqs:
        toks = [engine.prefill("x", list(r.prompt), r.sampling).token_id]
        while not engine.is_finished("x"):  # type: ignore[attr-defined]
            toks.append(engine.decode(["x"])[0].token_id)
        engine.release("x", cache_prefix=False)
        out.append(toks)
    return out


async def send_pairs(
    targets: tuple[str, str], a: list[DemoRequest], b: list[DemoRequest], pipeline_of: dict[int, str]
) -> list[tuple[RequestResult, RequestResult]]:
    """Each wave: every pair's two requests sent at once, one to each router, under one client id."""
    out: list[tuple[RequestResult, RequestResult]] = []
    for start in range(0, len(a), WAVE):
        idx = range(start, min(start + WAVE, len(a)))
        by_pipeline: dict[str, list[int]] = {}
        for i in idx:
            by_pipeline.setdefault(pipeline_of[i], []).append(i)
        calls = []
        for pipeline, ids in by_pipeline.items():
            for target, reqs in ((targets[0], a), (targets[1], b)):
                wave = [reqs[i] for i in ids]
                calls.append(
                    replay(target, wave, deadline_s=DEADLINE_S, pipeline=pipeline, id_prefix="same-")
                )
        answered = await asyncio.gather(*calls)
        first = {r.index: r for batch in answered[0::2] for r in batch}
        second = {r.index: r for batch in answered[1::2] for r in batch}
        out += [(first[i], second[i]) for i in idx]
    return out


def judge(r: RequestResult, expected: list[int]) -> str:
    """'exact', 'refused' (failed with a reason well before its deadline), 'hung' (ran into its
    deadline, or past it), 'wrong' (finished with other tokens) or 'untyped' (failed, no reason)."""
    if r.outcome == "finished" and r.e2e_s <= DEADLINE_S + 1.0:
        return "exact" if r.tokens == expected else "wrong"
    if r.e2e_s >= HUNG_S or "DEADLINE_EXCEEDED" in r.reason or "deadline" in r.reason:
        return "hung"
    return "refused" if r.reason else "untyped"


def test_the_same_client_id_at_two_routers_at_once(routers: tuple[Cluster, SecondRouter]) -> None:
    cluster, second = routers
    a, b = make_pairs(PAIRS, seed=25)
    pipeline_of = {i: PIPELINES[i % len(PIPELINES)] for i in range(PAIRS)}
    t0 = time.monotonic()
    pairs = asyncio.run(send_pairs((cluster.router_target, second.target), a, b, pipeline_of))
    took = time.monotonic() - t0
    expected_a, expected_b = alone(a), alone(b)
    verdicts: dict[str, int] = {}
    bad = []
    for i, (ra, rb) in enumerate(pairs):
        for r, expected in ((ra, expected_a[i]), (rb, expected_b[i])):
            v = judge(r, expected)
            verdicts[v] = verdicts.get(v, 0) + 1
            if v not in ("exact", "refused"):
                bad.append((i, v, pipeline_of[i], r.outcome, r.reason, r.trace.get("fallbacks")))
        if ra.outcome == rb.outcome == "finished":  # two keys, one label
            assert ra.trace["request_id"] == rb.trace["request_id"] == f"same-{i}"
            assert ra.trace["request_key"] != rb.trace["request_key"]
            assert ra.trace["request_key"].startswith("router0-")
    figures = {"pairs": PAIRS, "requests": 2 * PAIRS, "seconds": round(took, 1), **verdicts}
    print("two routers, one client id:", json.dumps(figures))
    assert not bad, (figures, bad[:10])
    assert verdicts.get("exact", 0) + verdicts.get("refused", 0) == 2 * PAIRS
