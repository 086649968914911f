"""Who may use a sidecar's admin HTTP on its TCP port (``admin_port``).

The admin endpoints tell what the sidecar holds (``/status``, ``/memory``, ``/drc/snapshot``) and
take work (``POST /drc/match``), so on TCP they need a bearer key from ``admin_keys_file``
(``Authorization: Bearer KEY``; the same file format as the router's API keys,
``pddlink.serving.client_guard.load_key_file``). Only the liveness and readiness probes answer without one:
Kubernetes' ``httpGet`` probes carry no credentials, and they say nothing but up or down. The unix
socket (``admin_unix``) needs no key: its file mode (0600) already limits it to the sidecar's user.
Without keys the TCP port answers everyone, which ``sidecar.config`` allows on loopback only
(``pddlink.listen_policy.check_open_http``).
"""

from __future__ import annotations

from pddlink.serving.client_guard import Refusal, bearer_client
from pddlink.serving.http import Handler, Request, Response, error_response

OPEN_PATHS = frozenset({"/healthz", "/readyz"})  # probes: no credentials, nothing told but up/down


def admin_refusal(keys: tuple[bytes, ...], req: Request) -> Refusal | None:
    """None when ``req`` may reach the admin endpoints over TCP, else the 401 to answer."""
    if not keys or (req.method == "GET" and req.path in OPEN_PATHS):
        return None
    client = bearer_client(keys, req.header("authorization"))
    return client if isinstance(client, Refusal) else None


def guarded(handler: Handler, keys: tuple[bytes, ...]) -> Handler:
    """``handler`` behind ``admin_refusal``: what the TCP admin port serves."""

    async def serve(req: Request) -> Response:
        refusal = admin_refusal(keys, req)
        if refusal is None:
            return await handler(req)
        resp = error_response(refusal.status, refusal.message, refusal.kind)
        return Response(resp.status, resp.body, resp.content_type, (("www-authenticate", "Bearer"),))

    return serve
