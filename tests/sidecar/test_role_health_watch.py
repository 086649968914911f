"""The router's role watcher holds a bounded number of gRPC connectivity watches, however long it
runs (the chaos suite's router RSS grew x1.26-1.35 over a run with nothing held).

``grpc.aio.Channel.wait_for_state_change`` has no deadline: each call registers a watch in gRPC's
core that lives until the channel's state changes. The watcher waited with ``asyncio.wait_for(...,
WATCH_TICK_S)``, so on a channel that stays READY every tick cancelled the Python side and left one
more core watch (and its callback) behind: two a second per role, for as long as the role is up.
A real gRPC server on loopback; the watches left are counted from the garbage collector's objects.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import grpc
import pytest

from pddlink.serving.rpc import stubs
from router import role_health
from router.role_health import RoleHealth


def pending_watches() -> int:
    return sum(1 for o in gc.get_objects() if type(o).__name__ == "CallbackWrapper")


@pytest.mark.timeout(60)
def test_a_ready_channel_leaves_no_connectivity_watches_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(role_health, "WATCH_TICK_S", 0.005)  # 200 ticks a second: a leak shows at once
    pb2, pb2_grpc = stubs()

    class Sidecar(pb2_grpc.SidecarServicer):  # type: ignore[misc,name-defined]
        async def Status(self, request: Any, context: Any) -> Any:
            return pb2.StatusReply(json="{}")

    async def main() -> None:
        server = grpc.aio.server()
        pb2_grpc.add_SidecarServicer_to_server(Sidecar(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        health = RoleHealth(("md",))
        health.watch({"md": channel})
        try:
            health.start()
            await asyncio.sleep(0.5)  # connected, probed, READY
            assert health.status()["md"]["channel"] == "READY"
            before = pending_watches()
            await asyncio.sleep(1.5)  # ~300 ticks on a channel that stays READY
            left = pending_watches() - before
            assert left < 10, f"{left} connectivity watches left behind in 1.5 s"
            assert health.usable("md")
        finally:
            await health.close()
            await channel.close(None)
            await server.stop(None)

    asyncio.run(main())
