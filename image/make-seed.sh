#!/bin/bash
# make-seed.sh — write a boxery NoCloud seed (the contract in docs/images.md, "Seed contract")
# and pack it into an ISO with volume label `cidata`. The Rust qemu backend writes the same
# files itself; this script is the reference implementation and what boot-test.sh uses.
#
#   image/make-seed.sh --instance-id ID --hostname NAME --host-key KEYFILE \
#       --authorized-keys FILE --token FILE SEED_DIR OUT.iso
#
#   KEYFILE   an OpenSSH ed25519 private key made on the host (ssh-keygen -t ed25519 -N '');
#             KEYFILE.pub is its public half, the one the host pins
#   FILE      authorized_keys lines for `agent` (one key per line)
#   token     the per-VM proxy token (its bytes are written as they are)
# SEED_DIR gets meta-data and user-data (it is created; existing files are replaced).
set -euo pipefail
usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
IID='' HOST='' HK='' AK='' TOK=''
while [ $# -gt 0 ]; do
  case "$1" in
    --instance-id) IID=$2; shift 2 ;;
    --hostname) HOST=$2; shift 2 ;;
    --host-key) HK=$2; shift 2 ;;
    --authorized-keys) AK=$2; shift 2 ;;
    --token) TOK=$2; shift 2 ;;
    -h|--help) usage ;;
    --*) echo "make-seed.sh: unknown option $1" >&2; usage ;;
    *) break ;;
  esac
done
[ $# -eq 2 ] && [ -n "$IID" ] && [ -n "$HOST" ] && [ -n "$HK" ] && [ -n "$AK" ] && [ -n "$TOK" ] || usage
DIR=$1 ISO=$2
[ -f "$HK" ] && [ -f "$HK.pub" ] || { echo "make-seed.sh: $HK and $HK.pub must exist" >&2; exit 1; }
case "$HOST" in *[!a-zA-Z0-9-]*|-*|"") echo "make-seed.sh: hostname must be [a-zA-Z0-9-], not starting with -" >&2; exit 1 ;; esac
command -v genisoimage >/dev/null || { echo "make-seed.sh: genisoimage missing: run scripts/install-deps.sh" >&2; exit 1; }
b64() { base64 -w0 < "$1"; }
mkdir -p "$DIR"

cat > "$DIR/meta-data" <<EOM
instance-id: $IID
local-hostname: $HOST
EOM

{
cat <<EOU
#cloud-config
# boxery seed v1 (docs/images.md, "Seed contract")
hostname: $HOST
preserve_hostname: false
manage_etc_hosts: true
disable_root: true
bootcmd:
  - [cloud-init-per, instance, boxery-reset-authorized-keys, rm, -f, /home/agent/.ssh/authorized_keys]
  - [cloud-init-per, instance, boxery-machine-id, sh, -c, "rm -f /etc/machine-id /var/lib/dbus/machine-id && systemd-machine-id-setup"]
ssh_authorized_keys:
EOU
# each key double-quoted (backslash and quote escaped) so no comment can break the YAML
grep -Ev '^[[:space:]]*(#|$)' "$AK" | sed 's/\\/\\\\/g; s/"/\\"/g; s/^/  - "/; s/$/"/'
cat <<EOU
write_files:
  - path: /etc/ssh/boxery_host_ed25519_key
    permissions: '0600'
    encoding: b64
    content: $(b64 "$HK")
  - path: /etc/ssh/boxery_host_ed25519_key.pub
    permissions: '0644'
    encoding: b64
    content: $(b64 "$HK.pub")
  - path: /etc/ssh/sshd_config.d/05-boxery-hostkey.conf
    permissions: '0644'
    encoding: b64
    content: $(printf 'HostKey /etc/ssh/boxery_host_ed25519_key\n' | base64 -w0)
  - path: /home/agent/.boxery/token
    owner: agent:agent
    permissions: '0600'
    encoding: b64
    content: $(b64 "$TOK")
EOU
} > "$DIR/user-data"

rm -f "$ISO.tmp"
genisoimage -quiet -output "$ISO.tmp" -volid cidata -joliet -rock "$DIR/user-data" "$DIR/meta-data"
mv "$ISO.tmp" "$ISO"
