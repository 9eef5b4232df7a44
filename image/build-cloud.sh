#!/bin/bash
# build-cloud.sh [--force] OUT_DIR — a cloud image as a distribution publishes one, made offline
# from Debian's packages, to test bring-your-own images (docs/images.md, "Bring your own image"):
# nothing of boxery's is in it.
#
#   - a partitioned disk (MBR, one ext4 partition) that boots itself: syslinux's MBR and
#     extlinux, the cloud kernel with its initramfs, root=UUID=…, console on ttyS0;
#   - Debian 12 (minbase) with systemd, udev, ifupdown + DHCP, OpenSSH's server, sudo and
#     cloud-init with Debian's own settings (default user `debian`, every datasource);
#   - no `agent` user, no boxery layer, no host keys, an empty machine-id.
#
#   OUT_DIR/cloud-debian-12.qcow2              the image
#   OUT_DIR/cloud-debian-12-no-cloud-init.qcow2 the same with cloud-init disabled
#                                              (/etc/cloud/cloud-init.disabled): an image
#                                              boxery must refuse clearly
#   OUT_DIR/cloud-debian-12.stamp              the input hash (not a `.json`: an image manifest
#                                              beside the disk would make boxery import it as a
#                                              builder's output)
#
# Cached by a hash of its inputs; --force rebuilds. Runs as root (debootstrap, chroot, a loop
# mount to install extlinux). Env: BOXERY_MIRROR, BOXERY_DEBOOTSTRAP_CACHE as build-debian.sh.
set -euo pipefail
. "$(dirname "$0")/lib.sh"

