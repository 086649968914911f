"""The engine bridge (``engines_adapter.bridge``): both kinds say the same things to the sidecar.

The reference bridge over the tiny torch engine (in this process); the vLLM bridge with its real
region and control socket, and a separate process in vLLM's place that dials the socket the way the
connector does, asks, and exits (its death is what the bridge must report; no vLLM needed).
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engines_adapter import SamplingParams
from engines_adapter.adapter_bridge import AdapterBridge
from engines_adapter.bridge import EngineBridge, EngineKind
from engines_adapter.torch_ref import TorchRefEngine
from engines_adapter.vllm.bridge import VllmBridge, VllmEngineSide
from pddlink.connector.control import Op
from pddlink.drc import PrefixIndex


def _tiny() -> TorchRefEngine:
    return TorchRefEngine(preset="tiny", dtype="float64", block_size=4, num_blocks=64, seed=3)


def test_reference_bridge_names_its_engine_and_keeps_a_drc_only_when_asked() -> None:
    engine = _tiny()
    plain: EngineBridge = AdapterBridge(engine, max_batch=4)
    assert plain.kind is EngineKind.REFERENCE and plain.prefix_index is None
    assert (plain.model_id, plain.block_size) == (engine.layout.model_id, 4)
    md = AdapterBridge(engine, max_batch=4, drc_blocks=48)
    assert isinstance(md.prefix_index, PrefixIndex) and md.prefix_index.capacity_blocks == 48
    assert md.health() == "" and md.status()["kv_bytes_per_token"] == engine.layout.bytes_per_token


def test_reference_bridge_runs_engine_calls_on_its_loop() -> None:
    async def go() -> tuple[int, int]:
        bridge = AdapterBridge(_tiny(), max_batch=4)
        bridge.start()
        try:
            out = await bridge.loop.call(
                "prefill", bridge.engine.prefill, "r1", [5, 6, 7, 8, 9], SamplingParams()
            )
            return out.position, bridge.status()["engine_active"]
        finally:
            await bridge.close()

    assert asyncio.run(go()) == (5, 0)  # the token after the 5 prompt tokens; nothing in the decode batch


_CONNECTOR = """
import sys
from pddlink.connector.control import ControlClient, Op
c = ControlClient(sys.argv[1])
print(c.call(Op.STATUS)["answer"], flush=True)
"""


def _side(tmp_path: Path, consumer: bool) -> VllmEngineSide:
    return VllmEngineSide(
        name="md0", workdir=tmp_path / "w", model_id="m", block_size=16, region_bytes=1 << 20,
        region_dir=tmp_path / "w", keeps_prefix_cache=consumer,
    )  # fmt: skip


@pytest.mark.process
def test_vllm_bridge_serves_the_connector_and_reports_its_death(tmp_path: Path) -> None:
    lost: list[str] = []

    async def go() -> tuple[str, dict[str, Any], bool, bool]:
        bridge: VllmBridge = VllmBridge(_side(tmp_path, consumer=True))
        region = bridge.open()
        assert isinstance(bridge.prefix_index, PrefixIndex)  # RLD/MD: vLLM's prefix cache as a DRC
        await bridge.serve(lambda op, msg: {"answer": f"{op.value} from the role logic"}, lost.append)
        mode = stat.S_IMODE(os.stat(bridge.control_path).st_mode)
        assert mode == 0o600, oct(mode)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _CONNECTOR, str(bridge.control_path), stdout=subprocess.PIPE, env=env
        )
        said, _ = await asyncio.wait_for(proc.communicate(), 30)
        for _ in range(100):  # the process has exited: its pidfd tells the bridge
            if lost:
                break
            await asyncio.sleep(0.05)
        status = bridge.status()
        path = Path(region.path)
        await bridge.close()
        return said.decode().strip(), status, path.exists(), bridge.control_path.exists()

    said, status, region_left, socket_left = asyncio.run(go())
    assert said == f"{Op.STATUS.value} from the role logic"
    assert len(lost) == 1 and lost[0], lost  # once, with a reason
    assert status["engine"]["state"] == "lost" and status["engine"]["losses"] == 1
    assert not region_left and not socket_left
    assert VllmBridge(_side(tmp_path, consumer=False)).prefix_index is None  # P keeps none
