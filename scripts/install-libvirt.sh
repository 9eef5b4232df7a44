#!/bin/bash
# install-libvirt.sh — install what boxery's libvirt backend needs, on Debian 12 (bookworm), from
# Debian's own archive only. Idempotent; fast when all is there. Runs scripts/install-deps.sh
# first (QEMU 10 and the bookworm-backports source the libvirt packages come from).
#
#   sudo scripts/install-libvirt.sh          # install what is missing
#   scripts/install-libvirt.sh --check       # only report; exit 1 if something is missing
#
# libvirt 11.3 comes from bookworm-backports (it must match QEMU 10 from there). Plain bookworm
# gives dnsmasq-base and iptables (libvirt's `default` NAT network, which carries each VM's ssh
# from the host), ebtables (nwfilter's MAC/ARP rules) and pkg-config (the `virt` crate's build
# finds libvirt through it).
set -euo pipefail
cd "$(dirname "$0")"

LIBVIRT_PKGS=(libvirt-daemon-system libvirt-clients libvirt-dev libvirt-daemon-driver-qemu)
BASE_PKGS=(dnsmasq-base iptables ebtables pkg-config)

say() { printf 'install-libvirt: %s\n' "$*"; }
missing() {
  local p st
  for p in "$@"; do
    st=$(dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null || true)
    [ "${st:0:2}" = ii ] || echo "$p"
  done
}

if [ "${1:-}" = --check ]; then
  ./install-deps.sh --check
  miss=$(missing "${LIBVIRT_PKGS[@]}" "${BASE_PKGS[@]}")
  [ -z "$miss" ] && { say "all present: libvirt $(dpkg-query -W -f='${Version}' libvirt-daemon-system)"; exit 0; }
  say "missing: $(echo $miss)"; exit 1
fi
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1; then exec sudo -- "$0" "$@"; fi
  say "must run as root (or with sudo available)"; exit 1
fi

./install-deps.sh
MISS_LV=$(missing "${LIBVIRT_PKGS[@]}")
MISS_BASE=$(missing "${BASE_PKGS[@]}")
if [ -z "$MISS_LV" ] && [ -z "$MISS_BASE" ]; then
  say "all present: libvirt $(dpkg-query -W -f='${Version}' libvirt-daemon-system), dnsmasq-base, iptables, ebtables"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
# install-deps.sh made sure a bookworm-backports source exists; refresh lists when a package has
# no candidate yet.
for p in $MISS_LV $MISS_BASE; do
  cand=$(apt-cache policy "$p" 2>/dev/null | awk '/Candidate:/{print $2}')
  if [ -z "$cand" ] || [ "$cand" = "(none)" ]; then say "apt-get update"; apt-get update -q; break; fi
done
if [ -n "$MISS_LV" ]; then
  say "installing from bookworm-backports: ${LIBVIRT_PKGS[*]}"
  # policy-rc.d: on a systemd-less machine the postinst must not try to start daemons
  apt-get install -y -q --no-install-recommends -t bookworm-backports "${LIBVIRT_PKGS[@]}"
fi
if [ -n "$MISS_BASE" ]; then
  say "installing from bookworm: $(echo $MISS_BASE)"
  # shellcheck disable=SC2086
  apt-get install -y -q --no-install-recommends $MISS_BASE
fi
left=$(missing "${LIBVIRT_PKGS[@]}" "${BASE_PKGS[@]}")
[ -z "$left" ] || { say "still missing after install: $(echo $left)"; exit 1; }
say "done: libvirt $(dpkg-query -W -f='${Version}' libvirt-daemon-system)"
