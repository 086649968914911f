"""A sidecar stand-in for the SIGKILL test: registers md/<name> and waits to be killed.

python _registrar_child.py ENDPOINT CLUSTER NAME TTL_S  (prints "registered" once etcd holds it)
"""

from __future__ import annotations

import asyncio
import sys

from test_record import md0

from pddlink.membership import MembershipKeys
from pddlink.membership.etcd import EtcdConfig
from pddlink.membership.registrar import Registrar, RegistrarConfig


async def main(endpoint: str, cluster: str, name: str, ttl_s: int) -> None:
    record = md0(name=name, identity=f"md/{name}")
    async with Registrar(
        EtcdConfig((endpoint,)), MembershipKeys(cluster), record, RegistrarConfig(ttl_s)
    ) as reg:
        await reg.wait_registered(10)
        print("registered", flush=True)
        await asyncio.sleep(60)  # killed long before


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
