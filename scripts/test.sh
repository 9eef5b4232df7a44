#!/usr/bin/env bash
# The whole test suite, from a clean clone on Debian 12: installs what the tests need (host
# packages, as root), then runs every test of the workspace — unit, store, controller, fake
# backend, the CLI end to end, the crash-recovery torture test, and the real-VM tests on the
# qemu and libvirt backends and on the incus backend's system containers.
#
#   scripts/test.sh            # everything
#   scripts/test.sh -E 'test(torture)'   # extra arguments go to cargo nextest
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s (%ss)\n' "$*" "$SECONDS"; }

# Every real backend is tested: qemu (direct QEMU), libvirt (a real libvirtd, started by the
# tests through scripts/libvirtd.sh when none answers, and stopped again at the end) and incus
# (a real incusd, the same way through scripts/incusd.sh).
features=boxery-backends/qemu,boxery-backends/libvirt,boxery-backends/incus,boxery/libvirt

step "disk space"
# A full disk fails the real-VM tests one slow timeout at a time (a CI run once spent its 90
# minutes that way), so say it first. A clean test build takes about 8 GiB in target/, the
# guest images about 8 GiB in the image cache, the VMs' disks and images the tests make a few
# GiB in the temporary directory (the incus tests' containers are whole copies of a ~0.7 GiB
# tree each: a few GiB more); all on one filesystem here. BOXERY_TEST_MIN_FREE_GIB overrides
# the estimate.
images="${BOXERY_IMAGE_CACHE:-/var/cache/boxery/images}"
need=10
[ -e target/debug/boxery ] || need=$((need + 9))
[ -e "$images/debian-12-agents-docker-rust.qcow2" ] || need=$((need + 8))
need="${BOXERY_TEST_MIN_FREE_GIB:-$need}"
mkdir -p "$images"
for dir in . "$images" "${TMPDIR:-/tmp}"; do
  free=$(df -Pk "$dir" | awk 'NR == 2 { print int($4 / 1048576) }')
  if [ "$free" -lt "$need" ]; then
    mount=$(df -Pk "$dir" | awk 'NR == 2 { print $6 }')
    echo "only $free GiB free on $mount (holding $dir); the suite needs about $need GiB there." >&2
    echo "Free some (\`cargo clean\` in other checkouts, old images in $images)," \
      "or set BOXERY_TEST_MIN_FREE_GIB to run anyway." >&2
    exit 1
  fi
done
echo "enough free space (needs about $need GiB)"

step "host packages"
scripts/install-libvirt.sh
scripts/install-incus.sh

command -v cargo >/dev/null || { echo "cargo is missing: install Rust 1.95 (rustup) first" >&2; exit 1; }
runner=(cargo nextest run)
if ! cargo nextest --version >/dev/null 2>&1; then
  echo "cargo-nextest is missing; falling back to cargo test" >&2
  runner=(cargo test)
fi

step "python clients (for tests/mcp.rs, tests/api.rs and the desktop test)"
# The official MCP client drives `boxery mcp` in tests/mcp.rs, the official Kubernetes client
# drives `serve --api-listen` in tests/api.rs, Playwright drives Debian's chromium (no browser
# download) on `boxery desktop`'s page in tests/real_vms/desktop.rs; kept in a venv under target/.
# Playwright drives Debian's chromium, which only the tests need (not `scripts/setup.sh`).
if ! command -v chromium >/dev/null; then
  apt-get install -y -q --no-install-recommends chromium
fi
if ! target/mcp-venv/bin/python -c 'import mcp, jsonschema, kubernetes, playwright' 2>/dev/null; then
  python3 -m venv target/mcp-venv
  target/mcp-venv/bin/pip install -q --disable-pip-version-check mcp jsonschema kubernetes playwright
fi

step "guest images: built in the background, beside the lints and the test build"
# The real-VM tests build the guest images they boot when the cache lacks them (keyed by the
# builders' inputs, so an edit of image/ means new builds). Built by the tests, five builds
# ran at once beside the tests' TCG guests on two cores, and a test whose own image came
# last used up its 30 minutes before its first step (CI, issue 33). Built here first, one at a
# time, every test starts with its image in the cache; a cached image takes a second. The
# list is what the tests ask for; one not in it is still built by its test.
image_log=$(mktemp /tmp/boxery-test-images.XXXXXX.log)
build_images() {
  set -e
  image/build-tiny.sh "$images"
  image/build-debian.sh "$images"
  for layers in agents "agents docker rust" desktop "desktop browser"; do
    BOXERY_EXTRA_LAYERS="$layers" image/build-debian.sh "$images"
  done
  BOXERY_GUEST_KIND=container image/build-debian.sh "$images"
  image/build-cloud.sh "$images"
}
# a process group of its own (job control on for this one job), so that a run stopped early
# stops every builder in it with TERM (the builders then unmount and clean up)
set -m
build_images >"$image_log" 2>&1 &
image_pid=$!
set +m
stop_images() { [ -n "${image_pid:-}" ] && kill -TERM -- "-$image_pid" 2>/dev/null || true; }
trap stop_images EXIT
echo "building or finding them (pid $image_pid, log $image_log)"

step "format and lints"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --features "$features" -- -D warnings

step "tests"
# The libvirt tests start libvirtd (and its default network) when they are not up, but none of
# them knows it is the last: afterwards, stop what was not running before the suite.
libvirtd_was_up=no; net_was_up=no; incusd_was_up=no
if scripts/libvirtd.sh status; then
  libvirtd_was_up=yes
  virsh -q -c qemu:///system net-info default 2>/dev/null | grep -q '^Active: *yes' && net_was_up=yes
fi
scripts/incusd.sh status && incusd_was_up=yes
cleanup_daemons() {
  [ "$net_was_up" = yes ] || virsh -q -c qemu:///system net-destroy default >/dev/null 2>&1 || true
  [ "$libvirtd_was_up" = yes ] || scripts/libvirtd.sh stop || true
  # every incus test tears down what its home made (instances, projects, network, pool)
  [ "$incusd_was_up" = yes ] || scripts/incusd.sh stop || true
}
trap 'stop_images; cleanup_daemons' EXIT
# the test binaries first (the same build nextest runs), then the images they need
cargo test --workspace --features "$features" --no-run --quiet
step "waiting for the guest images (log: $image_log)"
if ! wait "$image_pid"; then
  image_pid=
  echo "building the guest images failed; the end of $image_log:" >&2
  tail -n 30 "$image_log" >&2
  exit 1
fi
image_pid=
grep -E '\] (up to date|done)' "$image_log" || tail -n 8 "$image_log"
if [ "${runner[1]}" = nextest ]; then
  cargo nextest run --workspace --features "$features" --no-fail-fast "$@"
else
  cargo test --workspace --features "$features" --no-fail-fast "$@"
fi
step "done"
