//! `boxery drill VM`: the isolation drill (docs/egress.md). Probes run live from inside the
//! VM against listeners the drill opens on the host, each "blocked" probe beside a control
//! that shows the probe itself works (the same connection from the host, or an allowed
//! target), and a table of probe, expected, result, control. Exit 0 only when every probe
//! matched and every control worked.
//!
//! # Guarantees
//! - Every listener answers with a nonce new to this run: a probe counts as having reached
//!   it only by reading that nonce, so nothing else listening can pass for it.
//! - The stand-ins for the internet (203.0.113.10, 2001:db8:77::10, documentation ranges),
//!   a LAN (10.255.77.10) and a metadata service (169.254.77.77: in 169.254/16, not the real
//!   169.254.169.254) listen in a network namespace `boxery-drill`, routed from the host over
//!   a veth pair `bxdrill0`, both made by the drill and removed after it (also
//!   one left by a killed drill); drills on one host take turns (a lock under `/run/lock`).
//!   Without the privilege to make it, those probes are skipped, which fails the drill.
//! - All guest probes run at once, each within [`PROBE_SECS`]: a drill takes seconds.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use boxery_api::Vm;
use boxery_api::network::EgressPolicy;
use boxery_hands::{Voice, shell_quote};
use boxery_store::Store;

/// Each probe's time limit in the guest, in seconds.
pub const PROBE_SECS: u32 = 4;
/// The host side of the stand-ins' veth pair.
pub const VETH: &str = "bxdrill0";
/// The stand-ins' network namespace.
pub const NETNS: &str = "boxery-drill";
/// The internet stand-in (TEST-NET-3: public-range, routed nowhere).
pub const INTERNET: &str = "203.0.113.10";
/// The IPv6 internet stand-in (documentation range).
pub const INTERNET6: &str = "2001:db8:77::10";
/// The host side of the veth pair.
pub const HOST_SIDE: &str = "198.51.100.1";
/// The LAN stand-in.
pub const LAN: &str = "10.255.77.10";
/// The metadata stand-in (link-local, like 169.254.169.254, which the drill leaves alone).
pub const METADATA: &str = "169.254.77.77";
/// A name nothing lists.
pub const UNLISTED: &str = "unlisted.drill.invalid";

/// What a probe should find.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// It reaches the listener.
    Reached,
    /// The connection goes nowhere.
    Blocked,
    /// The egress proxy refuses it (403, `x-boxery-egress: denied`).
    Denied,
    /// The egress proxy lets it through its policy (anything but a policy refusal).
    Passed,
    /// No answer (a name lookup).
    NoAnswer,
    /// An answer (a name lookup).
    Answer,
    /// The credential proxy refuses it: 401.
    Unauthorized,
    /// The credential proxy accepts the token (anything but 401).
    Authorized,
}

impl Expect {
    fn word(self) -> &'static str {
        match self {
            Expect::Reached => "reached",
            Expect::Blocked => "blocked",
            Expect::Denied => "denied",
            Expect::Passed => "passed",
            Expect::NoAnswer => "no answer",
            Expect::Answer => "answer",
            Expect::Unauthorized => "401",
            Expect::Authorized => "token ok",
        }
    }
}

/// How a guest probe is made.
#[derive(Debug, Clone)]
enum How {
    /// A TCP connection to host:port, sending an HTTP GET (so a listener answers).
    Direct(String, u16),
    /// An absolute-form GET through the egress proxy.
    Get(String, u16),
    /// A CONNECT through the egress proxy.
    Connect(String, u16),
    /// A name lookup in the guest.
    Lookup(String),
    /// A credential-proxy request, with the VM's token or without.
    Token(bool),
}

