#!/usr/bin/env bash
# Regenerate manifests/schemas/*.json (editor schemas, used through yaml-language-server
# modelines) from the Rust types. `cargo test` fails when they are stale.
set -euo pipefail
cd "$(dirname "$0")/.."
# the features the test suite builds with (scripts/test.sh): the same binary, no second build
cargo build -q -p boxery --features boxery-backends/qemu,boxery-backends/libvirt,boxery/libvirt
for kind in vm image pool lease grant; do
  target/debug/boxery schema "$kind" > "manifests/schemas/$kind.json"
done
echo "wrote manifests/schemas/{vm,image,pool,lease,grant}.json"
