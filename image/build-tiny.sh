#!/bin/bash
# build-tiny.sh OUT_DIR — build boxery's small test guest from Debian packages only.
#
#   OUT_DIR/tiny.vmlinuz   Debian cloud kernel (linux-image-*-cloud-amd64, via apt-get download)
#   OUT_DIR/tiny.initrd    initramfs: busybox-static (init, shell, udhcpc, acpid), dropbear (+
#                          dropbearconvert, sftp-server), mke2fs/resize2fs, virtio modules, and
#                          /etc/boxery/rc.sysinit, which honours the NoCloud seed contract
#   OUT_DIR/tiny.qcow2     the base of the persistent data disk: 1 GiB virtual, ext4
#                          LABEL=boxery-data, mounted on /home (marker file /home/.boxery-disk)
#   OUT_DIR/tiny.build-info  the guest's /etc/boxery/build-info
#   OUT_DIR/tiny.json      manifest: files, sizes, hash, kernel cmdline, devices, memory
#
# Cached by a hash of its inputs (these scripts, image/tiny/*, the package versions): a second
# run with the same inputs returns at once. --force rebuilds. Needs root only for nothing but
# reading the host's binaries; runs as any user who can write OUT_DIR and the .deb cache.
# Env: BOXERY_DEB_CACHE (default /var/cache/boxery/debs), TINY_DISK_SIZE (default 1G),
# BOXERY_DEBIAN_MIRROR (default http://deb.debian.org/debian: where dropbear's source comes from).
#
# dropbear is built here, not copied from the host: bookworm's 2022.83 closes a new session
# when another session of the same connection ends at that moment (mkj/dropbear#321), which
# over a ControlMaster is any two commands that overlap: the second ssh exits 255 without a
# word. Debian's source of the same version (its patches, its localoptions.h) plus upstream's
# fix (image/tiny/dropbear-check-close.patch, commit 71521d1b of 2024.86), checked by hash.
set -euo pipefail
. "$(dirname "$0")/lib.sh"

FORCE=0
[ "${1:-}" = --force ] && { FORCE=1; shift; }
OUT=${1:-$BOXERY_DEFAULT_OUT}
DEB_CACHE=${BOXERY_DEB_CACHE:-/var/cache/boxery/debs}
DISK_SIZE=${TINY_DISK_SIZE:-1G}
CMDLINE="console=ttyS0 loglevel=4 panic=-1"
MODS="virtio_pci virtio_blk virtio_net virtio_rng virtio_console isofs button evdev"
require apt-get apt-cache dpkg-deb depmod modprobe cpio gzip mkfs.ext4 qemu-img sha256sum \
  busybox resize2fs ldd curl gcc make patch bzip2 xz
