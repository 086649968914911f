"""Which addresses a process may listen on without TLS, or serve HTTP on without credentials.

Plaintext is for one machine (tests, labs on loopback): a sidecar or router bound to any other
address without TLS is refused unless the operator says so explicitly
(``allow_plaintext_non_loopback``). Likewise an HTTP port that answers anyone (the router's client
API without API keys or client certificates, a sidecar's admin port without admin keys) is refused
on a non-loopback address unless said explicitly (``allow_unauthenticated_non_loopback``). Pure:
the host is only parsed, never resolved, so a name other than ``localhost`` counts as non-loopback.
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


def check_open_http(host: str, *, guarded: bool, allowed: bool, who: str, remedy: str) -> None:
    """Refuse an HTTP port that takes no credentials on a non-loopback ``host`` unless ``allowed``.
    ``remedy`` names the setting that would give it credentials."""
    if guarded or allowed or is_loopback(host):
        return
    raise ConfigError(
        f"{who}: refusing to serve HTTP without credentials on non-loopback address "
        f"{host or '0.0.0.0'!r}: give it {remedy}, or set allow_unauthenticated_non_loopback "
        "(--allow-unauthenticated-non-loopback) to accept that anyone who can reach it can call it"
    )
