#!/bin/bash
# devtools layer (root, idempotent): git, python3, jq, ripgrep, fd, curl, build tools.
# Debian 12 packages only; installs only what is missing. `devtools.sh --print-packages` prints
# the packages. (The seed's node 24, pi and opencode are not Debian packages: not here yet.)
set -euo pipefail
PACKAGES="git python3 python3-venv jq ripgrep fd-find curl build-essential pkg-config unzip xz-utils file"
[ "${1:-}" = --print-packages ] && { echo $PACKAGES; exit 0; }
[ "$(id -u)" = 0 ] || { echo "devtools: run as root" >&2; exit 1; }
export DEBIAN_FRONTEND=noninteractive
. "$(dirname "$0")/lib.sh"
install_missing devtools $PACKAGES
# Debian names fd `fdfind`
[ -e /usr/local/bin/fd ] || ln -s /usr/bin/fdfind /usr/local/bin/fd
echo "devtools: done ($(git --version), $(python3 --version), rg $(rg --version | head -1 | cut -d' ' -f2))"