[ -f /usr/include/zlib.h ] || die "zlib1g-dev is missing (dropbear is built here): run scripts/install-deps.sh"
# dropbear's source: Debian bookworm's, pinned by hash (the .dsc's Checksums-Sha256)
DB_V=2022.83 DB_DEB=1+deb12u3
DB_ORIG="dropbear_$DB_V.orig.tar.bz2" DB_ORIG_SHA=bc5a121ffbc94b5171ad5ebe01be42746d50aa797c9549a4639894a16749443b
DB_DEBIAN="dropbear_$DB_V-$DB_DEB.debian.tar.xz" DB_DEBIAN_SHA=74fb171a630f450430b771b2f781c420a4542881ae75fd2f75ca04c53a3eea93
MIRROR=${BOXERY_DEBIAN_MIRROR:-http://deb.debian.org/debian}
[ -x /bin/busybox ] && file_is_static=$(ldd /bin/busybox 2>&1 | grep -c 'not a dynamic' || true)
[ "${file_is_static:-0}" = 1 ] || die "/bin/busybox is not busybox-static: run scripts/install-deps.sh"

# --- inputs and cache ------------------------------------------------------------------------
phase "resolving inputs"
# one apt-cache call (it loads the whole cache): the cloud kernel meta package pins its image
SHOW=$(apt-cache show --no-all-versions linux-image-cloud-amd64 openssh-sftp-server 2>/dev/null || true)
KDEP=$(awk '/^Package: linux-image-cloud-amd64$/{p=1} p && /^Depends:/{print; exit}' <<< "$SHOW")
KPKG=$(sed -n 's/^Depends: \(linux-image-[0-9][^ ,]*\) (= \([^)]*\)).*/\1/p' <<< "$KDEP")
KPKG_V=$(sed -n 's/^Depends: \(linux-image-[0-9][^ ,]*\) (= \([^)]*\)).*/\2/p' <<< "$KDEP")
SFTP_V=$(awk '/^Package: openssh-sftp-server$/{p=1} p && /^Version:/{print $2; exit}' <<< "$SHOW")
[ -n "$KPKG" ] || die "apt knows no linux-image-cloud-amd64: run 'apt-get update' (or scripts/install-deps.sh)"
KVER=${KPKG#linux-image-}
inst() { dpkg-query -W -f='${Version}' "$1"; }
[ -n "$KPKG_V" ] && [ "$KPKG_V" != "(none)" ] || die "no candidate for $KPKG: run apt-get update"
[ -n "$SFTP_V" ] && [ "$SFTP_V" != "(none)" ] || die "no candidate for openssh-sftp-server: run apt-get update"
VERSIONS="kernel=$KPKG=$KPKG_V
openssh-sftp-server=$SFTP_V
busybox-static=$(inst busybox-static)
dropbear-src=$DB_V-$DB_DEB+$(sha256sum < "$BOXERY_IMAGE_DIR/tiny/dropbear-check-close.patch" | cut -c1-16)
zlib1g=$(inst zlib1g)
e2fsprogs=$(inst e2fsprogs)
disk_size=$DISK_SIZE
cmdline=$CMDLINE
modules=$MODS"
INPUTS=("$BOXERY_IMAGE_DIR/build-tiny.sh" "$BOXERY_IMAGE_DIR/lib.sh")
for f in "$BOXERY_IMAGE_DIR"/tiny/*; do INPUTS+=("$f"); done
KEY=$(sha256_of_inputs "${INPUTS[@]}" <<< "$VERSIONS")
OUTPUTS=(tiny.vmlinuz tiny.initrd tiny.qcow2 tiny.build-info)
if [ $FORCE = 0 ] && cache_hit "$OUT" tiny "$KEY" "${OUTPUTS[@]}"; then
  phase "up to date: $OUT/tiny.json (input hash ${KEY:0:16})"
  exit 0
fi
phase "building tiny (input hash ${KEY:0:16}) into $OUT"

mkdir -p "$OUT" "$DEB_CACHE"
W=$(mktemp -d "$OUT/.work-tiny.XXXXXX")
trap 'rm -rf "$W"' EXIT

# --- 1. packages: the kernel and sftp-server .debs (cached by version) -------------------------
fetch() { # fetch PKG VERSION -> path of the .deb in the cache
  local p=$1 v=$2 f
  f="$DEB_CACHE/${p}_${v/:/%3a}_amd64.deb"   # apt-get download spells the epoch colon %3a
  if [ ! -f "$f" ]; then
    (cd "$DEB_CACHE" && apt-get download -q -o APT::Sandbox::User=root "$p=$v" >/dev/null) \
      || die "apt-get download $p=$v failed"
    [ -f "$f" ] || die "apt-get download $p=$v did not write $f"
  fi
  echo "$f"
}
KDEB=$(fetch "$KPKG" "$KPKG_V"); SDEB=$(fetch openssh-sftp-server "$SFTP_V")
phase "packages: $(basename "$KDEB"), $(basename "$SDEB")"
fetch_src() { # fetch_src FILE SHA256 -> path in the cache, downloaded once and checked
  local f=$DEB_CACHE/$1
  if [ ! -f "$f" ] || [ "$(sha256sum < "$f" | cut -d' ' -f1)" != "$2" ]; then
    curl -fsSL --retry 3 --max-time 300 -o "$f.part" "$MIRROR/pool/main/d/dropbear/$1" \
      || die "cannot download $MIRROR/pool/main/d/dropbear/$1 (set BOXERY_DEBIAN_MIRROR to a mirror that has it)"
    [ "$(sha256sum < "$f.part" | cut -d' ' -f1)" = "$2" ] || { rm -f "$f.part"; die "$1: sha256 mismatch"; }
    mv "$f.part" "$f"
  fi
  echo "$f"
}
# --- 1b. dropbear: Debian's source + the channel close fix, built with its bundled libtom -------
DBS=$W/dropbear; mkdir -p "$DBS"
tar -xjf "$(fetch_src "$DB_ORIG" "$DB_ORIG_SHA")" -C "$DBS" --strip-components=1
tar -xJf "$(fetch_src "$DB_DEBIAN" "$DB_DEBIAN_SHA")" -C "$DBS"
while read -r p; do
  case $p in ''|'#'*) continue ;; esac
  patch -d "$DBS" -p1 -s < "$DBS/debian/patches/$p" || die "Debian's patch $p does not apply"
done < "$DBS/debian/patches/series"
patch -d "$DBS" -p1 -s < "$BOXERY_IMAGE_DIR/tiny/dropbear-check-close.patch" || die "the dropbear fix does not apply"
cp "$DBS/debian/localoptions.h" "$DBS/"
(cd "$DBS" && ./configure -q --enable-bundled-libtom CFLAGS="-O2" >"$W/dropbear-build.log" 2>&1 \
  && make -j"$(nproc)" PROGRAMS="dropbear dropbearkey dropbearconvert" >>"$W/dropbear-build.log" 2>&1) \
  || { tail -20 "$W/dropbear-build.log" >&2; die "building dropbear failed"; }
phase "dropbear $DB_V-$DB_DEB built with the channel close fix"

dpkg-deb -x "$KDEB" "$W/kroot"
dpkg-deb -x "$SDEB" "$W/sftp"
depmod -b "$W/kroot" "$KVER"
cp "$W/kroot/boot/vmlinuz-$KVER" "$W/tiny.vmlinuz"
phase "kernel $KVER extracted"

# --- 2. initramfs tree -------------------------------------------------------------------------
R=$W/root
mkdir -p "$R"/{bin,sbin,etc/boxery,etc/acpi/PWRF,proc,sys,dev,run,tmp,home,root,var/log,lib64,lib/x86_64-linux-gnu,usr/lib}
chmod 1777 "$R/tmp"
cp /bin/busybox "$R/bin/busybox"
for a in $(/bin/busybox --list); do [ -e "$R/bin/$a" ] || ln -s busybox "$R/bin/$a"; done
ln -s bin/busybox "$R/init"
cp "$DBS/dropbear" "$R/sbin/dropbear"
cp "$DBS/dropbearconvert" "$DBS/dropbearkey" "$R/bin/"
cp /sbin/mke2fs /sbin/resize2fs "$R/sbin/"
cp "$W/sftp/usr/lib/openssh/sftp-server" "$R/usr/lib/sftp-server"   # dropbear's sftp path
cp /etc/mke2fs.conf "$R/etc/"
for lib in $(ldd "$R/sbin/dropbear" "$R/bin/dropbearconvert" "$R/bin/dropbearkey" "$R/sbin/mke2fs" \
    "$R/sbin/resize2fs" "$R/usr/lib/sftp-server" | awk '/=> \//{print $3}' | sort -u); do
  cp -L "$lib" "$R/lib/x86_64-linux-gnu/"
done
cp -L /lib64/ld-linux-x86-64.so.2 "$R/lib64/"
# kernel modules with their dependencies, in load order (absolute paths inside the initramfs)
: > "$R/etc/modules.order"
# shellcheck disable=SC2086
modprobe -d "$W/kroot" -S "$KVER" --show-depends -a $MODS | awk '$1=="insmod"{print $2}' | awk '!seen[$0]++' |
while read -r ko; do
  rel=${ko#"$W/kroot"}; mkdir -p "$R$(dirname "$rel")"; cp "$ko" "$R$rel"; echo "$rel" >> "$R/etc/modules.order"
done
T=$BOXERY_IMAGE_DIR/tiny
install -m 0644 "$T/inittab" "$R/etc/inittab"
install -m 0755 "$T/rc.sysinit" "$T/rc.shutdown" "$T/sshd" "$R/etc/boxery/"
install -m 0644 "$T/seed-parse.awk" "$R/etc/boxery/"
install -m 0755 "$T/udhcpc.sh" "$R/etc/udhcpc.sh"
install -m 0755 "$T/sudo" "$R/bin/sudo"
install -m 0755 "$T/acpi-power" "$R/etc/acpi/PWRF/00000080"
echo 'PWRF PWRF/00000080' > "$R/etc/acpid.conf"
# `agent` is uid 0 (root-equivalent, listed first so whoami says agent); no passwords at all
cat > "$R/etc/passwd" <<'EOP'
agent:x:0:0:boxery agent:/home/agent:/bin/sh
root:x:0:0:root:/root:/bin/sh
EOP
printf 'agent:*:1::::::\nroot:*:1::::::\n' > "$R/etc/shadow"; chmod 600 "$R/etc/shadow"
printf 'root:x:0:\nagent:x:0:\ntty:x:5:\n' > "$R/etc/group"
echo /bin/sh > "$R/etc/shells"
printf 'passwd: files\ngroup: files\nshadow: files\nhosts: files dns\n' > "$R/etc/nsswitch.conf"
printf 'PRETTY_NAME="boxery tiny guest"\nID=boxery-tiny\nVERSION_ID=1\n' > "$R/etc/os-release"
echo 'export PATH=/sbin:/bin:/usr/sbin:/usr/bin HOME=${HOME:-/home/agent}' > "$R/etc/profile"
BUILT_AT=$(date -u +%Y-%m-%dT%H:%M:%SZ)
cat > "$W/tiny.build-info" <<EOB
built_at=$BUILT_AT
image=tiny
layers=
layers_hash=
kernel=$KVER
input_hash=$KEY
EOB
cp "$W/tiny.build-info" "$R/etc/boxery/build-info"
echo tiny > "$R/etc/boxery/image"
(cd "$R" && find . | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet | gzip -6) > "$W/tiny.initrd"
phase "initramfs: $(($(file_size "$W/tiny.initrd") / 1024)) KiB, $(wc -l < "$R/etc/modules.order") modules"

# --- 3. data disk: ext4 made from a folder (no mounts), converted to qcow2 ----------------------
D=$W/disk; mkdir -p "$D/agent/.ssh" "$D/agent/.boxery" "$D/.boxery-guest"
chmod 700 "$D/agent/.ssh" "$D/agent/.boxery" "$D/.boxery-guest"
echo "boxery tiny data disk (mounted on /home); built $BUILT_AT" > "$D/.boxery-disk"
truncate -s "$DISK_SIZE" "$W/disk.raw"
mkfs.ext4 -q -F -L boxery-data -d "$D" -E lazy_itable_init=1,lazy_journal_init=1,root_owner=0:0 "$W/disk.raw"
qemu-img convert -f raw -O qcow2 "$W/disk.raw" "$W/tiny.qcow2"; rm -f "$W/disk.raw"
chmod 0444 "$W/tiny.qcow2"   # a base image: read-only, VMs get overlays
phase "data disk: $DISK_SIZE virtual, $(($(file_size "$W/tiny.qcow2") / 1024)) KiB file"

# --- 4. manifest and atomic publish ------------------------------------------------------------
DISK_SHA=$(sha256sum < "$W/tiny.qcow2" | cut -d' ' -f1)
BUILD_S=$(secs_since "$BOXERY_T0")
cat > "$W/tiny.json" <<EOJ
{
  "name": "tiny",
  "format": "qcow2",
  "disk": "tiny.qcow2",
  "disk_virtual_size": $(qcow2_virtual_size "$W/tiny.qcow2"),
  "disk_file_size": $(file_size "$W/tiny.qcow2"),
  "disk_sha256": "$DISK_SHA",
  "disk_device": "/dev/vda",
  "disk_mount": "/home",
  "root_device": "initramfs",
  "kernel": "tiny.vmlinuz",
  "kernel_size": $(file_size "$W/tiny.vmlinuz"),
  "initrd": "tiny.initrd",
  "initrd_size": $(file_size "$W/tiny.initrd"),
  "kernel_version": "$KVER",
  "cmdline": $(json_str "$CMDLINE"),
  "boot": "direct-kernel",
  "seed": {"type": "nocloud", "label": "cidata", "attach": "raw read-only virtio-blk, after the disk"},
  "cpus": 1,
  "memory_mib": 256,
  "min_memory_mib": 128,
  "ssh_user": "agent",
  "guest_agent": false,
  "acpi_powerdown": true,
  "build_info": "tiny.build-info",
  "built_at": "$BUILT_AT",
  "build_seconds": $BUILD_S,
  "input_hash": "$KEY"
}
EOJ
rm -f "$OUT/tiny.json"   # the manifest goes last: it is what marks a complete build
for f in "${OUTPUTS[@]}"; do rm -f "$OUT/$f"; mv "$W/$f" "$OUT/$f"; done
mv "$W/tiny.json" "$OUT/tiny.json"
phase "done: $OUT/tiny.{vmlinuz,initrd,qcow2,build-info,json}"
