"""``pddlink bench edge``: what other clients' traffic costs one client's small request at the
router's HTTP edge (issue 27), each figure a ratio to the same request unloaded in the same run.

- ``heavy_1mb``: a small streaming request's first token, alone and sent 5 ms after another client
  (another process, another address) has sent four ~1 MB text prompts at once (refused on their
  bytes before any tokenizing). Rounds alternate alone / loaded, so both see the same background.
  Target: loaded median <= 1.2x alone.
- ``heavy_1mb_to_bare``, ``heavy_1mb_to_router``: the same prompts sent elsewhere on this machine
  (the small request still through the router): to a process that only receives each body and
  answers 400, at idle priority, and to a second router process with parse workers of its own.
  What the bytes alone cost the small request, and what the prompts' handling costs it when no
  event loop of its own router takes part. Reported, no target.
- ``heavy_under_limit``: the same with prompts just under the router's byte limit (tokenized on the
  router's worker threads, then refused on their token count). Reported, no target.
- ``idle_flood``: a keyed client's first token, alone and with 3,000 idle unauthenticated
  connections held open from 50 loopback addresses (64 on the keyed client's own address), the
  router at its default caps (512 connections, 64 per client). Targets: median <= 1.5x alone; the
  router's open files under its cap + 64.

Real processes: P, RLD and MD sidecars with the reference engine (``harness.cluster``, no WAN,
mutual TLS) and a router process (``pddlink router``) whose ``[api] tokenizer`` is trained here.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from harness.cluster import Cluster, ClusterError, ClusterSpec, NoWan
from harness.router_proc import RouterProc, router_process

WORDS = ["prefill", "decode", "relay", "main", "wan", "cache", "prefix", "block", "token", "stream"]
SMALL = {"prompt": list(range(1, 17)), "max_tokens": 2, "stream": True, "temperature": 0.0}
KEY = "k-edge-0123456789abcdef"  # the small request's client
HEAVY_KEY = "k-edge-heavy-0123456789"  # the heavy prompts' client
FLOOD = 3000
CAP = 512  # ApiConfig's default max_connections
HEAVY_TARGET, IDLE_TARGET = 1.2, 1.5
WORKERS_UP_S = 6.0  # the router's parse workers, woken by a first large body, load the tokenizer


def tokenizer_dir(out: Path) -> Path:
    """A small byte-level BPE tokenizer trained here (no model hub), saved as a model directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

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


def text(n_bytes: int, seed: int) -> str:
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_bytes:
        w = rng.choice(WORDS) + str(rng.randrange(1000)) + " "
        parts.append(w)
        size += len(w)
    return "".join(parts)[:n_bytes]


def _head(key: str) -> dict[str, str]:
    return {"content-type": "application/json", "authorization": f"Bearer {key}"}


def post(port: int, body: bytes, source: str, key: str = HEAVY_KEY) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60, source_address=(source, 0))
    try:
        conn.request("POST", "/v1/completions", body, _head(key))
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def first_token_s(port: int, key: str = KEY, source: str = "127.0.0.2") -> float:
    """Seconds from sending the small streaming request to its first token's event."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30, source_address=(source, 0))
    try:
        t0 = time.monotonic()
        conn.request("POST", "/v1/completions", json.dumps(SMALL), _head(key))
        r = conn.getresponse()
        if r.status != 200:
            raise ClusterError(f"small request: {r.status} {r.read()[:200]!r}")
        while line := r.readline():
            if line.startswith(b"data: {"):
                took = time.monotonic() - t0
                r.read()
                return took
        raise ClusterError("small request: no token")
    finally:
        conn.close()


def limit_bytes(port: int) -> int:
    """The router's text byte limit, from its answer to a prompt one byte too long for anything."""
    _, answer = post(port, json.dumps({"prompt": "x" * 1_000_000}).encode(), "127.0.0.3")
    message = json.loads(answer)["error"]["message"]
    return int(message.split("the limit is ")[1].split()[0])


_SENDER = """
import http.client, sys, threading, time
port, path, key = int(sys.argv[1]), sys.argv[2], sys.argv[3]
body = open(path, "rb").read()
head = {"content-type": "application/json", "authorization": "Bearer " + key}
lock = threading.Lock()
def client(go):
    while True:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60, source_address=("127.0.0.3", 0))
        conn.connect()  # open before the round: its request is on the wire at once
        go.acquire()
        t0 = time.monotonic()
        conn.request("POST", "/v1/completions", body, head)
        r = conn.getresponse(); r.read(); conn.close()
        with lock:
            print(f"{r.status} {time.monotonic() - t0:.4f}", flush=True)
gos = [threading.Semaphore(0) for _ in range(4)]
for go in gos:
    threading.Thread(target=client, args=(go,), daemon=True).start()
for line in sys.stdin:
    for go in gos:
        go.release()
"""


