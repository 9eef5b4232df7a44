//! "The internet" for the egress benchmarks (`proxy/benches/egress.rs`, and
//! `cli/benches/egress.rs` through `#[path]`): a listener at a public documentation address in
//! a network namespace, routed from the host over a veth pair, so it is not an address of the
//! host (the egress proxy refuses those). `GET /N` answers N bytes. Needs root; everything is
//! removed on drop (and what a killed run left, on the next `make`).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};

fn ip(args: &[&str]) -> bool {
    std::process::Command::new("ip")
        .args(args)
        .status()
        .is_ok_and(|s| s.success())
}

/// The namespace with the stand-in, removed on drop.
pub struct Net {
    netns: String,
    veth: String,
    addr: String,
}

impl Net {
    /// Namespace `netns`, veth `veth` (host side with `host_side`), the stand-in at `addr`.
    pub fn make(netns: &str, veth: &str, addr: &str, host_side: &str) -> Net {
        let _ = ip(&["link", "del", veth]);
        let _ = ip(&["netns", "del", netns]);
        let peer = format!("{veth}p");
        let net = Net {
            netns: netns.into(),
            veth: veth.into(),
            addr: addr.into(),
        };
        let (a32, h32) = (format!("{addr}/32"), format!("{host_side}/32"));
        for a in [
            vec!["netns", "add", netns],
            vec![
                "link", "add", veth, "type", "veth", "peer", "name", &peer, "netns", netns,
            ],
            vec!["-n", netns, "link", "set", "lo", "up"],
            vec!["-n", netns, "link", "set", &peer, "up"],
            vec!["link", "set", veth, "up"],
            vec!["addr", "add", &h32, "dev", veth],
            vec!["-n", netns, "addr", "add", &a32, "dev", &peer],
            vec!["route", "add", &a32, "dev", veth],
            vec!["-n", netns, "route", "add", "default", "dev", &peer],
        ] {
            assert!(
                ip(&a),
                "ip {} failed: the egress benchmarks need root (a network namespace)",
                a.join(" ")
            );
        }
        net
    }

    /// A listener inside the namespace: `GET /N` answers N bytes.
    pub fn serve(&self) -> SocketAddr {
        let (netns, addr) = (self.netns.clone(), self.addr.clone());
        let l = std::thread::spawn(move || {
            use std::os::fd::AsFd;
            let f = std::fs::File::open(format!("/run/netns/{netns}")).unwrap();
            rustix::thread::move_into_link_name_space(
                f.as_fd(),
                Some(rustix::thread::LinkNameSpaceType::Network),
            )
            .unwrap();
            TcpListener::bind((addr.as_str(), 0)).unwrap()
        })
        .join()
        .unwrap();
        let at = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for c in l.incoming() {
                let Ok(mut c) = c else { continue };
                std::thread::spawn(move || {
                    let _ = c.set_nodelay(true);
                    let mut seen = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                        match c.read(&mut buf) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => seen.extend_from_slice(&buf[..n]),
                        }
                    }
                    let line = String::from_utf8_lossy(&seen);
                    let n: usize = line
                        .split_whitespace()
                        .nth(1)
                        .and_then(|p| p.rsplit('/').next())
                        .and_then(|n| n.parse().ok())
                        .unwrap_or(0);
                    let head = format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {n}\r\nConnection: close\r\n\r\n"
                    );
                    let _ = c.write_all(head.as_bytes());
                    let chunk = vec![b'x'; 256 * 1024];
                    let mut left = n;
                    while left > 0 {
                        let k = left.min(chunk.len());
                        if c.write_all(&chunk[..k]).is_err() {
                            return;
                        }
                        left -= k;
                    }
                });
            }
        });
        at
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        let _ = ip(&["link", "del", &self.veth]);
        let _ = ip(&["netns", "del", &self.netns]);
    }
}
