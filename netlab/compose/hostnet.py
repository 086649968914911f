"""What a container engine changes in the host's network settings, recorded before and put back after.

dockerd with its iptables mode on adds chains and rules to the host's ``filter`` and ``nat`` tables
(IPv4 and IPv6) and may switch forwarding sysctls on. ``take_snapshot`` records those tables and
sysctls before the compose lab starts its own dockerd; ``restore`` puts them back once that dockerd
has stopped: every table is replaced by its recorded content, a table that did not exist before is
deleted, every sysctl gets its old value. ``differences`` lists what still differs (the lab's
``status`` and the tests use it).

Backends: ``nft`` (iptables-nft, Debian's default: tables are saved and restored with ``nft`` per
table, atomically), ``legacy`` (iptables-save / iptables-restore per table) and ``none`` (no
iptables on the machine: only sysctls are recorded).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pddlink.errors import LocalError

SYSCTLS = (
    "net.ipv4.ip_forward",
    "net.ipv4.conf.all.forwarding",
    "net.ipv6.conf.all.forwarding",
    "net.ipv6.conf.default.forwarding",
    "net.bridge.bridge-nf-call-iptables",
    "net.bridge.bridge-nf-call-ip6tables",
)
# (nft family, table): what dockerd writes to
TABLES = (("ip", "filter"), ("ip", "nat"), ("ip6", "filter"), ("ip6", "nat"))
_COUNTERS = re.compile(r"counter packets \d+ bytes \d+|\[\d+:\d+\]")


@dataclass(frozen=True, slots=True)
class HostNetSnapshot:
    """The host's firewall tables and forwarding sysctls at one moment ('' = table or key absent)."""

    backend: str
    tables: tuple[tuple[str, str], ...]  # ("ip filter", text), one per TABLES entry
    sysctls: tuple[tuple[str, str], ...]

    def to_json(self) -> str:
        return json.dumps({"backend": self.backend, "tables": self.tables, "sysctls": self.sysctls})

    @classmethod
    def from_json(cls, text: str) -> HostNetSnapshot:
        raw = json.loads(text)
        return cls(
            str(raw["backend"]),
            tuple((str(k), str(v)) for k, v in raw["tables"]),
            tuple((str(k), str(v)) for k, v in raw["sysctls"]),
        )


def backend() -> str:
    """``nft``, ``legacy`` or ``none``, from ``iptables -V``."""
    if shutil.which("iptables") is None:
        return "none"
    out = _run(["iptables", "-V"], check=False)
    return "nft" if "nf_tables" in out else "legacy"


def normalized(text: str) -> str:
    """A table's text without its packet counters and comment lines, for comparison."""
    lines = [_COUNTERS.sub("", line).rstrip() for line in text.splitlines()]
    return "\n".join(line for line in lines if line.strip() and not line.lstrip().startswith("#"))


def take_snapshot() -> HostNetSnapshot:
    kind = backend()
    tables = tuple((f"{fam} {table}", _read_table(kind, fam, table)) for fam, table in TABLES)
    return HostNetSnapshot(kind, tables, tuple((key, read_sysctl(key)) for key in SYSCTLS))


def differences(before: HostNetSnapshot) -> list[str]:
    """What differs now from ``before``: '<table> changed' and '<sysctl> A -> B' lines."""
    now = take_snapshot()
    out = [
        f"{name} changed"
        for (name, old), (_, new) in zip(before.tables, now.tables, strict=True)
        if normalized(old) != normalized(new)
    ]
    out += [
        f"{key} {old or 'absent'} -> {new or 'absent'}"
        for (key, old), (_, new) in zip(before.sysctls, now.sysctls, strict=True)
        if old != new
    ]
    return out


def restore(before: HostNetSnapshot) -> list[str]:
    """Put tables and sysctls back as ``before`` recorded them; returns what was changed back."""
    changed = differences(before)
    now = dict(take_snapshot().tables)
    for name, old in before.tables:
        if normalized(old) != normalized(now[name]):
            _write_table(before.backend, name, old, existed_now=bool(now[name]))
    for key, old in before.sysctls:
        if old and read_sysctl(key) != old:
            write_sysctl(key, old)
    left = differences(before)
    if left:
        raise LocalError(f"could not restore the host's network settings: {'; '.join(left)}")
    return changed


# ---- one table ------------------------------------------------------------------------------


def _read_table(kind: str, family: str, table: str) -> str:
    if kind == "nft":
        return _run(["nft", "list", "table", family, table], check=False)
    if kind == "legacy":
        tool = "iptables-save" if family == "ip" else "ip6tables-save"
        return _run([tool, "-t", table], check=False) if shutil.which(tool) else ""
    return ""


def _write_table(kind: str, name: str, text: str, existed_now: bool) -> None:
    family, table = name.split()
    if kind == "nft":
        script = (f"delete table {family} {table}\n" if existed_now else "") + text
        if script.strip():
            _run(["nft", "-f", "-"], stdin=script)
    elif kind == "legacy" and text:
        tool = "iptables-restore" if family == "ip" else "ip6tables-restore"
        _run([tool, "-T", table], stdin=text)


def _run(argv: list[str], *, check: bool = True, stdin: str | None = None) -> str:
    proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30, check=False)
    if check and proc.returncode != 0:
        raise LocalError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout if proc.returncode == 0 else ""


# ---- sysctls --------------------------------------------------------------------------------


def _sysctl_path(key: str) -> Path:
    return Path("/proc/sys") / key.replace(".", "/")


def read_sysctl(key: str) -> str:
    try:
        return _sysctl_path(key).read_text().strip()
    except OSError:
        return ""


def write_sysctl(key: str, value: str) -> None:
    try:
        _sysctl_path(key).write_text(value + "\n")
    except OSError as exc:
        raise LocalError(f"cannot set {key}={value}: {exc.strerror}") from None
