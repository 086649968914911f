"""The ``[membership]`` table of a sidecar's and a router's TOML file: where etcd is and which
cluster's members to announce or follow. Absent (``etcd = ""``): the static topology file alone,
nothing else to start.

    [membership]
    etcd = "10.0.0.9:2379,10.0.0.10:2379"   # etcd's client endpoints
    cluster = "prod"                         # keys under <prefix>/<cluster>/members/
    datacenter = "dc-b"                      # sidecar: its datacenter (one of the routers' topology)
    ttl_s = 5                                # sidecar: its lease; a killed sidecar leaves after this

Membership needs mutual TLS (``tls_dir``): a record only says where to connect and whom to expect
there; the peer's certificate, signed by the deployment's CA, proves it (docs/topology.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pddlink.errors import ConfigError, InvalidInput
from pddlink.membership.record import MembershipKeys

if TYPE_CHECKING:  # the adapters import aetcd: only where etcd is configured
    from pddlink.membership.etcd import EtcdConfig
    from pddlink.membership.registrar import RegistrarConfig


@dataclass(frozen=True, slots=True)
class MembershipConfig:
    etcd: str = ""  # "host:port,host:port"; "" = no membership through etcd
    cluster: str = "pddlink"
    prefix: str = "/pddlink"
    datacenter: str = ""  # a sidecar's datacenter (required for a sidecar with etcd)
    ttl_s: int = 5
    request_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.etcd:
            return
        self.etcd_config()
        self.registrar_config()
        try:
            self.keys()
        except InvalidInput as exc:
            raise ConfigError(f"membership: {exc.message}") from None

    @property
    def enabled(self) -> bool:
        return bool(self.etcd)

    def etcd_config(self) -> EtcdConfig:
        from pddlink.membership.etcd import EtcdConfig

        return EtcdConfig.parse(self.etcd, request_timeout_s=self.request_timeout_s)

    def keys(self) -> MembershipKeys:
        return MembershipKeys(self.cluster, self.prefix)

    def registrar_config(self) -> RegistrarConfig:
        from pddlink.membership.registrar import RegistrarConfig

        return RegistrarConfig(ttl_s=self.ttl_s)

    def check_for(self, who: str, *, tls: bool, sidecar: bool) -> None:
        """What a program needs besides the table: mutual TLS, and a sidecar its datacenter."""
        if not self.enabled:
            return
        if not tls:
            raise ConfigError(
                f"{who}: [membership] needs tls_dir: a record in etcd names whom to expect at an address, "
                "and only mutual TLS proves the peer is that one"
            )
        if sidecar and not self.datacenter:
            raise ConfigError(f"{who}: [membership] datacenter is required (the datacenter it announces)")
