#!/usr/bin/env bash
# Regenerate manifests/schemas/*.json (editor schemas, used through yaml-language-server
# modelines) from the Rust types. `cargo test` fails when they are stale.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build -q -p boxery
for kind in vm image pool lease grant; do
  target/debug/boxery schema "$kind" > "manifests/schemas/$kind.json"
done
echo "wrote manifests/schemas/{vm,image,pool,lease,grant}.json"
