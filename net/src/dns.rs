//! The guest's name lookups: UDP queries to slirp's DNS address (`10.0.2.3:53`, what DHCP
//! gives the guest) are taken out of the frame stream before slirp sees them (a restricted
//! slirp drops them) and sent, tagged, to the control plane's datagram socket, which answers
//! by the VM's egress policy (`boxery_proxy::dns`). Each answer comes back with its tag and is
//! made into the frame the guest expects from `10.0.2.3:53`.
//!
//! The tag ([`TAG`] bytes, echoed unchanged by the control plane) is where the answer goes:
//! the query's source MAC, IPv4 address and UDP port. The helper keeps no state per query.
//!
//! # Guarantees
//! - Only an unfragmented IPv4/UDP datagram to [`DNS_ADDR`]:[`DNS_PORT`] whose lengths agree
//!   with the frame is taken; every other frame goes to slirp unchanged.
//! - An answer shorter than a tag and a DNS header, or longer than [`MAX_ANSWER`], is dropped.
//!
//! DNS over TCP (a resolver's retry after a truncated answer, `dig +tcp`, Go's resolver) to
//! `10.0.2.3:53` is carried too, by slirp itself: restricted slirp forwards nothing to its DNS
//! address, so the helper gives the guest's TCP segments to [`DNS_TCP_ADDR`] instead
//! ([`tcp_to_forward`]), where a slirp forward connects them to the control plane's stream
//! socket, and gives slirp's answers back from `10.0.2.3` ([`tcp_from_forward`]). The guest
//! sees only `10.0.2.3`; the stream socket is the VM's own, as the datagram socket is.
//!
//! # Caveats
//! - No control plane serving the VM: a query is answered SERVFAIL by the helper itself
//!   ([`servfail`]), at once, as everything else of the guest's way out fails.

use std::net::Ipv4Addr;

/// slirp's DNS address, which DHCP hands the guest.
pub const DNS_ADDR: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 3);
/// Where the guest's TCP connections to [`DNS_ADDR`]:53 are given to slirp: an address of
/// slirp's network that is none of its own (gateway, DNS), outside its DHCP range (.15 up)
/// and not the proxy's (`.100`), whose port 53 is forwarded to the control plane.
pub const DNS_TCP_ADDR: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 53);
/// The DNS port.
pub const DNS_PORT: u16 = 53;
/// The tag before each query and answer: the guest's MAC (6), IPv4 address (4), UDP port (2).
pub const TAG: usize = 12;
/// The longest DNS answer carried back (a DNS header is 12 bytes; EDNS's common limit).
pub const MAX_ANSWER: usize = 1232;
/// The shortest DNS message (its header).
const DNS_HEADER: usize = 12;

const ETH: usize = 14;
const IPV4: usize = 20;
const UDP: usize = 8;
const ETHERTYPE_IPV4: u16 = 0x0800;
const PROTO_UDP: u8 = 17;
const PROTO_TCP: u8 = 6;
/// A TCP header's checksum offset.
const TCP_CHECKSUM: usize = 16;
/// The shortest TCP header.
const TCP_HEADER: usize = 20;

fn be16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*b.get(at)?, *b.get(at + 1)?]))
}

/// The tag and the DNS message of `frame` when it is a guest's query to [`DNS_ADDR`]:53.
pub fn query(frame: &[u8]) -> Option<([u8; TAG], &[u8])> {
    let (ihl, total) = ipv4(frame, PROTO_UDP, UDP)?;
    let ip = &frame[ETH..];
    if ip[16..20] != DNS_ADDR.octets() {
        return None;
    }
    let udp = &ip[ihl..total];
    let len = usize::from(be16(udp, 4)?);
    if be16(udp, 2)? != DNS_PORT || len < UDP + DNS_HEADER || len > udp.len() {
        return None;
    }
    let mut tag = [0u8; TAG];
    tag[..6].copy_from_slice(frame.get(6..12)?); // the sender's MAC
    tag[6..10].copy_from_slice(&ip[12..16]); // its address
    tag[10..].copy_from_slice(&udp[..2]); // its port
    Some((tag, &udp[UDP..len]))
}

