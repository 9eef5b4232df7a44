//! The cost of answering a guest's name lookup by its VM's policy, against the floor of the
//! same datagram round trip with nothing answered (docs/benchmarks.md, "Name lookups"): one
//! client sends tagged queries one at a time, as a VM's `boxery-net` does, to
//! - the VM's DNS socket served by `boxery_proxy::dns` (policy read, the name looked up in
//!   `proxy.egress.resolve`, the answer built, the lookup audited);
//! - the VM's stream socket (the same over TCP, each message after its 2-byte length, on a
//!   connection kept open, as a resolver keeps it for its retries);
//! - an echo on a unix datagram socket in the same runtime (the floor: two socket hops and a
//!   task wake-up, nothing decided).
//!
//! Interleaved in rounds; percentiles of each round trip. A VM may make [`dns::BURST`] lookups
//! at once (then [`dns::PER_SECOND`]), so the lookups are spread over as many VMs as that
//! takes, each with its own sockets. `cargo bench -p boxery-proxy --bench dns`
//! (`BOXERY_BENCH_N`: lookups per kind, default 5000).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use boxery_api::network::{Egress, EgressPolicy};
use boxery_proxy::dns;
use hickory_proto::op::{Message, Query};
use hickory_proto::rr::{Name, RecordType};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixDatagram, UnixStream};

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

async fn round_trip(c: &UnixDatagram, to: &Path, msg: &[u8], buf: &mut [u8]) -> f64 {
    let t = Instant::now();
    c.send_to(msg, to).await.unwrap();
    let n = c.recv(buf).await.unwrap();
    assert!(n > 12, "an answer");
    t.elapsed().as_secs_f64() * 1e6
}

async fn tcp_round_trip(c: &mut UnixStream, framed: &[u8], buf: &mut Vec<u8>) -> f64 {
    let t = Instant::now();
    c.write_all(framed).await.unwrap();
    let mut len = [0u8; 2];
    c.read_exact(&mut len).await.unwrap();
    buf.resize(usize::from(u16::from_be_bytes(len)), 0);
    c.read_exact(buf).await.unwrap();
    assert!(buf.len() > 12, "an answer");
    t.elapsed().as_secs_f64() * 1e6
}

/// One VM's sockets: its datagram socket's path and a connection to its stream socket.
struct Vm {
    udp: PathBuf,
    tcp: UnixStream,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n: usize = std::env::var("BOXERY_BENCH_N")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5000);
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    let mut cfg = boxery_api::config::ProxyConfig::default();
    cfg.egress
        .resolve
        .insert("mirror.test".into(), "203.0.113.7".parse().unwrap());
    let proxy = boxery_proxy::Proxy::new(&home, cfg).unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    const WARM: usize = 100;
    // a round takes one lookup of each kind from a VM's bucket: half a burst of rounds each
    let per_vm = (dns::BURST as usize) / 2;
    let mut vms = Vec::new();
    for i in 0..(WARM + n).div_ceil(per_vm) {
        let name = format!("b{i}");
        boxery_home::egress::write(
            &home,
            &name,
            &Egress {
                policy: EgressPolicy::Allowlist,
                allow: vec!["mirror.test".into()],
            },
        )
        .unwrap();
        let udp = dir.path().join(format!("{name}.dns.sock"));
        let tcp = dir.path().join(format!("{name}.dns-tcp.sock"));
        dns::start(&proxy, &name, &udp, Some(&tcp), stop.child_token()).unwrap();
        let tcp = UnixStream::connect(&tcp).await.unwrap();
        vms.push(Vm { udp, tcp });
    }
    // the floor: an echo
    let echo_at = dir.path().join("echo.sock");
    let echo = Arc::new(UnixDatagram::bind(&echo_at).unwrap());
    tokio::spawn(async move {
        let mut buf = vec![0u8; 2048];
        loop {
            let (n, from) = echo.recv_from(&mut buf).await.unwrap();
            let to = from.as_pathname().unwrap().to_path_buf();
            echo.send_to(&buf[..n], &to).await.unwrap();
        }
    });
    let client = UnixDatagram::bind(dir.path().join("client.sock")).unwrap();
    let mut q = Message::query();
    q.metadata.recursion_desired = true;
    q.add_query(Query::query(
        Name::from_ascii("mirror.test.").unwrap(),
        RecordType::A,
    ));
    let query = q.to_vec().unwrap();
    let msg = [&[0u8; 12][..], &query].concat();
    let framed = [&(query.len() as u16).to_be_bytes()[..], &query].concat();
    let mut buf = vec![0u8; 4096];
    let mut tcp_buf = Vec::new();
    let (mut udp, mut tcp, mut floor) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    let mut t0 = Instant::now();
    for round in 0..WARM + n {
        if round == WARM {
            (udp, tcp, floor) = (Vec::new(), Vec::new(), Vec::new());
            t0 = Instant::now();
        }
        let vm = &mut vms[round / per_vm];
        udp.push(round_trip(&client, &vm.udp, &msg, &mut buf).await);
        tcp.push(tcp_round_trip(&mut vm.tcp, &framed, &mut tcp_buf).await);
        floor.push(round_trip(&client, &echo_at, &msg, &mut buf).await);
    }
    let wall = t0.elapsed().as_secs_f64();
    let f50 = pct(&mut floor, 0.5);
    let f99 = pct(&mut floor, 0.99);
    println!(
        "name lookups, {n} of each, interleaved, over {} VMs ({wall:.1} s)",
        vms.len()
    );
    println!("  echo (floor):             p50 {f50:8.1} µs  p99 {f99:8.1} µs");
    for (what, v) in [
        ("by policy over UDP", &mut udp),
        ("by policy over TCP", &mut tcp),
    ] {
        let (p50, p99) = (pct(v, 0.5), pct(v, 0.99));
        println!(
            "  {what}:  p50 {p50:8.1} µs  p99 {p99:8.1} µs  (+{:.1} µs, {:.2}x the floor)",
            p50 - f50,
            p50 / f50
        );
    }
    stop.cancel();
}
