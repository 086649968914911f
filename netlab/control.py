"""The relay's control socket: one JSON request line in, one JSON reply line out.

Each running relay listens on ``<state dir>/control.sock`` (a Unix socket, root-only in the
namespaced lab). Requests: ``{"op": "status"}``, ``{"op": "outage", "seconds": S | null}`` (null: until
restored), ``{"op": "restore"}``, ``{"op": "profile", "toml": TEXT}`` (replace the link model live),
``{"op": "forward", ...}`` (loopback mode) and ``{"op": "stop"}``. Replies carry ``"ok"``, and
``"error"`` when it is false.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Callable
from typing import Any

from pddlink.errors import InvalidInput, Unavailable

Handler = Callable[[dict[str, Any]], dict[str, Any]]
MAX_REQUEST_BYTES = 1 << 20


class ControlServer:
    """A non-blocking listening socket; the relay's loop calls ``serve_one`` when it is readable."""

    def __init__(self, path: str) -> None:
        if os.path.exists(path):
            os.unlink(path)
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        os.chmod(path, 0o600)
        self.sock.listen(8)
        self.sock.setblocking(False)

    def fileno(self) -> int:
        return self.sock.fileno()

    def serve_one(self, handler: Handler) -> None:
        try:
            conn, _ = self.sock.accept()
        except BlockingIOError:
            return
        with conn:
            conn.settimeout(0.25)  # the packet loop waits meanwhile: keep it short
            try:
                request = json.loads(_read_line(conn))
                if not isinstance(request, dict):
                    raise InvalidInput("a control request is a JSON object")
                reply = handler(request)
            except (OSError, ValueError, InvalidInput) as exc:
                reply = {"ok": False, "error": str(exc)}
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps(reply).encode() + b"\n")

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_REQUEST_BYTES:
            raise InvalidInput("control request too large")
    return data


def request(path: str, message: dict[str, Any], timeout_s: float = 5.0) -> dict[str, Any]:
    """Send one request to a relay and return its reply; Unavailable when no relay answers."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(path)
            sock.sendall(json.dumps(message).encode() + b"\n")
            reply = json.loads(_read_line(sock) or b"null")
    except (OSError, ValueError) as exc:
        raise Unavailable(f"the lab's relay does not answer on {path}: {exc}") from exc
    if not isinstance(reply, dict):
        raise Unavailable(f"the lab's relay gave no reply on {path}")
    if not reply.get("ok"):
        raise InvalidInput(str(reply.get("error", "refused")))
    return reply
