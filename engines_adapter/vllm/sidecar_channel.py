"""``SidecarChannel``: one connector half's end of the control channel to the local sidecar.

Each half (scheduler, worker) owns one, over its own ``ControlClient``. Besides the client's own
pipelined ``send`` and blocking ``call``, it keeps the answers nobody waits for (PREPARE, RELEASE):
they are read when the channel is next used, and logged if refused. The sidecar handles each
connection's requests in order, so a later request on the same channel sees their effect without
anyone waiting on them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pddlink.connector.control import ControlClient, Op, Pending
from pddlink.errors import PddlinkError

log = logging.getLogger("pddlink.vllm")


class SidecarChannel:
    def __init__(self, control_socket: Path) -> None:
        self.control = ControlClient(control_socket)
        self._unread: list[tuple[str, Pending]] = []  # (transfer, answer owed)

    def send(self, op: Op, **fields: Any) -> Pending:
        """A pipelined request whose answer the caller reads itself (``Pending.result``)."""
        return self.control.send(op, **fields)

    def call(self, op: Op, **fields: Any) -> dict[str, Any]:
        """A blocking round trip; raises ``PddlinkError`` as ``ControlClient.call`` does."""
        return self.control.call(op, **fields)

    def poll_answers(self) -> None:
        """Read the answers that have already arrived, without blocking."""
        self.control.poll_answers()

    def call_or_warn(self, op: Op, **fields: Any) -> dict[str, Any] | None:
        """A blocking round trip whose failure is logged, not raised (``None``): for RELEASEs
        after a failed save or commit, where nothing is left to do but tell the sidecar."""
        try:
            return self.control.call(op, **fields)
        except PddlinkError as exc:
            log.warning("pddlink sidecar %s failed: %s", op.value, exc)
            return None
        finally:
            self.log_unread()

    def send_unawaited(self, op: Op, **fields: Any) -> None:
        """A request whose answer vLLM need not wait for: written now, its answer read (and a
        refusal logged) the next time this side uses the channel."""
        self.log_unread()
        self._unread.append((str(fields.get("transfer", "")), self.control.send(op, **fields)))

    def log_unread(self) -> None:
        """Read the unawaited answers that have arrived; log each refusal."""
        if not self._unread:
            return
        self.control.poll_answers()
        keep = []
        for transfer, pending in self._unread:
            if not pending.done:
                keep.append((transfer, pending))
                continue
            try:
                pending.result()
            except PddlinkError as exc:
                log.warning("pddlink sidecar %s of %s failed: %s", pending.op.value, transfer, exc)
        self._unread = keep

    def close(self) -> None:
        self.control.close()
