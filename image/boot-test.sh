#!/bin/bash
# boot-test.sh OUT_DIR NAME — boot a built image (OUT_DIR/NAME.json) with raw QEMU under TCG and a
# generated NoCloud seed, and prove the seed contract over ssh with the pinned host key.
#
# Boots (MODE=full, the default; MODE=quick does boot 1 only):
#   1. seed A on a fresh overlay of NAME.qcow2: wait for the "SSH-" banner, then
#      ssh -o StrictHostKeyChecking=yes (only the seed's host key is known) and check hostname,
#      /etc/machine-id, ~/.boxery/token; write a file; power off with QMP system_powerdown (ACPI)
#   2. seed A again, same disk (a reboot): same machine-id, the file is still there; power off
#      with `sudo poweroff` over ssh
#   3. seed B (new instance-id, hostname, host key, client key, token), same disk (what a VM made
#      from an image sees): key A is refused, key B works against host key B, a new machine-id,
#      token B, the file is still there; power off with QMP system_powerdown
# Prints launch->banner and banner->first command seconds per boot (boot 1 is the "raw QEMU
# boot-to-ssh" limit the benchmarks compare against). Every QEMU it starts is killed on exit.
# Env: MEM (MiB), SMP, MODE=full|quick, BOOT_TIMEOUT (s), KEEP_WORK=1 (keep the work dir),
#      GUEST_CMD (a command to run and show after the checks of boot 1), EMPTY_DISK=1 (boot
#      tiny on a blank 1 GiB disk instead of an overlay of NAME.qcow2).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
[ $# -eq 2 ] || { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
OUT=$1 NAME=$2
MF=$OUT/$NAME.json
[ -f "$MF" ] || die "no manifest $MF: build the image first (image/build-$NAME.sh $OUT)"
require qemu-system-x86_64 qemu-img ssh ssh-keygen socat genisoimage
mf() { # mf KEY: a top-level string or number of the manifest
  sed -n -e "s/^  \"$1\": \"\(.*\)\",\{0,1\}\$/\1/p" -e "s/^  \"$1\": \([^\",]*\),\{0,1\}\$/\1/p" "$MF" | head -1
}
DISK=$OUT/$(mf disk) KERNEL=$OUT/$(mf kernel) INITRD=$OUT/$(mf initrd) CMDLINE=$(mf cmdline)
MEM=${MEM:-$(mf memory_mib)} SMP=${SMP:-$(mf cpus)} SMP=${SMP:-1}
GA=$(mf guest_agent) MODE=${MODE:-full} MOUNT=$(mf disk_mount)
# what boot checks read from the guest, one answer a line
PROBE="hostname; cat /etc/machine-id; cat ~/.boxery/token; echo; stat -c %a ~/.boxery/token;
  cat ~/persist.txt 2>/dev/null || echo none; df -m $MOUNT | awk 'NR==2{print \$2}'"
BOOT_TIMEOUT=${BOOT_TIMEOUT:-$([ "$NAME" = tiny ] && echo 120 || echo 600)}
for f in "$DISK" "$KERNEL" "$INITRD"; do [ -f "$f" ] || die "missing $f"; done

W=$(mktemp -d /tmp/boxery-boot-test.XXXXXX)
QPID=
stop_qemu() { # kill the QEMU we started (only if the pid is still that QEMU)
  if [ -n "$QPID" ] && kill -0 "$QPID" 2>/dev/null && grep -q "$W" "/proc/$QPID/cmdline" 2>/dev/null; then
    kill "$QPID" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$QPID" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$QPID" 2>/dev/null || true
  fi
  QPID=
}
cleanup() { stop_qemu; [ "${KEEP_WORK:-0}" = 1 ] && echo "work dir kept: $W" || rm -rf "$W"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() { # a loopback TCP port nobody listens on
  local p
  for _ in $(seq 100); do
    p=$((20000 + RANDOM % 40000))
    (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null || { echo "$p"; return; }
  done
  die "no free port found"
}
qmp() { # qmp COMMAND-JSON...: send QMP commands, print the replies
  { echo '{"execute":"qmp_capabilities"}'; for c in "$@"; do echo "$c"; done; sleep 0.5; } |
    socat -t 2 - "UNIX-CONNECT:$W/qmp.sock" 2>/dev/null || true
}

# identity S: make keys, token and seed ISO for identity S (A or B) in $W/S/
make_identity() {
  local s=$1 d=$W/$1
  mkdir -p "$d"
  ssh-keygen -q -t ed25519 -N '' -C "boot-test-host-$s" -f "$d/host_key"
  ssh-keygen -q -t ed25519 -N '' -C "boot-test-client-$s" -f "$d/client_key"
  head -c 24 /dev/urandom | base64 | tr -d '/+=\n' > "$d/token"
  echo "bt-$(tr -dc 'a-z0-9' < /dev/urandom | head -c 6)-$s" > "$d/hostname"
  echo "iid-$(cat /proc/sys/kernel/random/uuid)" > "$d/instance-id"
  # the pinned key: one known_hosts line under the alias the host uses, whatever the port
  echo "$(cat "$d/hostname").boxery $(cut -d' ' -f1-2 "$d/host_key.pub")" > "$d/known_hosts"
  "$BOXERY_IMAGE_DIR/make-seed.sh" --instance-id "$(cat "$d/instance-id")" --hostname "$(cat "$d/hostname")" \
    --host-key "$d/host_key" --authorized-keys "$d/client_key.pub" --token "$d/token" "$d/seed" "$d/seed.iso"
}
# gssh S KEY_S CMD: ssh as agent, pinned to identity S's host key, with identity KEY_S's client key
gssh() {
  local s=$1 k=$2; shift 2
  ssh -i "$W/$k/client_key" -o IdentitiesOnly=yes -o BatchMode=yes -o ConnectTimeout=10 \
    -o StrictHostKeyChecking=yes -o UserKnownHostsFile="$W/$s/known_hosts" -o GlobalKnownHostsFile=/dev/null \
    -o HostKeyAlias="$(cat "$W/$s/hostname").boxery" -o LogLevel=ERROR \
    -p "$PORT" agent@127.0.0.1 "$@"
}
wait_banner() { # seconds to wait; 0 when the guest's sshd answered with its banner
  local end=$(( $(date +%s) + $1 ))
  while [ "$(date +%s)" -lt "$end" ]; do
    kill -0 "$QPID" 2>/dev/null || return 2
    if timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/$PORT && head -c 4 <&3" 2>/dev/null | grep -q SSH-; then return 0; fi
    sleep 0.1
  done
  return 1
}

# boot S: start QEMU with identity S's seed on the overlay; sets QPID, PORT, T_LAUNCH
boot() {
  local s=$1
  PORT=$(free_port)
  rm -f "$W/serial.log" "$W/qmp.sock" "$W/qga.sock" "$W/qemu.pid"
  local ga=()
  # shellcheck disable=SC2054 # commas are QEMU option syntax
  [ "$GA" = true ] && ga=(-chardev "socket,path=$W/qga.sock,server=on,wait=off,id=qga0"
    -device virtio-serial-pci -device virtserialport,chardev=qga0,name=org.qemu.guest_agent.0)
  # shellcheck disable=SC2054
  QEMU_ARGS=(-name "boxery-boot-test-$NAME" -machine q35 -accel tcg -cpu max -smp "$SMP" -m "$MEM"
    -nodefaults -no-user-config -display none -uuid "$(cat /proc/sys/kernel/random/uuid)"
    -kernel "$KERNEL" -initrd "$INITRD" -append "$CMDLINE" -no-reboot
    -serial "file:$W/serial.log"
    -netdev "user,id=n0,hostfwd=tcp:127.0.0.1:$PORT-:22"
    -device "virtio-net-pci,netdev=n0,mac=52:54:00:$(od -An -N3 -tx1 /dev/urandom | sed 's/^ //; s/ /:/g'),romfile="
    -drive "file=$W/disk.qcow2,if=none,id=disk0,format=qcow2,cache=writeback,discard=unmap" -device virtio-blk-pci,drive=disk0
    -drive "file=$W/$s/seed.iso,if=none,id=seed0,format=raw,readonly=on" -device virtio-blk-pci,drive=seed0
    -device virtio-rng-pci "${ga[@]}"
    -qmp "unix:$W/qmp.sock,server=on,wait=off" -daemonize -pidfile "$W/qemu.pid")
  T_LAUNCH=$(now_ns)
  qemu-system-x86_64 "${QEMU_ARGS[@]}" 2> "$W/qemu.err" || { cat "$W/qemu.err"; die "qemu failed to start"; }
  QPID=$(cat "$W/qemu.pid")
}
# poweroff_guest HOW S: acpi (QMP system_powerdown) or ssh (sudo poweroff); print seconds to exit
poweroff_guest() {
  local how=$1 s=$2 t limit
  t=$(now_ns)
  limit=$([ "$NAME" = tiny ] && echo 30 || echo 120)
  if [ "$how" = acpi ]; then qmp '{"execute":"system_powerdown"}' > /dev/null
  else gssh "$s" "$s" 'sudo poweroff' > /dev/null 2>&1 || true; fi
  local end=$(( $(date +%s) + limit ))
  while kill -0 "$QPID" 2>/dev/null && [ "$(date +%s)" -lt "$end" ]; do sleep 0.1; done
  if kill -0 "$QPID" 2>/dev/null; then
    echo "   WARNING: no clean poweroff ($how) within ${limit}s; QMP quit"; FAILS=$((FAILS + 1))
    qmp '{"execute":"quit"}' > /dev/null; sleep 1; stop_qemu
  else
    echo "   poweroff ($how) -> qemu exit: $(secs_since "$t")s"; QPID=
  fi
}

FAILS=0
check() { # check DESCRIPTION TEST-COMMAND...
  local what=$1; shift
  if "$@"; then echo "   ok   $what"; else echo "   FAIL $what"; FAILS=$((FAILS + 1)); fi
}
# run_boot N S: boot identity S and run the contract checks; sets ANSWER lines
run_boot() {
  local n=$1 s=$2
  boot "$s"
  local rc=0; wait_banner "$BOOT_TIMEOUT" || rc=$?
  if [ $rc != 0 ]; then
    echo "boot $n: no ssh banner ($([ $rc = 2 ] && echo 'qemu exited' || echo "timeout ${BOOT_TIMEOUT}s")); serial tail:"
    tail -25 "$W/serial.log"; exit 1
  fi
  local banner_s t1 cmd_s
  banner_s=$(secs_since "$T_LAUNCH"); t1=$(now_ns)
  local out=""
  for _ in $(seq 60); do   # sshd may answer before the key is in place (full image: cloud-init)
    out=$(gssh "$s" "$s" "$PROBE" 2> "$W/ssh.err") && break
    out=""; sleep 1
  done
  cmd_s=$(secs_since "$t1")
  if [ -z "$out" ]; then echo "boot $n: banner after ${banner_s}s but ssh failed: $(cat "$W/ssh.err")"; tail -25 "$W/serial.log"; exit 1; fi
  echo "boot $n (seed $s, ${MEM} MiB, ${SMP} vCPU, TCG): launch->ssh banner ${banner_s}s, +first command ${cmd_s}s, qemu RSS $(($(ps -o rss= -p "$QPID") / 1024)) MiB"
  G_HOST=$(sed -n 1p <<< "$out"); G_MID=$(sed -n 2p <<< "$out"); G_TOK=$(sed -n 3p <<< "$out")
  G_MODE=$(sed -n 4p <<< "$out"); G_PERSIST=$(sed -n 5p <<< "$out"); G_SIZE=$(sed -n 6p <<< "$out")
  check "hostname is the seed's ($G_HOST)" test "$G_HOST" = "$(cat "$W/$s/hostname")"
  check "machine-id is 32 hex digits ($G_MID)" grep -Eqx '[0-9a-f]{32}' <<< "$G_MID"
  check "token is the seed's, mode 600" test "$G_TOK:$G_MODE" = "$(cat "$W/$s/token"):600"
  check "the disk is mounted on $MOUNT (${G_SIZE:-no} MiB)" test -n "$G_SIZE"
  check "host key pinned (StrictHostKeyChecking=yes with only the seed's key)" true
  BANNERS+=("$banner_s")
}

phase "boot-test $NAME: $MF (mode $MODE)"
BANNERS=()
if [ "${EMPTY_DISK:-0}" = 1 ]; then   # a blank disk: the tiny guest formats it on first boot
  qemu-img create -q -f qcow2 "$W/disk.qcow2" 1G
else
  qemu-img create -q -f qcow2 -b "$DISK" -F qcow2 "$W/disk.qcow2"
fi
make_identity A
run_boot 1 A
MID_A=$G_MID
check "no file from an earlier boot" test "$G_PERSIST" = none
gssh A A 'echo "written in boot 1" > ~/persist.txt; sync' || FAILS=$((FAILS + 1))
head -c 100000 /dev/urandom > "$W/scp.bin"
scp -q -i "$W/A/client_key" -o IdentitiesOnly=yes -o BatchMode=yes -o StrictHostKeyChecking=yes \
  -o UserKnownHostsFile="$W/A/known_hosts" -o HostKeyAlias="$(cat "$W/A/hostname").boxery" -o LogLevel=ERROR \
  -P "$PORT" "$W/scp.bin" agent@127.0.0.1:scp.bin 2> "$W/scp.err" || true
check "scp (sftp) to the guest: same sha256" test "$(gssh A A 'sha256sum scp.bin' 2>/dev/null | cut -d" " -f1)" = "$(sha256sum < "$W/scp.bin" | cut -d" " -f1)"
if [ -n "${GUEST_CMD:-}" ]; then echo "   guest: \$ $GUEST_CMD"; gssh A A "$GUEST_CMD" 2>&1 | sed "s/^/   guest: /" || true; fi
if [ "$GA" = true ]; then
  r=$({ echo '{"execute":"guest-ping"}'; sleep 1; } | socat -t 3 - "UNIX-CONNECT:$W/qga.sock" 2>/dev/null || true)
  check "qemu-guest-agent answers guest-ping ($r)" grep -q '"return"' <<< "$r"
fi
if [ "$MODE" = quick ]; then
  poweroff_guest acpi A
else
  poweroff_guest acpi A
  run_boot 2 A
  check "machine-id kept across a reboot" test "$G_MID" = "$MID_A"
  check "file written in boot 1 persisted" test "$G_PERSIST" = "written in boot 1"
  poweroff_guest ssh A
  SIZE_A=$G_SIZE
  qemu-img resize -q "$W/disk.qcow2" +1G   # what a resize of a stopped VM does
  make_identity B
  run_boot 3 B
  check "new instance: new machine-id" test "$G_MID" != "$MID_A"
  check "disk data kept in the new instance" test "$G_PERSIST" = "written in boot 1"
  check "filesystem on $MOUNT grew with the disk (${SIZE_A} -> ${G_SIZE} MiB)" test "$G_SIZE" -gt $((SIZE_A + 900))
  err=$(gssh B A true 2>&1 >/dev/null) && ok=1 || ok=0
  check "the old instance's client key is refused ($err)" test $ok = 0 -a -n "$(grep -o 'Permission denied' <<< "$err")"
  err=$(gssh A B true 2>&1 >/dev/null) && ok=1 || ok=0
  check "the old host key is no longer presented" test $ok = 0
  poweroff_guest acpi B
fi
echo "summary $NAME: launch->ssh banner ${BANNERS[*]} s; failures: $FAILS"
[ "$FAILS" = 0 ]
