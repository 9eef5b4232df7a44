#!/bin/bash
# serve-rss.sh BIN [N]: idle RSS of `BIN serve` with N Vms (default 1,000) on the fake backend,
# through the CLI (what `cargo bench -p boxery --bench controlplane` does, for any binary
# without building the bench): serve, `apply -f` of N Vms, wait until all are Ready, 20 s idle,
# then VmRSS and its file-backed (code) and anonymous parts. A throwaway home.
set -euo pipefail
BIN=$(readlink -f "$1"); N=${2:-1000}
H=$(mktemp -d /tmp/serve-rss.XXXXXX)
export BOXERY_HOME=$H BOXERY_BACKEND=fake
"$BIN" serve --inventory-every 5s >/dev/null 2>&1 &
P=$!
trap 'kill $P 2>/dev/null; wait $P 2>/dev/null; rm -rf "$H"' EXIT
sleep 2
rss() { echo "$1: $(grep -E '^(VmRSS|RssFile|RssAnon)' /proc/$P/status | tr -s ' \t' ' ' | paste -sd, -)"; }
rss "empty"
python3 - "$N" > "$H/vms.yaml" <<'PY'
import sys
for i in range(int(sys.argv[1])):
    print(f"---\napiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata: {{name: vm-{i:04d}}}\n"
          "spec:\n  source: {image: debian-12}\n  runStrategy: Running")
PY
t0=$(date +%s.%N)
"$BIN" apply -f "$H/vms.yaml" >/dev/null
until [ "$("$BIN" get vms -o json | python3 -c 'import json,sys; print(sum(1 for v in json.load(sys.stdin)["items"] if any(c.get("type")=="Ready" and c.get("status")=="True" for c in v.get("status",{}).get("conditions",[]))))')" = "$N" ]; do
  sleep 0.5
done
echo "converged in $(python3 -c "import time; print(round(time.time() - $t0, 2))") s"
sleep 20
rss "idle, $N Vms, 20 s after converging"
