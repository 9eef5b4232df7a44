#!/bin/bash
# docker layer (root, idempotent): Docker from Debian 12's packages (docker.io: dockerd, the
# docker CLI, containerd, runc; apparmor), enabled at boot, and the agent user in the `docker`
# group (its docker commands need no sudo). Nothing is configured for a network: the control plane writes
# the daemon's proxy settings at each boot when the VM's egress goes through boxery's proxy
# (docs/egress.md, "Developer traffic"). Debian 12 packages only.
# `docker.sh --print-packages` prints the packages.
set -euo pipefail
# apparmor: Debian 12's kernel has AppArmor on, and dockerd then loads its containers' profile
# with apparmor_parser (a Recommends of docker.io): without it no container starts
PACKAGES="docker.io apparmor"
[ "${1:-}" = --print-packages ] && { echo $PACKAGES; exit 0; }
[ "$(id -u)" = 0 ] || { echo "docker: run as root" >&2; exit 1; }
export DEBIAN_FRONTEND=noninteractive
. "$(dirname "$0")/lib.sh"
install_missing docker $PACKAGES
# (a container's veth stays Docker's: the base image's DHCP matches only the machine's own NICs)
getent group docker >/dev/null || groupadd --system docker
if id agent >/dev/null 2>&1; then usermod -aG docker agent; fi
# started at boot (the package enables it; a chroot build has no systemd to ask, so the links
# are made the way `systemctl enable` makes them)
for u in docker.service docker.socket containerd.service; do
  [ -f "/lib/systemd/system/$u" ] || continue
  case "$u" in *.socket) w=sockets.target.wants ;; *) w=multi-user.target.wants ;; esac
  mkdir -p "/etc/systemd/system/$w"
  ln -sf "/lib/systemd/system/$u" "/etc/systemd/system/$w/$u"
done
echo "docker: done ($(dpkg-query -W -f='docker.io ${Version}' docker.io))"
