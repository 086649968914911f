#!/usr/bin/env bash
# CI step for the containers (issue 18): installs the engine (Debian's docker.io, docker-compose,
# debootstrap), builds the images (cached under /var/lib/pddlink-compose: seconds when nothing
# changed, a few minutes from scratch) and runs the tests marked `docker`: the compose lab for real
# (build, roles in containers, a request over mTLS across the relay container, WAN delay and rate
# measured inside it, an outage, `down` leaving nothing behind). Where no container engine can run
# (not root, no apt) it says why and the tests skip with their reasons. The main test run skips
# these tests in CI (CI=true) and runs the offline ones (compose file, Kubernetes manifests).
#
# `scripts/ci-docker.sh prepare` does only the slow first half that needs no project environment:
# installs the engine and makes the base image (debootstrap) with the system's Python; CI runs it
# beside the set-up, whose pip install keeps one core busy and leaves the other idle.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
VENV=${PDDLINK_VENV:-.venv}
install_engine() {
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    if ! command -v dockerd >/dev/null || ! command -v docker-compose >/dev/null || ! command -v debootstrap >/dev/null; then
      echo "ci-docker: installing docker.io docker-compose debootstrap"
      scripts/apt-install.sh docker.io docker-compose debootstrap \
        || echo "ci-docker: could not install the container engine; the container tests will skip"
    fi
  else
    echo "ci-docker: not root or no apt-get: no container engine here; the container tests will skip"
  fi
}
install_engine
if [ "${1:-}" = prepare ]; then
  if [ "$(id -u)" = 0 ] && command -v dockerd >/dev/null && command -v debootstrap >/dev/null; then
    PYTHONPATH=. timeout 900 python3 -m netlab.compose.images
  fi
  exit 0
fi
[ -x "$VENV/bin/pddlink" ] || scripts/setup.sh >/dev/null  # (CI's `make test` has set it up already)
export PDDLINK_CI_DOCKER=1
if [ "$(id -u)" = 0 ] && command -v dockerd >/dev/null && command -v debootstrap >/dev/null; then
  timeout 900 "$VENV/bin/pddlink" lab compose build --json
fi
# (not the fleet-marked vLLM compose demo: it builds the vLLM image, GBs; `make test-fleet` runs it)
timeout 900 "$VENV/bin/python" -m pytest -q -m "docker and not fleet" tests/docker -p no:cacheprovider
