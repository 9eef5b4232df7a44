#!/bin/bash
# libvirtd.sh — start or stop libvirt's daemons by hand, on machines without systemd (PID 1 is
# not systemd: containers, these CI machines). On a systemd host use the units instead:
#   systemctl enable --now virtlogd.socket libvirtd.socket   (or the modular virtqemud.socket)
#
#   scripts/libvirtd.sh start    # start virtlogd and libvirtd unless they answer; wait for them
#   scripts/libvirtd.sh stop     # stop the ones this script started (by PID, checked by name)
#   scripts/libvirtd.sh status   # exit 0 when libvirtd answers on qemu:///system
#
# PID files: $BOXERY_LIBVIRTD_RUN (default /run/boxery-libvirtd)/{virtlogd,libvirtd}.pid; the
# daemon log is libvirtd.log beside them. Daemons started some other way are never stopped.
# Stopping libvirtd leaves running domains and the networks' dnsmasq alone (libvirtd
# re-attaches to them when it starts again), as a systemd stop does.
set -euo pipefail
RUN=${BOXERY_LIBVIRTD_RUN:-/run/boxery-libvirtd}
URI=qemu:///system
say() { printf 'libvirtd.sh: %s\n' "$*" >&2; }
answers() { timeout 5 virsh -q -c "$URI" version >/dev/null 2>&1; }

# ours NAME: the PID in NAME.pid when that process is alive and is NAME
ours() {
  local f=$RUN/$1.pid pid
  [ -f "$f" ] || return 1
  pid=$(cat "$f" 2>/dev/null) || return 1
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = "$1" ] || return 1
  echo "$pid"
}

# One start or stop at a time (tests run in parallel, and each starts libvirtd when none
# answers): the second waits, then finds it answering.
serialize() {
  mkdir -p "$RUN"
  exec 9>"$RUN/lock"
  flock 9
}

start() {
  command -v libvirtd >/dev/null || { say "libvirtd is not installed: run scripts/install-libvirt.sh"; exit 1; }
  if answers; then say "libvirtd already answers on $URI"; return 0; fi
  serialize
  if answers; then say "libvirtd already answers on $URI"; return 0; fi
  mkdir -p "$RUN" /run/libvirt /var/log/libvirt/qemu /var/lib/libvirt/qemu
  if ! ours virtlogd >/dev/null; then
    rm -f "$RUN/virtlogd.pid"
    virtlogd -d -p "$RUN/virtlogd.pid" 9>&-  # the daemons must not inherit the lock
  fi
  if ! ours libvirtd >/dev/null; then
    rm -f "$RUN/libvirtd.pid"
    LIBVIRT_LOG_OUTPUTS="3:file:$RUN/libvirtd.log" libvirtd -d -p "$RUN/libvirtd.pid" 9>&-
  fi
  local t=$SECONDS
  # the first start probes QEMU's capabilities (measured: up to ~8 s here; more under load)
  until answers; do
    if ((SECONDS - t > 90)); then say "libvirtd did not answer within 90 s; see $RUN/libvirtd.log"; exit 1; fi
    ours libvirtd >/dev/null || { say "libvirtd exited; see $RUN/libvirtd.log"; tail -5 "$RUN/libvirtd.log" >&2 || true; exit 1; }
    sleep 0.2
  done
  say "libvirtd answers on $URI (pid $(ours libvirtd), virtlogd $(ours virtlogd || echo '?'))"
}

stop() {
  local d pid
  serialize
  for d in libvirtd virtlogd; do
    if pid=$(ours "$d"); then
      kill "$pid"
      for _ in $(seq 1 100); do [ -d /proc/"$pid" ] || break; sleep 0.1; done
      [ -d /proc/"$pid" ] && kill -9 "$pid"
      say "stopped $d (pid $pid)"
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
