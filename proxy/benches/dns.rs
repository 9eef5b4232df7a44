//! The cost of answering a guest's name lookup by its VM's policy, against the floor of the
//! same datagram round trip with nothing answered (docs/benchmarks.md, "Name lookups"): one
//! client sends tagged queries one at a time, as a VM's `boxery-net` does, to
//! - the VM's DNS socket served by `boxery_proxy::dns` (policy read, the name looked up in
//!   `proxy.egress.resolve`, the answer built, the lookup audited);
//! - an echo on a unix datagram socket in the same runtime (the floor: two socket hops and a
//!   task wake-up, nothing decided).
//!
//! Interleaved in rounds; percentiles of each round trip. `cargo bench -p boxery-proxy --bench
//! dns` (`BOXERY_BENCH_N`: lookups per kind, default 5000).

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use boxery_api::network::{Egress, EgressPolicy};
use hickory_proto::op::{Message, Query};
use hickory_proto::rr::{Name, RecordType};
use tokio::net::UnixDatagram;

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
    boxery_home::egress::write(
        &home,
        "b1",
        &Egress {
            policy: EgressPolicy::Allowlist,
            allow: vec!["mirror.test".into()],
        },
    )
    .unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let served = dir.path().join("dns.sock");
    boxery_proxy::dns::start(&proxy, "b1", &served, stop.child_token()).unwrap();
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
    let msg = [&[0u8; 12][..], &q.to_vec().unwrap()].concat();
    let mut buf = vec![0u8; 4096];
    // warm up
    for _ in 0..100 {
        round_trip(&client, &served, &msg, &mut buf).await;
        round_trip(&client, &echo_at, &msg, &mut buf).await;
    }
    let (mut dns, mut floor) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let t0 = Instant::now();
    for _ in 0..n {
        dns.push(round_trip(&client, &served, &msg, &mut buf).await);
        floor.push(round_trip(&client, &echo_at, &msg, &mut buf).await);
    }
    let wall = t0.elapsed().as_secs_f64();
    let (d50, f50) = (pct(&mut dns, 0.5), pct(&mut floor, 0.5));
    let (d99, f99) = (pct(&mut dns, 0.99), pct(&mut floor, 0.99));
    println!("name lookups, {n} of each, interleaved ({wall:.1} s)");
    println!("  echo (floor):      p50 {f50:8.1} µs  p99 {f99:8.1} µs");
    println!("  answered by policy: p50 {d50:8.1} µs  p99 {d99:8.1} µs");
    println!(
        "  added per lookup:   p50 {:+8.1} µs  ({:.2}x the floor)",
        d50 - f50,
        d50 / f50
    );
    stop.cancel();
}
