#!/bin/sh
# udhcpc event script of the boxery tiny guest: address, default route, DNS
# shellcheck disable=SC2154 # udhcpc passes interface, ip, mask, router, dns in the environment
case "$1" in
  deconfig) ip addr flush dev "$interface"; ip link set "$interface" up ;;
  bound|renew)
    ip addr flush dev "$interface"
    ip addr add "$ip/${mask:-24}" dev "$interface"
    for r in $router; do ip route add default via "$r" dev "$interface"; done
    : > /etc/resolv.conf
    for d in $dns; do echo "nameserver $d" >> /etc/resolv.conf; done ;;
esac
exit 0
