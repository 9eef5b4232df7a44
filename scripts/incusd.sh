#!/bin/bash
# incusd.sh — start or stop the Incus daemon by hand, on machines without systemd (PID 1 is not
# systemd: containers, these CI machines). On a systemd host use its units instead:
#   systemctl enable --now incus.socket incus.service
#
#   scripts/incusd.sh start    # start incusd unless it answers; wait until it is ready
#   scripts/incusd.sh stop     # stop the one this script started (by PID, checked by name)
#   scripts/incusd.sh status   # exit 0 when incusd answers on its socket
#
# lxcfs goes first (as on a systemd host, where incus.service requires lxcfs.service): it gives
# each container a /proc/meminfo, /proc/cpuinfo and uptime of its own limits, not the host's.
#
# PID files: $BOXERY_INCUSD_RUN (default /run/boxery-incusd)/{lxcfs,incusd}.pid; the logs
# beside them. A daemon started some other way is never stopped. Stopping incusd (TERM) leaves
# running containers and the networks' dnsmasq alone, as a systemd stop does; the tests remove
# what they made before that (IncusBackend::teardown).
set -euo pipefail
RUN=${BOXERY_INCUSD_RUN:-/run/boxery-incusd}
INCUSD=${BOXERY_INCUSD:-/usr/libexec/incus/incusd}
say() { printf 'incusd.sh: %s\n' "$*" >&2; }
answers() { timeout 10 "$INCUSD" waitready --timeout 5 >/dev/null 2>&1; }

# ours [NAME]: the PID in NAME.pid (default incusd) when that process is alive and is NAME
ours() {
  local name=${1:-incusd} f pid
  f=$RUN/$name.pid
  [ -f "$f" ] || return 1
  pid=$(cat "$f" 2>/dev/null) || return 1
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = "$name" ] || return 1
  echo "$pid"
}
LXCFS_DIR=/var/lib/lxcfs
lxcfs_up() { grep -q " $LXCFS_DIR fuse.lxcfs " /proc/mounts; }

# One start or stop at a time (tests run in parallel, and each starts incusd when none
# answers): the second waits, then finds it answering.
serialize() {
  mkdir -p "$RUN"
  exec 9>"$RUN/lock"
  flock 9
}

start() {
  [ -x "$INCUSD" ] || { say "incusd is not installed: run scripts/install-incus.sh"; exit 1; }
  if answers; then say "incusd already answers"; return 0; fi
  serialize
  if answers; then say "incusd already answers"; return 0; fi
  if ! lxcfs_up && command -v lxcfs >/dev/null; then
    rm -f "$RUN/lxcfs.pid"
    mkdir -p "$LXCFS_DIR"
    setsid lxcfs "$LXCFS_DIR" </dev/null >>"$RUN/lxcfs.log" 2>&1 9>&- &
    echo $! > "$RUN/lxcfs.pid"
    for _ in $(seq 1 50); do lxcfs_up && break; sleep 0.1; done
    lxcfs_up || say "lxcfs did not mount $LXCFS_DIR (see $RUN/lxcfs.log): containers will see the host's /proc/meminfo"
  fi
  if ! ours >/dev/null; then
    rm -f "$RUN/incusd.pid"
    # its own session (no terminal's signals), its output in its log; the lock not inherited
    setsid "$INCUSD" --group incus-admin --logfile "$RUN/incusd.log" \
      </dev/null >>"$RUN/incusd.out" 2>&1 9>&- &
    echo $! > "$RUN/incusd.pid"
  fi
  local t=$SECONDS
  until answers; do
    if ((SECONDS - t > 90)); then say "incusd was not ready within 90 s; see $RUN/incusd.log"; exit 1; fi
    ours >/dev/null || { say "incusd exited; see $RUN/incusd.log"; tail -5 "$RUN/incusd.log" "$RUN/incusd.out" >&2 || true; exit 1; }
    sleep 0.2
  done
  say "incusd is ready (pid $(ours))"
}

stop() {
  local pid d
  serialize
  for d in incusd lxcfs; do
    if pid=$(ours "$d"); then
      kill "$pid"
      for _ in $(seq 1 150); do [ -d /proc/"$pid" ] || break; sleep 0.1; done
      [ -d /proc/"$pid" ] && kill -9 "$pid"
      say "stopped $d (pid $pid)"
      [ "$d" = lxcfs ] && { fusermount -u "$LXCFS_DIR" 2>/dev/null || umount -l "$LXCFS_DIR" 2>/dev/null || true; }
    fi
    rm -f "$RUN/$d.pid"
  done
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) answers ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
