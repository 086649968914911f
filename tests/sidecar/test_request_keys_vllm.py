"""Request identity on the vLLM bridges (issue 25, item 3), in memory: vLLM's connector names a
transfer only by its key (ALLOC, COMMIT and POLL say nothing of which vLLM request asks), so a key
used twice must end the transfer -- both sides' vLLM then prefill themselves, exact -- never hand
one request's KV to another. No vLLM here: the bridges as the connector drives them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pddlink.connector.control import Op, TransferState
from pddlink.connector.shm import ShmRegion
from pddlink.drc import PrefixIndex
from pddlink.errors import ErrorCode, NotFound
from pddlink.kv.codec import CodecId
from pddlink.kv.hashing import BlockHasher
from pddlink.transport import PeerIdentity, ReceivedTransfer
from pddlink.wire import KVLayoutSpec, Reserve, ReserveAnswer, TransferBegin
from sidecar.request_keys import RequestKeyInUse
from sidecar.vllm_kv.consumer import ConsumerBridge
from sidecar.vllm_kv.producer import ProducerBridge

BLOCK = 16
HASHER = BlockHasher("m", BLOCK)
PROMPT_A = list(range(3, 3 + 64))
PROMPT_B = list(range(500, 500 + 64))
LAYOUT = KVLayoutSpec(
    model_id="m", num_layers=1, num_kv_heads=1, head_dim=2, block_size=BLOCK, dtype="float32"
)
PER_BLOCK = 2 * BLOCK * 2 * 4  # K and V, 16 tokens, head_dim 2, float32
P_PEER = PeerIdentity("p", "p0")


@pytest.fixture
def region(tmp_path: Path) -> Iterator[ShmRegion]:
    r = ShmRegion(tmp_path / "region", 1 << 20)
    yield r
    r.close()


class SilentPeer:
    """A destination that never answers (the reservation stays pending)."""

    transport_name = "tcp"

    async def client(self, deadline: float) -> Any:
        await asyncio.sleep(3600)


def test_the_consumer_ends_a_key_reserved_twice(region: ShmRegion) -> None:
    md = ConsumerBridge(region, PrefixIndex(), block_size=BLOCK)
    first = md.on_message(P_PEER, Reserve("router0/k1", tuple(HASHER.hash_blocks(PROMPT_A)), 30_000))
    assert isinstance(first, ReserveAnswer) and first.code is None
    second = md.on_message(P_PEER, Reserve("router0/k1", tuple(HASHER.hash_blocks(PROMPT_B)), 30_000))
    assert isinstance(second, ReserveAnswer) and second.code is ErrorCode.BAD_REQUEST
    assert "key_collision" in second.reason
    state = md.handle(Op.POLL, {"transfers": ["router0/k1"]})["states"]["router0/k1"]
    assert state["state"] == TransferState.FAILED and "key_collision" in state["reason"]
    md.on_transfer(landing("router0/k1", PROMPT_B))  # whichever KV comes is no one's for sure now
    assert region.held_slots == 0 and md.counts["key_refused"] == 2


def landing(key: str, prompt: list[int], first_block: int = 0) -> ReceivedTransfer:
    blocks = (len(prompt) - 1) // BLOCK - first_block
    data = memoryview(bytes(range(256)) * (blocks * PER_BLOCK // 256))
    begin = TransferBegin(
        transfer_id=1,
        generation=0,
        request_id=key,
        layout=LAYOUT,
        first_block=first_block,
        num_tokens=blocks * BLOCK,
        block_hashes=tuple(HASHER.hash_blocks(prompt)[first_block:]),
        codec=CodecId.RAW,
        total_bytes=data.nbytes,
        chunk_bytes=data.nbytes,
        deadline_ms=10_000,
    )
    return ReceivedTransfer(P_PEER, begin, [data], 0.01)


def test_the_consumer_never_lands_kv_of_another_prompt(region: ShmRegion) -> None:
    md = ConsumerBridge(region, PrefixIndex(), block_size=BLOCK)
    md.on_message(P_PEER, Reserve("router0/k2", tuple(HASHER.hash_blocks(PROMPT_A)), 30_000))
    md.on_transfer(landing("router0/k2", PROMPT_B))
    state = md.handle(Op.POLL, {"transfers": ["router0/k2"]})["states"]["router0/k2"]
    assert state["state"] == TransferState.FAILED and state["reason"].startswith("kv_mismatch")
    assert region.held_slots == 0


def test_a_second_landing_ends_the_transfer_but_keeps_the_slot_until_release(region: ShmRegion) -> None:
    md = ConsumerBridge(region, PrefixIndex(), block_size=BLOCK)
    md.on_message(P_PEER, Reserve("router0/k3", tuple(HASHER.hash_blocks(PROMPT_A)), 30_000))
    md.on_transfer(landing("router0/k3", PROMPT_A))
    state = md.handle(Op.POLL, {"transfers": ["router0/k3"]})["states"]["router0/k3"]
    assert state["state"] == TransferState.LANDED  # the right KV lands as before
    md.on_transfer(landing("router0/k3", PROMPT_A))
    state = md.handle(Op.POLL, {"transfers": ["router0/k3"]})["states"]["router0/k3"]
    assert state["state"] == TransferState.FAILED and "key_collision" in state["reason"]
    assert region.held_slots == 1  # a load that read LANDED may still be copying it
    md.handle(Op.RELEASE, {"transfer": "router0/k3", "reason": "request finished"})
    assert region.held_slots == 0


def test_a_reserve_after_the_key_was_released_is_refused(region: ShmRegion) -> None:
    md = ConsumerBridge(region, PrefixIndex(), block_size=BLOCK)
    md.handle(Op.RELEASE, {"transfer": "router0/k4", "reason": "deadline_exceeded: not known in time"})
    answer = md.on_message(P_PEER, Reserve("router0/k4", tuple(HASHER.hash_blocks(PROMPT_A)), 30_000))
    assert isinstance(answer, ReserveAnswer) and answer.code is ErrorCode.BAD_REQUEST
    assert len(md.index.reserved()) == 0  # no lease pinned for a request that ended


def test_the_producer_ends_a_key_prepared_twice(region: ShmRegion) -> None:
    async def body() -> None:
        p = ProducerBridge(region, SilentPeer(), model_id="m", block_size=BLOCK)  # type: ignore[arg-type]
        prepare = {"transfer": "router0/k5", "prompt": PROMPT_A, "deadline_at": time.time() + 30}
        assert p.handle(Op.PREPARE, prepare) == {"legs": ["md"]}
        with pytest.raises(RequestKeyInUse):
            p.handle(Op.PREPARE, {**prepare, "prompt": PROMPT_B})
        # neither request's worker can save under the key now: both destinations prefill themselves
        alloc = {"transfer": "router0/k5", "num_blocks": 3, "bytes_per_block": PER_BLOCK}
        with pytest.raises(NotFound):
            answer = p.handle(Op.ALLOC, alloc)
            if asyncio.iscoroutine(answer):
                await answer
        record = p.result("router0/k5")
        assert record is not None and not record["ok"] and "key_collision" in record["error"]
        with pytest.raises(RequestKeyInUse):  # and the key is not taken again
            p.handle(Op.PREPARE, prepare)
        assert region.held_slots == 0
        await p.close()

    asyncio.run(body())


def test_a_second_alloc_of_one_transfer_is_refused(region: ShmRegion) -> None:
    async def body() -> None:
        p = ProducerBridge(region, SilentPeer(), model_id="m", block_size=BLOCK)  # type: ignore[arg-type]
        p.handle(Op.PREPARE, {"transfer": "router0/k6", "prompt": PROMPT_A, "deadline_at": time.time() + 30})
        alloc = {"transfer": "router0/k6", "num_blocks": 3, "bytes_per_block": PER_BLOCK}
        first = p.handle(Op.ALLOC, alloc)
        assert isinstance(first, dict) and first["nbytes"] == 3 * PER_BLOCK
        with pytest.raises(Exception, match="already holds a slot"):
            p.handle(Op.ALLOC, alloc)
        p.handle(Op.RELEASE, {"transfer": "router0/k6", "reason": "test"})
        assert region.held_slots == 0
        await p.close()

    asyncio.run(body())
