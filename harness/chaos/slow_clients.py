"""The chaos suite's slow clients (fault ``slow_clients``): extra streaming requests over the
router's HTTP API (its unix socket: local, keyless) whose clients take their answer slowly or not
at all, beside the usual load.

Half stop reading once the response head has come ("stalled"), half read at a trickle
(``TRICKLE_BYTES_PER_S``: each of the router's writes completes within its stall bound, but the
answer could not be out by the deadline). Each asks for ``MAX_TOKENS`` tokens, far more SSE than
the socket buffers hold, so the router's write waits on them. At deadline + 1 s every client
drains what is left at full speed: an answer the router ended by then (cut, or closed with its
reason) is read to its end within ``DRAIN_SLACK_S``; one still streaming is not (it "hung").

Outcomes: ``cut`` (the stream ended without ``[DONE]``: the router's write deadline,
``pddlink.serving.write_bound``), ``failed`` (an error event: its reason), ``finished``, ``refused`` (not
200: its status), ``hung``.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import asdict, dataclass
from typing import Any

from harness.chaos.invariants import HUNG_SLACK_S
from harness.chaos.load import CLIENT_SLACK_S
from harness.demo import VOCAB
from pddlink.serving.http import fetch

CLIENTS = 10
MAX_TOKENS = 1536  # ~470 kB of SSE: more than the router's send buffer and the socket's hold
TRICKLE_BYTES_PER_S = 16 << 10
READ_BYTES = 4096
DRAIN_SLACK_S = 0.5  # reading what the buffers hold, once the clients drain (a loaded machine)
PROMPT_TOKENS = 64
_ERROR = re.compile(rb'data: \{"error": \{"message": "([^"]*)"')


@dataclass(slots=True)
class SlowResult:
    index: int
    kind: str  # stalled | trickle
    started_s: float = 0.0  # on the load's clock
    ended_s: float = 0.0
    outcome: str = ""  # cut | failed | finished | refused | hung
    reason: str = ""
    bytes_read: int = 0

    @property
    def e2e_s(self) -> float:
        return self.ended_s - self.started_s


def _request(index: int, deadline_s: float, vocab: int) -> bytes:
    rng = random.Random(index)
    prompt = [rng.randrange(1, vocab) for _ in range(PROMPT_TOKENS)]
    body = json.dumps(
        {"prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True, "deadline_s": deadline_s, "seed": index}
    ).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-length: {len(body)}\r\n\r\n"
    return head.encode() + body


async def _read(reader: asyncio.StreamReader, kind: str, fast_at: float) -> bytes:
    """The next bytes, as this client takes them: nothing (stalled) or a trickle until ``fast_at``."""
    now = time.monotonic()
    if now < fast_at:
        if kind == "stalled":
            await asyncio.sleep(fast_at - now)
        else:
            await asyncio.sleep(READ_BYTES / TRICKLE_BYTES_PER_S)
            return await reader.read(READ_BYTES)
    return await reader.read(1 << 16)


def _ending(res: SlowResult, data: bytes, closed: bool) -> None:
    if (m := _ERROR.search(data[-4096:])) is not None:
        res.outcome, res.reason = "failed", m.group(1).decode(errors="replace")
    elif b"data: [DONE]" in data[-256:]:
        res.outcome, res.reason = "finished", ""
    elif closed:
        res.outcome, res.reason = "cut", "the router cut the stream (write deadline)"


async def _one(path: str, index: int, kind: str, deadline_s: float, vocab: int, t0: float) -> SlowResult:
    start = time.monotonic()
    res = SlowResult(index, kind, started_s=start - t0)
    fast_at = start + deadline_s + HUNG_SLACK_S
    data = b""
    writer = None
    try:
        async with asyncio.timeout(deadline_s + CLIENT_SLACK_S):
            reader, writer = await asyncio.open_unix_connection(path, limit=READ_BYTES)
            writer.write(_request(index, deadline_s, vocab))
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            if status != 200:
                res.outcome, res.reason = "refused", f"http_{status}: {(await reader.read(512))[:200]!r}"
            else:
                while not res.outcome:
                    chunk = await _read(reader, kind, fast_at)
                    data = data[-8192:] + chunk
                    res.bytes_read += len(chunk)
                    _ending(res, data, closed=not chunk)
    except TimeoutError:
        res.outcome, res.reason = "hung", f"still open {CLIENT_SLACK_S:g} s after the deadline"
    except (ConnectionError, asyncio.IncompleteReadError, OSError) as exc:
        res.outcome, res.reason = "cut", f"the router cut the stream ({type(exc).__name__})"
    finally:
        if writer is not None:
            writer.close()
    res.ended_s = time.monotonic() - t0
    return res


async def run(
    path: str, deadline_s: float, vocab: int, t0: float, clients: int = CLIENTS
) -> list[SlowResult]:
    """``clients`` slow clients at once against the router's HTTP unix socket ``path``."""
    kinds = ("stalled", "trickle")
    return list(
        await asyncio.gather(*(_one(path, i, kinds[i % 2], deadline_s, vocab, t0) for i in range(clients)))
    )


def late(r: SlowResult, deadline_s: float) -> bool:
    """Ended (as its client saw it, after draining) later than deadline + 1 s + the drain's slack,
    or not at all."""
    return r.outcome in ("", "hung") or r.e2e_s > deadline_s + HUNG_SLACK_S + DRAIN_SLACK_S


def summary(results: list[SlowResult], deadline_s: float, writes_cut: float | None) -> dict[str, Any]:
    """The fault's record: outcomes, the late ones, the longest, the router's cut count."""
    outcomes: dict[str, int] = {}
    for r in results:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    return {
        "clients": len(results),
        "outcomes": outcomes,
        "late": sum(late(r, deadline_s) for r in results),
        "untyped": sum(1 for r in results if r.outcome != "finished" and not r.reason),
        "longest_s": round(max((r.e2e_s for r in results), default=0.0), 3),
        "router_writes_cut": writes_cut,
        "records": [asdict(r) for r in results],
    }


def note(doc: dict[str, Any], deadline_s: float) -> str:
    outcomes = ", ".join(f"{n} {k}" for k, n in sorted(doc["outcomes"].items()))
    return (
        f"{doc['clients']} slow clients: {outcomes}; {doc['late']} late, {doc['untyped']} untyped; "
        f"longest {doc['longest_s']:.1f} s (deadline {deadline_s:g} s + {HUNG_SLACK_S:g} s + drain); "
        f"router cut {doc['router_writes_cut']} writes"
    )


def writes_cut(metrics_text: str) -> float:
    """``pddlink_writes_cut_total{api="http"}`` from the router's /metrics text."""
    for line in metrics_text.splitlines():
        if line.startswith('pddlink_writes_cut_total{api="http"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0  # no write cut yet


def slow_clients_fault(router_unix: str, deadline_s: float, t0: float) -> dict[str, Any]:
    """Apply the fault (blocking, from the fault runner's thread): the clients, then their record
    with its one-line ``note``."""
    before = _router_writes_cut(router_unix)
    results = asyncio.run(run(router_unix, deadline_s, VOCAB, t0))
    after = _router_writes_cut(router_unix)
    cut = after - before if after is not None and before is not None else None
    doc = summary(results, deadline_s, cut)
    doc["note"] = note(doc, deadline_s)
    return doc


def _router_writes_cut(router_unix: str) -> float | None:
    try:
        code, body = fetch("unix:" + router_unix, "GET", "/metrics", timeout_s=5.0)
    except OSError:
        return None
    return writes_cut(body.decode()) if code == 200 else None
