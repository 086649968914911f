"""Transport names -> ``module:Class``, imported on first use.

A transport whose optional dependency is missing (aioquic/qh3 for QUIC, pyverbs and a device for
RDMA) fails only when it is chosen, with ``Unavailable`` saying what to install. ``auto`` picks the
datacenter fast path: RDMA where a device and pyverbs exist, else TCP; the choice and its reason are
logged once and returned as a ``FastPathChoice`` the sidecar exports in its metrics.

"rdma" itself loads without pyverbs: it is a TCP link that sets RDMA up per link over the control
connection and falls back to its TCP stripes, with the reason, where either side cannot
(``rdma_session``). ``auto`` skips that round trip where this host has no device at all.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from pddlink.errors import InvalidInput, Unavailable
from pddlink.transport.base import Transport

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TransportEntry:
    target: str  # "module:Class"
    install_hint: str  # what to install when the import fails


TRANSPORTS: dict[str, TransportEntry] = {
    "tcp": TransportEntry("pddlink.transport.tcp:TcpTransport", "pip install uvloop (optional, for speed)"),
    "quic": TransportEntry(
        "pddlink.transport.quic:QuicTransport", "pip install 'pddlink[quic-native]' (qh3) or aioquic"
    ),
    "rdma": TransportEntry(
        "pddlink.transport.rdma_session:RdmaTransport",
        "an RDMA device and pyverbs (apt-get install python3-pyverbs, or pip install 'pddlink[rdma]'"
        " with libnl-3-dev and libnl-route-3-dev)",
    ),
}
NAMES = (*TRANSPORTS, "auto")
_INFINIBAND_SYSFS = Path("/sys/class/infiniband")


@dataclass(frozen=True, slots=True)
class FastPathChoice:
    """What ``auto`` chose and why; ``rdma_available`` is the metric flag."""

    name: str
    reason: str
    rdma_available: bool


def load(name: str) -> type[Transport]:
    """The transport class registered as ``name`` ("auto" resolves through ``choose_fast_path``)."""
    if name == "auto":
        name = choose_fast_path().name
    entry = TRANSPORTS.get(name)
    if entry is None:
        raise InvalidInput(f"unknown transport {name!r}; choose one of {', '.join(NAMES)}")
    module_name, _, attr = entry.target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (exc.name == "pddlink" or exc.name.startswith("pddlink.")):
            raise Unavailable(f"transport {name!r} is not part of this build ({exc.name})") from exc
        raise Unavailable(f"transport {name!r} needs {exc.name}: install {entry.install_hint}") from exc
    except ImportError as exc:
        raise Unavailable(f"transport {name!r} cannot load ({exc}): install {entry.install_hint}") from exc
    try:
        return cast(type[Transport], getattr(module, attr))
    except AttributeError as exc:
        raise Unavailable(f"transport {name!r}: {entry.target} does not exist in this build") from exc


def rdma_devices(sysfs: Path = _INFINIBAND_SYSFS) -> list[str]:
    """Names of RDMA devices the kernel exposes (empty where there are none)."""
    try:
        return sorted(p.name for p in sysfs.iterdir())
    except OSError:
        return []


_choice: FastPathChoice | None = None


def choose_fast_path(sysfs: Path = _INFINIBAND_SYSFS) -> FastPathChoice:
    """RDMA if a device exists and the rdma transport loads, else TCP; logged once with the reason."""
    global _choice
    if _choice is not None and sysfs == _INFINIBAND_SYSFS:
        return _choice
    devices = rdma_devices(sysfs)
    if not devices:
        choice = FastPathChoice("tcp", f"no RDMA device under {sysfs}: fast path uses TCP", False)
    else:
        try:
            load("rdma")
            from pddlink.transport.rdma import rdma_available

            usable, why = rdma_available()
            if not usable:
                raise Unavailable(why)
            choice = FastPathChoice("rdma", f"RDMA device(s) {', '.join(devices)}", True)
        except Unavailable as exc:
            found = ", ".join(devices)
            choice = FastPathChoice(
                "tcp", f"RDMA device(s) {found} present but {exc.message}; using TCP", False
            )
    log.log(logging.INFO if choice.rdma_available else logging.WARNING, "fast path: %s", choice.reason)
    if sysfs == _INFINIBAND_SYSFS:
        _choice = choice
    return choice
