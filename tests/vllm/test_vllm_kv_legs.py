"""P's vLLM sidecar ships one slot to two destinations (no vLLM needed: real sidecars, real
sockets, the connector's control calls made by hand): RelayDecode gets every whole block over the
fast path, MD only the blocks its DRC lacks; a leg that fails does not fail the other; the slot is
freed once every leg ended; ``to`` picks the legs."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from pddlink.connector.control import Op, TransferState
from pddlink.connector.shm import MappedRegion, Slot
from pddlink.errors import InvalidInput
from pddlink.kv.hashing import BlockHasher
from pddlink.roles import Role
from sidecar.vllm_kv.service import VllmSidecar, VllmSidecarConfig

BS, PER_BLOCK, MODEL = 32, 4096, "tiny"
LAYOUT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "dtype": "float32", "block_size": BS}


async def _until(pred: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _trio(root: Path, *, md_addr: str | None = None) -> tuple[VllmSidecar, VllmSidecar, VllmSidecar]:
    md = await VllmSidecar(VllmSidecarConfig(Role.MD, "md", root, MODEL, BS, region_bytes=8 << 20)).start()
    rld = await VllmSidecar(VllmSidecarConfig(Role.RLD, "rld", root, MODEL, BS, region_bytes=8 << 20)).start()
    p_cfg = VllmSidecarConfig(
        Role.P,
        "p",
        root,
        MODEL,
        BS,
        region_bytes=8 << 20,
        md_addr=md_addr or f"127.0.0.1:{md.kv_port}",
        rld_addr=f"127.0.0.1:{rld.kv_port}",
        rld_transport="auto",
    )
    return await VllmSidecar(p_cfg).start(), rld, md


async def _ship(p: VllmSidecar, transfer: str, prompt: list[int], **prepare: Any) -> bytes:
    """What P's connector does: PREPARE, ALLOC, fill the slot, COMMIT; returns the bytes copied."""
    assert p.producer is not None and p.region is not None
    h = p.producer.handle
    h(Op.PREPARE, {"transfer": transfer, "prompt": prompt, "deadline_at": time.time() + 5, **prepare})
    out = p.producer.out[transfer]
    await _until(
        lambda: all(leg.reservation is not None and leg.reservation.done() for leg in out.legs.values())
    )
    n = (len(prompt) - 1) // BS
    a = h(Op.ALLOC, {"transfer": transfer, "num_blocks": n, "bytes_per_block": PER_BLOCK})
    region = MappedRegion(p.region.path)
    data = bytes((i * 7 + int(a["first_block"])) % 251 for i in range(int(a["nbytes"])))
    if a["nbytes"]:
        region.buffer(Slot(int(a["offset"]), int(a["nbytes"])))[:] = data
    h(
        Op.COMMIT,
        {
            "transfer": transfer,
            "offset": a["offset"],
            "nbytes": a["nbytes"],
            "first_block": a["first_block"],
            "num_blocks": n,
            "num_tokens": len(prompt),
            "layout": LAYOUT,
        },
    )
    await _until(lambda: p.producer is not None and transfer in p.producer.done)
    return data


def _landed(side: VllmSidecar, transfer: str) -> bytes | None:
    assert side.consumer is not None and side.region is not None
    st = side.consumer.handle(Op.POLL, {"transfers": [transfer]})["states"][transfer]
    if st["state"] != TransferState.LANDED:
        return None
    n = int(st["num_blocks"]) * int(st["bytes_per_block"])
    return bytes(side.region.view[int(st["offset"]) : int(st["offset"]) + n])


async def _close(*sides: VllmSidecar) -> None:
    for s in sides:
        await s.close()


