"""The engine link's messages <-> the engine contract's values, and the engine side's dispatcher.

Pure conversions between ``pddlink_engine.proto`` messages and ``engines_adapter`` values
(``KVLayout``, ``KVBlocks``, ``SamplingParams``, ``StepOutput``), each contract call as a ``Plan``
(command message + reply reader, used by ``RemoteEngine``), typed errors in both directions
(``error_reply`` on the engine side, ``raise_error`` on the sidecar side: the same class comes
out that went in), and ``execute(engine, command)``: one command run on a local engine, one reply.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engines_adapter import (
    EngineAdapter,
    EngineError,
    InvalidBlocks,
    InvalidRequest,
    InvalidTokens,
    KVBlocks,
    KVLayout,
    LayoutMismatch,
    PoolExhausted,
    SamplingParams,
    StepOutput,
    UnknownRequest,
)
from pddlink.errors import (
    ConfigError,
    DeadlineExceeded,
    ErrorCode,
    InvalidInput,
    NotFound,
    PddlinkError,
    Unavailable,
)
from pddlink.kv.hash_bytes import HASH_BYTES, hash_from_bytes, hash_to_bytes
from pddlink.serving.rpc import engine_stubs

pb2, _ = engine_stubs()

# Error classes that cross the link by name; anything else arrives as EngineError with its code.
ERROR_KINDS: dict[str, type[PddlinkError]] = {
    cls.__name__: cls
    for cls in (
        EngineError,
        UnknownRequest,
        InvalidTokens,
        LayoutMismatch,
        InvalidBlocks,
        InvalidRequest,
        PoolExhausted,
        InvalidInput,
        ConfigError,
        NotFound,
        DeadlineExceeded,
        Unavailable,
    )
}


def layout_msg(layout: KVLayout) -> Any:
    return pb2.Layout(**layout.to_dict())


def layout_of(msg: Any) -> KVLayout:
    return KVLayout(
        model_id=msg.model_id,
        num_layers=msg.num_layers,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        dtype=msg.dtype,
        block_size=msg.block_size,
    )


def sampling_msg(s: SamplingParams) -> Any:
    return pb2.Sampling(
        seed=s.seed,
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        max_tokens=s.max_tokens,
        stop_token_ids=list(s.stop_token_ids),
    )


def sampling_of(msg: Any) -> SamplingParams:
    return SamplingParams(
        seed=msg.seed,
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p,
        max_tokens=msg.max_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
    )


def blocks_msg(kv: KVBlocks) -> Any:
    return pb2.KVBlocksMsg(
        layout=layout_msg(kv.layout),
        first_block=kv.first_block,
        num_blocks=kv.num_blocks,
        num_tokens=kv.num_tokens,
        data=bytes(kv.data),
    )


def blocks_of(msg: Any) -> KVBlocks:
    return KVBlocks(layout_of(msg.layout), msg.first_block, msg.num_blocks, msg.num_tokens, msg.data)


def step_msg(out: StepOutput) -> Any:
    return pb2.Step(
        request_id=out.request_id, token_id=out.token_id, position=out.position, finished=out.finished
    )


def step_of(msg: Any) -> StepOutput:
    return StepOutput(msg.request_id, msg.token_id, msg.position, msg.finished)


def hash_bytes(h: int) -> bytes:
    if not 0 <= h < 1 << (8 * HASH_BYTES):
        raise InvalidInput(f"block hash {h} is not a 128-bit unsigned value")
    return hash_to_bytes(h)


def error_reply(command_id: int, exc: BaseException) -> Any:
    if isinstance(exc, PddlinkError):
        err = pb2.Error(code=int(exc.code), kind=type(exc).__name__, message=exc.message)
    else:  # a bug in the engine: reported, never fatal to the link
        err = pb2.Error(
            code=int(ErrorCode.INTERNAL), kind="EngineError", message=f"{type(exc).__name__}: {exc}"
        )
    return pb2.Reply(command_id=command_id, error=err)


def raise_error(err: Any) -> None:
    """Raise the error a Reply carries as the class the engine raised (EngineError if unknown)."""
    cls = ERROR_KINDS.get(err.kind, EngineError)
    try:
        code = ErrorCode(err.code)
    except ValueError:
        code = ErrorCode.UNKNOWN
    raise cls(err.message, code=code)


@dataclass(frozen=True, slots=True)
class Plan:
    """One engine-contract call as a command: the oneof field, its message, how to read the reply."""

    op: str
    msg: Any
    unpack: Callable[[Any], Any]


def _none(reply: Any) -> None:
    return None


def _count(reply: Any) -> int:
    return int(reply.count.value)


def plan_prefill(request_id: str, prompt: Sequence[int], sampling: SamplingParams) -> Plan:
    msg = pb2.Prefill(request_id=request_id, prompt=list(prompt), sampling=sampling_msg(sampling))
    return Plan("prefill", msg, lambda r: step_of(r.step))


def plan_decode(request_ids: Sequence[str]) -> Plan:
    return Plan(
        "decode", pb2.Decode(request_ids=list(request_ids)), lambda r: [step_of(s) for s in r.steps.steps]
    )


def plan_extend(request_id: str, token_ids: Sequence[int]) -> Plan:
    msg = pb2.Extend(request_id=request_id, token_ids=list(token_ids))
    return Plan("extend", msg, lambda r: step_of(r.step))


def plan_import_kv(
    request_id: str,
    prompt: Sequence[int],
    blocks: Sequence[KVBlocks],
    sampling: SamplingParams,
    *,
    reuse_prefix_tokens: int = 0,
) -> Plan:
    if reuse_prefix_tokens < 0:
        raise InvalidBlocks("reuse_prefix_tokens must be >= 0")
    msg = pb2.ImportKV(
        request_id=request_id,
        prompt=list(prompt),
        blocks=[blocks_msg(b) for b in blocks],
        sampling=sampling_msg(sampling),
        reuse_prefix_tokens=reuse_prefix_tokens,
    )
    return Plan("import_kv", msg, _none)


def plan_export_kv(request_id: str, first_block: int = 0, num_blocks: int | None = None) -> Plan:
    if first_block < 0 or (num_blocks is not None and num_blocks < 0):
        raise InvalidBlocks("first_block and num_blocks must be >= 0")
    msg = pb2.ExportKV(
        request_id=request_id,
        first_block=first_block,
        all_blocks=num_blocks is None,
        num_blocks=num_blocks or 0,
    )
    return Plan("export_kv", msg, lambda r: blocks_of(r.kv))


def plan_release(request_id: str, *, cache_prefix: bool = True) -> Plan:
    return Plan("release", pb2.Release(request_id=request_id, cache_prefix=cache_prefix), _none)


def plan_cached_prefix_tokens(prompt: Sequence[int]) -> Plan:
    return Plan("cached_prefix_tokens", pb2.CachedPrefixTokens(prompt=list(prompt)), _count)


def plan_evict_prefix_blocks(block_hashes: Sequence[int]) -> Plan:
    msg = pb2.EvictPrefixBlocks(block_hashes=[hash_bytes(h) for h in block_hashes])
    return Plan("evict_prefix_blocks", msg, _count)


def plan_drain_evicted_hashes() -> Plan:
    return Plan(
        "drain_evicted_hashes",
        pb2.DrainEvictedHashes(),
        lambda r: [hash_from_bytes(h) for h in r.hashes.block_hashes],
    )


def plan_tokens(request_id: str) -> Plan:
    return Plan("tokens", pb2.Tokens(request_id=request_id), lambda r: list(r.tokens.token_ids))


PLANS: dict[str, Callable[..., Plan]] = {
    "prefill": plan_prefill,
    "decode": plan_decode,
    "extend": plan_extend,
    "import_kv": plan_import_kv,
    "export_kv": plan_export_kv,
    "release": plan_release,
    "cached_prefix_tokens": plan_cached_prefix_tokens,
    "evict_prefix_blocks": plan_evict_prefix_blocks,
    "tokens": plan_tokens,
    "drain_evicted_hashes": plan_drain_evicted_hashes,
}


def _run(engine: EngineAdapter, cmd: Any) -> dict[str, Any]:
    op = cmd.WhichOneof("op")
    if op is None:
        raise InvalidInput("engine command without an operation")
    m: Any = getattr(cmd, op)
    if op == "prefill":
        return {"step": step_msg(engine.prefill(m.request_id, list(m.prompt), sampling_of(m.sampling)))}
    if op == "decode":
        return {"steps": pb2.Steps(steps=[step_msg(o) for o in engine.decode(list(m.request_ids))])}
    if op == "extend":
        return {"step": step_msg(engine.extend(m.request_id, list(m.token_ids)))}
    if op == "import_kv":
        blocks = [blocks_of(b) for b in m.blocks]
        engine.import_kv(
            m.request_id,
            list(m.prompt),
            blocks,
            sampling_of(m.sampling),
            reuse_prefix_tokens=m.reuse_prefix_tokens,
        )
        return {"done": pb2.Done()}
    if op == "export_kv":
        n = None if m.all_blocks else m.num_blocks
        return {"kv": blocks_msg(engine.export_kv(m.request_id, m.first_block, n))}
    if op == "release":
        engine.release(m.request_id, cache_prefix=m.cache_prefix)
        return {"done": pb2.Done()}
    if op == "cached_prefix_tokens":
        return {"count": pb2.Count(value=engine.cached_prefix_tokens(list(m.prompt)))}
    if op == "evict_prefix_blocks":
        hashes = [hash_from_bytes(h) for h in m.block_hashes]
        return {"count": pb2.Count(value=engine.evict_prefix_blocks(hashes))}
    if op == "tokens":
        return {"tokens": pb2.TokenList(token_ids=engine.tokens(m.request_id))}
    if op == "drain_evicted_hashes":
        return {"hashes": pb2.HashList(block_hashes=[hash_bytes(h) for h in engine.drain_evicted_hashes()])}
    raise InvalidInput(f"unknown engine command {op!r}")


def execute(engine: EngineAdapter, cmd: Any, received_at: float) -> Any:
    """Run one command on ``engine``; the reply (result or typed error). ``received_at`` is the
    monotonic time the command arrived: one whose deadline passed while queued is not run."""
    t0 = time.monotonic()
    if cmd.deadline_s > 0 and t0 > received_at + cmd.deadline_s:
        late = DeadlineExceeded(f"command {cmd.command_id} waited past its {cmd.deadline_s:.1f} s deadline")
        return error_reply(cmd.command_id, late)
    try:
        result = _run(engine, cmd)
    except Exception as exc:  # every failure goes back typed; the engine keeps serving
        reply = error_reply(cmd.command_id, exc)
    else:
        reply = pb2.Reply(command_id=cmd.command_id, **result)
    reply.engine_seconds = time.monotonic() - t0
    return reply
