"""Mutual TLS 1.3 on the gRPC control plane (pddlink.serving.grpc_tls), with real gRPC servers and channels.

A server built as the sidecar daemon builds it (``new_server`` + ``bind`` + ``SIDECAR_CALLERS``)
serves a small Sidecar servicer that counts the calls reaching it, so each test can tell whether a
refused peer got "anything to happen" (it must not).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import pytest

from pddlink.serving.grpc_tls import (
    SIDECAR_CALLERS,
    CallerCheck,
    bind,
    caller_identity,
    new_server,
    open_channel,
    probe_server,
)
from pddlink.serving.rpc import stubs
from pddlink.transport import PeerIdentity, TlsConfig, load_or_create_pki
from pddlink.transport.tls import AuthError

pb2, pb2_grpc = stubs()
MD, P, ROUTER, RLD = (PeerIdentity(r, f"{r}0") for r in ("md", "p", "router", "rld"))
RPC_TIMEOUT_S = 5.0


class CountingSidecar(pb2_grpc.SidecarServicer):  # type: ignore[misc,name-defined]
    def __init__(self) -> None:
        self.reached: Counter[str] = Counter()
        self.callers: list[PeerIdentity] = []

    async def Ping(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        self.reached["Ping"] += 1
        self.callers.append(caller_identity(context))
        return pb2.PingReply(nonce=request.nonce, role="md")

    async def Prefill(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        self.reached["Prefill"] += 1
        return pb2.PrefillReply(first_token=7)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsConfig]:
    base = tmp_path_factory.mktemp("pki")
    creds = load_or_create_pki(base / "ours", [MD, P, ROUTER, RLD])
    # the same identity as P, but issued by another CA
    rogue = load_or_create_pki(base / "rogue", [P])[P]
    return {"md": creds[MD], "p": creds[P], "router": creds[ROUTER], "rld": creds[RLD], "rogue": rogue}


async def _with_md_server(md_tls: TlsConfig, client: Any) -> tuple[Any, CountingSidecar, CallerCheck | None]:
    servicer = CountingSidecar()
    server, check = new_server(md_tls, callers=SIDECAR_CALLERS)
    pb2_grpc.add_SidecarServicer_to_server(servicer, server)
    port = bind(server, "127.0.0.1:0", md_tls)
    await server.start()
    try:
        result = await client(f"127.0.0.1:{port}")
    finally:
        await server.stop(0)
    return result, servicer, check


async def _ping(addr: str, tls: TlsConfig | None, expected: PeerIdentity | None) -> Any:
    async with open_channel(addr, tls, expected) as channel:
        return await pb2_grpc.SidecarStub(channel).Ping(pb2.PingRequest(nonce=5), timeout=RPC_TIMEOUT_S)


def test_authenticated_caller_is_served_and_recorded(pki: dict[str, TlsConfig]) -> None:
    reply, servicer, check = asyncio.run(
        _with_md_server(pki["md"], lambda addr: _ping(addr, pki["router"], MD))
    )
    assert reply.nonce == 5
    assert servicer.callers == [ROUTER]
    assert check is not None and check.status() == {"callers": {ROUTER.uri: 1}, "refused": {}}


def _refused(client: Any, pki: dict[str, TlsConfig]) -> tuple[grpc.aio.AioRpcError, CountingSidecar]:
    async def expect_refusal(addr: str) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client(addr)
        return info.value

    err, servicer, _ = asyncio.run(_with_md_server(pki["md"], expect_refusal))
    return err, servicer


def test_client_certificate_from_another_ca_is_refused_in_the_handshake(pki: dict[str, TlsConfig]) -> None:
    err, servicer = _refused(lambda addr: _ping(addr, pki["rogue"], MD), pki)
    assert err.code() is grpc.StatusCode.UNAVAILABLE
    assert not servicer.reached  # nothing reached the service


def test_server_with_another_identity_is_refused_by_the_client(pki: dict[str, TlsConfig]) -> None:
    # the router meant to reach RLD; the server at that address is MD (a valid certificate of our CA)
    err, servicer = _refused(lambda addr: _ping(addr, pki["router"], RLD), pki)
    assert err.code() is grpc.StatusCode.UNAVAILABLE
    assert "Verification" in (err.details() or "")
    assert not servicer.reached


def test_plaintext_client_gets_nothing_from_a_tls_server(pki: dict[str, TlsConfig]) -> None:
    err, servicer = _refused(lambda addr: _ping(addr, None, None), pki)
    assert err.code() is grpc.StatusCode.UNAVAILABLE
    assert not servicer.reached


def test_role_not_allowed_for_the_method_is_refused_before_the_handler(pki: dict[str, TlsConfig]) -> None:
    async def prefill(addr: str, tls: TlsConfig) -> Any:
        async with open_channel(addr, tls, MD) as channel:
            return await pb2_grpc.SidecarStub(channel).Prefill(pb2.PrefillRequest(), timeout=RPC_TIMEOUT_S)

    err, servicer = _refused(lambda addr: prefill(addr, pki["p"]), pki)  # only the router prefills
    assert err.code() is grpc.StatusCode.PERMISSION_DENIED and "p/p0" in (err.details() or "")
    assert not servicer.reached
    reply, servicer, _ = asyncio.run(_with_md_server(pki["md"], lambda addr: prefill(addr, pki["router"])))
    assert reply.first_token == 7 and servicer.reached["Prefill"] == 1


def test_probe_reports_the_identity_and_tls13(pki: dict[str, TlsConfig]) -> None:
    async def probe(addr: str) -> Any:
        seen = await asyncio.to_thread(probe_server, addr, pki["p"], RPC_TIMEOUT_S)
        with pytest.raises(AuthError):  # another CA's client: the server refuses the handshake
            await asyncio.to_thread(probe_server, addr, pki["rogue"], RPC_TIMEOUT_S)
        return seen

    seen, _, _ = asyncio.run(_with_md_server(pki["md"], probe))
    assert seen.identity == MD and seen.version == "TLSv1.3" and seen.cipher


class _AuthContextOnly:
    """Stands in for a servicer context: gRPC Python cannot make a client that negotiates TLS 1.2,
    so the refusal of a TLS 1.2 session is checked on the auth context such a session would carry."""

    def __init__(self, auth: dict[str, list[bytes]]) -> None:
        self._auth = auth

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._auth


def test_caller_identity_requires_tls13(pki: dict[str, TlsConfig]) -> None:
    pem = Path(pki["p"].cert_file).read_bytes()
    ok = _AuthContextOnly({"ssl_tls_version": [b"TLSv1.3"], "x509_pem_cert": [pem]})
    assert caller_identity(ok) == P  # type: ignore[arg-type]
    old = _AuthContextOnly({"ssl_tls_version": [b"TLSv1.2"], "x509_pem_cert": [pem]})
    with pytest.raises(AuthError, match=r"TLSv1\.2"):
        caller_identity(old)  # type: ignore[arg-type]
    with pytest.raises(AuthError, match="no TLS"):
        caller_identity(_AuthContextOnly({}))  # type: ignore[arg-type]


def test_local_plaintext_only_on_the_unix_socket(pki: dict[str, TlsConfig], tmp_path: Path) -> None:
    """The router's shape: mutual TLS on TCP, plaintext for local clients on a unix socket."""
    sock = f"unix:{tmp_path}/router.grpc"

    async def scenario() -> tuple[Any, grpc.aio.AioRpcError, CallerCheck | None, CountingSidecar]:
        servicer = CountingSidecar()
        server, check = new_server(pki["md"], local_plaintext=True)
        pb2_grpc.add_SidecarServicer_to_server(servicer, server)
        port = bind(server, "127.0.0.1:0", pki["md"])
        bind(server, sock, None)
        await server.start()
        try:
            async with open_channel(sock, None, None) as channel:
                stub = pb2_grpc.SidecarStub(channel)
                local = await stub.Prefill(pb2.PrefillRequest(), timeout=RPC_TIMEOUT_S)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _ping(f"127.0.0.1:{port}", None, None)
        finally:
            await server.stop(0)
        return local, info.value, check, servicer

    local, refused, check, servicer = asyncio.run(scenario())
    assert local.first_token == 7 and refused.code() is grpc.StatusCode.UNAVAILABLE
    assert check is not None and check.status()["callers"] == {"local": 1}
    assert servicer.reached == Counter({"Prefill": 1})
