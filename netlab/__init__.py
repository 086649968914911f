"""netlab: a real emulated WAN between two datacenters on one machine.

``Lab`` brings datacenters ``dc-a`` and ``dc-b`` up (network namespaces joined by a user-space relay
over TUN devices as root; relays on 127.0.0.1 otherwise) and applies a ``Profile`` (TOML: delay,
jitter, loss, bursts, reordering, duplication, corruption, rate, queue, outages) to every packet.
"""

from netlab.lab import Lab
from netlab.profile import DirectionSpec, GilbertElliott, Outage, Profile, load_profile, parse_profile

__all__ = ["DirectionSpec", "GilbertElliott", "Lab", "Outage", "Profile", "load_profile", "parse_profile"]