/// The header length and total length of the IPv4 packet `frame` carries, when it is one
/// whole packet of protocol `proto` (not a fragment: neither MF nor an offset) with at least
/// `transport` bytes after its header, and lengths that agree with the frame.
fn ipv4(frame: &[u8], proto: u8, transport: usize) -> Option<(usize, usize)> {
    if be16(frame, 12)? != ETHERTYPE_IPV4 {
        return None;
    }
    let ip = frame.get(ETH..)?;
    let (version, ihl) = (ip.first()? >> 4, usize::from(ip[0] & 0x0f) * 4);
    let total = usize::from(be16(ip, 2)?);
    let fragmented = be16(ip, 6)? & 0x3fff != 0;
    let whole = version == 4 && ihl >= IPV4 && total >= ihl + transport && total <= ip.len();
    (whole && !fragmented && ip[9] == proto).then_some((ihl, total))
}

/// The SERVFAIL answer to `query` (its header and one question echoed, nothing looked up):
/// what the guest gets at once when no control plane answers, rather than waiting out its
/// resolver's timeouts. `None` when `query` is not one question (uncompressed, as queries are).
pub fn servfail(query: &[u8]) -> Option<Vec<u8>> {
    if query.len() < DNS_HEADER || be16(query, 4)? != 1 || query[2] & 0x80 != 0 {
        return None;
    }
    let mut at = DNS_HEADER;
    loop {
        let len = usize::from(*query.get(at)?);
        if len & 0xc0 != 0 {
            return None; // (a pointer: not in a query)
        }
        at += 1 + len;
        if len == 0 {
            break;
        }
    }
    let question = query.get(DNS_HEADER..at + 4)?;
    let mut a = Vec::with_capacity(DNS_HEADER + question.len());
    a.extend_from_slice(&query[..2]); // the id
    a.push(0x80 | (query[2] & 0x79)); // QR, the opcode and RD kept
    a.push(0x80 | 2); // RA, SERVFAIL
    a.extend_from_slice(&[0, 1, 0, 0, 0, 0, 0, 0]);
    a.extend_from_slice(question);
    Some(a)
}

/// slirp's MAC for one of its own addresses: `52:55` and the address (as slirp answers ARP).
fn mac_of(addr: Ipv4Addr) -> [u8; 6] {
    let o = addr.octets();
    [0x52, 0x55, o[0], o[1], o[2], o[3]]
}

/// The one's-complement sum of `data` as 16-bit big-endian words, added to `sum`.
fn sum16(mut sum: u32, data: &[u8]) -> u32 {
    let mut words = data.chunks_exact(2);
    for w in &mut words {
        sum += u32::from(u16::from_be_bytes([w[0], w[1]]));
    }
    if let [last] = words.remainder() {
        sum += u32::from(*last) << 8;
    }
    sum
}

