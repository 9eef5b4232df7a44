#!/bin/bash
# build-debian.sh [--force] OUT_DIR — build boxery's Debian 12 guest from Debian's packages only
# (and, with BOXERY_EXTRA_LAYERS=agents, the npm registry's packages that layer names).
#
#   1. debootstrap --variant=minbase bookworm into a folder, with systemd, openssh-server, sudo,
#      cloud-init (NoCloud only), qemu-guest-agent, the cloud kernel and every layer's packages
#   2. configure the tree: apt sources (with security), fstab, empty machine-id, systemd-networkd
#      DHCP on every NIC + systemd-resolved, cloud-init datasource_list [NoCloud, None] and no
#      network config, no host keys
#   3. run the layers in a chroot: boxery-provision plumbing devtools (security updates
#      included), then hold the kernel (it boots from outside the disk) and clean up
#   4. mkfs.ext4 -d (no loop mounts), qemu-img convert to qcow2; vmlinuz + initrd copied out for
#      direct kernel boot (root=/dev/vda, no bootloader, no partition table)
#
#   OUT_DIR/debian-12.qcow2  OUT_DIR/debian-12.vmlinuz  OUT_DIR/debian-12.initrd
#   OUT_DIR/debian-12.build-info  OUT_DIR/debian-12.json (manifest)
#
# With BOXERY_GUEST_KIND=container (the incus backend's system containers): no kernel, no
# initramfs, no fstab; step 4 packs the tree as an Incus unified image instead (metadata.yaml
# and rootfs/ in one plain tar), in OUT_DIR/container/:
#
#   OUT_DIR/container/debian-12.tar  OUT_DIR/container/debian-12.build-info
#   OUT_DIR/container/debian-12.json (manifest)
#
# Cached by a hash of its inputs (this script, lib.sh, the layers, the package list, suite,
# mirror, disk size): a second run with the same inputs returns at once. --force rebuilds.
# Runs as root (debootstrap, chroot). Needs network access to the Debian archive.
# Env: BOXERY_EXTRA_LAYERS (layers after plumbing and devtools: the output is debian-12-LAYER…),
#      BOXERY_MIRROR (default http://deb.debian.org/debian), DEBIAN_DISK_SIZE (default 4G),
#      BOXERY_DEBOOTSTRAP_CACHE (default /var/cache/boxery/debootstrap: downloaded .debs),
#      BOXERY_GUEST_KIND (vm, the default, or container).
set -euo pipefail
. "$(dirname "$0")/lib.sh"

FORCE=0
[ "${1:-}" = --force ] && { FORCE=1; shift; }
OUT=${1:-$BOXERY_DEFAULT_OUT}
KIND=${BOXERY_GUEST_KIND:-vm}
case "$KIND" in
  vm) ;;
  container) OUT=$OUT/container ;;
  *) die "BOXERY_GUEST_KIND must be vm or container, not '$KIND'" ;;
