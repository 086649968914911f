"""pddlink: transport middleware for cross-datacenter Prefill / RelayDecode / MainDecode inference.

The package is layered: ``wire``, ``kv``, ``drc``, ``transfer``, ``handoff`` and ``routing`` are pure
(sans-I/O: no asyncio, sockets, grpc or torch); ``transport`` drives them over real links; ``cli``
and the ``sidecar`` daemon use everything. See DESIGN.md in the shared folder for the map.
"""

__version__ = "0.1.0"
