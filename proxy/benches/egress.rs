//! The egress proxy's cost against the same transfer with no policy in the way, in the same
//! run (docs/benchmarks.md, "Egress (issue 14)"):
//! - connection setup: connect, one small request, its first byte back; direct TCP vs a
//!   CONNECT tunnel through the VM's channel (a unix socket, as qemu's `guestfwd` reaches it),
//!   and the same with `socat` in front (what slirp spawns per guest connection);
//! - bulk: a 100 MiB download, direct vs through a CONNECT tunnel, vs through `socat` and the
//!   tunnel, vs an absolute-form `GET` forwarded by the proxy.
//!
//! The "internet" is a listener at 203.0.113.20 in a network namespace the bench makes (and
//! removes), routed from the host over a veth pair: a public address that is not the host's,
//! as the policy requires. Needs root. `cargo bench -p boxery-proxy --bench egress`
//! (`BOXERY_BENCH_N`: connection pairs, default 500; `BOXERY_BENCH_MIB`: download size).

use std::net::SocketAddr;
use std::time::Instant;

use boxery_api::network::{Egress, EgressPolicy};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

#[path = "standin/mod.rs"]
mod standin;

use standin::Net;

const INTERNET: &str = "203.0.113.20";

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

/// Read an HTTP response head; returns what came after it.
async fn head<S: AsyncRead + Unpin>(s: &mut S) -> Vec<u8> {
    let mut seen = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        let n = s.read(&mut buf).await.unwrap();
        assert!(
            n > 0,
            "closed before a response: {:?}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
        if let Some(at) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
            let status = String::from_utf8_lossy(&seen[..at]).into_owned();
            assert!(status.starts_with("HTTP/1.1 200"), "{status}");
            return seen[at + 4..].to_vec();
        }
    }
}

/// Through an open byte stream: `GET /n`, the head, then `n` bytes. Returns the bytes read.
async fn get<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    n: usize,
    absolute: Option<&str>,
) -> usize {
    let target = match absolute {
        Some(hp) => format!("http://{hp}/{n}"),
        None => format!("/{n}"),
    };
    s.write_all(
        format!("GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut got = head(s).await.len();
    let mut buf = vec![0u8; 256 * 1024];
    while got < n {
        let k = s.read(&mut buf).await.unwrap();
        if k == 0 {
            break;
        }
        got += k;
    }
    got
}

/// A tunnel through the proxy to `to` over `s`.
async fn tunnel<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, to: SocketAddr) {
    s.write_all(format!("CONNECT {to} HTTP/1.1\r\nHost: {to}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let rest = head(s).await;
    assert!(rest.is_empty());
}

/// What slirp's guestfwd runs per guest connection: `socat STDIO UNIX-CONNECT:sock`, or
/// `boxery-relay sock`; as one byte stream.
fn spawn(relay: Option<&std::path::Path>, sock: &std::path::Path) -> tokio::process::Child {
    let mut c = match relay {
        Some(r) => {
            let mut c = tokio::process::Command::new(r);
            c.arg(sock);
            c
        }
        None => {
            let mut c = tokio::process::Command::new("socat");
            c.arg("STDIO")
                .arg(format!("UNIX-CONNECT:{}", sock.display()));
            c
        }
    };
    c.stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("socat is installed (scripts/install-deps.sh), boxery-relay is built")
}

/// `boxery-relay` as the qemu backend finds it: beside the program (target/release, two
/// levels up from this bench in target/release/deps), or `BOXERY_RELAY`.
fn relay() -> Option<std::path::PathBuf> {
    std::env::var_os("BOXERY_RELAY")
        .map(Into::into)
        .or_else(|| {
            let exe = std::env::current_exe().ok()?;
            Some(exe.parent()?.parent()?.join("boxery-relay"))
        })
        .filter(|r: &std::path::PathBuf| r.is_file())
}

struct Pipe(tokio::process::Child);

impl AsyncRead for Pipe {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(self.0.stdout.as_mut().unwrap()).poll_read(cx, buf)
    }
}

impl AsyncWrite for Pipe {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(self.0.stdin.as_mut().unwrap()).poll_write(cx, buf)
    }
    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(self.0.stdin.as_mut().unwrap()).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(self.0.stdin.as_mut().unwrap()).poll_shutdown(cx)
    }
}

/// Setup through a process spawned per connection, as slirp does; in ms.
async fn spawned(relay: Option<&std::path::Path>, sock: &std::path::Path, to: SocketAddr) -> f64 {
    let t = Instant::now();
    let mut c = Pipe(spawn(relay, sock));
    tunnel(&mut c, to).await;
    get(&mut c, 1, None).await;
    t.elapsed().as_secs_f64() * 1e3
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(bench());
}

