"""One client's heavy prompts do not stall another client (issue 27, item 4).

A client sends a small streaming request to a real router process (its own tokenizer, trained
here) and times its first token, sent just after four heavy ones (another process, another
address). Two loads: ~1 MB prompts, refused on their byte count before any tokenizing, and
prompts just under the byte limit, tokenized on the router's worker threads (and refused on their
token count). Alone and loaded rounds alternate, so both see the same background load; the
loaded median stays within 3x the alone one + 30 ms (the base router: 3 s against 19 ms).

Real processes: P, RLD and MD sidecars with the reference engine (``harness.cluster``), and a
router process (``pddlink router``) with ``[api] tokenizer``.
"""

from __future__ import annotations

import http.client
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from harness.cluster import Cluster, ClusterSpec, NoWan
from tests.router_edge.router_proc import RouterProc, connect, router_process

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]

WORDS = ["prefill", "decode", "relay", "main", "wan", "cache", "prefix", "block", "token", "stream"]
SMALL = {"prompt": list(range(1, 17)), "max_tokens": 2, "stream": True, "temperature": 0.0}
ROUNDS = 21


def _tokenizer_dir(out: Path) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    rng = random.Random(0)
    tok.train_from_iterator([" ".join(rng.choice(WORDS) for _ in range(50)) for _ in range(200)], trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    return out


def _text(n_bytes: int, seed: int) -> str:
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_bytes:
        w = rng.choice(WORDS) + str(rng.randrange(1000)) + " "
        parts.append(w)
        size += len(w)
    return "".join(parts)[:n_bytes]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    spec = ClusterSpec(tmp_path_factory.mktemp("heavy"), relay=True, tls=True, deadline_s=30.0)
    with Cluster(NoWan(), spec) as c:
        yield c


@pytest.fixture(scope="module")
def router(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProc]:
    tmp = tmp_path_factory.mktemp("heavy-router")
    p = cluster.ports
    api = {
        "tokenizer": str(_tokenizer_dir(tmp / "tok")),
        "max_body_bytes": 2 << 20,
        "rate_per_client_s": 0.0,
    }
    with router_process(
        tmp,
        api,
        p=f"127.0.0.1:{p['p_grpc']}",
        rld=f"127.0.0.1:{p['rld_grpc']}",
        md=f"127.0.0.1:{p['md_grpc']}",
        tls_dir=cluster.tls_dir("router"),
        admission=False,
    ) as r:
        yield r


def _post(port: int, body: bytes, source: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60, source_address=(source, 0))
    try:
        conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _first_token_s(port: int, headers: dict[str, str] | None = None) -> float:
    """Seconds from sending the small streaming request to its first token's event."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30, source_address=("127.0.0.2", 0))
    try:
        t0 = time.monotonic()
        head = {"content-type": "application/json", **(headers or {})}
        conn.request("POST", "/v1/completions", json.dumps(SMALL), head)
        r = conn.getresponse()
        assert r.status == 200, r.read()
        while line := r.readline():
            if line.startswith(b"data: {"):
                took = time.monotonic() - t0
                r.read()
                return took
        raise AssertionError("no token")
    finally:
        conn.close()


_SENDER = """
import http.client, sys, threading, time
port, path = int(sys.argv[1]), sys.argv[2]
body = open(path, "rb").read()
lock = threading.Lock()
def send():
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60, source_address=("127.0.0.3", 0))
    conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    r = conn.getresponse(); r.read(); conn.close()
    with lock:
        print(f"{r.status} {time.monotonic() - t0:.4f}", flush=True)
for line in sys.stdin:
    for _ in range(4):
        threading.Thread(target=send).start()
