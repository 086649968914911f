"""Which addresses a process may listen on without TLS.

Plaintext is for one machine (tests, labs on loopback): a sidecar or router bound to any other
address without TLS is refused unless the operator says so explicitly
(``allow_plaintext_non_loopback``). Pure: the host is only parsed, never resolved, so a name other
than ``localhost`` counts as non-loopback.
"""

from __future__ import annotations

import ipaddress

from pddlink.errors import ConfigError


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``; "" and 0.0.0.0 mean every interface: False."""
    text = host.strip().strip("[]")
    if text.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(text).is_loopback
    except ValueError:
        return False


def check_plaintext_exposure(host: str, *, tls: bool, allowed: bool, who: str) -> None:
    """Refuse a plaintext listener on a non-loopback ``host`` unless ``allowed``."""
    if tls or allowed or is_loopback(host):
        return
    raise ConfigError(
        f"{who}: refusing to serve plaintext on non-loopback address {host or '0.0.0.0'!r}: give it a "
        "tls_dir (pddlink pki issue), or set allow_plaintext_non_loopback (--allow-plaintext-non-loopback) "
        "to accept that anyone who can reach it can call it"
    )
