#!/bin/bash
# rust layer (root, idempotent): Rust and cargo from Debian 12's packages: `rustc-web` and
# `cargo-web`, the toolchain Debian keeps current in bookworm for its browsers (1.85 in
# bookworm, newer from bookworm-security, which the image's security updates bring), as
# /usr/bin/rustc, /usr/bin/cargo and /usr/bin/rustdoc. (Debian's plain `cargo` package is
# 0.66, too old for today's crates and the sparse crates.io index.)
# Debian 12 packages only. `rust.sh --print-packages` prints the packages.
set -euo pipefail
PACKAGES="rustc-web cargo-web"
[ "${1:-}" = --print-packages ] && { echo $PACKAGES; exit 0; }
[ "$(id -u)" = 0 ] || { echo "rust: run as root" >&2; exit 1; }
export DEBIAN_FRONTEND=noninteractive
. "$(dirname "$0")/lib.sh"
install_missing rust $PACKAGES
# The toolchain's libraries carry its version in their package names, so the security update
# to a newer rustc-web installs beside the one debootstrap put in (libstd-rust-web-1.85,
# libllvm19) instead of replacing it: hand those to apt as removable, and remove what nothing
# needs any more (0.2 GiB of the disk)
old=$(dpkg-query -W -f='${Package}\n' 'libstd-rust-web-1.*' 'libllvm*' 2>/dev/null || true)
if [ -n "$old" ]; then
  apt-mark auto $old >/dev/null
  apt-get autoremove -y -q --purge
fi
echo "rust: done ($(rustc --version), $(cargo --version))"
