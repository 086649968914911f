"""Friendly one-line errors for the commands that bind or write.

Every command that listens checks its addresses with ``check_listen`` / ``check_unix_socket`` and
every command that writes checks its directories with ``check_writable`` before it starts work
(before an engine loads or a lab comes up), so a port in use, an address that is not this
machine's or an unwritable directory ends in one ``error: ...`` line and exit code 2 (``main``
prints any ``PddlinkError`` that way). What still slips through at run time (a port taken between
the check and the bind) is translated by ``explain`` in ``main``. ``private_umask`` makes what a
serving process creates (its unix sockets) its owner's alone, whatever the umask it was started with.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import tempfile
from pathlib import Path

from pddlink.errors import ConfigError


class PortInUse(ConfigError):
    """Another process listens on the address."""


class AddressNotLocal(ConfigError):
    """The address is not one of this machine's (or does not resolve)."""


class NotWritable(ConfigError):
    """A directory (or a file's directory) this command must write into cannot be written."""


_IN_USE = {errno.EADDRINUSE}
_NOT_LOCAL = {errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT}
_NO_WRITE = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.ENOSPC, errno.EDQUOT, errno.EISDIR}


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)


def check_listen(host: str, port: int, what: str) -> None:
    """Can this process listen on ``host:port`` (TCP; port 0: any port, the address alone is checked)?"""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise AddressNotLocal(f"{what} {host}:{port}: cannot resolve {host!r} ({exc.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is no conflict
        try:
            s.bind(addr)
            s.listen(1)  # binding alone succeeds beside a listener that set SO_REUSEADDR too
        except OSError as exc:
            raise _listen_error(exc, f"{what} {host}:{port}") from None


def _listen_error(exc: OSError, where: str) -> ConfigError:
    if exc.errno in _IN_USE:
        return PortInUse(f"{where}: port already in use (another process listens there)")
    if exc.errno in _NOT_LOCAL:
        return AddressNotLocal(f"{where}: not an address of this machine ({_why(exc)})")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return PortInUse(f"{where}: permission denied (ports below 1024 need privileges)")
    return ConfigError(f"{where}: cannot listen: {_why(exc)}")


def check_unix_socket(path: str, what: str) -> None:
    """Can this process create the unix socket ``path``: its directory writable, nobody serving there?"""
    if not path:
        return
    target = Path(path)
    if target.exists():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            with contextlib.suppress(OSError):
                s.connect(path)
                raise PortInUse(f"{what} {path}: a process already serves on this socket")
    check_writable(target.parent, f"{what} {path}")


def check_writable(directory: Path | str, what: str, *, create: bool = False) -> None:
    """Can this process create files in ``directory``? (``create``: make it, with its parents, first.)

    Tried for real (a temporary file), not with ``os.access``: root passes every access check but
    still cannot write a read-only mount or below a regular file."""
    directory = Path(directory) if str(directory) else Path(".")
    try:
        if create:
            directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".pddlink-write-check-")
    except OSError as exc:
        raise NotWritable(f"{what}: cannot write into {directory}: {_why(exc)}") from None
    os.close(fd)
    os.unlink(probe)


def check_output_file(path: str | None, what: str) -> None:
    """An output file's directory is created if missing and must be writable."""
    if path:
        check_writable(Path(path).parent, f"{what} {path}", create=True)


def explain(exc: BaseException) -> ConfigError | None:
    """A one-line error for an OS error that escaped the checks above, or None if it is none of them."""
    if isinstance(exc, OSError):
        where = " ".join(str(p) for p in (exc.filename, exc.filename2) if p) or "address"
        if exc.errno in _IN_USE:
            return PortInUse(f"{where}: port already in use ({_why(exc)})")
        if exc.errno in _NOT_LOCAL:
            return AddressNotLocal(f"{where}: not an address of this machine ({_why(exc)})")
        if exc.errno in _NO_WRITE:
            return NotWritable(f"{where}: cannot write or read: {_why(exc)}")
        return None
    if isinstance(exc, RuntimeError) and "Failed to bind" in str(exc):  # grpc's add_*_port
        return PortInUse(f"{str(exc).splitlines()[0]} (port in use or address not local)")
    return None


def private_umask() -> None:
    """Files and sockets this process creates from now on: owner only (group and others cut)."""
    os.umask(os.umask(0o077) | 0o077)
