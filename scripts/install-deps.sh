#!/bin/bash
# install-deps.sh — install the host packages boxery's qemu backend and image builders need,
# on Debian 12 (bookworm), from Debian's own archive only. Idempotent; fast when all is there.
#
#   sudo scripts/install-deps.sh            # install what is missing
#   scripts/install-deps.sh --check         # only report; exit 1 if something is missing
#
# Why bookworm-backports: machines of this kind ship qemu-utils 10.0.2 (a bookworm-backports
# build) without a backports apt source. Bookworm's own qemu-system-x86 is 7.2 and qemu-utils 10
# "Breaks: qemu-system-common (<< 8.0)", so installing bookworm's QEMU would make apt remove and
# downgrade qemu-utils. We add bookworm-backports (default pin 100: nothing is upgraded from it
# implicitly) and install QEMU 10 from it with -t bookworm-backports.
set -euo pipefail

# QEMU (from bookworm-backports): the emulator and qemu-img.
QEMU_PKGS=(qemu-system-x86 qemu-utils)
# Plain bookworm: seed ISOs (genisoimage), tiny guest (busybox-static, cpio, kmod for
# depmod/modprobe --show-depends; gcc, make, zlib1g-dev, curl, patch, bzip2, xz-utils to build
# its dropbear from Debian's source with a fix, see image/build-tiny.sh), full guest
# (debootstrap, e2fsprogs for mkfs.ext4 -d), ssh-keygen/ssh (openssh-client), socat (QMP/serial
# helpers), keyring for debootstrap.
BASE_PKGS=(genisoimage busybox-static cpio kmod debootstrap e2fsprogs
  gcc make libc6-dev zlib1g-dev curl patch bzip2 xz-utils
  openssh-client socat gzip debian-archive-keyring ca-certificates)
# fdisk (sfdisk), extlinux and syslinux-common (its MBR): image/build-cloud.sh makes a cloud
# image that boots itself, for the bring-your-own-image test (tests/real_vms/cloud_image.rs).
BASE_PKGS+=(fdisk extlinux syslinux-common)
# zsh and fish: the completion tests drive them (tests/cli.rs).
BASE_PKGS+=(zsh fish)
# git: `boxery sync` reads repositories with it (tests/sync.rs, the gitops bench); python3:
# store/tests/locks.rs checks SQLite's lock from another process with it.
BASE_PKGS+=(git python3)
# openssh-server: the git-over-ssh stand-in of tests/real_vms/dev_traffic.rs runs /usr/sbin/sshd
# with a config of its own in a network namespace it makes (the host's ssh service is not used).
BASE_PKGS+=(openssh-server)
# prometheus (with promtool): tests/metrics.rs starts its own Prometheus on loopback to scrape
# `serve --metrics-listen` and checks the exposition with `promtool check metrics`. The
# package's own service is not wanted: a fresh install has it disabled again (below).
BASE_PKGS+=(prometheus)
# kubectl: `apply|diff|delete -k DIR` build kustomizations with `kubectl kustomize`, and boxery
# works as a kubectl plugin (tests/cli.rs). Debian's kubernetes-client when none is on PATH.
command -v kubectl >/dev/null 2>&1 || BASE_PKGS+=(kubernetes-client)
# novnc: `boxery desktop` serves its page (/usr/share/novnc) to the person's browser. (The tests'
# own browser, chromium, is installed by scripts/test.sh.)
BASE_PKGS+=(novnc)
# protobuf-compiler: the etcd client crate (store-etcd/) generates its gRPC code with protoc at
# build time. etcd-server and etcd-client (etcdctl): the etcd store's tests start their own
# three-member cluster on loopback ports (store-etcd/tests/cluster/); the package's own service
# is not wanted: a fresh install has it disabled again (below).
BASE_PKGS+=(protobuf-compiler etcd-server etcd-client)

SRC=/etc/apt/sources.list.d/boxery-bookworm-backports.sources
CHECK_ONLY=0
[ "${1:-}" = --check ] && CHECK_ONLY=1

say() { printf 'install-deps: %s\n' "$*"; }

