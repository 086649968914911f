#!/bin/sh
# Entry point of every container of the compose lab.
#   PDDLINK_ROUTE="SUBNET via GATEWAY"  reach the other datacenter through the netlab relay container
#                                       (needs NET_ADMIN, which is dropped with root just below)
#   PDDLINK_USER=NAME                   then run the command as NAME, with no capabilities left
set -eu
if [ -n "${PDDLINK_ROUTE:-}" ]; then
  # shellcheck disable=SC2086
  ip route replace ${PDDLINK_ROUTE}
fi
if [ -n "${PDDLINK_USER:-}" ] && [ "$(id -u)" = 0 ]; then
  exec setpriv --reuid="$PDDLINK_USER" --regid="$PDDLINK_USER" --clear-groups \
    --inh-caps=-all --bounding-set=-all --no-new-privs -- "$@"
fi
exec "$@"
