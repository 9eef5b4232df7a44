#!/bin/sh
# udhcpc event script of the boxery tiny guest: address, default route, DNS. It touches IPv4
# only (flushing every address would drop the kernel's IPv6 link-local one). A renewal that
# keeps the address changes nothing (open connections are not disturbed).
# shellcheck disable=SC2154 # udhcpc passes interface, ip, mask, router, dns in the environment
log() { echo "[boxery-tiny $(cut -d' ' -f1 /proc/uptime)] $*" > /dev/console; }
case "$1" in
  deconfig) ip -4 addr flush dev "$interface"; ip link set "$interface" up ;;
  bound|renew)
    if ! ip -4 -o addr show dev "$interface" | grep -q " $ip/${mask:-24} "; then
      ip -4 addr flush dev "$interface"
      ip addr add "$ip/${mask:-24}" dev "$interface"
      for r in $router; do ip route add default via "$r" dev "$interface"; done
      log "dhcp $interface: $ip/${mask:-24}"
    fi
    : > /etc/resolv.conf.tmp
    for d in $dns; do echo "nameserver $d" >> /etc/resolv.conf.tmp; done
    mv /etc/resolv.conf.tmp /etc/resolv.conf ;;
esac
exit 0
