//! `/metrics` with 1,000 Vms (issue 36's targets: a scrape ≤ 50 ms, ≤ 1 MiB more RSS), on the
//! zero-latency fake backend under `boxery serve --metrics-listen`:
//! - a scrape that renders (the last render is over a second old), p50 and p99, against
//!   `GET /healthz` on the same listener in the same run (the HTTP floor);
//! - a scrape served from the last render (within the second);
//! - 200 scrapes at once from 8 clients: the work stays one render a second;
//! - `serve`'s RSS idle before any scrape and idle after them (a heap trim between).
//!
//! `cargo bench -p boxery --bench metrics` (release build). Prints a table; the figures go
//! into docs/benchmarks.md with this command. `BOXERY_BENCH_VMS=N` changes the count.

#[path = "support/fleet.rs"]
mod fleet;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use boxery_api::Vm;
use boxery_store::{ApplyOptions, Store};
use fleet::{Serve, rss_kib, vms};

fn get(addr: &str, path: &str) -> (Duration, usize) {
    let t = Instant::now();
    let mut c = TcpStream::connect(addr).unwrap();
    write!(
        c,
        "GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = Vec::new();
    c.read_to_end(&mut out).unwrap();
    let d = t.elapsed();
    assert!(out.starts_with(b"HTTP/1.1 200"), "{path}");
    (d, out.len())
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

fn main() {
    let n: usize = std::env::var("BOXERY_BENCH_VMS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000);
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path();
    let store = Store::open(&home.join("store.db")).unwrap();
    let serve = Serve(
        Command::new(env!("CARGO_BIN_EXE_boxery"))
            .args(["serve", "--metrics-listen", "127.0.0.1:0"])
            .env("BOXERY_HOME", home)
            .env("BOXERY_BACKEND", "fake")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let pid = serve.0.id();
    let addr_file = home.join("metrics.addr");
    let t = Instant::now();
    let addr = loop {
        if let Ok(a) = std::fs::read_to_string(&addr_file) {
            break a.trim().to_string();
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "serve wrote no metrics.addr"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    store.apply_all(vms(n), &ApplyOptions::default()).unwrap();
    let t = Instant::now();
    loop {
        let ready = store
            .list_as::<Vm>(&Default::default())
            .unwrap()
            .iter()
            .filter(|v| boxery_reconcilers::vm::is_ready(v))
            .count();
        if ready == n {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(300), "{ready}/{n} ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Idle (serve trims its heap every 5 s; the store closes idle readers every 10 s).
    std::thread::sleep(Duration::from_secs(20));
    let rss_before = rss_kib(pid);

    // Renders: each scrape more than a second after the last.
    let mut render = Vec::new();
    let mut size = 0;
    for _ in 0..15 {
        std::thread::sleep(Duration::from_millis(1100));
        let (d, s) = get(&addr, "/metrics");
        render.push(d);
        size = s;
    }
    render.sort();
    // Served again: scrapes right after a render.
    let mut cached = Vec::new();
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(1100));
        get(&addr, "/metrics");
        for _ in 0..5 {
            cached.push(get(&addr, "/metrics").0);
        }
    }
    cached.sort();
    let mut floor: Vec<Duration> = (0..50).map(|_| get(&addr, "/healthz").0).collect();
    floor.sort();
    // A flood: 8 clients, 25 scrapes each, at once.
    std::thread::sleep(Duration::from_millis(1100));
    let t = Instant::now();
    let clients: Vec<_> = (0..8)
        .map(|_| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                for _ in 0..25 {
                    get(&addr, "/metrics");
                }
            })
        })
        .collect();
    for c in clients {
        c.join().unwrap();
    }
    let flood = t.elapsed();
    // Idle again: a trim has run.
    std::thread::sleep(Duration::from_secs(12));
    let rss_after = rss_kib(pid);
    drop(serve);

    let p50 = pct(&render, 0.5);
    println!("/metrics, fake backend (zero latency), {n} Vms, 2 cores");
    println!("| measure | result | target |");
    println!("|---|---|---|");
    println!(
        "| scrape that renders, p50 / p99 (15 runs) | {} / {} | ≤ 50 ms |",
        ms(p50),
        ms(pct(&render, 0.99))
    );
    println!(
        "| `GET /healthz` on the same listener, p50 (the HTTP floor) | {} | |",
        ms(pct(&floor, 0.5))
    );
    println!(
        "| scrape served from the last render, p50 (50 runs) | {} | |",
        ms(pct(&cached, 0.5))
    );
    println!("| exposition size | {:.0} KiB | |", size as f64 / 1024.0);
    println!(
        "| 200 scrapes from 8 clients at once, wall | {} | |",
        ms(flood)
    );
    println!(
        "| `serve` RSS idle before any scrape / after them | {:.1} / {:.1} MiB (+{:.2} MiB) | ≤ +1 MiB |",
        rss_before as f64 / 1024.0,
        rss_after as f64 / 1024.0,
        (rss_after as f64 - rss_before as f64) / 1024.0
    );
}
