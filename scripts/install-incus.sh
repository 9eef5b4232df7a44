#!/bin/bash
# install-incus.sh — install what boxery's incus backend needs, on Debian 12 (bookworm), from
# Debian's own archive only. Idempotent; fast when all is there. Runs scripts/install-deps.sh
# first (the bookworm-backports source, debootstrap for the container images).
#
#   sudo scripts/install-incus.sh          # install what is missing
#   scripts/install-incus.sh --check       # only report; exit 1 if something is missing
#
# Incus 6.0 LTS comes from bookworm-backports. The package's service is not started here:
# scripts/incusd.sh starts the daemon by hand on machines without systemd (these CI machines),
# and `systemctl enable --now incus.socket` does on a systemd host. nftables: the backend's
# host firewall rules (guest → host, guest → out) are nftables tables of its own.
# dnsmasq-base: Incus runs dnsmasq for its managed bridges (DHCP for the guests).
# btrfs-progs: the backend's storage pool is btrfs on a loop file Incus makes (copies and
# snapshots are copy-on-write, disk sizes are quotas); the kernel's btrfs is enough.
set -euo pipefail
cd "$(dirname "$0")"

INCUS_PKGS=(incus)
BASE_PKGS=(nftables iproute2 dnsmasq-base btrfs-progs)

say() { printf 'install-incus: %s\n' "$*"; }
missing() {
  local p st
  for p in "$@"; do
    st=$(dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null || true)
    [ "${st:0:2}" = ii ] || echo "$p"
  done
}

if [ "${1:-}" = --check ]; then
  ./install-deps.sh --check
  miss=$(missing "${INCUS_PKGS[@]}" "${BASE_PKGS[@]}")
  [ -z "$miss" ] && { say "all present: incus $(dpkg-query -W -f='${Version}' incus)"; exit 0; }
  say "missing: $(echo $miss)"; exit 1
fi
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1; then exec sudo -- "$0" "$@"; fi
  say "must run as root (or with sudo available)"; exit 1
fi

./install-deps.sh
MISS_INCUS=$(missing "${INCUS_PKGS[@]}")
MISS_BASE=$(missing "${BASE_PKGS[@]}")
if [ -z "$MISS_INCUS" ] && [ -z "$MISS_BASE" ]; then
  say "all present: incus $(dpkg-query -W -f='${Version}' incus), nftables"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
for p in $MISS_INCUS $MISS_BASE; do
  cand=$(apt-cache policy "$p" 2>/dev/null | awk '/Candidate:/{print $2}')
  if [ -z "$cand" ] || [ "$cand" = "(none)" ]; then say "apt-get update"; apt-get update -q; break; fi
done
if [ -n "$MISS_INCUS" ]; then
  say "installing from bookworm-backports: ${INCUS_PKGS[*]}"
  apt-get install -y -q --no-install-recommends -t bookworm-backports "${INCUS_PKGS[@]}"
fi
if [ -n "$MISS_BASE" ]; then
  say "installing from bookworm: $(echo $MISS_BASE)"
  # shellcheck disable=SC2086
  apt-get install -y -q --no-install-recommends $MISS_BASE
fi
left=$(missing "${INCUS_PKGS[@]}" "${BASE_PKGS[@]}")
[ -z "$left" ] || { say "still missing after install: $(echo $left)"; exit 1; }
say "done: incus $(dpkg-query -W -f='${Version}' incus)"
