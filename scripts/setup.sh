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
# The guest image is built beside boxery (it is mostly downloads and disk work, the build is
# compiling): into the cache boxery reads, so the apply below finds it made. It is cached by a
# hash of its inputs, so this is instant once it was built.
image_pid=""
image_log=""
if [ "${BOXERY_BACKEND:-qemu}" != fake ] && [ "$(id -u)" = 0 ]; then
  image_log=$(mktemp /tmp/boxery-image-build.XXXXXX.log)
  step "the debian-12 guest image: building in the background (log: $image_log)"
  image/build-debian.sh "${BOXERY_IMAGE_CACHE:-/var/cache/boxery/images}" >"$image_log" 2>&1 &
  image_pid=$!
  trap '[ -n "$image_pid" ] && kill -0 "$image_pid" 2>/dev/null && echo "setup: the image build goes on in the background (pid $image_pid, log $image_log)" >&2' EXIT
fi

step "build boxery (release)"
cargo build --release -p boxery -p boxery-net  # boxery-net: each VM's network (beside boxery)
if [ -n "$image_pid" ]; then
  step "waiting for the debian-12 guest image"
  if ! wait "$image_pid"; then
    image_pid=""
    tail -n 30 "$image_log" >&2
    echo "setup: building the debian-12 image failed (the whole log: $image_log)" >&2
    exit 1
  fi
  image_pid=""
  tail -n 2 "$image_log"
fi
bin_dir=$HOME/.local/bin
[ "$(id -u)" = 0 ] && bin_dir=/usr/local/bin
mkdir -p "$bin_dir"
ln -sf "$repo/target/release/boxery" "$bin_dir/boxery"
export PATH="$bin_dir:$PATH"
export BOXERY_IMAGE_DIR="$repo/image"
echo "boxery is $(command -v boxery) ($(boxery --version))"

step "boot dev1 from manifests/examples/vm.yaml"
boxery apply -f manifests/examples/vm.yaml --wait --timeout 20m
boxery get vm dev1 -o wide

step "run a command in it"
if [ "${BOXERY_BACKEND:-}" = fake ]; then
  echo "(the fake backend has no guests to run commands in)"
else
  boxery run dev1 -- uname -a
fi
step "done: try \`boxery ssh dev1\`, \`boxery snap dev1 before\`, \`boxery rm dev1 --wait\`"
