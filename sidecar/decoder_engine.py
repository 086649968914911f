"""A decoder's engine and DRC calls for one request: importing the KV that arrived (or, on MD,
recomputing the prompt itself), and releasing the request (cached in the prefix pool, and
published to the DRC, when the machine says so)."""

from __future__ import annotations

import contextlib
import time

from engines_adapter import KVBlocks, StepOutput
from engines_adapter.drc_host import DrcHost
from engines_adapter.engine_loop import EngineLoop
from pddlink.errors import PddlinkError
from pddlink.lifecycle import DecodeSequence
from pddlink.transport import ReceivedTransfer


async def import_kv(
    loop: EngineLoop, drc: DrcHost | None, seq: DecodeSequence[ReceivedTransfer], kv: ReceivedTransfer
) -> None:
    """Import ``kv`` for ``seq`` (raises ``PddlinkError``: bad layout or blocks, pool full)."""
    assert seq.sampling is not None
    begin, layout, engine = kv.begin, loop.engine.layout, loop.engine
    data = b"".join(kv.chunks)
    blocks = KVBlocks(layout, begin.first_block, len(data) // layout.bytes_per_block, begin.num_tokens, data)
    reuse = begin.first_block * layout.block_size
    args = (seq.request_id, list(seq.prompt), [blocks], seq.sampling)
    await loop.call("import", engine.import_kv, *args, reuse_prefix_tokens=reuse)
    if drc is not None:
        drc.publish(await loop.call("drc", drc.commit, seq.request_id, seq.prompt))


async def recompute(
    loop: EngineLoop, drc: DrcHost | None, seq: DecodeSequence[ReceivedTransfer]
) -> tuple[StepOutput, float, int]:
    """Prefill ``seq``'s prompt from its token ids, reusing this engine's own prefix cache (the DRC
    reservation counts the lookup as P's would): (first step, prefill seconds, cached tokens)."""
    assert seq.sampling is not None
    engine, prompt = loop.engine, list(seq.prompt)
    cached = await loop.call("cached", engine.cached_prefix_tokens, prompt)
    if drc is not None:
        hashes = drc.hasher.hash_blocks(prompt)
        _, events = await loop.call("drc", drc.reserve, seq.request_id, hashes, 30.0)
        drc.publish(events)
    t0 = time.perf_counter()
    out = await loop.call("prefill", engine.prefill, seq.request_id, prompt, seq.sampling)
    took = time.perf_counter() - t0
    if drc is not None:
        drc.publish(await loop.call("drc", drc.commit, seq.request_id, seq.prompt))
    return out, took, int(cached)


async def release_prefilled(loop: EngineLoop, request_id: str) -> None:
    """A recompute that ended while it prefilled: free what the prefill left (into the prefix pool)."""
    with contextlib.suppress(PddlinkError):
        await loop.call("release", loop.engine.release, request_id, cache_prefix=True)


async def release(loop: EngineLoop, drc: DrcHost | None, request_id: str, *, cache_prefix: bool) -> None:
    """Out of the decode batch and out of the engine; a cached sequence goes into the DRC."""
    engine = loop.engine
    await loop.stop_decoding(request_id)
    with contextlib.suppress(PddlinkError):
        tokens = await loop.call("tokens", engine.tokens, request_id)
        await loop.call("release", engine.release, request_id, cache_prefix=cache_prefix)
        if cache_prefix and drc is not None:
            drc.publish(await loop.call("drc", drc.insert, tokens[:-1]))
    if drc is not None and not cache_prefix:
        await loop.call("drc", drc.release, request_id)