FORCE=0
[ "${1:-}" = --force ] && { FORCE=1; shift; }
OUT=${1:-$BOXERY_DEFAULT_OUT}
NAME=cloud-debian-12
SUITE=bookworm
MIRROR=${BOXERY_MIRROR:-http://deb.debian.org/debian}
DEB_CACHE=${BOXERY_DEBOOTSTRAP_CACHE:-/var/cache/boxery/debootstrap}
DISK_MIB=2048
PKGS="systemd-sysv udev dbus openssh-server sudo cloud-init python3-cffi-backend
linux-image-cloud-amd64 initramfs-tools ifupdown isc-dhcp-client iproute2 netbase ca-certificates"
INCLUDE=$(echo $PKGS | tr ' ' ',')
[ "$(id -u)" = 0 ] || die "build-cloud.sh must run as root (debootstrap, chroot, mount)"
require debootstrap chroot mkfs.ext4 qemu-img sfdisk extlinux mount umount
MBR=/usr/lib/syslinux/mbr/mbr.bin
[ -f "$MBR" ] || die "missing $MBR: run scripts/install-deps.sh (syslinux-common)"

KEY=$(sha256_of_inputs "$BOXERY_IMAGE_DIR/build-cloud.sh" "$BOXERY_IMAGE_DIR/lib.sh" <<EOI
suite=$SUITE
mirror=$MIRROR
include=$INCLUDE
disk_mib=$DISK_MIB
EOI
)
OUTPUTS=("$NAME.qcow2" "$NAME-no-cloud-init.qcow2")
if [ $FORCE = 0 ] && [ "$(cat "$OUT/$NAME.stamp" 2>/dev/null)" = "$KEY" ] &&
  [ -f "$OUT/${OUTPUTS[0]}" ] && [ -f "$OUT/${OUTPUTS[1]}" ]; then
  phase "up to date: $OUT/$NAME.qcow2 (input hash ${KEY:0:16})"
  exit 0
fi
phase "building $NAME (input hash ${KEY:0:16}) into $OUT"
mkdir -p "$OUT" "$DEB_CACHE"
avail_mib=$(( $(df --output=avail -k "$OUT" | tail -1) / 1024 ))
[ "$avail_mib" -ge $((DISK_MIB * 3)) ] ||
  die "$OUT has $avail_mib MiB free: building $NAME needs about $((DISK_MIB * 3)) MiB"
W=$(mktemp -d "$OUT/.work-$NAME.XXXXXX")
ROOT=$W/rootfs
MNT=$W/mnt
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
  if grep -q " $W/" /proc/mounts; then
    echo "warning: mounts left under $W; not removing it" >&2
  else
    rm -rf "$W"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

phase "debootstrap $SUITE (log: $W/debootstrap.log)"
debootstrap --variant=minbase --include="$INCLUDE" --cache-dir="$DEB_CACHE" \
  "$SUITE" "$ROOT" "$MIRROR" > "$W/debootstrap.log" 2>&1 ||
  { tail -30 "$W/debootstrap.log"; die "debootstrap failed (log above)"; }
KVER=$(ls "$ROOT/lib/modules" | sort -V | tail -1)
phase "debootstrap done: $(du -sm "$ROOT" | cut -f1) MiB, kernel $KVER"

UUID=$(cat /proc/sys/kernel/random/uuid)
echo debian > "$ROOT/etc/hostname"
printf '127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n' > "$ROOT/etc/hosts"
echo "UUID=$UUID / ext4 defaults,errors=remount-ro 0 1" > "$ROOT/etc/fstab"
printf 'auto lo\niface lo inet loopback\n\nsource /etc/network/interfaces.d/*\n' > "$ROOT/etc/network/interfaces"
mkdir -p "$ROOT/etc/network/interfaces.d"
mkdir -p "$ROOT/boot/extlinux"
cat > "$ROOT/boot/extlinux/extlinux.conf" <<EOC
DEFAULT debian
TIMEOUT 1
LABEL debian
  LINUX /boot/vmlinuz-$KVER
  INITRD /boot/initrd.img-$KVER
  APPEND root=UUID=$UUID ro console=tty0 console=ttyS0,115200
EOC
[ -f "$ROOT/boot/initrd.img-$KVER" ] || chroot "$ROOT" update-initramfs -c -k "$KVER" >/dev/null
rm -f "$ROOT"/etc/ssh/ssh_host_*
: > "$ROOT/etc/machine-id"
rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/*.bin "$ROOT"/var/cache/apt/archives/*.deb
phase "tree configured"

# disk DEST: the tree as a bootable partitioned disk (qcow2)
disk() {
  local dest=$1 raw=$W/disk.raw part=$W/part.raw
  rm -f "$raw" "$part"
  truncate -s $((DISK_MIB - 1))M "$part"
  # no 64bit: extlinux reads ext4 without it
  mkfs.ext4 -q -F -O ^64bit -U "$UUID" -L cloudimg-rootfs -d "$ROOT" "$part"
  truncate -s ${DISK_MIB}M "$raw"
  printf 'label: dos\nstart=2048, type=83, bootable\n' | sfdisk -q "$raw"
  dd if="$part" of="$raw" bs=1M seek=1 conv=notrunc,sparse status=none
  rm -f "$part"
  mkdir -p "$MNT"
  mount -o loop,offset=1048576 "$raw" "$MNT"; MOUNTS+=("$MNT")
  extlinux --install "$MNT/boot/extlinux" >/dev/null 2>&1
  unmount_all
  dd if="$MBR" of="$raw" bs=440 count=1 conv=notrunc status=none
  qemu-img convert -f raw -O qcow2 "$raw" "$W/$(basename "$dest")"; rm -f "$raw"
  chmod 0444 "$W/$(basename "$dest")"
  mv -f "$W/$(basename "$dest")" "$dest"
}
rm -f "$OUT/$NAME.stamp"
disk "$OUT/$NAME.qcow2"
phase "$NAME.qcow2: $(($(file_size "$OUT/$NAME.qcow2") / 1048576)) MiB"
touch "$ROOT/etc/cloud/cloud-init.disabled"
disk "$OUT/$NAME-no-cloud-init.qcow2"
phase "$NAME-no-cloud-init.qcow2: $(($(file_size "$OUT/$NAME-no-cloud-init.qcow2") / 1048576)) MiB"
echo "$KEY" > "$OUT/$NAME.stamp"
phase "done"