fn fold(mut sum: u32) -> u16 {
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// Which end of a segment [`readdress`] moves.
#[derive(Clone, Copy)]
enum End {
    /// The destination (address at IPv4 offset 16, port at TCP offset 2).
    To,
    /// The source (address at IPv4 offset 12, port at TCP offset 0).
    From,
}

/// Move one end of an unfragmented IPv4/TCP segment of `frame` from `from`:[`DNS_PORT`] to
/// `to`:[`DNS_PORT`], both checksums adjusted (RFC 1624); whether it was such a segment.
/// Anything else (another protocol, port or address, a fragment, lengths that disagree) is
/// left as it is.
fn readdress(frame: &mut [u8], end: End, from: Ipv4Addr, to: Ipv4Addr) -> bool {
    let Some((ihl, _)) = ipv4(frame, PROTO_TCP, TCP_HEADER) else {
        return false;
    };
    let (addr_at, port_at) = match end {
        End::To => (16, 2),
        End::From => (12, 0),
    };
    let ip = &mut frame[ETH..];
    if ip[addr_at..addr_at + 4] != from.octets() || be16(ip, ihl + port_at) != Some(DNS_PORT) {
        return false;
    }
    let (old, new) = (from.octets(), to.octets());
    ip[addr_at..addr_at + 4].copy_from_slice(&new);
    for at in [10, ihl + TCP_CHECKSUM] {
        let sum = u16::from_be_bytes([ip[at], ip[at + 1]]);
        ip[at..at + 2].copy_from_slice(&adjusted(sum, old, new).to_be_bytes());
    }
    true
}

/// A checksum over data in which the 4 bytes `old` became `new` (RFC 1624, eqn. 3:
/// `HC' = ~(~HC + ~m + m')`, word by word).
fn adjusted(sum: u16, old: [u8; 4], new: [u8; 4]) -> u16 {
    let mut acc = u32::from(!sum);
    for i in [0, 2] {
        acc += u32::from(!u16::from_be_bytes([old[i], old[i + 1]]));
        acc += u32::from(u16::from_be_bytes([new[i], new[i + 1]]));
    }
    fold(acc)
}

/// A guest's TCP segment to [`DNS_ADDR`]:53, made one to [`DNS_TCP_ADDR`]:53 in place (for
/// slirp, whose forward there reaches the control plane); whether it was one.
pub fn tcp_to_forward(frame: &mut [u8]) -> bool {
    readdress(frame, End::To, DNS_ADDR, DNS_TCP_ADDR)
}

/// slirp's TCP segment from [`DNS_TCP_ADDR`]:53, made one from [`DNS_ADDR`]:53 in place (for
/// the guest, which asked `10.0.2.3`); whether it was one.
pub fn tcp_from_forward(frame: &mut [u8]) -> bool {
    readdress(frame, End::From, DNS_TCP_ADDR, DNS_ADDR)
}

/// The frame that carries `answer` (tagged as [`query`] tagged its question) from
/// [`DNS_ADDR`]:53 to the guest; `None` when it is not one.
pub fn answer_frame(tagged: &[u8]) -> Option<Vec<u8>> {
    let (tag, dns) = tagged.split_at_checked(TAG)?;
    if dns.len() < DNS_HEADER || dns.len() > MAX_ANSWER {
        return None;
    }
    let (mac, to, port) = (&tag[..6], &tag[6..10], &tag[10..12]);
    let udp_len = (UDP + dns.len()) as u16;
    let total = (IPV4 + UDP + dns.len()) as u16;
    let mut f = Vec::with_capacity(ETH + usize::from(total));
    f.extend_from_slice(mac);
    f.extend_from_slice(&mac_of(DNS_ADDR));
    f.extend_from_slice(&ETHERTYPE_IPV4.to_be_bytes());
    let ip_at = f.len();
    f.extend_from_slice(&[0x45, 0]);
    f.extend_from_slice(&total.to_be_bytes());
    f.extend_from_slice(&[0, 0, 0x40, 0, 64, PROTO_UDP, 0, 0]); // id 0, DF, TTL 64
    f.extend_from_slice(&DNS_ADDR.octets());
    f.extend_from_slice(to);
    let ip_sum = fold(sum16(0, &f[ip_at..ip_at + IPV4]));
    f[ip_at + 10..ip_at + 12].copy_from_slice(&ip_sum.to_be_bytes());
    let udp_at = f.len();
    f.extend_from_slice(&DNS_PORT.to_be_bytes());
    f.extend_from_slice(port);
    f.extend_from_slice(&udp_len.to_be_bytes());
    f.extend_from_slice(&[0, 0]);
    f.extend_from_slice(dns);
    // the pseudo-header: both addresses, the protocol, the UDP length
    let mut pseudo = sum16(0, &f[ip_at + 12..ip_at + 20]);
    pseudo += u32::from(PROTO_UDP) + u32::from(udp_len);
    let udp_sum = match fold(sum16(pseudo, &f[udp_at..])) {
        0 => 0xffff, // 0 means "no checksum" in UDP over IPv4
        s => s,
    };
    f[udp_at + 6..udp_at + 8].copy_from_slice(&udp_sum.to_be_bytes());
    Some(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GUEST_MAC: [u8; 6] = [0x52, 0x54, 0, 0x12, 0x34, 0x56];
    const GUEST: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 15);

    /// A query frame as a guest sends it, built by the same code path as an answer (an answer
    /// from the guest to slirp's address), with the ends swapped.
    fn query_frame(dns: &[u8], to: Ipv4Addr, port: u16) -> Vec<u8> {
        let mut tag = [0u8; TAG];
        tag[..6].copy_from_slice(&mac_of(DNS_ADDR));
        tag[6..10].copy_from_slice(&to.octets());
        tag[10..].copy_from_slice(&port.to_be_bytes());
        let mut f = answer_frame(&[&tag[..], dns].concat()).unwrap();
        // from the guest (MAC, address, port 40000) to `to`:port
        f[..6].copy_from_slice(&mac_of(DNS_ADDR));
        f[6..12].copy_from_slice(&GUEST_MAC);
        f[ETH + 12..ETH + 16].copy_from_slice(&GUEST.octets());
        f[ETH + 16..ETH + 20].copy_from_slice(&to.octets());
        f[ETH + IPV4..ETH + IPV4 + 2].copy_from_slice(&40000u16.to_be_bytes());
        f[ETH + IPV4 + 2..ETH + IPV4 + 4].copy_from_slice(&port.to_be_bytes());
        f
    }

    fn dns_query() -> Vec<u8> {
        // id 0x1234, RD, one question: example.com A IN
        let mut q = vec![0x12, 0x34, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0];
        q.extend_from_slice(b"\x07example\x03com\x00\x00\x01\x00\x01");
        q
    }

    #[test]
    fn a_query_to_slirps_dns_address_is_taken_with_its_tag() {
        let f = query_frame(&dns_query(), DNS_ADDR, 53);
        let (tag, q) = query(&f).expect("a DNS query");
        assert_eq!(q, dns_query());
        assert_eq!(&tag[..6], &GUEST_MAC);
        assert_eq!(&tag[6..10], &GUEST.octets());
        assert_eq!(u16::from_be_bytes([tag[10], tag[11]]), 40000);
    }

    #[test]
    fn other_frames_are_left_to_slirp() {
        assert!(query(&query_frame(&dns_query(), Ipv4Addr::new(10, 0, 2, 2), 53)).is_none());
        assert!(query(&query_frame(&dns_query(), DNS_ADDR, 5353)).is_none());
        let mut f = query_frame(&dns_query(), DNS_ADDR, 53);
        f[ETH + 9] = 6; // TCP
        assert!(query(&f).is_none());
        let mut f = query_frame(&dns_query(), DNS_ADDR, 53);
        f[ETH + 6] |= 0x20; // more fragments
        assert!(query(&f).is_none());
        let mut f = query_frame(&dns_query(), DNS_ADDR, 53);
        f[12..14].copy_from_slice(&0x86ddu16.to_be_bytes()); // IPv6
        assert!(query(&f).is_none());
        // lengths that disagree with the frame
        let f = query_frame(&dns_query(), DNS_ADDR, 53);
        assert!(query(&f[..f.len() - 1]).is_none(), "cut short");
        let mut f = query_frame(&dns_query(), DNS_ADDR, 53);
        f[ETH + IPV4 + 4..ETH + IPV4 + 6].copy_from_slice(&9000u16.to_be_bytes());
        assert!(query(&f).is_none(), "a UDP length past the datagram");
        let mut f = query_frame(&dns_query(), DNS_ADDR, 53);
        f[ETH] = 0x44; // IHL 16 bytes
        assert!(query(&f).is_none());
        for n in 0..f.len() {
            let _ = query(&f[..n]); // never panics on a short frame
        }
        // a datagram too short for a DNS header
        let mut f = query_frame(&[0; 12], DNS_ADDR, 53);
        f.truncate(ETH + IPV4 + UDP + 4);
        f[ETH + 2..ETH + 4].copy_from_slice(&((IPV4 + UDP + 4) as u16).to_be_bytes());
        f[ETH + IPV4 + 4..ETH + IPV4 + 6].copy_from_slice(&((UDP + 4) as u16).to_be_bytes());
        assert!(query(&f).is_none(), "no DNS header");
    }

    #[test]
    fn servfail_echoes_the_question() {
        let a = servfail(&dns_query()).unwrap();
        assert_eq!(&a[..2], &[0x12, 0x34], "the id");
        assert_eq!(a[2], 0x81, "a response, RD kept");
        assert_eq!(a[3] & 0x0f, 2, "SERVFAIL");
        assert_eq!(&a[4..12], &[0, 1, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&a[12..], &dns_query()[12..], "the question");
        // not a query of one question: nothing
        let mut two = dns_query();
        two[5] = 2;
        assert!(servfail(&two).is_none());
        let mut resp = dns_query();
        resp[2] |= 0x80;
        assert!(servfail(&resp).is_none());
        let q = dns_query();
        for n in 0..q.len() {
            assert!(servfail(&q[..n]).is_none(), "cut at {n}");
        }
        let mut pointer = dns_query();
        pointer[12] = 0xc0;
        assert!(servfail(&pointer).is_none());
    }

    /// A guest's TCP segment from 10.0.2.15:40000 to `to`:`port` with `payload`, both
    /// checksums right.
    fn tcp_frame(to: Ipv4Addr, port: u16, payload: &[u8]) -> Vec<u8> {
        let total = (IPV4 + 20 + payload.len()) as u16;
        let mut f = Vec::new();
        f.extend_from_slice(&mac_of(DNS_ADDR));
        f.extend_from_slice(&GUEST_MAC);
        f.extend_from_slice(&ETHERTYPE_IPV4.to_be_bytes());
        f.extend_from_slice(&[0x45, 0]);
        f.extend_from_slice(&total.to_be_bytes());
        f.extend_from_slice(&[0x12, 0x34, 0x40, 0, 64, PROTO_TCP, 0, 0]);
        f.extend_from_slice(&GUEST.octets());
        f.extend_from_slice(&to.octets());
        let sum = fold(sum16(0, &f[ETH..ETH + IPV4]));
        f[ETH + 10..ETH + 12].copy_from_slice(&sum.to_be_bytes());
        f.extend_from_slice(&40000u16.to_be_bytes());
        f.extend_from_slice(&port.to_be_bytes());
        // seq, ack, offset 5 words, PSH|ACK, window, checksum (0 for now), urgent
        f.extend_from_slice(&[
            0, 0, 0x10, 0, 0, 0, 0x20, 0, 0x50, 0x18, 0xff, 0xff, 0, 0, 0, 0,
        ]);
        f.extend_from_slice(payload);
        let sum = fold(tcp_sum(&f));
        f[ETH + IPV4 + 16..ETH + IPV4 + 18].copy_from_slice(&sum.to_be_bytes());
        f
    }

    /// The TCP checksum sum over `frame`'s pseudo-header and segment (0 folded: right).
    fn tcp_sum(frame: &[u8]) -> u32 {
        let ip = &frame[ETH..];
        let seg = &ip[IPV4..];
        let pseudo = sum16(0, &ip[12..20]) + u32::from(PROTO_TCP) + seg.len() as u32;
        sum16(pseudo, seg)
    }

    fn checksums_hold(frame: &[u8]) {
        assert_eq!(
            fold(sum16(0, &frame[ETH..ETH + IPV4])),
            0,
            "the IPv4 checksum"
        );
        assert_eq!(fold(tcp_sum(frame)), 0, "the TCP checksum");
    }

    #[test]
    fn a_tcp_lookup_goes_to_the_forward_and_its_answer_comes_from_slirps_dns_address() {
        // payloads of odd and even length, one whose checksum word is 0xffff-prone
        for payload in [&b"\x00\x1dquery"[..], b"\x00\x1cquer", &[0xff; 64]] {
            let mut f = tcp_frame(DNS_ADDR, 53, payload);
            checksums_hold(&f);
            assert!(tcp_to_forward(&mut f));
            assert_eq!(&f[ETH + 16..ETH + 20], &DNS_TCP_ADDR.octets());
            checksums_hold(&f);
            assert_eq!(&f[ETH + IPV4 + 20..], payload, "the payload untouched");
            assert!(!tcp_to_forward(&mut f), "once only");

            // slirp's answer: the ends swapped
            let mut a = f.clone();
            a.copy_within(ETH + 12..ETH + 16, ETH + 16);
            a[ETH + 12..ETH + 16].copy_from_slice(&DNS_TCP_ADDR.octets());
            a[ETH + IPV4..ETH + IPV4 + 2].copy_from_slice(&53u16.to_be_bytes());
            a[ETH + IPV4 + 2..ETH + IPV4 + 4].copy_from_slice(&40000u16.to_be_bytes());
            a[ETH + 10..ETH + 12].copy_from_slice(&[0, 0]);
            let sum = fold(sum16(0, &a[ETH..ETH + IPV4]));
            a[ETH + 10..ETH + 12].copy_from_slice(&sum.to_be_bytes());
            a[ETH + IPV4 + 16..ETH + IPV4 + 18].copy_from_slice(&[0, 0]);
            let sum = fold(tcp_sum(&a));
            a[ETH + IPV4 + 16..ETH + IPV4 + 18].copy_from_slice(&sum.to_be_bytes());
            assert!(tcp_from_forward(&mut a));
            assert_eq!(&a[ETH + 12..ETH + 16], &DNS_ADDR.octets());
            checksums_hold(&a);
        }
    }

    #[test]
    fn other_segments_are_left_as_they_are() {
        let untouched = |mut f: Vec<u8>, why: &str| {
            let before = f.clone();
            assert!(!tcp_to_forward(&mut f), "{why}");
            assert!(!tcp_from_forward(&mut f), "{why}");
            assert_eq!(f, before, "{why}");
        };
        untouched(tcp_frame(DNS_ADDR, 80, b"x"), "another port");
        untouched(
            tcp_frame(Ipv4Addr::new(10, 0, 2, 2), 53, b"x"),
            "another address",
        );
        untouched(
            query_frame(&dns_query(), DNS_ADDR, 53),
            "UDP (taken as a query instead)",
        );
        let mut frag = tcp_frame(DNS_ADDR, 53, b"x");
        frag[ETH + 6] |= 0x20; // more fragments
        untouched(frag, "a fragment");
        let mut long = tcp_frame(DNS_ADDR, 53, b"x");
        long[ETH + 2..ETH + 4].copy_from_slice(&9000u16.to_be_bytes());
        untouched(long, "a length past the frame");
        let f = tcp_frame(DNS_ADDR, 53, b"xy");
        for n in 0..f.len() - 2 {
            untouched(f[..n].to_vec(), "cut short");
        }
    }

    #[test]
    fn an_answer_frame_has_valid_checksums_and_goes_back_to_the_asker() {
        let f = query_frame(&dns_query(), DNS_ADDR, 53);
        let (tag, _) = query(&f).unwrap();
        let answer = [&tag[..], &dns_query()].concat();
        let a = answer_frame(&answer).unwrap();
        assert_eq!(&a[..6], &GUEST_MAC);
        assert_eq!(&a[6..12], &[0x52, 0x55, 10, 0, 2, 3]);
        let ip = &a[ETH..];
        assert_eq!(fold(sum16(0, &ip[..IPV4])), 0, "the IPv4 header checksum");
        assert_eq!(&ip[12..16], &DNS_ADDR.octets());
        assert_eq!(&ip[16..20], &GUEST.octets());
        let udp = &ip[IPV4..];
        let pseudo = sum16(0, &ip[12..20]) + u32::from(PROTO_UDP) + udp.len() as u32;
        assert_eq!(fold(sum16(pseudo, udp)), 0, "the UDP checksum");
        assert_eq!(be16(udp, 0), Some(53));
        assert_eq!(be16(udp, 2), Some(40000));
        assert_eq!(&udp[UDP..], &dns_query()[..]);
        // too short, too long
        assert!(answer_frame(&tag).is_none());
        assert!(answer_frame(&[&tag[..], &[0; 11]].concat()).is_none());
        assert!(answer_frame(&[&tag[..], &vec![0; MAX_ANSWER + 1]].concat()).is_none());
        assert!(answer_frame(&[&tag[..], &vec![0; MAX_ANSWER]].concat()).is_some());
    }
}
