#!/usr/bin/env bash
# The whole test suite, from a clean clone on Debian 12: installs what the tests need (host
# packages, as root), then runs every test of the workspace — unit, store, controller, fake
# backend, the CLI end to end, the crash-recovery torture test, and the real-QEMU tests.
#
#   scripts/test.sh            # everything
#   scripts/test.sh -E 'test(torture)'   # extra arguments go to cargo nextest
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s (%ss)\n' "$*" "$SECONDS"; }

# The libvirt backend's tests need a libvirtd (started by the tests) and libvirt-dev; they
# join the suite with BOXERY_TEST_LIBVIRT=1 until they pass reliably (issue 6 is open).
features=boxery-backends/qemu
step "host packages"
if [ "${BOXERY_TEST_LIBVIRT:-}" = 1 ]; then
  scripts/install-libvirt.sh
  features=boxery-backends/qemu,boxery-backends/libvirt
else
  scripts/install-deps.sh
fi

command -v cargo >/dev/null || { echo "cargo is missing: install Rust 1.95 (rustup) first" >&2; exit 1; }
runner=(cargo nextest run)
if ! cargo nextest --version >/dev/null 2>&1; then
  echo "cargo-nextest is missing; falling back to cargo test" >&2
  runner=(cargo test)
fi

step "python MCP SDK (for tests/mcp.rs)"
# The official MCP client drives `boxery mcp` in tests/mcp.rs; kept in a venv under target/.
if ! target/mcp-venv/bin/python -c 'import mcp, jsonschema' 2>/dev/null; then
  python3 -m venv target/mcp-venv
  target/mcp-venv/bin/pip install -q --disable-pip-version-check mcp jsonschema
fi

step "format and lints"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --features "$features" -- -D warnings

step "tests"
if [ "${BOXERY_TEST_LIBVIRT:-}" = 1 ]; then
  # The libvirt tests start libvirtd (scripts/libvirtd.sh) but none of them knows it is the
  # last: stop it, and the default network's dnsmasq, when the suite ends.
  trap 'virsh -c qemu:///system net-destroy default >/dev/null 2>&1 || true; scripts/libvirtd.sh stop || true' EXIT
fi
if [ "${runner[1]}" = nextest ]; then
  cargo nextest run --workspace --features "$features" --no-fail-fast "$@"
else
  cargo test --workspace --features "$features" --no-fail-fast "$@"
fi
step "done"
