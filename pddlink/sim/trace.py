"""The request trace: one format on disk (JSONL), shared by ``pddlink sim`` and ``pddlink demo``.

A trace is a header line followed by one request per line::

    {"pddlink_trace": 1, "block_tokens": 512, "source": "agentic-v1 seed=1"}
    {"id": 0, "arrival_s": 0.0, "session": 3, "blocks": [17, 18, 91], "prompt_tokens": 1400,
     "output_tokens": 212, "max_tokens": 4096}

A prompt is a list of block ids, ``block_tokens`` tokens each (the last one may be partial). Ids are
prefix-chained: two prompts share block ``i`` only if they share every block before it, so shared
leading runs are shared prompt prefixes, exactly as in the Mooncake trace format (``hash_ids``), which
``read_trace`` also loads as it stands. ``block_token_ids`` turns an id into a deterministic block of
token ids for a real engine; ``scale_trace`` shrinks blocks, contexts, outputs and time for
one-machine runs while keeping the shape (who shares what, relative lengths, arrival pattern).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from pddlink.errors import InvalidInput

FORMAT_VERSION = 1
MOONCAKE_BLOCK_TOKENS = 512


class TraceFormatError(InvalidInput):
    """A trace or workload file is malformed; the message names the file, line and field."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    request_id: int
    arrival_s: float
    session_id: int
    block_ids: tuple[int, ...]
    prompt_tokens: int
    output_tokens: int
    max_tokens: int

    def __post_init__(self) -> None:
        if self.arrival_s < 0 or not math.isfinite(self.arrival_s):
            raise InvalidInput(f"request {self.request_id}: arrival_s must be finite and >= 0")
        if self.prompt_tokens < 1:
            raise InvalidInput(f"request {self.request_id}: prompt_tokens must be >= 1")
        if not 1 <= self.output_tokens <= self.max_tokens:
            raise InvalidInput(
                f"request {self.request_id}: need 1 <= output_tokens ({self.output_tokens}) "
                f"<= max_tokens ({self.max_tokens})"
            )
        if not self.block_ids:
            raise InvalidInput(f"request {self.request_id}: blocks must not be empty")

    def prompt_token_ids(self, block_tokens: int, vocab_size: int, seed: int = 0) -> list[int]:
        """The prompt as token ids: each block id expanded deterministically, cut to ``prompt_tokens``."""
        out: list[int] = []
        for block_id in self.block_ids:
            out.extend(block_token_ids(block_id, block_tokens, vocab_size, seed))
        return out[: self.prompt_tokens]


@dataclass(frozen=True, slots=True)
class TraceMeta:
    block_tokens: int
    source: str = ""

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise InvalidInput(f"block_tokens must be >= 1, got {self.block_tokens}")


@dataclass(frozen=True, slots=True)
class Trace:
    meta: TraceMeta
    requests: tuple[TraceRequest, ...]

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0


def block_token_ids(block_id: int, block_tokens: int, vocab_size: int, seed: int = 0) -> list[int]:
    """A deterministic block of token ids for ``block_id``: the same id always gives the same tokens."""
    if vocab_size < 2:
        raise InvalidInput(f"vocab_size must be >= 2, got {vocab_size}")
    rng = np.random.default_rng([seed & 0xFFFFFFFF, block_id & 0xFFFFFFFFFFFFFFFF])
    return [int(t) for t in rng.integers(1, vocab_size, size=block_tokens)]


# --- writing ---------------------------------------------------------------------------------------


def _request_obj(r: TraceRequest) -> dict[str, Any]:
    return {
        "id": r.request_id,
        "arrival_s": round(r.arrival_s, 6),
        "session": r.session_id,
        "blocks": list(r.block_ids),
        "prompt_tokens": r.prompt_tokens,
        "output_tokens": r.output_tokens,
        "max_tokens": r.max_tokens,
    }


def write_trace(path: str | Path, trace: Trace) -> None:
    header = {"pddlink_trace": FORMAT_VERSION, "block_tokens": trace.meta.block_tokens}
    header["source"] = trace.meta.source  # type: ignore[assignment]
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(header) + "\n")
        for r in trace.requests:
            f.write(json.dumps(_request_obj(r), separators=(",", ":")) + "\n")


# --- reading ---------------------------------------------------------------------------------------


def _lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceFormatError(f"{path}: cannot read: {exc.strerror}") from None
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{path}:{lineno}: not JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise TraceFormatError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        yield lineno, obj


def _field(obj: dict[str, Any], name: str, kind: type, where: str) -> Any:
    if name not in obj:
        raise TraceFormatError(f"{where}: missing field '{name}'")
    value = obj[name]
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok:
        raise TraceFormatError(f"{where}: field '{name}' must be {kind.__name__}, got {value!r:.40}")
    return value


def _block_list(obj: dict[str, Any], name: str, where: str) -> tuple[int, ...]:
    blocks = _field(obj, name, list, where)
    if not blocks or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks):
        raise TraceFormatError(f"{where}: field '{name}' must be a non-empty list of ints >= 0")
    return tuple(blocks)


