//! Control-plane benchmarks on the zero-latency fake backend:
//! - `boxery get vm NAME` and `boxery get vm` wall time with 1,000 objects in the store;
//! - time for 1,000 Vms to converge (written in one apply → all Ready) under `boxery serve`;
//! - the control plane's RSS, idle, with those 1,000 VMs (and their Events) in the store.
//!
//! `cargo bench -p boxery --bench controlplane` (release build). Prints a table; the figures
//! go into docs/benchmarks.md with this command. `BOXERY_BENCH_VMS=N` changes the count.

#[path = "support/fleet.rs"]
mod fleet;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use boxery_api::Vm;
use boxery_store::{ApplyOptions, Store};
use fleet::{Serve, rss_kib, vms};

/// The binary measured: this build's, or `BOXERY_BENCH_BIN` (another build of the same commit,
/// e.g. another release profile, measured by the same driver in the same run).
fn bin() -> String {
    std::env::var("BOXERY_BENCH_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_boxery").to_string())
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

fn run_get(home: &Path, args: &[&str]) -> Duration {
    let t = Instant::now();
    let out = Command::new(bin())
        .args(args)
        .env("BOXERY_HOME", home)
        .env("BOXERY_BACKEND", "fake")
        .stdout(Stdio::null())
        .output()
        .unwrap();
    let d = t.elapsed();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    d
}

fn main() {
    let n: usize = std::env::var("BOXERY_BENCH_VMS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000);
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path();
    let store = Store::open(&home.join("store.db")).unwrap();

    // Idle RSS of an empty control plane, for reference.
    let serve = Serve(
        Command::new(bin())
            .args(["serve", "--inventory-every", "5s"])
            .env("BOXERY_HOME", home)
            .env("BOXERY_BACKEND", "fake")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    std::thread::sleep(Duration::from_secs(2));
    let rss_empty = rss_kib(serve.0.id());

    // Converge N VMs: one apply writes them all; time until every one is Ready.
    let t = Instant::now();
    store.apply_all(vms(n), &ApplyOptions::default()).unwrap();
    let written = t.elapsed();
    let mut polls = 0;
    let converged = loop {
        polls += 1;
        let ready = store
            .list_as::<Vm>(&Default::default())
            .unwrap()
            .iter()
            .filter(|v| boxery_reconcilers::vm::is_ready(v))
            .count();
        if ready == n {
            break t.elapsed();
        }
        assert!(
            t.elapsed() < Duration::from_secs(300),
            "only {ready}/{n} ready after 300 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    // Idle: 3 s after the last Vm turned Ready, 8 s after (`serve` gives its heap's free pages
    // back every 5 s, so one trim has run by then), and 20 s after (the store has closed its
    // idle readers and emptied its page caches, every 10 s, and a trim followed).
    std::thread::sleep(Duration::from_secs(3));
    let rss_settling = rss_kib(serve.0.id());
    std::thread::sleep(Duration::from_secs(5));
    let rss_loaded = rss_kib(serve.0.id());
    std::thread::sleep(Duration::from_secs(12));
    let rss_idle = rss_kib(serve.0.id());
    let objects = ["Vm", "Image", "Event"]
        .iter()
        .map(|k| store.list(k, &Default::default()).unwrap().0.len())
        .sum::<usize>();
    drop(serve);

    // `get` wall time with N VMs in the store (no serve running: the CLI alone).
    let mut one: Vec<Duration> = (0..40)
        .map(|_| run_get(home, &["get", "vm", "vm-0500"]))
        .collect();
    one.sort();
    let mut all: Vec<Duration> = (0..10).map(|_| run_get(home, &["get", "vm"])).collect();
    all.sort();
    let mut help: Vec<Duration> = (0..20).map(|_| run_get(home, &["--version"])).collect();
    help.sort();

    println!("control plane, fake backend (zero latency), {n} VMs, 2 cores");
    println!("| measure | result | target |");
    println!("|---|---|---|");
    println!("| {n} Vms written (one apply) | {} | |", ms(written));
    println!(
        "| {n} Vms converge (apply → all Ready, `serve`) | {:.2} s ({polls} polls) | ≤ 10 s |",
        converged.as_secs_f64()
    );
    println!(
        "| `boxery get vm NAME` p50 / p99 (40 runs) | {} / {} | ≤ 15 ms |",
        ms(pct(&one, 0.5)),
        ms(pct(&one, 0.99))
    );
    println!(
        "| `boxery get vm` ({n} rows) p50 / p99 (10 runs) | {} / {} | |",
        ms(pct(&all, 0.5)),
        ms(pct(&all, 0.99))
    );
    println!(
        "| process start floor (`boxery --version`) p50 | {} | |",
        ms(pct(&help, 0.5))
    );
    println!(
        "| `serve` RSS, idle, empty store | {:.1} MiB | |",
        rss_empty as f64 / 1024.0
    );
    println!(
        "| `serve` RSS, {objects} objects ({n} Vms + images + events), 3 s after converging | {:.1} MiB | |",
        rss_settling as f64 / 1024.0
    );
    println!(
        "| `serve` RSS, {objects} objects ({n} Vms + images + events), 8 s after converging | {:.1} MiB | |",
        rss_loaded as f64 / 1024.0
    );
    println!(
        "| `serve` RSS, idle, {objects} objects ({n} Vms + images + events), 20 s after converging | {:.1} MiB | ≤ 30 MiB |",
        rss_idle as f64 / 1024.0
    );
}
