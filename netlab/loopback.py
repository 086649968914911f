"""Loopback mode: the WAN as UDP and TCP relays on 127.0.0.1, for machines where we are not root.

There are no namespaces: both datacenters are this host. A *forward* ``(proto, dc, port)`` is a relay
port on 127.0.0.1 that the other datacenter's processes use instead of ``dc``'s service port; the
relay applies the link model on the way there (direction ``a_to_b`` when ``dc`` is ``dc-b``) and on
the way back. Forwards are added at run time through the control socket (``Lab.endpoint``).

- UDP (for QUIC): every impairment per datagram. A corrupted datagram is dropped, as the receiver's
  UDP checksum would drop it. One upstream socket per client address keeps replies apart.
- TCP: the relay terminates both connections and shapes the byte stream: delay, jitter (order
  kept), rate and outages (data is held while the link is cut). Loss, reordering, duplication and
  corruption do not apply: TCP would repair them before any application saw them.

Everything runs in one asyncio loop; due deliveries wait in one ``DelayLine`` per direction.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import os
import selectors
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from netlab.control import ControlServer
from netlab.model import DirectionModel, LinkModel
from netlab.profile import parse_profile
from netlab.relay_control import ControlHandler, owner_fd, sharpen_timing
from netlab.state import LabState

TCP_CHUNK_BYTES = 256 * 1024
TCP_MAX_BACKLOG_BYTES = 32 * 1024 * 1024  # stop reading a sender once this much waits in the relay
TCP_SEGMENT_BYTES = 1448
HEADER_BYTES = 52  # IPv4 + TCP with timestamps; UDP uses 28
OUTAGE_POLL_S = 0.02


def toward(dc: str) -> tuple[str, str]:
    """(request direction, reply direction) for traffic to a service in ``dc``."""
    return ("a_to_b", "b_to_a") if dc == "dc-b" else ("b_to_a", "a_to_b")


class DelayLine:
    """Callbacks due at given times, in time order, with a single armed timer."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self._timer: asyncio.TimerHandle | None = None

    def at(self, when_s: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (when_s, self._seq, action))
        if self._heap[0][2] is action:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._loop.call_at(when_s, self._fire)

    def _fire(self) -> None:
        self._timer = None
        now = self._loop.time()
        while self._heap and self._heap[0][0] <= now:
            heapq.heappop(self._heap)[2]()
        if self._heap:
            self._timer = self._loop.call_at(self._heap[0][0], self._fire)


class UdpForward:
    """127.0.0.1:listen_port -> 127.0.0.1:port, datagram by datagram through the model."""

    def __init__(self, relay: LoopbackRelay, dc: str, port: int, listen_port: int = 0) -> None:
        self.relay, self.port = relay, port
        self.req_dir, self.rep_dir = toward(dc)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", listen_port))
        self.sock.setblocking(False)
        self.listen_port: int = self.sock.getsockname()[1]
        self.sessions: dict[tuple[str, int], socket.socket] = {}
        relay.loop.add_reader(self.sock.fileno(), self._from_clients)

    def _from_clients(self) -> None:
        for _ in range(256):
            try:
                data, client = self.sock.recvfrom(65536)
            except BlockingIOError:
                return
            up = self.sessions.get(client) or self._session(client)
            self.relay.pass_datagram(self.req_dir, data, up.send)

    def _session(self, client: tuple[str, int]) -> socket.socket:
        up = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        up.setblocking(False)
        up.connect(("127.0.0.1", self.port))
        self.sessions[client] = up
        self.relay.loop.add_reader(up.fileno(), self._from_server, up, client)
        return up

    def _from_server(self, up: socket.socket, client: tuple[str, int]) -> None:
        for _ in range(256):
            try:
                data = up.recv(65536)
            except (BlockingIOError, ConnectionRefusedError):
                return
            self.relay.pass_datagram(self.rep_dir, data, lambda d: self.sock.sendto(d, client))


