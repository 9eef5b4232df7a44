#!/bin/bash
# incusd.sh — start or stop the Incus daemon by hand, on machines without systemd (PID 1 is not
# systemd: containers, these CI machines). On a systemd host use its units instead:
#   systemctl enable --now incus.socket incus.service
#
#   scripts/incusd.sh start    # start incusd unless it answers; wait until it is ready
#   scripts/incusd.sh stop     # stop the one this script started (by PID, checked by name)
#   scripts/incusd.sh status   # exit 0 when incusd answers on its socket
#
# PID file: $BOXERY_INCUSD_RUN (default /run/boxery-incusd)/incusd.pid; its log is incusd.log
# beside it. A daemon started some other way is never stopped. Stopping incusd (TERM) leaves
# running containers and the networks' dnsmasq alone, as a systemd stop does; the tests remove
# what they made before that (IncusBackend::teardown).
set -euo pipefail
RUN=${BOXERY_INCUSD_RUN:-/run/boxery-incusd}
INCUSD=${BOXERY_INCUSD:-/usr/libexec/incus/incusd}
say() { printf 'incusd.sh: %s\n' "$*" >&2; }
answers() { timeout 10 "$INCUSD" waitready --timeout 5 >/dev/null 2>&1; }

# ours: the PID in incusd.pid when that process is alive and is incusd
ours() {
  local f=$RUN/incusd.pid pid
  [ -f "$f" ] || return 1
  pid=$(cat "$f" 2>/dev/null) || return 1
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = incusd ] || return 1
  echo "$pid"
}

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
  local pid
  serialize
  if pid=$(ours); then
    kill "$pid"
    for _ in $(seq 1 150); do [ -d /proc/"$pid" ] || break; sleep 0.1; done
    [ -d /proc/"$pid" ] && kill -9 "$pid"
    say "stopped incusd (pid $pid)"
  fi
  rm -f "$RUN/incusd.pid"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) answers ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
