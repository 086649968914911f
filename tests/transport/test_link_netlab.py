"""Across a real emulated WAN (netlab, namespaces): outages during a striped TLS transfer.

Sender and receiver are the ``pddlink bench link`` peer processes, in dc-a and dc-b; the WAN is cut
with ``Lab.outage`` while the transfer runs, so TCP's own retransmission and pddlink's deadlines
react to real packet loss.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from pddlink.bench.peer import RECEIVER, SENDER, BenchSpec
from pddlink.bench.run import peer_argv, read_event
from pddlink.transport.pki import load_or_create_pki

pytestmark = [pytest.mark.root, pytest.mark.netlab]
PROFILE = """
[link]
delay_ms = 10
rate_mbit = 200
queue_packets = 1000
"""


def spec_for(tmp_path: Path, deadline_s: float, transport: str) -> BenchSpec:
    certs = tmp_path / "certs"
    load_or_create_pki(certs, [RECEIVER, SENDER])
    size = 120_000_000 if transport == "tcp" else 50_000_000  # about 5 s at 200 Mbit/s (QUIC: 170)
    return BenchSpec(
        transport=transport, streams=4, total_bytes=size, chunk_bytes=1 << 20, transfer_bytes=size,
        codec="none", congestion_control="bbr", tls=True, quic_impl="auto", deadline_s=deadline_s,
        certs=certs, max_datagram_bytes=1452,
    )  # fmt: skip


def run_with_outage(
    tmp_path: Path, spec: BenchSpec, outage_s: float
) -> tuple[dict[str, Any], dict[str, Any], float]:
    from netlab.lab import Lab

    profile = tmp_path / "wan.toml"
    profile.write_text(PROFILE)
    with Lab.up(profile, name="tport-outage") as lab:
        addr = lab.addr("dc-b")
        receiver = lab.popen(
            "dc-b", peer_argv(spec, "receiver", f"{addr}:0"), stdout=subprocess.PIPE, text=True
        )
        try:
            port = read_event(receiver, 30.0)["port"]
            sender = lab.popen(
                "dc-a", peer_argv(spec, "sender", f"{addr}:{port}"), stdout=subprocess.PIPE, text=True
            )
            t0 = time.monotonic()
            while lab.status()["stats"]["a_to_b"]["bytes_in"] < spec.total_bytes // 5:  # mid-transfer
                assert sender.poll() is None and time.monotonic() - t0 < 30.0
                time.sleep(0.05)
            lab.outage(outage_s)
            t0 = time.monotonic()
            sent = read_event(sender, spec.deadline_s + 30.0)
            elapsed = time.monotonic() - t0
            received = read_event(receiver, 30.0)
            sender.wait(10)
        finally:
            for proc in (receiver,):
                if proc.poll() is None:
                    proc.kill()
    return sent, received, elapsed


@pytest.mark.parametrize("transport", ["tcp", "quic"])
def test_transfer_survives_a_3_second_outage(tmp_path: Path, transport: str) -> None:
    spec = spec_for(tmp_path, deadline_s=40.0, transport=transport)
    sent, received, elapsed = run_with_outage(tmp_path, spec, 3.0)
    assert "error" not in sent, sent
    assert received["bytes"] == spec.total_bytes and received["failures"] == []
    assert elapsed > 3.0  # the outage stalled it, nothing broke


@pytest.mark.parametrize("transport", ["tcp", "quic"])
def test_outage_longer_than_the_deadline_aborts_with_reason_on_both_sides(
    tmp_path: Path, transport: str
) -> None:
    spec = spec_for(tmp_path, deadline_s=4.0, transport=transport)
    sent, received, elapsed = run_with_outage(tmp_path, spec, 10.0)
    assert sent["error"]["code"] == "DEADLINE_EXCEEDED" and "deadline" in sent["error"]["reason"]
    assert elapsed < 8.0  # it gave up at its deadline, not when the WAN came back
    assert received["failures"] and received["failures"][0]["code"] == "DEADLINE_EXCEEDED"
    assert received["bytes"] == 0