esac
# More layers on top of plumbing and devtools (an Image's spec.source.build.layers): the
# output is then named debian-12-LAYER[-LAYER…], beside the plain one.
EXTRA=$(echo ${BOXERY_EXTRA_LAYERS:-})
NAME=debian-12${EXTRA:+-${EXTRA// /-}}
SUITE=bookworm
MIRROR=${BOXERY_MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${BOXERY_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
DISK_SIZE=${DEBIAN_DISK_SIZE:-4G}
DEB_CACHE=${BOXERY_DEBOOTSTRAP_CACHE:-/var/cache/boxery/debootstrap}
CMDLINE="root=/dev/vda rw console=ttyS0 panic=-1"
L=$BOXERY_IMAGE_DIR/layers
LAYERS="plumbing devtools${EXTRA:+ $EXTRA}"
for l in $EXTRA; do
  case "$l" in *[!a-z0-9-]*|plumbing|devtools|provision|lib) die "bad extra layer '$l'" ;; esac
  [ -f "$L/$l.sh" ] || die "no layer $L/$l.sh (layers: $(cd "$L" && ls *.sh | sed 's/\.sh$//' | grep -vx 'provision\|lib' | tr '\n' ' '))"
done
[ "$(id -u)" = 0 ] || die "build-debian.sh must run as root (debootstrap, chroot)"
require debootstrap chroot mkfs.ext4 qemu-img sha256sum mount umount tar flock

# The base system. python3-cffi-backend: debootstrap does not resolve the virtual
# python3-cffi-backend-api-min that cloud-init's python3-cryptography needs.
BASE_PKGS="systemd-sysv udev dbus systemd-resolved openssh-server sudo qemu-guest-agent cloud-init
python3-cffi-backend iproute2 netbase ca-certificates"
# a VM boots its own kernel (from outside its disk); a container runs on the host's
[ "$KIND" = vm ] && BASE_PKGS="$BASE_PKGS linux-image-cloud-amd64 initramfs-tools"
LAYER_PKGS=""
for l in $LAYERS; do LAYER_PKGS="$LAYER_PKGS $(bash "$L/$l.sh" --print-packages)"; done
INCLUDE=$(echo $BASE_PKGS $LAYER_PKGS | tr ' ' '\n' | awk 'NF && !seen[$0]++' | paste -sd,)

phase "resolving inputs"
INPUTS=("$BOXERY_IMAGE_DIR/build-debian.sh" "$BOXERY_IMAGE_DIR/lib.sh" "$L/provision.sh" "$L/lib.sh")
for l in $LAYERS; do INPUTS+=("$L/$l.sh"); done
KEY=$(sha256_of_inputs "${INPUTS[@]}" <<EOI
suite=$SUITE
mirror=$MIRROR
security=$SECURITY_MIRROR
disk_size=$DISK_SIZE
include=$INCLUDE
cmdline=$CMDLINE
layers=$LAYERS
kind=$KIND
npm_registry=${BOXERY_NPM_REGISTRY:-https://registry.npmjs.org}
EOI
)
if [ "$KIND" = vm ]; then
  OUTPUTS=("$NAME.qcow2" "$NAME.vmlinuz" "$NAME.initrd" "$NAME.build-info")
else
  OUTPUTS=("$NAME.tar" "$NAME.build-info")
fi
# One build of an output at a time (tests and control planes start builds of the same stock
# image at once): a second waits here, then finds the first one's output in the cache.
mkdir -p "$OUT"
exec 8>"$OUT/.build-$NAME.lock"
if ! flock -n 8; then
  phase "waiting for another build of $NAME into $OUT"
  flock 8
fi
if [ $FORCE = 0 ] && cache_hit "$OUT" "$NAME" "$KEY" "${OUTPUTS[@]}"; then
  phase "up to date: $OUT/$NAME.json (input hash ${KEY:0:16})"
  exit 0
fi
phase "building $NAME (input hash ${KEY:0:16}) into $OUT"

mkdir -p "$OUT" "$DEB_CACHE"
# Room first: a full disk fails a build late and without a word (even its log cannot be
# written). The tree, the raw disk while it is made (sparse, up to DISK_SIZE) and the qcow2.
case "$DISK_SIZE" in
  *G) need_mib=$(( (${DISK_SIZE%G} + 2) * 1024 ))
      avail_mib=$(( $(df --output=avail -k "$OUT" | tail -1) / 1024 ))
      [ "$avail_mib" -ge "$need_mib" ] ||
        die "$OUT has $avail_mib MiB free: building $NAME needs about $need_mib MiB (free some, or set BOXERY_IMAGE_CACHE elsewhere)" ;;
esac
W=$(mktemp -d "$OUT/.work-$NAME.XXXXXX")
ROOT=$W/rootfs
MOUNTS=()
unmount_all() {
  local i
  for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do
    umount "${MOUNTS[$i]}" 2>/dev/null || umount -l "${MOUNTS[$i]}" 2>/dev/null || true
  done
  MOUNTS=()
}
cleanup() {
  unmount_all
  # never rm -rf a tree that still has something mounted in it (it would reach the host's /dev)
  if grep -q " $W/" /proc/mounts; then
    echo "warning: mounts left under $W; not removing it" >&2
  else
    rm -rf "$W"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- 1. debootstrap ----------------------------------------------------------------------------
phase "debootstrap $SUITE (minbase + $(echo "$INCLUDE" | tr ',' '\n' | wc -l) packages named; log: $W/debootstrap.log)"
# progress: one line each time debootstrap moves to a new stage
debootstrap --variant=minbase --include="$INCLUDE" --cache-dir="$DEB_CACHE" \
  "$SUITE" "$ROOT" "$MIRROR" 2>&1 | tee "$W/debootstrap.log" |
  awk -v t0="$BOXERY_T0" '/^I: / { st = $2; if (st == "Validating") next; cmd = "date +%s"; cmd | getline now; close(cmd);
      n[st]++; if (st != last || now - lastp >= 10) { last = st; lastp = now;
        printf "[%7.2fs]   debootstrap: %s (%d)\n", now - t0 / 1e9, substr($0, 4), n[st]; fflush() } }' \
  || { tail -30 "$W/debootstrap.log"; die "debootstrap failed (log above)"; }
[ -x "$ROOT/usr/bin/apt-get" ] && { [ "$KIND" = container ] || [ -d "$ROOT/lib/modules" ]; } || { tail -30 "$W/debootstrap.log"; die "debootstrap failed"; }
phase "debootstrap done: $(du -sm "$ROOT" | cut -f1) MiB, $(chroot "$ROOT" dpkg-query -W | wc -l) packages"

# --- 2. configure the tree ---------------------------------------------------------------------
rm -f "$ROOT/etc/apt/sources.list"
cat > "$ROOT/etc/apt/sources.list.d/debian.sources" <<EOS
Types: deb
URIs: $MIRROR
Suites: $SUITE $SUITE-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $SECURITY_MIRROR
Suites: $SUITE-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOS
echo "$NAME" > "$ROOT/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 %s\n::1 localhost ip6-localhost ip6-loopback\n' "$NAME" > "$ROOT/etc/hosts"
if [ "$KIND" = vm ]; then
  echo '/dev/vda / ext4 defaults,discard,errors=remount-ro 0 1' > "$ROOT/etc/fstab"
else
  : > "$ROOT/etc/fstab"   # the container manager mounts the root
fi
echo 'LANG=C.UTF-8' > "$ROOT/etc/default/locale"
# networking: DHCP on the machine's own NICs, whatever their names; DNS through
# systemd-resolved. Only the machine's own: links that software in the guest makes (a Docker
# container's veth, a bridge, a tunnel) belong to that software, and DHCP on them took them
# from it (no Docker container had a network). A VM's NICs are devices with no link kind
# (virtio-net, e1000); a container's NIC is a veth like any other, so there it is matched by
# the name its manager gives it (Incus: eth0, eth1, ...).
if [ "$KIND" = vm ]; then
  NIC_MATCH='Type=ether
Kind=!*'
else
  NIC_MATCH='Type=ether
Name=eth*'
fi
mkdir -p "$ROOT/etc/systemd/network"
cat > "$ROOT/etc/systemd/network/20-boxery-dhcp.network" <<EON
# boxery: DHCP on the machine's own NICs (QEMU user networking: 10.0.2.15, gateway 10.0.2.2)
[Match]
$NIC_MATCH

[Network]
DHCP=ipv4
LinkLocalAddressing=no

[DHCPv4]
ClientIdentifier=mac
EON
# cloud-init: only the local seed, never a network metadata service; the image does the network
cat > "$ROOT/etc/cloud/cloud.cfg.d/99-boxery.cfg" <<'EOC'
# boxery: read only the NoCloud seed (ISO/disk labelled cidata); networking is the image's own
datasource_list: [ NoCloud, None ]
network: {config: disabled}
# sshd presents only the seed's host key (05-boxery-hostkey.conf). An empty ssh_genkeytypes
# fails the schema check, so cloud-init makes one ed25519 key that sshd never loads.
ssh_deletekeys: true
ssh_genkeytypes: [ed25519]
EOC
# no services start inside the chroot
printf '#!/bin/sh\nexit 101\n' > "$ROOT/usr/sbin/policy-rc.d"; chmod +x "$ROOT/usr/sbin/policy-rc.d"
phase "tree configured"

# --- 3. layers in a chroot ---------------------------------------------------------------------
for m in proc sys dev dev/pts; do mkdir -p "$ROOT/$m"; done
mount -t proc proc "$ROOT/proc"; MOUNTS+=("$ROOT/proc")
mount -t sysfs sys "$ROOT/sys"; MOUNTS+=("$ROOT/sys")
mount --bind /dev "$ROOT/dev"; MOUNTS+=("$ROOT/dev")
mount -t devpts devpts "$ROOT/dev/pts"; MOUNTS+=("$ROOT/dev/pts")
# DNS for apt inside the chroot (the real resolv.conf link is made after)
rm -f "$ROOT/etc/resolv.conf"; cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf"
# The build host's own CAs (/usr/local/share/ca-certificates: e.g. a TLS-intercepting proxy on
# its network) are trusted for the layers' downloads (curl, npm: NODE_EXTRA_CA_CERTS below) and
# taken out again before the disk is made: an image never trusts a build host's local CAs.
BUILD_CAS=$ROOT/usr/local/share/ca-certificates/boxery-build-host
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  mkdir -p "$BUILD_CAS"; cp /usr/local/share/ca-certificates/*.crt "$BUILD_CAS/"
  chroot "$ROOT" update-ca-certificates >/dev/null 2>&1 || true
fi
install -d "$ROOT/usr/local/lib/boxery/layers"
install -m 0755 "$L"/*.sh "$ROOT/usr/local/lib/boxery/layers/"
ln -sf /usr/local/lib/boxery/layers/provision.sh "$ROOT/usr/local/sbin/boxery-provision"
echo "$LAYERS" > "$ROOT/etc/boxery-provision.tmp"; install -d "$ROOT/etc/boxery"
mv "$ROOT/etc/boxery-provision.tmp" "$ROOT/etc/boxery/provision"
chroot "$ROOT" env -i PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 BOXERY_IMAGE=$NAME \
  BOXERY_NPM_REGISTRY="${BOXERY_NPM_REGISTRY:-https://registry.npmjs.org}" \
  NODE_EXTRA_CA_CERTS=/etc/ssl/certs/ca-certificates.crt \
  /usr/local/sbin/boxery-provision $LAYERS 2>&1 | while IFS= read -r line; do
    case "$line" in boxery-provision:*) phase "  $line" ;; *) for l in $LAYERS; do case "$line" in "$l:"*) phase "  $line" ;; esac; done ;; esac
  done || true
[ -f "$ROOT/var/log/boxery-provision.ok" ] || { tail -40 "$ROOT/var/log/boxery-provision.log" | tee /dev/stderr; die "layers failed (the provision log's end above)"; }

if [ -d "$BUILD_CAS" ]; then
  rm -rf "$BUILD_CAS"; chroot "$ROOT" update-ca-certificates --fresh >/dev/null 2>&1 || true
fi

KVER=none
if [ "$KIND" = vm ]; then
  # the kernel boots from outside the disk (direct kernel boot): keep only the newest, and hold it
  # so an upgrade inside a VM never removes the modules of the kernel the VM boots
  KVER=$(ls "$ROOT/lib/modules" | sort -V | tail -1)
  for k in $(ls "$ROOT/lib/modules" | sort -V | head -n -1); do
    phase "  removing older kernel $k"
    chroot "$ROOT" env DEBIAN_FRONTEND=noninteractive apt-get purge -y -q "linux-image-$k" >/dev/null
  done
  chroot "$ROOT" apt-mark hold "linux-image-$KVER" linux-image-cloud-amd64 >/dev/null
  [ -f "$ROOT/boot/initrd.img-$KVER" ] || chroot "$ROOT" update-initramfs -c -k "$KVER" >/dev/null
fi
chroot "$ROOT" systemctl enable systemd-networkd.service systemd-resolved.service >/dev/null 2>&1
chroot "$ROOT" systemctl mask apt-daily.timer apt-daily-upgrade.timer >/dev/null 2>&1
chroot "$ROOT" apt-get clean
unmount_all
if [ "$KIND" = vm ]; then phase "layers done; kernel $KVER"; else phase "layers done"; fi

# leave nothing instance-specific: host keys, machine-id, cloud-init state, logs, apt lists
rm -f "$ROOT"/etc/ssh/ssh_host_* "$ROOT/usr/sbin/policy-rc.d"
: > "$ROOT/etc/machine-id"; rm -f "$ROOT/var/lib/dbus/machine-id"
ln -s /etc/machine-id "$ROOT/var/lib/dbus/machine-id"
rm -rf "$ROOT"/var/lib/cloud/* "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/*.bin \
  "$ROOT"/var/log/journal/* "$ROOT"/tmp/* "$ROOT"/var/tmp/* "$ROOT/root/.bash_history"
find "$ROOT/var/log" -type f ! -name 'boxery-provision.*' -delete
rm -f "$ROOT/etc/resolv.conf"; ln -s ../run/systemd/resolve/stub-resolv.conf "$ROOT/etc/resolv.conf"
if [ "$KIND" = vm ]; then
  cp "$ROOT/boot/vmlinuz-$KVER" "$W/$NAME.vmlinuz"; cp "$ROOT/boot/initrd.img-$KVER" "$W/$NAME.initrd"
fi
cp "$ROOT/etc/boxery/build-info" "$W/$NAME.build-info"
PKG_COUNT=$(dpkg-query --admindir="$ROOT/var/lib/dpkg" -W | wc -l)
phase "tree cleaned: $(du -sm "$ROOT" | cut -f1) MiB, $PKG_COUNT packages"

# publish_outputs: move the outputs from the work directory into OUT, the manifest last (it is
# what marks a complete build)
publish_outputs() {
  rm -f "$OUT/$NAME.json"
  local f
  for f in "${OUTPUTS[@]}"; do rm -f "$OUT/$f"; mv "$W/$f" "$OUT/$f"; done
  mv "$W/$NAME.json" "$OUT/$NAME.json"
}

# --- 4. filesystem and qcow2 (a VM), or an Incus unified image (a container) -------------------
if [ "$KIND" = container ]; then
  BUILT_AT=$(sed -n 's/^built_at=//p' "$W/$NAME.build-info")
  cat > "$W/metadata.yaml" <<EOM
architecture: x86_64
creation_date: $(date +%s)
properties:
  os: debian
  release: bookworm
  description: boxery $NAME (layers $LAYERS, input hash ${KEY:0:16})
EOM
  # plain tar (no compression: Incus unpacks it once, and xz costs minutes on 2 cores);
  # numeric owners, with extended attributes (file capabilities: ping)
  tar --numeric-owner --xattrs --xattrs-include='*' -C "$W" -cf "$W/$NAME.tar" metadata.yaml rootfs
  phase "unified image: $(($(file_size "$W/$NAME.tar") / 1048576)) MiB"
  TAR_SHA=$(sha256sum < "$W/$NAME.tar" | cut -d' ' -f1)
  cat > "$W/$NAME.json" <<EOJ
{
  "name": "$NAME",
  "kind": "container",
  "format": "incus-unified-tar",
  "image": "$NAME.tar",
  "image_size": $(file_size "$W/$NAME.tar"),
  "image_sha256": "$TAR_SHA",
  "ssh_user": "agent",
  "layers": "$LAYERS",
  "packages": $PKG_COUNT,
  "build_info": "$NAME.build-info",
  "built_at": "$BUILT_AT",
  "build_seconds": $(secs_since "$BOXERY_T0"),
  "input_hash": "$KEY"
}
EOJ
  publish_outputs
  phase "done: $OUT/$NAME.{tar,build-info,json}"
  exit 0
fi
truncate -s "$DISK_SIZE" "$W/root.raw"
mkfs.ext4 -q -F -L boxery-root -d "$ROOT" "$W/root.raw"
phase "mkfs.ext4 -d ($DISK_SIZE)"
qemu-img convert -f raw -O qcow2 "$W/root.raw" "$W/$NAME.qcow2"; rm -f "$W/root.raw"
chmod 0444 "$W/$NAME.qcow2"   # a base image: read-only, VMs get overlays
phase "qcow2: $(($(file_size "$W/$NAME.qcow2") / 1048576)) MiB"

DISK_SHA=$(sha256sum < "$W/$NAME.qcow2" | cut -d' ' -f1)
BUILT_AT=$(sed -n 's/^built_at=//p' "$W/$NAME.build-info")
cat > "$W/$NAME.json" <<EOJ
{
  "name": "$NAME",
  "format": "qcow2",
  "disk": "$NAME.qcow2",
  "disk_virtual_size": $(qcow2_virtual_size "$W/$NAME.qcow2"),
  "disk_file_size": $(file_size "$W/$NAME.qcow2"),
  "disk_sha256": "$DISK_SHA",
  "disk_device": "/dev/vda",
  "disk_mount": "/",
  "root_device": "/dev/vda",
  "kernel": "$NAME.vmlinuz",
  "kernel_size": $(file_size "$W/$NAME.vmlinuz"),
  "initrd": "$NAME.initrd",
  "initrd_size": $(file_size "$W/$NAME.initrd"),
  "kernel_version": "$KVER",
  "cmdline": $(json_str "$CMDLINE"),
  "boot": "direct-kernel",
  "seed": {"type": "nocloud", "label": "cidata", "attach": "raw read-only virtio-blk, after the disk"},
  "cpus": 2,
  "memory_mib": 1024,
  "min_memory_mib": 512,
  "ssh_user": "agent",
  "guest_agent": true,
  "acpi_powerdown": true,
  "layers": "$LAYERS",
  "packages": $PKG_COUNT,
  "build_info": "$NAME.build-info",
  "built_at": "$BUILT_AT",
  "build_seconds": $(secs_since "$BOXERY_T0"),
  "input_hash": "$KEY"
}
EOJ
publish_outputs
phase "done: $OUT/$NAME.{qcow2,vmlinuz,initrd,build-info,json}"