_BARE = """
import os, socket, sys, threading
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(64)
print(srv.getsockname()[1], flush=True)
answer = b'{"error":{"message":"too long","type":"BadRequestError","param":"prompt","code":400}}'
head = b"HTTP/1.1 400 Bad Request\\r\\ncontent-type: application/json\\r\\ncontent-length: %d\\r\\n\\r\\n"
answer = head % len(answer) + answer
def serve(c):
    got = b""
    while b"\\r\\n\\r\\n" not in got:
        more = c.recv(65536)
        if not more:
            return c.close()
        got += more
    head, _, rest = got.partition(b"\\r\\n\\r\\n")
    size = int(next(v for k, _, v in (line.partition(b":") for line in head.split(b"\\r\\n"))
                    if k.strip().lower() == b"content-length"))
    left = size - len(rest)
    while left > 0:
        more = c.recv(1 << 20)
        if not more:
            return c.close()
        left -= len(more)
    c.sendall(answer)
    c.recv(16)
    c.close()
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


def wake_parsers(port: int) -> None:
    """A first large body starts a router's parse workers; they are up once they loaded the
    tokenizer."""
    post(port, json.dumps({"prompt": "x" * 100_000}).encode(), "127.0.0.3")
    time.sleep(WORKERS_UP_S)


@contextmanager
def elsewhere(work: Path, kind: Literal["bare", "router"]) -> Iterator[int]:
    """A port on this machine, not the router's, for the other client's prompts: ``bare``, a
    process that only receives each body and answers 400, at idle priority (what the bytes alone
    cost the machine); ``router``, a second router process with parse workers of its own."""
    if kind == "router":
        (work / kind).mkdir(exist_ok=True)
        with router_process(work / kind, edge_api(work / kind)) as other:
            wake_parsers(other.port)
            yield other.port
        return
    proc = subprocess.Popen([sys.executable, "-c", _BARE], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait(10)


@dataclass(frozen=True, slots=True)
class Paired:
    alone: list[float]  # the small request's first-token seconds
    loaded: list[float]
    heavy: list[tuple[int, float]]  # the heavy requests' (status, seconds)

    def figures(self) -> dict[str, Any]:
        alone, loaded = statistics.median(self.alone), statistics.median(self.loaded)
        return {
            "rounds": len(self.alone),
            "alone_ms": round(alone * 1000, 2),
            "loaded_ms": round(loaded * 1000, 2),
            "loaded_max_ms": round(max(self.loaded) * 1000, 2),
            "ratio": round(loaded / alone, 3),
            "heavy_statuses": sorted({s for s, _ in self.heavy}),
            "heavy_median_ms": round(statistics.median(t for _, t in self.heavy) * 1000, 1),
        }


def paired(port: int, body: bytes, rounds: int, work: Path, heavy_port: int | None = None) -> Paired:
    """The small request alone, then 5 ms after another process (another client, 127.0.0.3) has
    sent four requests with ``body`` at once, round after round. The other client's four
    connections are open before its round starts, so that its requests are on the wire at once
    (started on the round, its threads' connects and heads came 1-10 ms late, some after the small
    request). One uncounted round first. ``heavy_port``: where the other client sends (the same
    router by default; ``elsewhere``)."""
    path = work / "heavy-body.json"
    path.write_bytes(body)
    sender = [sys.executable, "-c", _SENDER, str(heavy_port or port), str(path), HEAVY_KEY]
    proc = subprocess.Popen(sender, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    out = Paired([], [], [])
    try:
        time.sleep(0.5)  # the sender's interpreter is up, its connections open
        for i in range(rounds + 1):
            alone = first_token_s(port)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            time.sleep(0.005)
            loaded = first_token_s(port)
            answers = (proc.stdout.readline().split() for _ in range(4))
            heavy = [(int(status), float(took)) for status, took in answers]
            if i:  # the first round is not counted
                out.alone.append(alone)
                out.loaded.append(loaded)
                out.heavy.extend(heavy)
    finally:
        proc.kill()
        proc.wait(10)
    return out


def flood(port: int, n: int = FLOOD, keyed_source: str = "127.0.0.2") -> list[socket.socket]:
    """``n`` connections that never send a byte: 64 from the keyed client's address, the rest
    from 49 others."""
    sources = [keyed_source] * 64 + [f"127.0.0.{3 + i % 49}" for i in range(n - 64)]
    held = []
    for src in sources:
        s = socket.create_connection(("127.0.0.1", port), timeout=5.0, source_address=(src, 0))
        held.append(s)
    return held


@contextmanager
def deployment(work: Path, api: dict[str, Any]) -> Iterator[RouterProc]:
    """The three sidecars (reference engine, mutual TLS, no WAN) and a router process in front."""
    spec = ClusterSpec(work / "cluster", relay=True, tls=True, deadline_s=30.0)
    with Cluster(NoWan(), spec) as c:
        p = c.ports
        with router_process(
            work,
            api,
            p=f"127.0.0.1:{p['p_grpc']}",
            rld=f"127.0.0.1:{p['rld_grpc']}",
            md=f"127.0.0.1:{p['md_grpc']}",
            tls_dir=c.tls_dir("router"),
            admission=False,
        ) as router:
            yield router


def idle_flood(router: RouterProc, rounds: int, say: Callable[[str], None]) -> dict[str, Any]:
    first_token_s(router.port)  # warm
    before = [first_token_s(router.port) for _ in range(rounds)]
    base_files = router.open_files()
    t0 = time.monotonic()
    held = flood(router.port)
    say(f"edge: {len(held)} idle connections opened in {time.monotonic() - t0:.1f} s")
    try:
        time.sleep(0.5)
        loaded = [first_token_s(router.port) for _ in range(rounds)]
        files = router.open_files()
    finally:
        for s in held:
            s.close()
    time.sleep(0.5)
    after = [first_token_s(router.port) for _ in range(rounds)]
    alone = statistics.median(before + after)  # before and after the flood: the same background
    return {
        "connections": FLOOD,
        "alone_ms": round(alone * 1000, 2),
        "loaded_ms": round(statistics.median(loaded) * 1000, 2),
        "loaded_max_ms": round(max(loaded) * 1000, 2),
        "ratio": round(statistics.median(loaded) / alone, 3),
        "open_files_before": base_files,
        "open_files_flooded": files,
        "open_files_cap": CAP + 64,
    }


def edge_api(work: Path) -> dict[str, Any]:
    """The router's ``[api]`` table: the tokenizer, both clients' keys, 2 MB bodies, no rate limit,
    and a first-byte timeout longer than the run (the flood's connections stay idle and held)."""
    keys = work / "keys"
    keys.write_text(f"{KEY}\n{HEAVY_KEY}\n")
    keys.chmod(0o600)
    return {
        "tokenizer": str(tokenizer_dir(work / "tok")),
        "max_body_bytes": 2 << 20,
        "rate_per_client_s": 0.0,
        "api_keys_file": str(keys),
        "first_byte_timeout_s": 120.0,
    }


def run(rounds: int = 21, work: Path | None = None, say: Callable[[str], None] = print) -> dict[str, Any]:
    work = work or Path(tempfile.mkdtemp(prefix="pddlink-edge-"))
    out: dict[str, Any] = {}
    say("edge: starting P, RLD, MD (reference engine) and a router process")
    with deployment(work, edge_api(work)) as router:
        first_token_s(router.port)  # warm: the router's channels, the engines
        wake_parsers(router.port)
        for name, n_bytes in (("heavy_1mb", 1_000_000), ("heavy_under_limit", 0)):
            size = n_bytes or limit_bytes(router.port) - 1000
            body = json.dumps({"prompt": text(size, 2), "max_tokens": 2}).encode()
            say(f"edge: {name}: {rounds} rounds, four {size / 1e6:.2f} MB prompts each")
            out[name] = paired(router.port, body, rounds, work).figures()
            say(f"edge: {name}: {out[name]}")
            if name != "heavy_1mb":
                continue
            kinds: tuple[Literal["bare", "router"], ...] = ("bare", "router")
            for kind in kinds:  # the same prompts sent elsewhere on this machine
                with elsewhere(work, kind) as port:
                    out[f"heavy_1mb_to_{kind}"] = paired(router.port, body, rounds, work, port).figures()
                say(f"edge: heavy_1mb_to_{kind}: {out[f'heavy_1mb_to_{kind}']}")
        say(f"edge: idle_flood: {FLOOD} idle connections, {rounds} requests before, during, after")
        out["idle_flood"] = idle_flood(router, rounds, say)
    h, i = out["heavy_1mb"], out["idle_flood"]
    out["targets"] = {
        "heavy_1mb_ratio": {"max": HEAVY_TARGET, "value": h["ratio"], "ok": h["ratio"] <= HEAVY_TARGET},
        "idle_flood_ratio": {"max": IDLE_TARGET, "value": i["ratio"], "ok": i["ratio"] <= IDLE_TARGET},
        "idle_flood_open_files": {
            "max": CAP + 64,
            "value": i["open_files_flooded"],
            "ok": i["open_files_flooded"] < CAP + 64,
        },
    }
    out["ok"] = all(t["ok"] for t in out["targets"].values())
    return out
