#!/usr/bin/env bash
# Set up boxery on a fresh Debian 12 machine and run the main job: boot a real VM from
# manifests/examples/vm.yaml and run a command in it.
#
#   scripts/setup.sh                 # qemu backend, the full Debian 12 guest (a few minutes)
#   BOXERY_BACKEND=fake scripts/setup.sh   # the same flow without VMs (seconds)
#
# Installs host packages (as root: QEMU 10 from bookworm-backports and the image builders'
# tools), builds boxery in release mode, and puts it on PATH as ~/.local/bin/boxery (or
# /usr/local/bin/boxery as root). State goes to $BOXERY_HOME (default ~/.local/share/boxery).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
step() { printf '\n== %s (%ss)\n' "$*" "$SECONDS"; }

step "host packages"
scripts/install-deps.sh

command -v cargo >/dev/null || {
  echo "cargo is missing: install Rust 1.95 or newer (https://rustup.rs) and run this again" >&2
  exit 1
}
step "build boxery (release)"
cargo build --release -p boxery -p boxery-net  # boxery-net: each VM's network (beside boxery)
bin_dir=$HOME/.local/bin
[ "$(id -u)" = 0 ] && bin_dir=/usr/local/bin
mkdir -p "$bin_dir"
ln -sf "$repo/target/release/boxery" "$bin_dir/boxery"
export PATH="$bin_dir:$PATH"
export BOXERY_IMAGE_DIR="$repo/image"
echo "boxery is $(command -v boxery) ($(boxery --version))"

step "boot dev1 from manifests/examples/vm.yaml (builds the debian-12 image on first use)"
boxery apply -f manifests/examples/vm.yaml --wait --timeout 20m
boxery get vm dev1 -o wide

step "run a command in it"
if [ "${BOXERY_BACKEND:-}" = fake ]; then
  echo "(the fake backend has no guests to run commands in)"
else
  boxery run dev1 -- uname -a
fi
step "done: try \`boxery ssh dev1\`, \`boxery snap dev1 before\`, \`boxery rm dev1 --wait\`"