class TcpForward:
    """127.0.0.1:listen_port -> 127.0.0.1:port, each connection's byte stream shaped both ways."""

    def __init__(self, relay: LoopbackRelay, dc: str, port: int, listen_port: int = 0) -> None:
        self.relay, self.port = relay, port
        self.req_dir, self.rep_dir = toward(dc)
        self.sock = socket.create_server(("127.0.0.1", listen_port), backlog=128)
        self.listen_port = self.sock.getsockname()[1]
        self.tasks: set[asyncio.Task[None]] = set()
        relay.spawn(asyncio.start_server(self._accepted, sock=self.sock, limit=TCP_CHUNK_BYTES))

    async def _accepted(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            sr, sw = await asyncio.open_connection("127.0.0.1", self.port, limit=TCP_CHUNK_BYTES)
        except OSError:
            cw.close()
            return
        up = asyncio.ensure_future(self.relay.pump(self.req_dir, cr, sw))
        down = asyncio.ensure_future(self.relay.pump(self.rep_dir, sr, cw))
        # the server's side ended (it closed, or its process died): the client's connection ends
        # too. A real path would answer the client's next bytes with a reset; a relay that kept the
        # client's side open left it writing into a dead upstream forever (a gRPC channel to a
        # restarted server never reconnected)
        await asyncio.gather(down, return_exceptions=True)
        up.cancel()
        await asyncio.gather(up, return_exceptions=True)
        for w in (cw, sw):
            w.close()


class LoopbackRelay:
    """The model, the forwards and the control handler of a loopback lab."""

    def __init__(self, model: LinkModel, loop: asyncio.AbstractEventLoop) -> None:
        self.model, self.loop = model, loop
        self.lines = {d: DelayLine(loop) for d in ("a_to_b", "b_to_a")}
        self.forwards: dict[tuple[str, str, int], UdpForward | TcpForward] = {}
        self._tasks: set[asyncio.Future[Any]] = set()

    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def forward(self, proto: str, dc: str, port: int, listen_port: int = 0) -> int:
        """The relay port for ``(proto, dc, port)``: ``listen_port`` when given (pinned, so that
        configuration files can name it), any free port otherwise."""
        key = (proto, dc, port)
        if key not in self.forwards:
            cls = UdpForward if proto == "udp" else TcpForward
            self.forwards[key] = cls(self, dc, port, listen_port)
        have = self.forwards[key].listen_port
        if listen_port and have != listen_port:
            raise ValueError(f"{proto}:{dc}:{port} is already relayed on port {have}")
        return have

    def pass_datagram(self, direction: str, data: bytes, send: Callable[[bytes], object]) -> None:
        now = self.loop.time()
        fates = self.model.admit(direction, now, 1, len(data) + 28)

        def deliver() -> None:
            if not self.model.is_cut(direction, self.loop.time()):
                with contextlib.suppress(OSError):
                    send(data)

        for fate in fates:
            if not fate.corrupt:  # a corrupted datagram fails the receiver's checksum
                self.lines[direction].at(fate.at_s, deliver)

    def stream_shaper(self, direction: str) -> DirectionModel:
        """A per-connection model of one direction with only what a byte stream can show."""
        spec = dataclasses.replace(
            self.model.profile.direction(direction),
            loss=0.0, gilbert_elliott=None, reorder=0.0, duplicate=0.0, corrupt=0.0,
            jitter_reorders=False, queue_packets=0, queue_bytes=0,
        )  # fmt: skip
        return DirectionModel(spec, direction, self.model.profile.seed)

    async def pump(self, direction: str, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        shaper = self.stream_shaper(direction)
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        room = asyncio.Semaphore(TCP_MAX_BACKLOG_BYTES // TCP_CHUNK_BYTES)
        writer = asyncio.ensure_future(self._drain(direction, queue, room, dst))
        try:
            while data := await src.read(TCP_CHUNK_BYTES):
                await room.acquire()
                segments = -(-len(data) // TCP_SEGMENT_BYTES)
                fates = shaper.admit(self.loop.time(), segments, len(data) + segments * HEADER_BYTES, False)
                queue.put_nowait((max(f.at_s for f in fates), data))
            queue.put_nowait((0.0, b""))
            await writer
        finally:
            writer.cancel()

    async def _drain(
        self, direction: str, queue: asyncio.Queue[tuple[float, bytes]], room: asyncio.Semaphore, dst: Any
    ) -> None:
        while True:
            at_s, data = await queue.get()
            if not data:
                if dst.can_write_eof():
                    dst.write_eof()
                return
            await asyncio.sleep(max(0.0, at_s - self.loop.time()))
            while self.model.is_cut(direction, self.loop.time()):
                await asyncio.sleep(OUTAGE_POLL_S)
            dst.write(data)
            room.release()
            await dst.drain()


def loopback_handler(relay: LoopbackRelay, base: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    def handle(req: dict[str, Any]) -> dict[str, Any]:
        if req.get("op") != "forward":
            return base(req)
        proto, dc, port = req.get("proto"), req.get("dc"), req.get("port")
        if proto not in ("tcp", "udp") or dc not in ("dc-a", "dc-b"):
            return {"ok": False, "error": "forward needs proto tcp|udp and dc dc-a|dc-b"}
        if not isinstance(port, int) or not 0 < port < 65536:
            return {"ok": False, "error": f"forward port {port!r} must be 1-65535"}
        listen = req.get("listen_port", 0)
        if not isinstance(listen, int) or not 0 <= listen < 65536:
            return {"ok": False, "error": f"forward listen_port {listen!r} must be 0-65535"}
        try:
            return {"ok": True, "listen_port": relay.forward(proto, dc, port, listen)}
        except OSError as exc:
            return {"ok": False, "error": f"relay port {listen}: {exc.strerror}"}
        except ValueError as exc:
            return {"ok": False, "error": str(exc)}

    return handle


def run_loopback(state: LabState, lab_dir: Path) -> bool:
    """Relay until stopped; True when the owner died."""
    sharpen_timing()
    loop = asyncio.SelectorEventLoop(selectors.SelectSelector())  # select(): microsecond timeouts
    text = (lab_dir / "profile.toml").read_text()
    name = (lab_dir / "profile.name").read_text().strip()
    model = LinkModel(parse_profile(text, name=name), loop.time())
    relay = LoopbackRelay(model, loop)
    base = ControlHandler(model, None, loop.time)
    handler = loopback_handler(relay, base)
    control = ControlServer(state.control_path)
    done: asyncio.Future[bool] = loop.create_future()

    def serve() -> None:
        control.serve_one(handler)
        if base.stopping:
            finish(False)

    def finish(owner_died: bool) -> None:
        if not done.done():
            done.set_result(owner_died)

    loop.add_reader(control.fileno(), serve)
    owner = owner_fd(state)
    if owner is not None:
        loop.add_reader(owner, finish, True)
    loop.add_signal_handler(signal.SIGTERM, finish, False)
    print("ready", flush=True)
    try:
        return loop.run_until_complete(done)
    finally:
        control.close()
        if owner is not None:
            os.close(owner)
        loop.close()