def _build(where: str, **kw: Any) -> TraceRequest:
    try:
        return TraceRequest(**kw)
    except InvalidInput as exc:
        raise TraceFormatError(f"{where}: {exc.message}") from None


def _pddlink_request(obj: dict[str, Any], where: str) -> TraceRequest:
    return _build(
        where,
        request_id=_field(obj, "id", int, where),
        arrival_s=float(_field(obj, "arrival_s", float, where)),
        session_id=_field(obj, "session", int, where),
        block_ids=_block_list(obj, "blocks", where),
        prompt_tokens=_field(obj, "prompt_tokens", int, where),
        output_tokens=_field(obj, "output_tokens", int, where),
        max_tokens=_field(obj, "max_tokens", int, where),
    )


def _mooncake_request(obj: dict[str, Any], index: int, where: str) -> TraceRequest:
    # The Mooncake format carries no session and no output bound: a session is a shared first
    # block, and the bound is the output length the trace recorded.
    blocks = _block_list(obj, "hash_ids", where)
    output = _field(obj, "output_length", int, where)
    return _build(
        where,
        request_id=index,
        arrival_s=float(_field(obj, "timestamp", float, where)) / 1000.0,
        session_id=blocks[0],
        block_ids=blocks,
        prompt_tokens=_field(obj, "input_length", int, where),
        output_tokens=output,
        max_tokens=output,
    )


def read_trace(path: str | Path) -> Trace:
    """Load a pddlink trace or a Mooncake-format trace (detected from the first line)."""
    path = Path(path)
    rows = _lines(path)
    first = next(rows, None)
    if first is None:
        raise TraceFormatError(f"{path}: empty trace")
    lineno, head = first
    requests: list[TraceRequest] = []
    if "pddlink_trace" in head:
        where = f"{path}:{lineno}"
        if head["pddlink_trace"] != FORMAT_VERSION:
            raise TraceFormatError(
                f"{where}: field 'pddlink_trace': unsupported version {head['pddlink_trace']}"
            )
        meta = TraceMeta(_field(head, "block_tokens", int, where), str(head.get("source", "")))
        requests = [_pddlink_request(obj, f"{path}:{n}") for n, obj in rows]
    elif "hash_ids" in head:
        meta = TraceMeta(MOONCAKE_BLOCK_TOKENS, f"mooncake:{path.name}")
        requests.append(_mooncake_request(head, 0, f"{path}:{lineno}"))
        requests.extend(_mooncake_request(obj, i, f"{path}:{n}") for i, (n, obj) in enumerate(rows, start=1))
    else:
        raise TraceFormatError(
            f"{path}:{lineno}: unknown trace format: expected a 'pddlink_trace' header or Mooncake 'hash_ids'"
        )
    _check_order(path, requests)
    return Trace(meta, tuple(requests))


def _check_order(path: Path, requests: Iterable[TraceRequest]) -> None:
    last = 0.0
    for r in requests:
        if r.arrival_s < last:
            raise TraceFormatError(f"{path}: request {r.request_id}: arrival times must not decrease")
        last = r.arrival_s


# --- scaling ---------------------------------------------------------------------------------------


def scale_trace(
    trace: Trace,
    *,
    block_tokens: int | None = None,
    context_tokens: int | None = None,
    max_output_tokens: int | None = None,
    time_scale: float = 1.0,
    limit: int | None = None,
) -> Trace:
    """Shrink a trace for one machine, keeping its shape.

    ``block_tokens`` sets the new block length directly; ``context_tokens`` instead picks it so that
    the median prompt becomes about that long. Prompt lengths scale with the block length (same
    blocks, same sharing). ``max_output_tokens`` caps outputs and bounds; ``time_scale`` stretches
    arrival times (2.0 = half the rate); ``limit`` keeps the first requests.
    """
    if time_scale <= 0:
        raise InvalidInput(f"time_scale must be > 0, got {time_scale}")
    requests = trace.requests[:limit] if limit is not None else trace.requests
    old_b = trace.meta.block_tokens
    new_b = old_b
    if block_tokens is not None:
        new_b = block_tokens
    elif context_tokens is not None and requests:
        median = float(np.median([r.prompt_tokens for r in requests]))
        new_b = max(1, round(old_b * context_tokens / median))
    if new_b < 1:
        raise InvalidInput(f"block_tokens must be >= 1, got {new_b}")
    out = []
    for r in requests:
        prompt = min(len(r.block_ids) * new_b, max(1, round(r.prompt_tokens * new_b / old_b)))
        bound = r.max_tokens if max_output_tokens is None else min(r.max_tokens, max_output_tokens)
        out.append(
            replace(
                r,
                arrival_s=r.arrival_s * time_scale,
                prompt_tokens=prompt,
                output_tokens=min(r.output_tokens, bound),
                max_tokens=bound,
            )
        )
    source = f"{trace.meta.source} scaled(block={new_b}, time={time_scale})"
    return Trace(TraceMeta(new_b, source), tuple(out))
