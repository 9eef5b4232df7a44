# image/lib.sh — helpers shared by the image builders and boot-test.sh (source it; bash only).
# shellcheck shell=bash
# Nothing here touches the system: progress lines, hashing, atomic output, manifest JSON.

BOXERY_IMAGE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck disable=SC2034 # used by the scripts that source this file
BOXERY_DEFAULT_OUT=/var/cache/boxery/images

# now_ns: nanoseconds since the epoch
now_ns() { date +%s%N; }
BOXERY_T0=${BOXERY_T0:-$(now_ns)}
# secs_since NS: seconds (2 decimals) since the nanosecond timestamp NS
secs_since() { local d=$(( $(now_ns) - $1 )); printf '%d.%02d' $((d / 1000000000)) $(((d / 10000000) % 100)); }
# phase TEXT: a progress line with the seconds elapsed since the script started
phase() { printf '[%7ss] %s\n' "$(secs_since "$BOXERY_T0")" "$*"; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# sha256_of_inputs FILE...: one hash over the names (relative to the image dir) and contents
# of FILEs, followed by any extra text read from stdin (package versions, settings).
sha256_of_inputs() {
  {
    local f
    for f in "$@"; do
      printf '%s %s\n' "${f#"$BOXERY_IMAGE_DIR"/}" "$(sha256sum < "$f" | cut -d' ' -f1)"
    done
    cat
  } | sha256sum | cut -d' ' -f1
}

# layers_hash LAYERS_DIR LAYER...: the build-info layers_hash, exactly as provision.sh computes
# it: sha256 of `sha256sum provision.sh LAYER.sh...` run inside the layers dir.
layers_hash() {
  local dir=$1; shift
  local files=(provision.sh) l
  for l in "$@"; do files+=("$l.sh"); done
  (cd "$dir" && sha256sum "${files[@]}") | sha256sum | cut -d' ' -f1
}

# cache_hit OUT_DIR NAME KEY FILE...: true when OUT_DIR/NAME.json records input hash KEY and
# every listed output file exists.
cache_hit() {
  local out=$1 name=$2 key=$3; shift 3
  [ -f "$out/$name.json" ] || return 1
  grep -q "\"input_hash\": \"$key\"" "$out/$name.json" || return 1
  local f; for f in "$@"; do [ -f "$out/$f" ] || return 1; done
}

# json_str TEXT: TEXT as a JSON string literal (escapes \ " and control characters we emit)
json_str() {
  local s=$1
  s=${s//\\/\\\\}; s=${s//\"/\\\"}; s=${s//$'\n'/\\n}; s=${s//$'\t'/\\t}
  printf '"%s"' "$s"
}

# file_size FILE: size in bytes
file_size() { stat -c %s "$1"; }
# qcow2_virtual_size FILE: virtual size in bytes
qcow2_virtual_size() { qemu-img info -U "$1" | sed -n "s/^virtual size:.*(\([0-9]*\) bytes).*/\1/p" | head -1; }

# require CMD...: fail with the package hint when a host tool is missing
require() {
  local c; for c in "$@"; do
    command -v "$c" >/dev/null 2>&1 || die "missing host tool '$c': run scripts/install-deps.sh"
  done
}