/// What shows a blocked probe is not a broken probe.
#[derive(Debug, Clone)]
enum Control {
    /// The same target from the host reaches it (reads the nonce, or `SSH-`).
    Host(SocketAddr, bool),
    /// Another probe of this drill (by name) got through.
    Probe(&'static str),
    /// None needed (the probe shows a thing reached).
    None,
}

#[derive(Debug, Clone)]
struct Probe {
    name: String,
    key: &'static str,
    how: How,
    expect: Expect,
    control: Control,
}

/// One row of the table.
#[derive(Debug, Clone)]
pub struct Row {
    /// What was probed.
    pub probe: String,
    /// What should happen.
    pub expected: String,
    /// What happened.
    pub result: String,
    /// The control's outcome.
    pub control: String,
    /// Whether the row passes.
    pub ok: bool,
}

/// The listeners' answer, with this run's nonce.
fn response(nonce: &str) -> Vec<u8> {
    let body = format!("boxery-drill-{nonce}\n");
    format!(
        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Serve `l` in a thread: every connection gets the nonce response, then is closed.
fn serve(l: TcpListener, reply: Vec<u8>) {
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
struct Standins {
    v6: bool,
}

fn ip(args: &[&str]) -> std::io::Result<std::process::Output> {
    std::process::Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
}

impl Standins {
    fn make() -> Result<Standins, String> {
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
    fn bind(&self, addrs: Vec<SocketAddr>) -> Result<Vec<TcpListener>> {
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
fn host_address() -> Option<IpAddr> {
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
fn host_reaches(addr: SocketAddr, ssh: bool, nonce: &str) -> bool {
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

/// The guest script: every probe at once, each output in its own file, then all of them.
fn script(probes: &[Probe], proxy: &str) -> String {
    let (phost, pport) = split_hostport(proxy);
    let mut s = format!(
        "T={PROBE_SECS}; P={}; PP={}; d=$(mktemp -d); \n\
         tcp() {{ if command -v nc >/dev/null 2>&1; then {{ printf \"$3\"; sleep $T; }} | timeout $T nc -w $T \"$1\" \"$2\" 2>&1 | head -c 600; \
         elif command -v bash >/dev/null 2>&1; then timeout $T bash -c 'exec 3<>/dev/tcp/$0/$1 && printf \"$2\" >&3 && head -c 600 <&3' \"$1\" \"$2\" \"$3\" 2>&1; \
         else echo 'no nc or bash in the guest'; fi; }}\n\
         lookup() {{ if command -v getent >/dev/null 2>&1; then timeout $T getent hosts \"$1\" && echo ANSWERED; \
         else o=$(timeout $T nc -w 1 \"$1\" 9 </dev/null 2>&1); echo \"$o\"; case \"$o\" in *'bad address'*|'') ;; *'('*')'*) echo ANSWERED;; esac; fi; }}\n\
         auth=''; if [ -n \"${{BOXERY_TOKEN:-}}\" ]; then auth=\"Proxy-Authorization: Bearer $BOXERY_TOKEN\\r\\n\"; fi\n",
        shell_quote(phost),
        pport,
    );
    for (i, p) in probes.iter().enumerate() {
        let cmd = match &p.how {
            How::Direct(h, port) => {
                format!("tcp {} {port} 'GET / HTTP/1.0\\r\\n\\r\\n'", shell_quote(h))
            }
            How::Get(h, port) => {
                let hp = hostport(h, *port);
                format!(
                    "tcp \"$P\" \"$PP\" \"GET http://{hp}/ HTTP/1.1\\r\\nHost: {hp}\\r\\n${{auth}}Connection: close\\r\\n\\r\\n\""
                )
            }
            How::Connect(h, port) => {
                let hp = hostport(h, *port);
                format!(
                    "tcp \"$P\" \"$PP\" \"CONNECT {hp} HTTP/1.1\\r\\nHost: {hp}\\r\\n${{auth}}\\r\\nGET / HTTP/1.0\\r\\n\\r\\n\""
                )
            }
            How::Lookup(n) => format!("lookup {}", shell_quote(n)),
            How::Token(with) => {
                let h = if *with {
                    "x-boxery-token: ${BOXERY_TOKEN:-none}\\r\\n"
                } else {
                    ""
                };
                format!(
                    "tcp \"$P\" \"$PP\" \"GET /llm/anthropic/v1/models HTTP/1.1\\r\\nHost: $P\\r\\n{h}Connection: close\\r\\n\\r\\n\""
                )
            }
        };
        s.push_str(&format!("( {cmd} ) > \"$d/{i}\" 2>&1 &\n"));
    }
    s.push_str("wait\n");
    for i in 0..probes.len() {
        s.push_str(&format!(
            "printf '\\n=== {i}\\n'; tr -d '\\r' < \"$d/{i}\"\n"
        ));
    }
    s.push_str("rm -rf \"$d\"\n");
    s
}

fn hostport(h: &str, port: u16) -> String {
    if h.contains(':') {
        format!("[{h}]:{port}")
    } else {
        format!("{h}:{port}")
    }
}

fn split_hostport(url: &str) -> (&str, u16) {
    let hp = url
        .trim_start_matches("http://")
        .rsplit('@')
        .next()
        .unwrap_or_default()
        .trim_end_matches('/');
    match hp.rsplit_once(':') {
        Some((h, p)) => (h, p.parse().unwrap_or(80)),
        None => (hp, 80),
    }
}

/// What a probe's output says.
fn outcome(out: &str, nonce: &str, how: &How) -> Expect {
    let status = out
        .lines()
        .find(|l| l.starts_with("HTTP/1."))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or("");
    match how {
        How::Lookup(_) => {
            if out.contains("ANSWERED") {
                Expect::Answer
            } else {
                Expect::NoAnswer
            }
        }
        How::Token(_) => {
            if status == "401" {
                Expect::Unauthorized
            } else if status.is_empty() {
                Expect::Blocked
            } else {
                Expect::Authorized
            }
        }
        _ if out.contains(&format!("boxery-drill-{nonce}")) => Expect::Reached,
        How::Get(..) | How::Connect(..)
            if out.to_ascii_lowercase().contains("x-boxery-egress: denied") =>
        {
            Expect::Denied
        }
        How::Get(..) | How::Connect(..) if !status.is_empty() => Expect::Passed,
        _ => Expect::Blocked,
    }
}

/// Whether `got` satisfies `want`.
fn matches(want: Expect, got: Expect) -> bool {
    match want {
        Expect::Passed => matches!(got, Expect::Passed | Expect::Reached),
        _ => want == got,
    }
}

/// Run the drill against `vm` (and a sibling): the table's rows.
pub fn run(home: &Path, store: &Store, vm: &str, sibling: Option<&str>) -> Result<Vec<Row>> {
    let v = store
        .get_as::<Vm>(vm)?
        .with_context(|| format!("VM {vm} not found"))?;
    let backend = v.status.backend.clone().unwrap_or_default();
    let reach = boxery_hands::reach(home, store, vm, Voice::Cli)?;
    let policy = v.spec.network.egress.clone();
    // The guest side: where it reaches the host and the proxy (waited for, bounded, before
    // the host-wide lock is taken).
    let proxy = home_proxy_url(&reach, vm)?;
    // Drills on one host take turns: the stand-ins are host-wide.
    std::fs::create_dir_all("/run/lock").ok();
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open("/run/lock/boxery-drill.lock")
        .or_else(|_| {
            std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(home.join("drill.lock"))
        })
        .context("cannot open the drill's lock")?;
    lock.lock().context("cannot take the drill's lock")?;
    let nonce = boxery_backends::identity::proxy_token();
    let nonce = nonce.trim_start_matches("bxt_")[..16].to_string();
    let reply = response(&nonce);
    let listen = |a: SocketAddr| -> Result<SocketAddr> {
        let l = TcpListener::bind(a).with_context(|| format!("cannot listen on {a}"))?;
        let at = l.local_addr()?;
        serve(l, reply.clone());
        Ok(at)
    };
    let standins = Standins::make();
    let gateway = match backend.as_str() {
        "qemu" => "10.0.2.2".to_string(),
        _ => split_hostport(&proxy).0.to_string(),
    };
    let direct_public = backend != "qemu" && policy.policy == EgressPolicy::Public;
    let via = |allowed: bool| {
        if allowed {
            Expect::Reached
        } else {
            Expect::Denied
        }
    };
    let mut probes: Vec<Probe> = Vec::new();
    let mut skipped: Vec<(String, String)> = Vec::new();

    // The host's loopback.
    let lo = listen("127.0.0.1:0".parse()?)?;
    probes.push(Probe {
        name: format!("host loopback {lo}, direct via {gateway}"),
        key: "lo-direct",
        how: How::Direct(gateway.clone(), lo.port()),
        expect: Expect::Blocked,
        control: Control::Host(lo, false),
    });
    probes.push(Probe {
        name: format!("host loopback {lo}, through the egress proxy"),
        key: "lo-proxy",
        how: How::Get("127.0.0.1".into(), lo.port()),
        expect: Expect::Denied,
        control: Control::Host(lo, false),
    });
    probes.push(Probe {
        name: format!(
            "localhost:{} (a name that resolves to loopback), proxy",
            lo.port()
        ),
        key: "rebind",
        how: How::Get("localhost".into(), lo.port()),
        expect: Expect::Denied,
        control: Control::Host(lo, false),
    });
    // The host's other address.
    match host_address() {
        Some(h) => {
            let a = listen(SocketAddr::new(h, 0))?;
            probes.push(Probe {
                name: format!("host address {a}, direct"),
                key: "host-direct",
                how: How::Direct(h.to_string(), a.port()),
                expect: Expect::Blocked,
                control: Control::Host(a, false),
            });
            probes.push(Probe {
                name: format!("host address {a}, through the egress proxy"),
                key: "host-proxy",
                how: How::Get(h.to_string(), a.port()),
                expect: Expect::Denied,
                control: Control::Host(a, false),
            });
        }
        None => skipped.push((
            "host address".into(),
            "the host has no global IPv4 address".into(),
        )),
    }
    // Another guest's sshd.
    let sib = match sibling {
        Some(s) => store.get_as::<Vm>(s)?.filter(|s| s.metadata.name != vm),
        None => store
            .list_as::<Vm>(&Default::default())?
            .into_iter()
            .find(|s| {
                s.metadata.name != vm
                    && s.status.backend.as_deref() == Some(backend.as_str())
                    && boxery_hands::not_ready(s, Voice::Cli).is_none()
            }),
    };
    match sib.as_ref().and_then(|s| {
        boxery_hands::ssh::Target::of(s).map(|t| (s.metadata.name.clone(), t.endpoint))
    }) {
        Some((sname, endpoint)) => {
            let sa: SocketAddr = endpoint
                .parse()
                .with_context(|| format!("VM {sname}'s ssh endpoint {endpoint}"))?;
            let (dh, dp) = if backend == "qemu" {
                (gateway.clone(), sa.port())
            } else {
                (sa.ip().to_string(), sa.port())
            };
            probes.push(Probe {
                name: format!("VM {sname}'s sshd ({endpoint}), direct"),
                key: "sib-direct",
                how: How::Direct(dh, dp),
                expect: Expect::Blocked,
                control: Control::Host(sa, true),
            });
            probes.push(Probe {
                name: format!("VM {sname}'s sshd ({endpoint}), through the egress proxy"),
                key: "sib-proxy",
                how: How::Connect(sa.ip().to_string(), sa.port()),
                expect: Expect::Denied,
                control: Control::Host(sa, true),
            });
            probes.push(Probe {
                name: format!("name lookup of VM {sname}"),
                key: "sib-dns",
                how: How::Lookup(sname.clone()),
                expect: Expect::NoAnswer,
                control: Control::Probe("dns-control"),
            });
            probes.push(Probe {
                name: "name lookup of localhost (the lookup works)".into(),
                key: "dns-control",
                how: How::Lookup("localhost".into()),
                expect: Expect::Answer,
                control: Control::None,
            });
        }
        None => skipped.push((
            "another VM".into(),
            format!(
                "no other ready VM on the {backend} backend: start one or name it with --sibling"
            ),
        )),
    }
    // The stand-ins.
    match &standins {
        Ok(d) => {
            let mut want = vec![
                SocketAddr::new(LAN.parse()?, 0),
                SocketAddr::new(METADATA.parse()?, 0),
                SocketAddr::new(INTERNET.parse()?, 0),
            ];
            if d.v6 {
                want.push(SocketAddr::new(INTERNET6.parse()?, 0));
            }
            let mut bound = Vec::new();
            for l in d.bind(want)? {
                bound.push(l.local_addr()?);
                serve(l, reply.clone());
            }
            let (lan, md, net) = (bound[0], bound[1], bound[2]);
            for (what, a) in [("LAN stand-in", lan), ("metadata stand-in", md)] {
                probes.push(Probe {
                    name: format!("{what} {a}, direct"),
                    key: "private-direct",
                    how: How::Direct(a.ip().to_string(), a.port()),
                    expect: Expect::Blocked,
                    control: Control::Host(a, false),
                });
                probes.push(Probe {
                    name: format!("{what} {a}, through the egress proxy"),
                    key: "private-proxy",
                    how: How::Get(a.ip().to_string(), a.port()),
                    expect: Expect::Denied,
                    control: Control::Host(a, false),
                });
            }
            probes.push(Probe {
                name: format!("internet stand-in {net}, direct (raw TCP)"),
                key: "net-direct",
                how: How::Direct(INTERNET.into(), net.port()),
                expect: if direct_public {
                    Expect::Reached
                } else {
                    Expect::Blocked
                },
                control: Control::Host(net, false),
            });
            let public = policy.policy == EgressPolicy::Public;
            probes.push(Probe {
                name: format!("internet stand-in {net}, GET through the egress proxy"),
                key: "net-get",
                how: How::Get(INTERNET.into(), net.port()),
                expect: via(public),
                control: Control::Host(net, false),
            });
            probes.push(Probe {
                name: format!("internet stand-in {net}, CONNECT through the egress proxy"),
                key: "net-connect",
                how: How::Connect(INTERNET.into(), net.port()),
                expect: via(public),
                control: Control::Host(net, false),
            });
            if let Some(&net6) = bound.get(3) {
                probes.push(Probe {
                    name: format!("IPv6 internet stand-in {net6}, direct"),
                    key: "v6-direct",
                    how: How::Direct(INTERNET6.into(), net6.port()),
                    expect: Expect::Blocked,
                    control: Control::Host(net6, false),
                });
            } else {
                skipped.push(("IPv6".into(), "the host has IPv6 off".into()));
            }
            // Names through the policy.
            let allowed = policy.allow.first().map(|a| match a.strip_prefix("*.") {
                Some(s) => format!("drill.{s}"),
                None => a.clone(),
            });
            if policy.policy == EgressPolicy::Allowlist {
                match allowed {
                    Some(name) => probes.push(Probe {
                        name: format!("{name} (listed), through the egress proxy"),
                        key: "name-allowed",
                        how: How::Get(name, net.port()),
                        expect: Expect::Passed,
                        control: Control::None,
                    }),
                    None => {
                        skipped.push(("a listed name".into(), "the allow list is empty".into()))
                    }
                }
            }
            probes.push(Probe {
                name: format!("{UNLISTED} (not listed), through the egress proxy"),
                key: "name-unlisted",
                how: How::Get(UNLISTED.into(), net.port()),
                expect: if public {
                    Expect::Passed
                } else {
                    Expect::Denied
                },
                control: if policy.policy == EgressPolicy::Allowlist {
                    Control::Probe("name-allowed")
                } else {
                    Control::Host(net, false)
                },
            });
        }
        Err(why) => skipped.push((
            "stand-ins (internet, LAN, metadata, IPv6)".into(),
            format!("cannot make the network namespace {NETNS} (run the drill as root): {why}"),
        )),
    }
    // The credential proxy.
    probes.push(Probe {
        name: "credential proxy without a token".into(),
        key: "token-none",
        how: How::Token(false),
        expect: Expect::Unauthorized,
        control: Control::Probe("token-ok"),
    });
    probes.push(Probe {
        name: "credential proxy with the VM's token".into(),
        key: "token-ok",
        how: How::Token(true),
        expect: Expect::Authorized,
        control: Control::None,
    });

    // Run every guest probe at once.
    let script = script(&probes, &proxy);
    let mut c = reach.std_command();
    c.args(["-T", "--", &format!("{}sh -s", boxery_hands::guest::SOURCE)])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = c.spawn().context("cannot run ssh")?;
    child
        .stdin
        .take()
        .context("no stdin")?
        .write_all(script.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() && out.stdout.is_empty() {
        bail!(
            "the probes could not run in VM {vm}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut outputs: BTreeMap<usize, String> = BTreeMap::new();
    let mut cur: Option<usize> = None;
    for line in text.lines() {
        if let Some(i) = line.strip_prefix("=== ").and_then(|i| i.parse().ok()) {
            cur = Some(i);
            outputs.insert(i, String::new());
        } else if let Some(i) = cur {
            let o = outputs.entry(i).or_default();
            o.push_str(line);
            o.push('\n');
        }
    }
    let got: Vec<Expect> = probes
        .iter()
        .enumerate()
        .map(|(i, p)| outcome(outputs.get(&i).map_or("", String::as_str), &nonce, &p.how))
        .collect();
    let by_key = |k: &str| {
        probes
            .iter()
            .zip(&got)
            .find(|(p, _)| p.key == k)
            .map(|(p, g)| matches(p.expect, *g) && *g != Expect::Denied && *g != Expect::Blocked)
    };
    let mut rows = Vec::new();
    for (p, g) in probes.iter().zip(&got) {
        let (control, cok) = match &p.control {
            Control::Host(a, ssh) => {
                let ok = host_reaches(*a, *ssh, &nonce);
                (
                    format!("host → {a}: {}", if ok { "reached" } else { "NOT reached" }),
                    ok,
                )
            }
            Control::Probe(k) => match by_key(k) {
                Some(true) => (format!("{k}: got through"), true),
                Some(false) => (format!("{k}: did NOT get through"), false),
                None => (format!("{k}: not run"), false),
            },
            Control::None => ("-".into(), true),
        };
        let ok = matches(p.expect, *g) && cok;
        rows.push(Row {
            probe: p.name.clone(),
            expected: p.expect.word().into(),
            result: g.word().into(),
            control,
            ok,
        });
    }
    for (what, why) in skipped {
        rows.push(Row {
            probe: what,
            expected: "-".into(),
            result: "skipped".into(),
            control: why,
            ok: false,
        });
    }
    drop(standins);
    Ok(rows)
}

/// How long a drill waits for the guest's settings (`BOXERY_PROXY`, pushed by the control
/// plane a few seconds after the VM is ready): a drill right after `apply --wait` waits
/// instead of failing (issue 30, class 6).
const SETTINGS_WAIT: Duration = Duration::from_secs(90);

/// The credential proxy's base URL as the guest sees it, read from the guest's own env; waits
/// (at most [`SETTINGS_WAIT`], saying so on stderr) until the control plane has pushed it.
fn home_proxy_url(reach: &boxery_hands::Reach, vm: &str) -> Result<String> {
    let mut last_ssh_error = String::new();
    let mut next_note = Duration::from_secs(15);
    let read = |last_ssh_error: &mut String| -> Result<Option<String>> {
        let out = reach
            .std_command()
            .args([
                "-T",
                "--",
                &format!(
                    "{}printf '%s' \"${{BOXERY_PROXY:-}}\"",
                    boxery_hands::guest::SOURCE
                ),
            ])
            .stdin(Stdio::null())
            .output()
            .context("cannot run ssh")?;
        if !out.status.success() {
            *last_ssh_error = String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or_default()
                .to_string();
        }
        let url = String::from_utf8_lossy(&out.stdout).trim().to_string();
        Ok((!url.is_empty()).then_some(url))
    };
    let found = poll_until(
        SETTINGS_WAIT,
        Duration::from_secs(1),
        || read(&mut last_ssh_error),
        |waited| {
            if waited.is_zero() {
                eprintln!(
                    "drill: waiting for VM {vm}'s guest settings (BOXERY_PROXY) from the control plane (at most {} s)…",
                    SETTINGS_WAIT.as_secs()
                );
            } else if waited >= next_note {
                eprintln!(
                    "drill: still waiting for VM {vm}'s guest settings ({} s)",
                    waited.as_secs()
                );
                next_note += Duration::from_secs(15);
            }
        },
    )?;
    match found {
        Some(url) => Ok(url),
        None => bail!(
            "VM {vm}'s guest still has no BOXERY_PROXY after {} s: the control plane pushes it once \
             the VM is ready; is a control plane running (`boxery service status`)?{}",
            SETTINGS_WAIT.as_secs(),
            if last_ssh_error.is_empty() {
                String::new()
            } else {
                format!(
                    " (last ssh error: {})",
                    boxery_verbs::render::safe(&last_ssh_error)
                )
            }
        ),
    }
}

/// Call `probe` until it gives a value or `timeout` has passed (then `Ok(None)`), every
/// `every`; `waiting` is told how long it has waited before each pause (zero the first
/// time). A probe's error ends the wait at once.
fn poll_until<T>(
    timeout: Duration,
    every: Duration,
    mut probe: impl FnMut() -> Result<Option<T>>,
    mut waiting: impl FnMut(Duration),
) -> Result<Option<T>> {
    let start = std::time::Instant::now();
    let mut first = true;
    loop {
        if let Some(v) = probe()? {
            return Ok(Some(v));
        }
        let waited = start.elapsed();
        if waited >= timeout {
            return Ok(None);
        }
        waiting(if first { Duration::ZERO } else { waited });
        first = false;
        std::thread::sleep(every.min(timeout - waited));
    }
}

#[cfg(test)]
mod wait_tests {
    use super::*;

    /// A drill right after `apply --wait` waits for the guest's settings that come a little
    /// later, saying so once at the start, rather than failing at the first look; it gives up
    /// (None) only after its bound, and a probe's error ends it at once (issue 30, class 6).
    #[test]
    fn the_settings_wait_polls_until_they_come_bounded() {
        let mut calls = 0;
        let mut notes = Vec::new();
        let got = poll_until(
            Duration::from_secs(5),
            Duration::from_millis(10),
            || {
                calls += 1;
                Ok((calls == 4).then(|| "http://10.0.2.2:7391".to_string()))
            },
            |w| notes.push(w),
        )
        .unwrap();
        assert_eq!(got.as_deref(), Some("http://10.0.2.2:7391"));
        assert_eq!(calls, 4);
        assert_eq!(notes.len(), 3);
        assert!(notes[0].is_zero() && !notes[1].is_zero(), "{notes:?}");

        let start = std::time::Instant::now();
        let none: Option<String> = poll_until(
            Duration::from_millis(200),
            Duration::from_millis(20),
            || Ok(None),
            |_| {},
        )
        .unwrap();
        assert!(none.is_none());
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(200) && took < Duration::from_secs(2),
            "{took:?}"
        );

        let mut n = 0;
        let e = poll_until::<String>(
            Duration::from_secs(5),
            Duration::from_millis(10),
            || {
                n += 1;
                bail!("cannot run ssh")
            },
            |_| {},
        );
        assert!(e.is_err() && n == 1);
    }
}