def test_one_slot_ships_every_block_to_rld_and_the_missing_suffix_to_md() -> None:
    async def run() -> None:
        root = Path(tempfile.mkdtemp(prefix="pddlink-legs-"))
        p, rld, md = await _trio(root)
        try:
            prompt = list(range(3, 3 + 5 * BS + 7))  # 5 whole blocks travel
            assert md.consumer is not None
            md.consumer.index.insert(BlockHasher(MODEL, BS).hash_blocks(prompt)[:2], time.monotonic())
            data = await _ship(p, "t1", prompt)
            rec = p.producer.done["t1"]  # type: ignore[union-attr]
            assert (
                rec["ok"] and rec["legs"]["rld"]["first_block"] == 0 and rec["legs"]["md"]["first_block"] == 2
            )
            assert rec["first_block"] == 2 and rec["wan_bytes"] == 3 * PER_BLOCK  # MD's leg at the top
            await _until(lambda: _landed(rld, "t1") is not None and _landed(md, "t1") is not None)
            assert _landed(rld, "t1") == data  # every whole block, from block 0
            assert _landed(md, "t1") == data[2 * PER_BLOCK :]  # only what MD's DRC lacked
            st = p.status()
            assert st["held_slots"] == 0 and st["in_flight"] == 0 and st["fast_path"] == "tcp"
            assert st["legs"]["rld"]["bytes"] == 5 * PER_BLOCK and st["legs"]["md"]["bytes"] == 3 * PER_BLOCK
            for side in (rld, md):
                side.consumer.handle(Op.RELEASE, {"transfer": "t1", "reason": "loaded"})  # type: ignore[union-attr]
                assert side.status()["held_slots"] == 0 and side.status()["loaded"] == 1
            # "to" picks the legs: the P->MD baseline in the same deployment
            await _ship(p, "t2", [t + 1 for t in prompt], to=["md"])
            assert list(p.producer.done["t2"]["legs"]) == ["md"]  # type: ignore[union-attr]
            assert _landed(rld, "t2") is None
        finally:
            await _close(p, rld, md)

    asyncio.run(run())


def test_md_unreachable_fails_its_leg_only_and_frees_the_slot() -> None:
    async def run() -> None:
        root = Path(tempfile.mkdtemp(prefix="pddlink-legs-"))
        p, rld, md = await _trio(root, md_addr="127.0.0.1:1")  # nothing listens there
        try:
            prompt = list(range(3, 3 + 3 * BS + 1))
            data = await _ship(p, "t1", prompt)
            rec = p.producer.done["t1"]  # type: ignore[union-attr]
            assert rec["ok"] is False and rec["legs"]["rld"]["ok"] is True
            assert rec["legs"]["md"]["ok"] is False and rec["legs"]["md"]["error"]
            assert _landed(rld, "t1") == data
            st = p.status()
            assert (st["held_slots"], st["in_flight"], st["failed"]) == (0, 0, 1)
            assert st["legs"]["md"]["failed"] == 1 and st["legs"]["rld"]["shipped"] == 1
        finally:
            await _close(p, rld, md)

    asyncio.run(run())


def test_an_alloc_read_before_its_prepare_waits_for_it() -> None:
    """vLLM's scheduler (PREPARE) and worker (ALLOC) each hold a control connection of their own, so
    P's sidecar can read a request's ALLOC before its PREPARE (measured: 2 of 32 requests, whose KV
    then never left P). The ALLOC waits for the PREPARE and is answered with a slot; the transfer
    ships. Real sidecars and control sockets: the worker's ALLOC is written first, the scheduler's
    PREPARE after it."""
    from pddlink.connector.control import ControlClient

    async def go() -> tuple[dict[str, Any], bool]:
        root = Path(tempfile.mkdtemp(prefix="pddlink-legs-"))
        p, rld, md = await _trio(root)
        scheduler, worker = ControlClient(p.control_path), ControlClient(p.control_path)
        try:
            prompt = list(range(3, 3 + 4 * BS + 5))
            n = (len(prompt) - 1) // BS
            alloc = await asyncio.to_thread(
                worker.send, Op.ALLOC, transfer="t9", num_blocks=n, bytes_per_block=PER_BLOCK
            )
            await asyncio.sleep(0.2)  # the ALLOC is read and waits
            await asyncio.to_thread(
                scheduler.call, Op.PREPARE, transfer="t9", prompt=prompt, deadline_at=time.time() + 5
            )
            answer = await asyncio.to_thread(alloc.result)
            await asyncio.to_thread(
                worker.call,
                Op.COMMIT,
                transfer="t9",
                offset=answer["offset"],
                nbytes=answer["nbytes"],
                first_block=answer["first_block"],
                num_blocks=n,
                num_tokens=len(prompt),
                layout=LAYOUT,
            )
            assert p.producer is not None
            await _until(lambda: "t9" in p.producer.done)  # type: ignore[union-attr]
            return answer, bool(p.producer.done["t9"]["ok"])
        finally:
            scheduler.close()
            worker.close()
            await _close(p, rld, md)

    answer, shipped = asyncio.run(go())
    assert answer["nbytes"] == 4 * PER_BLOCK and answer["first_block"] == 0, answer
    assert shipped