async fn bench() {
    let n: usize = std::env::var("BOXERY_BENCH_N")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(500);
    let mib: usize = std::env::var("BOXERY_BENCH_MIB")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100);
    let net = Net::make("boxery-bench-egress", "bxbench0", INTERNET, "198.51.100.21");
    let to = net.serve();
    let home = tempfile::Builder::new()
        .prefix("boxery-egress-bench-")
        .tempdir()
        .unwrap();
    boxery_home::egress::write(
        home.path(),
        "dev1",
        &Egress {
            policy: EgressPolicy::Public,
            allow: vec![],
        },
    )
    .unwrap();
    let proxy =
        boxery_proxy::Proxy::new(home.path(), boxery_api::config::ProxyConfig::default()).unwrap();
    let sock = home.path().join("proxy.sock");
    let l = tokio::net::UnixListener::bind(&sock).unwrap();
    let router = proxy.router(Some("dev1".into()));
    tokio::spawn(async move { axum::serve(l, router).await });
    let relay = relay().expect(
        "boxery-relay is not built beside this bench: cargo build --release -p boxery --bin boxery-relay",
    );
    println!(
        "egress proxy benchmark: {n} connection pairs, {mib} MiB downloads, to {to}; relay {}",
        relay.display()
    );

    // Connection setup to the first byte of a small answer, interleaved.
    let (mut d, mut p, mut s, mut r) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..n + 50 {
        let t = Instant::now();
        let mut c = tokio::net::TcpStream::connect(to).await.unwrap();
        c.set_nodelay(true).unwrap();
        get(&mut c, 1, None).await;
        let direct = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        let mut c = tokio::net::UnixStream::connect(&sock).await.unwrap();
        tunnel(&mut c, to).await;
        get(&mut c, 1, None).await;
        let proxied = t.elapsed().as_secs_f64() * 1e3;
        // A spawn per connection, as slirp does: every 5th pair, each way.
        let (socat_ms, relay_ms) = if i % 5 == 0 {
            (
                Some(spawned(None, &sock, to).await),
                Some(spawned(Some(&relay), &sock, to).await),
            )
        } else {
            (None, None)
        };
        if i >= 50 {
            d.push(direct);
            p.push(proxied);
            s.extend(socat_ms);
            r.extend(relay_ms);
        }
    }
    let (d50, d99, p50, p99) = (
        pct(&mut d, 0.5),
        pct(&mut d, 0.99),
        pct(&mut p, 0.5),
        pct(&mut p, 0.99),
    );
    let (s50, s99, r50, r99) = (
        pct(&mut s, 0.5),
        pct(&mut s, 0.99),
        pct(&mut r, 0.5),
        pct(&mut r, 0.99),
    );
    println!(
        "setup  direct p50 {d50:.3} ms p99 {d99:.3} | CONNECT via the channel p50 {p50:.3} p99 {p99:.3} (added p50 {:.3} ms)",
        p50 - d50
    );
    println!(
        "setup  spawned per connection as slirp does ({} samples each): boxery-relay p50 {r50:.3} p99 {r99:.3} (added p50 {:.3} ms) | socat p50 {s50:.3} p99 {s99:.3} (added p50 {:.3} ms)",
        s.len(),
        r50 - d50,
        s50 - d50
    );

    // Bulk, three rounds each, interleaved; the median rate.
    let size = mib * 1024 * 1024;
    let rate = |bytes: usize, t: Instant| bytes as f64 / 1048576.0 / t.elapsed().as_secs_f64();
    let (mut rd, mut rc, mut rs, mut rg) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut rr = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        let mut c = tokio::net::TcpStream::connect(to).await.unwrap();
        let got = get(&mut c, size, None).await;
        assert_eq!(got, size);
        rd.push(rate(got, t));
        let t = Instant::now();
        let mut c = tokio::net::UnixStream::connect(&sock).await.unwrap();
        tunnel(&mut c, to).await;
        let got = get(&mut c, size, None).await;
        assert_eq!(got, size);
        rc.push(rate(got, t));
        for (relay, out) in [(None, &mut rs), (Some(relay.as_path()), &mut rr)] {
            let t = Instant::now();
            let mut c = Pipe(spawn(relay, &sock));
            tunnel(&mut c, to).await;
            let got = get(&mut c, size, None).await;
            assert_eq!(got, size);
            out.push(rate(got, t));
        }
        let t = Instant::now();
        let mut c = tokio::net::UnixStream::connect(&sock).await.unwrap();
        let got = get(&mut c, size, Some(&to.to_string())).await;
        assert_eq!(got, size);
        rg.push(rate(got, t));
    }
    let (bd, bc, bs, bg, br) = (
        pct(&mut rd, 0.5),
        pct(&mut rc, 0.5),
        pct(&mut rs, 0.5),
        pct(&mut rg, 0.5),
        pct(&mut rr, 0.5),
    );
    println!(
        "bulk {mib} MiB  direct {bd:.0} MiB/s | CONNECT {bc:.0} MiB/s ({:.0} %) | forwarded GET {bg:.0} MiB/s ({:.0} %) | boxery-relay + CONNECT {br:.0} MiB/s ({:.0} %) | socat + CONNECT {bs:.0} MiB/s ({:.0} %)",
        bc / bd * 100.0,
        bg / bd * 100.0,
        br / bd * 100.0,
        bs / bd * 100.0
    );
    drop(net);
}
