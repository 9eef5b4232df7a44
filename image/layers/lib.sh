# Sourced by the layers (not a layer itself): what they share.

# install_missing LAYER PACKAGE…: install, from Debian's archive, the packages not installed
# yet, saying so as LAYER. At build time debootstrap's --include has put them all in already
# (each layer's --print-packages), so nothing is fetched then.
install_missing() {
  local layer=$1 p
  shift
  local missing=()
  for p in "$@"; do
    [ "$(dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null | cut -c1-2)" = ii ] || missing+=("$p")
  done
  [ ${#missing[@]} -gt 0 ] || return 0
  echo "$layer: installing ${missing[*]}"
  compgen -G "/var/lib/apt/lists/*_Packages" >/dev/null || apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
}
