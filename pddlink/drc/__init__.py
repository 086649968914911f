"""DRC: the decode-side prefix index, its change events, and the mirror that follows it across a WAN.

MainDecode (MD) owns a :class:`PrefixIndex` of the KV blocks its engine holds; every change comes
back as events (epoch, seq) that the sidecar publishes; the router (and P) keep a :class:`Mirror`,
which applies them, notices gaps and resyncs from a snapshot. The mirror only guides the choice of
pipeline: before P ships KV, MD's :meth:`PrefixIndex.reserve` answers with the authoritative cached
length and pins it under a lease. Pure: no I/O; time is passed in as ``now`` (seconds).

Usage::

    from pddlink.kv.hashing import BlockHasher
    from pddlink.drc import Mirror, PrefixIndex, decode_snapshot, encode_snapshot

    hasher = BlockHasher("my-model", block_size=64)
    index = PrefixIndex(capacity_blocks=100_000, epoch=start_time_ns)   # on MD
    mirror = Mirror(gap_timeout_s=1.0)                                  # at the router

    hashes = hasher.hash_blocks(prompt_token_ids)
    guess = mirror.match(hashes).matched_blocks                  # router: pick a pipeline
    held = index.reserve("req-1", hashes, lease_s=5.0, now=now)  # MD: authoritative, pinned
    ship = hashes[held.cached_blocks:]                           # P sends only these blocks
    events = index.commit("req-1", full_sequence_hashes, now=now)  # MD: sequence finished
    for ev in events:                                            # BlocksStored / BlocksRemoved ...
        engine_frees_if_removed(ev)                              # engine.evict_prefix_blocks(ev.hashes)
        mirror.apply(ev, now)                                    # (after crossing the WAN)
    if mirror.needs_resync:
        mirror.load_snapshot(decode_snapshot(encode_snapshot(index)), now)

Modules: ``index`` (tree, LRU, pins, reservations), ``prefix`` (match answer, stats, search),
``leases`` (reservation book and refusals), ``events`` (event types and binary codec), ``mirror``,
``snapshot`` (compact binary snapshot), ``inspect`` (the JSON answers of the sidecar's /drc/stats
and /drc/match), ``baseline`` (a token-list radix tree, for the benchmark).

Measured (``pddlink bench drc``): about 150-170 bytes of Python memory per cached block in the
index, about 80 in a mirror, 16 in a snapshot.
"""

from pddlink.drc.events import (
    BlocksRemoved,
    BlocksStored,
    Event,
    EventDecodeError,
    IndexCleared,
    decode_event,
    encode_event,
)
from pddlink.drc.index import PrefixIndex
from pddlink.drc.leases import RefusalReason, Reservation, ReservationRefused
from pddlink.drc.mirror import Mirror, MirrorStaleness
from pddlink.drc.prefix import DrcStats, PrefixMatch
from pddlink.drc.snapshot import Snapshot, SnapshotError, decode_snapshot, encode_snapshot

__all__ = [
    "BlocksRemoved",
    "BlocksStored",
    "DrcStats",
    "Event",
    "EventDecodeError",
    "IndexCleared",
    "Mirror",
    "MirrorStaleness",
    "PrefixIndex",
    "PrefixMatch",
    "RefusalReason",
    "Reservation",
    "ReservationRefused",
    "Snapshot",
    "SnapshotError",
    "decode_event",
    "decode_snapshot",
    "encode_event",
    "encode_snapshot",
]
