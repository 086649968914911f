"""netlab: a real emulated WAN between two datacenters on one machine."""