POOL_TOPOLOGY = """
[topology]
engine = "vllm"
[[topology.datacenter]]
name = "dc-a"
[[topology.datacenter.p]]
name = "p-a0"
api_url = "http://127.0.0.1:8100"
[[topology.datacenter]]
name = "dc-b"
[[topology.datacenter.md]]
name = "md-b0"
api_url = "http://127.0.0.1:8200"
kv = "{md0}"
[[topology.datacenter.md]]
name = "md-b1"
api_url = "http://127.0.0.1:8201"
kv = "{md1}"
[[topology.link]]
between = ["dc-a", "dc-b"]
line_mbit = 100
rtt_ms = 10
"""


def test_p_with_pools_ships_each_transfer_to_the_md_it_names_and_refuses_an_unknown_one() -> None:
    """P's sidecar file names a topology (``[peers] topology``): every MD there with a ``kv`` address
    is a peer by its instance name; each PREPARE names its MD, and only that MD gets the KV. A name
    P links none of fails that transfer, typed (``NotFound``, the reason in its record); the next
    transfer ships as before."""
    from pddlink.errors import NotFound
    from sidecar.config import load_config
    from sidecar.vllm_kv.roles import sidecar_config

    async def run() -> None:
        root = Path(tempfile.mkdtemp(prefix="pddlink-pools-"))
        mds = []
        for name in ("md-b0", "md-b1"):
            mds.append(
                await VllmSidecar(
                    VllmSidecarConfig(Role.MD, name, root, MODEL, BS, region_bytes=8 << 20)
                ).start()
            )
        (root / "fleet.toml").write_text(
            POOL_TOPOLOGY.format(md0=f"127.0.0.1:{mds[0].kv_port}", md1=f"127.0.0.1:{mds[1].kv_port}")
        )
        (root / "p.toml").write_text(
            f'engine = "vllm"\nrole = "p"\npeer_id = "p-a0"\n[vllm]\nmodel_id = "{MODEL}"\n'
            f'block_size = {BS}\nworkdir = "{root}"\nregion_bytes = {8 << 20}\n'
            '[peers]\ntopology = "fleet.toml"\n'
        )
        cfg = sidecar_config(load_config(root / "p.toml"))
        assert cfg.md_peers == (
            ("md-b0", f"127.0.0.1:{mds[0].kv_port}"),
            ("md-b1", f"127.0.0.1:{mds[1].kv_port}"),
        )
        assert cfg.md_addr == "" and cfg.rld_peers == ()
        p = await VllmSidecar(cfg).start()
        try:
            prompt = list(range(3, 3 + 3 * BS + 5))
            data1 = await _ship(p, "t1", prompt, to=["md"], md="md-b1")
            data0 = await _ship(p, "t0", [t + 1 for t in prompt], to=["md"], md="md-b0")
            assert p.producer is not None
            assert p.producer.done["t1"]["ok"] and p.producer.done["t1"]["instance"] == "md-b1"
            await _until(lambda: _landed(mds[1], "t1") is not None and _landed(mds[0], "t0") is not None)
            assert _landed(mds[1], "t1") == data1 and _landed(mds[0], "t0") == data0
            assert _landed(mds[0], "t1") is None and _landed(mds[1], "t0") is None
            st = p.status()["instances"]
            assert st["md-b0"]["shipped"] == st["md-b1"]["shipped"] == 1 and st["md-b1"]["bytes"] == len(
                data1
            )
            h = p.producer.handle
            with pytest.raises(NotFound, match="no md instance 'md-x' among P's sidecar's peers"):
                h(
                    Op.PREPARE,
                    {"transfer": "tx", "prompt": prompt, "deadline_at": time.time() + 5, "md": "md-x"},
                )
            with pytest.raises(InvalidInput, match="names no md instance, and P's sidecar links 2"):
                h(Op.PREPARE, {"transfer": "ty", "prompt": prompt, "deadline_at": time.time() + 5})
            rec = p.producer.done["tx"]
            assert rec["ok"] is False and rec["error"].startswith("not_found: no md instance 'md-x'")
            assert "tx" not in p.producer.out and p.status()["failed"] == 2
            await _ship(p, "t2", [t + 2 for t in prompt], md="md-b0")  # it serves on
            assert p.producer.done["t2"]["ok"]
        finally:
            await _close(p, *mds)

    asyncio.run(run())
