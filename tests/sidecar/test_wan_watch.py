"""P pushes its WAN book to the routers (``WatchWan``), and a router's link models follow it.

Real gRPC on loopback: P's ``SidecarService`` with a ``WanBook``, the router's ``watch_backlog``
over a channel to it, and a ``LinkModel`` whose estimate must count what P reports shipping,
whichever router sent it, well within the 0.5 s a router used to poll P's status at. A sidecar
without a book (MD: ``UNIMPLEMENTED``) is polled instead, as an older P would be.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from pddlink.routing import LinkModel
from pddlink.serving.backlog import POLL_INTERVAL_S, WanBook, watch_backlog
from pddlink.serving.pb import pb2, pb2_grpc
from sidecar.service import SidecarService

MB = 1_000_000


def _service(role: str, book: WanBook | None, status: dict[str, Any]) -> SidecarService:
    return SidecarService(
        role=role, peer_id=f"{role}0", model_id="m", tls_identity="", status=lambda: status, wan_book=book
    )


def _backlog(link: LinkModel) -> int:
    return link.estimate(time.monotonic()).backlog_bytes


async def _until(cond: Callable[[], bool], timeout_s: float) -> float | None:
    """Seconds until ``cond()`` held, or None when it did not within ``timeout_s``."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            return None
        await asyncio.sleep(0.002)
    return time.monotonic() - t0


async def _served(service: SidecarService, body: Callable[[Any], Awaitable[Any]]) -> Any:
    server = grpc.aio.server()
    pb2_grpc.add_SidecarServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        return await body(pb2_grpc.SidecarStub(channel))
    finally:
        await channel.close(None)
        await server.stop(None)


def test_a_pushed_book_reaches_the_link_model_at_once_and_names_pending_keys() -> None:
    book = WanBook()
    link = LinkModel(2 * MB, 0.02)
    pending: dict[int, frozenset[str]] = {}

    async def body(stub: Any) -> dict[str, Any]:
        told = lambda k, keys: pending.update({k: keys})  # noqa: E731
        watch = asyncio.create_task(watch_backlog([stub], pb2.StatusRequest(), [(link, None)], told))
        r: dict[str, Any] = {}
        try:
            book.will_ship("other-router-1", "md/md0")
            r["pending_s"] = await _until(lambda: pending.get(0) == frozenset({"other-router-1"}), 2.0)
            book.started("other-router-1", 3 * MB)  # another router's transfer: this model never admitted it
            r["shipping_s"] = await _until(lambda: _backlog(link) == 3 * MB, 2.0)
            book.ended("other-router-1")
            r["ended_s"] = await _until(lambda: _backlog(link) == 0, 2.0)
            book.started("mine", MB)  # nothing changes for 2 s: heartbeats keep the report fresh
            await asyncio.sleep(2.0)
            r["fresh"] = _backlog(link) == MB
        finally:
            watch.cancel()
        return r

    r = asyncio.run(_served(_service("p", book, {}), body))
    for step in ("pending_s", "shipping_s", "ended_s"):
        assert r[step] is not None and r[step] < POLL_INTERVAL_S / 2, r
    assert r["fresh"], r
    assert not book._watchers  # the stream's end unregistered its watcher


def test_a_sidecar_that_pushes_nothing_is_polled() -> None:
    shipping = {"transfers": {"wan": {"pending": [], "shipping": [["r1", 2 * MB]], "to": {}}}}
    link = LinkModel(2 * MB, 0.02)

    async def body(stub: Any) -> float | None:
        watch = asyncio.create_task(watch_backlog([stub], pb2.StatusRequest(), [(link, None)]))
        try:
            return await _until(lambda: _backlog(link) == 2 * MB, 3.0)
        finally:
            watch.cancel()

    assert asyncio.run(_served(_service("md", None, shipping), body)) is not None


def test_watch_sends_the_book_then_each_change_then_heartbeats() -> None:
    async def go() -> list[tuple[float, dict[str, Any]]]:
        book = WanBook()
        got: list[tuple[float, dict[str, Any]]] = []
        t0 = time.monotonic()

        async def read() -> None:
            async for doc in book.watch(heartbeat_s=0.1):
                got.append((time.monotonic() - t0, doc))

        task = asyncio.create_task(read())
        await asyncio.sleep(0.02)
        book.started("a", 100)
        await asyncio.sleep(0.35)
        book.close()  # P stopping: the watch ends by itself
        await asyncio.wait_for(task, 1.0)
        return got

    got = asyncio.run(go())
    assert got[0][1]["backlog_bytes"] == 0 and got[1][1]["backlog_bytes"] == 100
    assert got[1][0] < 0.06  # the change went out at once, not at the next heartbeat
    assert 3 <= len(got) - 2 <= 5  # then only heartbeats, about every 0.1 s
