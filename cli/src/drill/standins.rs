//! The host side of a drill: the listeners (each answering with this run's nonce), the
//! stand-ins' network namespace, and the controls from the host.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result};

use super::{HOST_SIDE, INTERNET, INTERNET6, LAN, METADATA, NETNS, VETH};

/// The listeners' answer, with this run's nonce.
pub(super) fn response(nonce: &str) -> Vec<u8> {
    let body = format!("boxery-drill-{nonce}\n");
    format!(
        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Serve `l` in a thread: every connection gets the nonce response, then is closed.
pub(super) fn serve(l: TcpListener, reply: Vec<u8>) {
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { continue };
            let reply = reply.clone();
            std::thread::spawn(move || {
                // The request first (every probe sends one): an HTTP client that gets its
                // answer before it has sent its request may call that an error.
                let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
                let mut seen = Vec::new();
                let mut buf = [0u8; 4096];
                while !seen.windows(4).any(|w| w == b"\r\n\r\n") && seen.len() < 16384 {
                    match c.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => seen.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = c.write_all(&reply);
            });
        }
    });
}

/// The stand-ins' network namespace and its veth pair, removed on drop: a listener there is
/// reached through a route, not at an address of the host (the egress proxy refuses the
/// host's own addresses, whatever their range).
pub(super) struct Standins {
    /// Whether the IPv6 stand-in is there.
    pub(super) v6: bool,
}

fn ip(args: &[&str]) -> std::io::Result<std::process::Output> {
    std::process::Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
}

impl Standins {
    pub(super) fn make() -> Result<Standins, String> {
        // Ones left by a killed drill are ours by name.
        let _ = ip(&["link", "del", VETH]);
        let _ = ip(&["netns", "del", NETNS]);
        let run = |args: &[&str]| -> Result<(), String> {
            let o = ip(args).map_err(|e| format!("cannot run ip: {e}"))?;
            if o.status.success() {
                Ok(())
            } else {
                Err(format!(
                    "ip {}: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&o.stderr).trim()
                ))
            }
        };
        run(&["netns", "add", NETNS])?;
        // From here on, dropping `d` removes what was made.
        let mut d = Standins { v6: false };
        let peer = format!("{VETH}p");
        run(&[
            "link", "add", VETH, "type", "veth", "peer", "name", &peer, "netns", NETNS,
        ])?;
        run(&["-n", NETNS, "link", "set", "lo", "up"])?;
        run(&["-n", NETNS, "link", "set", &peer, "up"])?;
        run(&["link", "set", VETH, "up"])?;
        // The host's side has an address of its own (TEST-NET-2), so traffic NATed from a
        // guest network (libvirt) has a source to take on the way in.
        run(&["addr", "add", &format!("{HOST_SIDE}/32"), "dev", VETH])?;
        for a in [INTERNET, LAN, METADATA] {
            run(&["-n", NETNS, "addr", "add", &format!("{a}/32"), "dev", &peer])?;
            run(&["route", "add", &format!("{a}/32"), "dev", VETH])?;
        }
        run(&["-n", NETNS, "route", "add", "default", "dev", &peer])?;
        d.v6 = run(&[
            "-6",
            "addr",
            "add",
            "2001:db8:77::1/64",
            "dev",
            VETH,
            "nodad",
        ])
        .is_ok()
            && run(&[
                "-n",
                NETNS,
                "-6",
                "addr",
                "add",
                &format!("{INTERNET6}/64"),
                "dev",
                &peer,
                "nodad",
            ])
            .is_ok();
        Ok(d)
    }

    /// Bind `addrs` inside the namespace (a thread of its own enters it; the sockets stay
    /// there).
    pub(super) fn bind(&self, addrs: Vec<SocketAddr>) -> Result<Vec<TcpListener>> {
        std::thread::spawn(move || -> Result<Vec<TcpListener>> {
            use std::os::fd::AsFd;
            let f = std::fs::File::open(format!("/run/netns/{NETNS}"))
                .context("cannot open the drill's network namespace")?;
            rustix::thread::move_into_link_name_space(
                f.as_fd(),
                Some(rustix::thread::LinkNameSpaceType::Network),
            )
            .context("cannot enter the drill's network namespace")?;
            addrs
                .iter()
                .map(|a| TcpListener::bind(a).with_context(|| format!("cannot listen on {a}")))
                .collect()
        })
        .join()
        .map_err(|_| anyhow::anyhow!("the namespace thread panicked"))?
    }
}

impl Drop for Standins {
    fn drop(&mut self) {
        let _ = ip(&["link", "del", VETH]);
        let _ = ip(&["netns", "del", NETNS]);
    }
}

/// The host's first global IPv4 address (not the drill's own).
pub(super) fn host_address() -> Option<IpAddr> {
    let o = ip(&["-o", "-4", "addr", "show", "scope", "global"]).ok()?;
    String::from_utf8_lossy(&o.stdout).lines().find_map(|l| {
        let mut w = l.split_whitespace();
        let dev = w.nth(1)?;
        if dev == VETH {
            return None;
        }
        let cidr = w.skip_while(|x| *x != "inet").nth(1)?;
        cidr.split('/').next()?.parse().ok()
    })
}

/// Connect from the host and read: whether `nonce` (or an ssh banner) came back.
pub(super) fn host_reaches(addr: SocketAddr, ssh: bool, nonce: &str) -> bool {
    let Ok(mut c) = TcpStream::connect_timeout(&addr, Duration::from_secs(3)) else {
        return false;
    };
    let _ = c.set_read_timeout(Some(Duration::from_secs(3)));
    if !ssh {
        let _ = c.write_all(b"GET / HTTP/1.0\r\n\r\n");
    }
    let mut buf = vec![0u8; 512];
    let n = c.read(&mut buf).unwrap_or(0);
    let got = String::from_utf8_lossy(&buf[..n]);
    if ssh {
        got.starts_with("SSH-")
    } else {
        got.contains(&format!("boxery-drill-{nonce}"))
    }
}
