"""P pushes its WAN book to the routers (``WatchWan``), and a router's link models follow it.

Real gRPC on loopback: P's ``SidecarService`` with a ``WanBook``, the router's ``watch_backlog``
over a channel to it, and a ``LinkModel`` whose estimate must count what P reports shipping,
whichever router sent it (P's status is empty here: only the stream carries the book). A sidecar
without a book (MD: ``UNIMPLEMENTED``) is polled instead, as an older P would be.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from pddlink.routing import LinkModel
from pddlink.serving.backlog import WanBook, watch_backlog
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


def test_a_pushed_book_reaches_the_link_model_and_names_pending_keys() -> None:
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

    r = asyncio.run(_served(_service("p", book, {}), body))  # its status is empty: only the stream tells
    for step in ("pending_s", "shipping_s", "ended_s"):
        assert r[step] is not None, r
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


def test_watch_sends_the_book_then_each_change_at_once_and_ends_on_close() -> None:
    async def go() -> list[dict[str, Any]]:
        book = WanBook()
        watch = book.watch(heartbeat_s=3600.0)  # no heartbeat within the test: each item is a change
        got = [await anext(watch)]
        book.started("a", 100)
        got.append(await asyncio.wait_for(anext(watch), 5.0))
        book.ended("a")
        got.append(await asyncio.wait_for(anext(watch), 5.0))
        book.close()  # P stopping: the watch ends by itself
        try:
            await asyncio.wait_for(anext(watch), 5.0)
        except StopAsyncIteration:
            got.append({"closed": True})
        return got

    got = asyncio.run(go())
    assert [d.get("backlog_bytes") for d in got[:3]] == [0, 100, 0]
    assert got[3] == {"closed": True}


def test_watch_repeats_an_unchanged_book_every_heartbeat() -> None:
    async def go() -> list[dict[str, Any]]:
        book = WanBook()
        book.started("a", 100)
        watch = book.watch(heartbeat_s=0.05)
        return [await asyncio.wait_for(anext(watch), 5.0) for _ in range(4)]

    got = asyncio.run(go())
    assert all(d["shipping"] == [["a", 100]] for d in got)
