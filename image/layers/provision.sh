#!/bin/bash
# boxery-provision [LAYER...] — run image layers in order (root), then record them.
# Layers: the arguments, else the words in /etc/boxery/provision, else "plumbing devtools".
# Each layer is LAYERS_DIR/NAME.sh (LAYERS_DIR: this script's folder, following symlinks, so
# /usr/local/sbin/boxery-provision -> /usr/local/lib/boxery/layers/provision.sh works).
# Writes: /etc/boxery/layers (the layers, one line), /etc/boxery/headless (when no desktop),
#   /etc/boxery/build-info (key=value: built_at, image, layers, layers_hash, kernel),
#   /var/log/boxery-provision.log, and /var/log/boxery-provision.ok when every layer succeeded.
# layers_hash = sha256 of the output of `sha256sum provision.sh lib.sh LAYER.sh...` run in
# LAYERS_DIR (lib.sh: what the layers share, sourced by them).
set -euo pipefail
[ "$(id -u)" = 0 ] || { echo "boxery-provision: run as root" >&2; exit 1; }
DIR=$(dirname "$(readlink -f "$0")")
if [ $# -gt 0 ]; then LAYERS="$*"
elif [ -s /etc/boxery/provision ]; then LAYERS=$(tr -s ' \n' ' ' < /etc/boxery/provision | sed 's/ $//')
else LAYERS="plumbing devtools"; fi
for l in $LAYERS; do
  case "$l" in *[!a-z0-9-]*|provision|lib) echo "boxery-provision: bad layer name '$l'" >&2; exit 1 ;; esac
  [ -f "$DIR/$l.sh" ] || { echo "boxery-provision: no layer $DIR/$l.sh" >&2; exit 1; }
done
mkdir -p /etc/boxery /var/log
rm -f /var/log/boxery-provision.ok
exec > >(tee -a /var/log/boxery-provision.log) 2>&1
echo "boxery-provision: layers: $LAYERS ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
for l in $LAYERS; do
  t=$(date +%s)
  echo "boxery-provision: --- $l"
  bash "$DIR/$l.sh"
  echo "boxery-provision: --- $l done in $(( $(date +%s) - t ))s"
done
echo "$LAYERS" > /etc/boxery/layers
case " $LAYERS " in *" desktop "*) rm -f /etc/boxery/headless ;; *) : > /etc/boxery/headless ;; esac
files=(provision.sh lib.sh); for l in $LAYERS; do files+=("$l.sh"); done
HASH=$(cd "$DIR" && sha256sum "${files[@]}" | sha256sum | cut -d' ' -f1)
# none in a container image (it runs on the host's kernel)
KERNEL=$(ls /lib/modules 2>/dev/null | sort -V | tail -1 || true)
{
  echo "built_at=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  [ -n "${BOXERY_IMAGE:-}" ] && echo "image=$BOXERY_IMAGE"
  echo "layers=$LAYERS"
  echo "layers_hash=$HASH"
  echo "kernel=$KERNEL"
} > /etc/boxery/build-info.tmp
mv /etc/boxery/build-info.tmp /etc/boxery/build-info
touch /var/log/boxery-provision.ok
echo "boxery-provision: ok"