"""


def _paired(port: int, body: bytes, rounds: int, tmp: Path) -> tuple[list[float], list[float], list[Any]]:
    """The small request's first-token times, alone and then sent 5 ms after another process
    (another client: 127.0.0.3) has sent four requests with ``body`` at once, round after round
    (so both see the same background load); and the heavy requests' (status, seconds)."""
    path = tmp / "heavy-body.json"
    path.write_bytes(body)
    proc = subprocess.Popen(
        [sys.executable, "-c", _SENDER, str(port), str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    alone: list[float] = []
    loaded: list[float] = []
    heavy: list[Any] = []
    try:
        time.sleep(0.5)  # the sender's interpreter is up
        for _ in range(rounds):
            alone.append(_first_token_s(port))
            proc.stdin.write("go\n")
            proc.stdin.flush()
            time.sleep(0.005)
            loaded.append(_first_token_s(port))
            for _ in range(4):
                status, took = proc.stdout.readline().split()
                heavy.append((int(status), float(took)))
    finally:
        proc.kill()
        proc.wait(10)
    return alone, loaded, heavy


def test_large_prompts_are_refused_on_their_bytes_before_tokenizing(router: RouterProc) -> None:
    body = json.dumps({"prompt": _text(1_000_000, 1), "max_tokens": 2}).encode()
    t0 = time.monotonic()
    status, answer = _post(router.port, body, "127.0.0.3")
    took = time.monotonic() - t0
    error = json.loads(answer)["error"]
    print(f"\n1 MB text prompt: {status} in {took * 1000:.1f} ms: {error['message']}")
    assert status == 400 and error["param"] == "prompt" and "bytes of text" in error["message"]
    assert took < 0.3, took


def router_limit_bytes(router: RouterProc) -> int:
    """The router's text byte limit, from its answer to a prompt one byte too long for anything."""
    _, answer = _post(router.port, json.dumps({"prompt": "x" * 1_000_000}).encode(), "127.0.0.3")
    message = json.loads(answer)["error"]["message"]
    return int(message.split("the limit is ")[1].split()[0])


@pytest.mark.timing
@pytest.mark.parametrize("size", ["1MB", "under_limit"])
def test_a_small_request_is_not_delayed_by_four_heavy_prompts(
    router: RouterProc, size: str, tmp_path: Path
) -> None:
    _first_token_s(router.port)  # warm: the router's channels, the engines
    # the byte limit: 8000 tokens (max_prompt_tokens) x the longest token's bytes
    n_bytes = 1_000_000 if size == "1MB" else router_limit_bytes(router) - 1000
    body = json.dumps({"prompt": _text(n_bytes, 2), "max_tokens": 2}).encode()
    alone, loaded, heavy = _paired(router.port, body, ROUNDS, tmp_path)
    unloaded, under = statistics.median(alone), statistics.median(loaded)
    statuses = {s for s, _ in heavy}
    heavy_s = statistics.median(t for _, t in heavy)
    print(
        f"\n{size}: small request first token median {unloaded * 1000:.1f} ms alone, "
        f"{under * 1000:.1f} ms with four heavy prompts in flight (max {max(loaded) * 1000:.1f} ms; "
        f"{len(heavy)} heavy requests, statuses {sorted(statuses)}, each {heavy_s * 1000:.0f} ms median)"
    )
    assert statuses == {400}
    # A stall shows at once (before: 3,004 ms against 19 ms alone). The 1.2x is printed,
    # not asserted: the 2 cores here also run the load's sender, three sidecars and others' work.
    assert under <= 3.0 * unloaded + 0.030, (under, unloaded)


def test_answers_carry_no_pddlink_field_unless_asked(router: RouterProc) -> None:
    """Issue 27: an answer has only vLLM's fields; ``pddlink-trace: 1`` adds the per-choice
    ``pddlink`` object (request id, positions, sources, trace)."""
    body = json.dumps({"prompt": list(range(1, 17)), "max_tokens": 2, "temperature": 0.0})
    for asked in (False, True):
        conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=30)
        headers = {"content-type": "application/json", **({"pddlink-trace": "1"} if asked else {})}
        conn.request("POST", "/v1/completions", body, headers)
        r = conn.getresponse()
        answer = json.loads(r.read())
        conn.close()
        assert r.status == 200 and r.reason == "OK", answer
        choice = answer["choices"][0]
        assert ("pddlink" in choice) is asked, choice
        if asked:
            assert choice["pddlink"]["trace"]["pipeline"] and len(choice["pddlink"]["sources"]) == 2


@pytest.mark.timing
def test_a_keyed_client_gets_its_first_token_through_three_thousand_idle_connections(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Issue 27's acceptance: with 3,000 idle unauthenticated connections held open against the
    router (default caps: 512, 64 per client), a request with a key gets its first token about as
    fast as unloaded, and the router's open files stay under its cap + 64."""
    keys = tmp_path / "keys"
    keys.write_text("k-edge-0123456789abcdef\n")
    p = cluster.ports
    api = {"api_keys_file": str(keys), "first_byte_timeout_s": 120.0, "rate_per_client_s": 0.0}
    with router_process(
        tmp_path,
        api,
        p=f"127.0.0.1:{p['p_grpc']}",
        rld=f"127.0.0.1:{p['rld_grpc']}",
        md=f"127.0.0.1:{p['md_grpc']}",
        tls_dir=cluster.tls_dir("router"),
        admission=False,
    ) as router:
        auth = {"authorization": "Bearer k-edge-0123456789abcdef"}
        _first_token_s(router.port, auth)
        alone = statistics.median(_first_token_s(router.port, auth) for _ in range(9))
        sources = ["127.0.0.2"] * 64 + [f"127.0.0.{3 + i % 49}" for i in range(3000 - 64)]
        held = [connect(router.port, src) for src in sources]
        try:
            time.sleep(0.5)
            flooded = statistics.median(_first_token_s(router.port, auth) for _ in range(9))
            files = router.open_files()
        finally:
            for s in held:
                s.close()
        print(
            f"\nkeyed first token median {alone * 1000:.1f} ms alone, {flooded * 1000:.1f} ms with 3000 "
            f"idle connections held; router open files {files}"
        )
        assert files < 512 + 64, files
        assert flooded <= 1.5 * alone + 0.010, (flooded, alone)
