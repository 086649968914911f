#!/bin/sh
# Entry point of every container of the compose lab.
#   PDDLINK_ROUTE="SUBNET via GATEWAY"   route to the other datacenter through this DC's WAN gateway
#   PDDLINK_NETEM_PROFILE=NAME_OR_FILE    (gateways) apply one direction of a netlab profile with tc netem
#   PDDLINK_NETEM_DIRECTION=a_to_b|b_to_a on the interface in PDDLINK_WAN_SUBNET
set -eu
if [ -n "${PDDLINK_ROUTE:-}" ]; then
  # shellcheck disable=SC2086
  ip route replace ${PDDLINK_ROUTE}
fi
if [ -n "${PDDLINK_NETEM_PROFILE:-}" ]; then
  python -m netlab.netem "$PDDLINK_NETEM_PROFILE" --direction "${PDDLINK_NETEM_DIRECTION:?}" \
    --subnet "${PDDLINK_WAN_SUBNET:-198.18.30.0/24}" --apply
fi
exec "$@"
