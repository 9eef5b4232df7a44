#!/bin/bash
# plumbing layer (root, idempotent): what every boxery guest needs.
#   the `agent` user (passwordless sudo, ~/.ssh and ~/.boxery), sshd settings, sysctls (no core
#   dumps, no MPTCP), cloud-init's default user = agent, /etc/profile.d/boxery.sh, tmux config,
#   socat, qemu-guest-agent; security updates (apt-get full-upgrade) unless BOXERY_NO_UPGRADE=1.
# Debian 12 packages only. `plumbing.sh --print-packages` prints the packages it installs.
set -euo pipefail
PACKAGES="sudo openssh-server qemu-guest-agent socat tmux ca-certificates procps less iputils-ping"
[ "${1:-}" = --print-packages ] && { echo $PACKAGES; exit 0; }
[ "$(id -u)" = 0 ] || { echo "plumbing: run as root" >&2; exit 1; }
export DEBIAN_FRONTEND=noninteractive
APT_OPTS=(-y -q -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)
say() { echo "plumbing: $*"; }

# --- packages ------------------------------------------------------------------------------
missing=()
for p in $PACKAGES; do
  [ "$(dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null | cut -c1-2)" = ii ] || missing+=("$p")
done
if [ "${BOXERY_NO_UPGRADE:-0}" != 1 ] || [ ${#missing[@]} -gt 0 ]; then
  say "apt-get update"; apt-get update -q
fi
if [ "${BOXERY_NO_UPGRADE:-0}" != 1 ]; then
  say "security updates (apt-get full-upgrade)"; apt-get "${APT_OPTS[@]}" full-upgrade
fi
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]}"; apt-get "${APT_OPTS[@]}" install --no-install-recommends "${missing[@]}"
fi

# --- the agent user --------------------------------------------------------------------------
if ! id agent >/dev/null 2>&1; then
  say "creating user agent"
  useradd --create-home --shell /bin/bash --comment "boxery agent" --user-group agent
fi
usermod -a -G sudo agent 2>/dev/null || true
passwd -l agent >/dev/null 2>&1 || true    # ssh keys only (sshd with PAM accepts locked accounts)
cat > /etc/sudoers.d/90-boxery-agent <<'EOS'
# boxery: the agent user has passwordless root
agent ALL=(ALL) NOPASSWD:ALL
EOS
chmod 0440 /etc/sudoers.d/90-boxery-agent
visudo -c -q -f /etc/sudoers.d/90-boxery-agent
install -d -o agent -g agent -m 0700 /home/agent/.ssh /home/agent/.boxery
install -d -m 0755 /etc/boxery

# --- sshd ------------------------------------------------------------------------------------
install -d -m 0755 /etc/ssh/sshd_config.d
cat > /etc/ssh/sshd_config.d/10-boxery.conf <<'EOS'
# boxery: keys only, many multiplexed sessions per connection (ControlMaster), no DNS lookups.
# The host key is the seed's (05-boxery-hostkey.conf, written by cloud-init from the seed).
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin no
MaxSessions 64
MaxStartups 64:30:256
UseDNS no
ClientAliveInterval 30
ClientAliveCountMax 6
EOS
if ls /etc/ssh/ssh_host_*_key /etc/ssh/boxery_host_*_key >/dev/null 2>&1; then
  sshd -t || { echo "plumbing: sshd -t failed" >&2; exit 1; }
fi

# --- sysctls and limits: no core dumps, no MPTCP ---------------------------------------------
cat > /etc/sysctl.d/90-boxery.conf <<'EOS'
kernel.core_pattern = |/bin/false
fs.suid_dumpable = 0
net.mptcp.enabled = 0
EOS
install -d /etc/security/limits.d
printf '* hard core 0\n* soft core 0\n' > /etc/security/limits.d/90-boxery.conf

# --- cloud-init: the default user is agent ---------------------------------------------------
if [ -d /etc/cloud/cloud.cfg.d ]; then
  cat > /etc/cloud/cloud.cfg.d/90-boxery-user.cfg <<'EOS'
# boxery: ssh_authorized_keys in the seed go to agent (made by the plumbing layer)
system_info:
  default_user:
    name: agent
    gecos: boxery agent
    lock_passwd: true
    groups: [sudo]
    sudo: ["ALL=(ALL) NOPASSWD:ALL"]
    shell: /bin/bash
EOS
fi

# --- shell environment, tmux -----------------------------------------------------------------
cat > /etc/profile.d/boxery.sh <<'EOS'
# boxery guest environment
export BOXERY_GUEST=1
case ":$PATH:" in *":$HOME/.local/bin:"*) ;; *) PATH="$HOME/.local/bin:$PATH" ;; esac
EOS
cat > /etc/tmux.conf <<'EOS'
# boxery
set -g history-limit 50000
set -g mouse on
set -g default-terminal "tmux-256color"
EOS

# --- qemu-guest-agent: Debian starts it from udev when the virtio port appears ----------------
systemctl enable qemu-guest-agent.service >/dev/null 2>&1 || true
say "done"
