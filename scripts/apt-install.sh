#!/usr/bin/env bash
# apt-install.sh PKG...: Debian's packages, installed quietly, also while another apt run holds the
# locks (CI installs the set-up's packages and the container engine side by side): `apt-get install`
# waits for dpkg's lock (DPkg::Lock::Timeout), and `apt-get update`, which does not wait for the lists'
# lock, is tried again for up to two minutes.
set -uo pipefail
export DEBIAN_FRONTEND=noninteractive
for _ in $(seq 60); do
  apt-get -o DPkg::Lock::Timeout=600 update -qq 2>/dev/null && break
  sleep 2
done
apt-get -o DPkg::Lock::Timeout=600 install -y -qq "$@" >/dev/null
