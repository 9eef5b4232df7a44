#!/bin/bash
# stress-real-vms.sh — issue 12's stress loop: the real-VM (qemu) and MCP suites, round after
# round, with more test threads than cores (parallel load), counting ssh exits 255.
#
#   scripts/stress-real-vms.sh 20 target/stress     # 20 rounds, logs and a summary there
#
# Each round's nextest output goes to LOGDIR/round-N.log; LOGDIR/rounds.txt gets one line per
# round (exit code, seconds, ssh 255 lines seen, nextest's summary). No retries: nextest.toml
# has none, so a failure is a failure. The libvirt tests are left out (they share the host's
# libvirtd with whatever else runs); the debian-12 guest tests too (minutes each).
set -u
rounds=${1:?how many rounds}
logs=${2:?a directory for the logs}
cd "$(dirname "$0")/.."
mkdir -p "$logs"
for i in $(seq 1 "$rounds"); do
  start=$(date +%s)
  cargo nextest run --features boxery/libvirt -p boxery --test real_vms --test mcp \
    --no-fail-fast --test-threads 4 -E 'not test(/^libvirt::/) and not test(debian)' \
    > "$logs/round-$i.log" 2>&1
  rc=$?
  n255=$(grep -c -E 'exit 255|status 255|exit status: 255' "$logs/round-$i.log")
  summary=$(grep -E '^ +Summary' "$logs/round-$i.log" | tail -1 | sed 's/^ *//')
  echo "round $i rc=$rc secs=$(( $(date +%s) - start )) ssh255=$n255 $summary" | tee -a "$logs/rounds.txt"
done
