"""The coordinator of ``pddlink bench link``: start receiver and sender processes, merge their figures.

Loopback: both peers are children of this process, the receiver on 127.0.0.1 with a kernel-chosen
port. Netlab: a lab is brought up from the profile, the receiver runs in dc-b and the sender in
dc-a (through the netlab API), and the lab is torn down whatever happens. Every wait is bounded by
the spec's deadline; a peer that fails or stalls is killed and the run fails with its last words.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from pddlink.bench.peer import RECEIVER, SENDER, BenchSpec
from pddlink.errors import DeadlineExceeded, ErrorCode, LocalError, RemoteError
from pddlink.transport.pki import load_or_create_pki

Spawn = Callable[[Sequence[str]], "subprocess.Popen[str]"]
_START_TIMEOUT_S = 30.0
LAB_NAME = "benchlink"


def peer_argv(spec: BenchSpec, role: str, addr: str) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "pddlink.cli.main",
        "bench",
        "link",
        "--role",
        role,
        "--peer" if role == "sender" else "--listen",
        addr,
        "--transport",
        spec.transport,
        "--streams",
        str(spec.streams),
        "--bytes",
        str(spec.total_bytes),
        "--chunk-bytes",
        str(spec.chunk_bytes),
        "--transfer-bytes",
        str(spec.transfer_bytes),
        "--codec",
        spec.codec,
        "--cc",
        spec.congestion_control,
        "--quic-impl",
        spec.quic_impl,
        "--deadline-s",
        str(spec.deadline_s),
        "--tls" if spec.tls else "--no-tls",
        "--datagram-bytes",
        str(spec.max_datagram_bytes),
        "--loop",
        spec.event_loop,
        "--line-mbit",
        str(spec.line_rate_bps / 1e6),
    ]
    if spec.certs is not None:
        argv += ["--certs", str(spec.certs)]
    return argv


def read_event(proc: subprocess.Popen[str], timeout_s: float) -> dict[str, Any]:
    """The next JSON line a peer prints, within ``timeout_s``."""
    import selectors

    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    end = time.monotonic() + timeout_s
    try:
        while (left := end - time.monotonic()) > 0:
            if not sel.select(left):
                continue
            line = proc.stdout.readline()
            if not line:
                raise RemoteError(f"bench peer exited (rc {proc.wait(5)}) before reporting")
            if line.startswith("{"):
                event = json.loads(line)
                assert isinstance(event, dict)
                return event
    finally:
        sel.close()
    raise DeadlineExceeded(f"bench peer said nothing for {timeout_s:.0f} s")


def _popen(argv: Sequence[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=None, text=True)


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def run_pair(
    spec: BenchSpec,
    listen_addr: str,
    connect_to: Callable[[int], tuple[str, int]],
    spawn_receiver: Spawn = _popen,
    spawn_sender: Spawn = _popen,
) -> dict[str, Any]:
    """Run one receiver and one sender to completion and merge what they report."""
    with tempfile.TemporaryDirectory(prefix="pddlink-bench-") as tmp, ExitStack() as stack:
        if spec.tls:
            certs = spec.certs or Path(tmp)
            load_or_create_pki(certs, [RECEIVER, SENDER])
            spec = _with_certs(spec, certs)
        receiver = spawn_receiver(peer_argv(spec, "receiver", listen_addr))
        stack.callback(_stop, receiver)
        listening = read_event(receiver, _START_TIMEOUT_S)
        host, port = connect_to(int(listening["port"]))
        sender = spawn_sender(peer_argv(spec, "sender", f"{host}:{port}"))
        stack.callback(_stop, sender)
        sent = read_event(sender, spec.deadline_s + _START_TIMEOUT_S)
        if "error" in sent:
            err = sent["error"]
            raise LocalError(f"transfer failed: {err['reason']}", code=ErrorCode[err["code"]])
        received = read_event(receiver, _START_TIMEOUT_S)
        if received.get("failures"):
            first = received["failures"][0]
            raise RemoteError(f"receiver: {first['reason']}", code=ErrorCode[first["code"]])
        return merge(spec, sent, received)


def merge(spec: BenchSpec, sent: dict[str, Any], received: dict[str, Any]) -> dict[str, Any]:
    seconds = float(sent["seconds"])
    gb = spec.total_bytes / 1e9
    return {
        "transport": spec.transport,
        "streams": spec.streams,
        "bytes": spec.total_bytes,
        "seconds": seconds,
        "goodput_gbit_per_s": spec.total_bytes * 8 / seconds / 1e9,
        "cpu_s_per_gb": (float(sent["cpu_s"]) + float(received["cpu_s"])) / gb,
        "retransmits": sent.get("retransmits"),  # TCP: TCP_INFO total_retrans; QUIC (qh3): lost packets
        "congestion_control": sent.get("congestion_control"),
        "tls": spec.tls,
        "chunk_bytes": spec.chunk_bytes,
        "codec": spec.codec,
        "rtt_ms": sent.get("rtt_ms"),
        "resent_chunks": sent.get("resent_chunks"),
        "wire_bytes": sent.get("wire_bytes"),
        "sender_cpu_s": sent["cpu_s"],
        "receiver_cpu_s": received["cpu_s"],
        "paced_to_line_mbit": spec.line_rate_bps / 1e6 if spec.line_rate_bps else None,
    }


def _with_certs(spec: BenchSpec, certs: Path) -> BenchSpec:
    return dataclasses.replace(spec, certs=certs)


def run_loopback(spec: BenchSpec) -> dict[str, Any]:
    return run_pair(spec, "127.0.0.1:0", lambda port: ("127.0.0.1", port))


def run_netlab(spec: BenchSpec, profile: str) -> dict[str, Any]:
    """Receiver in dc-b, sender in dc-a of a lab brought up for this run and torn down after."""
    from netlab.lab import Lab

    spec = dataclasses.replace(spec, max_datagram_bytes=1452)  # the emulated WAN has a 1500-byte MTU
    with Lab.up(profile, name=LAB_NAME) as lab:
        proto = "udp" if spec.transport == "quic" else "tcp"
        return run_pair(
            spec,
            f"{lab.addr('dc-b')}:0",
            lambda port: lab.endpoint("dc-b", port, proto),
            spawn_receiver=lambda argv: lab.popen("dc-b", argv, stdout=subprocess.PIPE, text=True),
            spawn_sender=lambda argv: lab.popen("dc-a", argv, stdout=subprocess.PIPE, text=True),
        )
