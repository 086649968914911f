"""The roles of a PDD deployment, one enum for every place that names one.

``Role`` is a ``StrEnum``: its values are the names used on the wire, in configuration files, in
certificates (``PeerIdentity``) and in traces, so ``Role("md")`` parses a name and ``Role.MD ==
"md"`` holds where older code still compares strings.
"""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    P = "p"  # Prefill
    RLD = "rld"  # RelayDecode (next to P, over the fast path)
    MD = "md"  # MainDecode (across the WAN)
    ROUTER = "router"


SIDECAR_ROLES: tuple[Role, ...] = (Role.P, Role.RLD, Role.MD)
DECODER_ROLES: tuple[Role, ...] = (Role.RLD, Role.MD)