if [ "$CHECK_ONLY" = 0 ] && [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1; then exec sudo -- "$0" "$@"; fi
  say "must run as root (or with sudo available)"; exit 1
fi

# missing PKG... : print the packages that are not installed
missing() {
  local p st
  for p in "$@"; do
    st=$(dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null || true)
    [ "${st:0:2}" = ii ] || echo "$p"
  done
}

# qemu_ok: qemu-system-x86 installed and at least version 8 (the one that fits qemu-utils 10)
qemu_ok() {
  local v
  v=$(dpkg-query -W -f='${Version}' qemu-system-x86 2>/dev/null || true)
  [ -n "$v" ] && dpkg --compare-versions "$v" ge 1:8.0
}

MISS_BASE=$(missing "${BASE_PKGS[@]}")
MISS_QEMU=$(missing "${QEMU_PKGS[@]}")
if [ -z "$MISS_BASE" ] && [ -z "$MISS_QEMU" ] && qemu_ok; then
  say "all present: qemu-system-x86 $(dpkg-query -W -f='${Version}' qemu-system-x86), qemu-img $(dpkg-query -W -f='${Version}' qemu-utils), ${BASE_PKGS[*]}"
  exit 0
fi
if [ "$CHECK_ONLY" = 1 ]; then
  say "missing: $(echo $MISS_QEMU $MISS_BASE) $(qemu_ok || echo '(qemu-system-x86 >= 8 needed)')"
  exit 1
fi

. /etc/os-release
if [ "${VERSION_CODENAME:-}" != bookworm ]; then
  say "this script targets Debian 12 (bookworm); found ${PRETTY_NAME:-unknown}. Install by hand: ${QEMU_PKGS[*]} ${BASE_PKGS[*]}"
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive

# 1. a bookworm-backports source: ours, or any active one already configured (no duplicates:
#    apt warns about a suite configured twice).
has_backports_elsewhere() {
  local f
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] && [ "$f" != "$SRC" ] || continue
    # an uncommented line naming the suite (one-line "deb ... bookworm-backports" or deb822 Suites:)
    if grep -Eq '^[[:space:]]*(deb[[:space:]].*[[:space:]]bookworm-backports([[:space:]]|$)|Suites:.*bookworm-backports)' "$f"; then
      # deb822 stanzas can be disabled with "Enabled: no"
      grep -Eiq '^[[:space:]]*Enabled:[[:space:]]*no' "$f" && continue
      echo "$f"; return 0
    fi
  done
  return 1
}
NEED_UPDATE=0
if [ -f "$SRC" ]; then
  say "backports source present: $SRC"
  if other=$(has_backports_elsewhere); then
    say "note: $other also names bookworm-backports (apt may warn that it is configured twice)"
  fi
elif other=$(has_backports_elsewhere); then
  say "using the bookworm-backports source already configured in $other"
else
  say "adding $SRC"
  cat > "$SRC" <<'EOS'
# Added by boxery scripts/install-deps.sh: QEMU 10 (qemu-system-x86) must match the
# qemu-utils 10 shipped from bookworm-backports. Default pin (100): nothing upgrades from
# here unless asked for with -t bookworm-backports.
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOS
  NEED_UPDATE=1
fi

# 2. apt-get update only when the lists lack something we install
if [ "$NEED_UPDATE" = 0 ]; then
  ls /var/lib/apt/lists/*bookworm-backports_main_binary-amd64_Packages* >/dev/null 2>&1 || NEED_UPDATE=1
fi
if [ "$NEED_UPDATE" = 0 ]; then
  for p in $MISS_BASE $MISS_QEMU qemu-system-x86; do
    cand=$(apt-cache policy "$p" 2>/dev/null | awk '/Candidate:/{print $2}')
    if [ -z "$cand" ] || [ "$cand" = "(none)" ]; then NEED_UPDATE=1; break; fi
  done
fi
if [ "$NEED_UPDATE" = 1 ]; then
  say "apt-get update"
  apt-get update -q
else
  say "apt lists are current enough; skipping apt-get update"
fi

# 3. install
if [ -n "$MISS_QEMU" ] || ! qemu_ok; then
  say "installing from bookworm-backports: ${QEMU_PKGS[*]}"
  apt-get install -y -q --no-install-recommends -t bookworm-backports "${QEMU_PKGS[@]}"
fi
MISS_BASE=$(missing "${BASE_PKGS[@]}")
if [ -n "$MISS_BASE" ]; then
  say "installing from bookworm: $(echo $MISS_BASE)"
  # shellcheck disable=SC2086
  apt-get install -y -q --no-install-recommends $MISS_BASE
  # Installed here for the tests' binaries, not as a service of this machine: the one the
  # package started is stopped and disabled (a Prometheus installed before is left alone).
  if echo "$MISS_BASE" | grep -qx prometheus && [ -d /run/systemd/system ]; then
    systemctl disable --now prometheus >/dev/null 2>&1 || true
  fi
  if echo "$MISS_BASE" | grep -qx etcd-server && [ -d /run/systemd/system ]; then
    systemctl disable --now etcd >/dev/null 2>&1 || true
  fi
fi

left=$(missing "${QEMU_PKGS[@]}" "${BASE_PKGS[@]}")
if [ -n "$left" ] || ! qemu_ok; then
  say "still missing after install: $(echo $left)"; exit 1
fi
say "done: qemu-system-x86 $(dpkg-query -W -f='${Version}' qemu-system-x86), qemu-img $(dpkg-query -W -f='${Version}' qemu-utils)"
