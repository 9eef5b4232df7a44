//! Pool benchmarks on the zero-latency fake backend, through a real `boxery serve`:
//! - warm-pool claim latency: Lease written → Bound (the store and runtime alone), p50/p99;
//! - claims per second with 1,000 members (1,000 Leases written at once → all Bound), with
//!   the store writes each claim took (revisions per claim);
//! - 500 Leases written at once through the CLI (`boxery lease acquire`, 500 processes) on
//!   500 free members → all Bound, end to end;
//! - the limits, measured in the same run: the store's `update_status` writes/s of an object
//!   the size of a member record (one claim needs a few such writes: the quotient is the
//!   claims/s the store alone allows), and 500 CLI acquires on a pool that does not exist
//!   (the CLI's own cost: process start, key pair, one write).
//!
//! `cargo bench -p boxery --bench pools`. `BOXERY_BENCH_MEMBERS=N` (default 1000),
//! `BOXERY_BENCH_CLI=N` (default 500).

#[path = "support/fleet.rs"]
mod fleet;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use boxery_api::lease::LeasePhase;
use boxery_api::pool::{PoolMember, PoolMemberSpec};
use boxery_api::{DynObject, Lease, Pool};
use boxery_store::{ApplyOptions, Store};
use fleet::{Serve, lease};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_boxery")
}

fn serve(home: &std::path::Path) -> Serve {
    Serve(
        Command::new(bin())
            .args(["serve", "--inventory-every", "30s"])
            .env("BOXERY_HOME", home)
            .env("BOXERY_BACKEND", "fake")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

fn pool(store: &Store, name: &str, n: u32) {
    let yaml = format!(
        "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {{name: {name}}}\nspec:\n  replicas: {n}\n  template:\n    spec:\n      source: {{image: debian-12}}\n"
    );
    let m = boxery_api::codec::parse_manifests("pool", yaml.as_bytes()).unwrap();
    store
        .apply_all(
            m.into_iter().map(|m| m.object).collect(),
            &ApplyOptions::default(),
        )
        .unwrap();
    let t = Instant::now();
    loop {
        let p: Pool = store.get_as(name).unwrap().unwrap();
        if p.status.free == n {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(600),
            "pool {name}: {} of {n} free",
            p.status.free
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

fn bound(store: &Store, prefix: &str) -> usize {
    store
        .list_as::<Lease>(&Default::default())
        .unwrap()
        .iter()
        .filter(|l| l.metadata.name.starts_with(prefix) && l.status.phase == LeasePhase::Bound)
        .count()
}

/// `n` `boxery lease acquire POOL` processes started at once; returns when all exited.
fn cli_acquires(home: &std::path::Path, pool: &str, prefix: &str, n: u32) {
    let children: Vec<_> = (0..n)
        .map(|i| {
            Command::new(bin())
                .args(["lease", "acquire", pool, "--holder", "bench", "--name"])
                .arg(format!("{prefix}{i}"))
                .env("BOXERY_HOME", home)
                .env("BOXERY_BACKEND", "fake")
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for c in children {
        let out = c.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "`boxery lease acquire` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The store's `update_status` writes/s of one object the size of a member record (a
/// PoolMember whose status says Leased, with a lease name and uid), `n` writes.
fn member_writes_per_s(store: &Store, n: u32) -> (f64, usize) {
    let mut m = PoolMember::new(
        "limit-0",
        PoolMemberSpec {
            pool: "limit".into(),
            created: true,
        },
    );
    m.metadata
        .labels
        .insert("boxery.dev/pool".into(), "limit".into());
    let mut m = store.create_as(&m).unwrap();
    let size = serde_json::to_string(&m).unwrap().len();
    let t = Instant::now();
    for i in 0..n {
        m.status.generation = u64::from(i) + 1;
        m.status.lease = Some(format!("b{i}"));
        m.status.lease_uid = Some(uuid::Uuid::new_v4().to_string());
        m = store.update_status_as(&m).unwrap();
    }
    (n as f64 / t.elapsed().as_secs_f64(), size)
}

fn main() {
    let members: u32 = std::env::var("BOXERY_BENCH_MEMBERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000);
    let cli: u32 = std::env::var("BOXERY_BENCH_CLI")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(500);
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("store.db")).unwrap();
    let _serve = serve(dir.path());

    // Claim latency on a warm pool of 20.
    pool(&store, "warm", 20);
    let mut lat = Vec::new();
    for round in 0..3 {
        for i in 0..15 {
            let name = format!("w{round}-{i}");
            let t = Instant::now();
            store.create_as(&lease("warm", &name)).unwrap();
            loop {
                let l: Lease = store.get_as(&name).unwrap().unwrap();
                if l.status.phase == LeasePhase::Bound {
                    break;
                }
                std::thread::sleep(Duration::from_micros(500));
            }
            lat.push(t.elapsed());
        }
        for i in 0..15 {
            store.delete("Lease", &format!("w{round}-{i}")).unwrap();
        }
        let t = Instant::now();
        loop {
            let p: Pool = store.get_as("warm").unwrap().unwrap();
            if p.status.free == 20
                && store
                    .list_as::<Lease>(&Default::default())
                    .unwrap()
                    .is_empty()
            {
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(120));
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    // Claims per second with N members: N leases at once.
    let t0 = Instant::now();
    pool(&store, "big", members);
    let made = t0.elapsed();
    let leases: Vec<DynObject> = (0..members)
        .map(|i| DynObject::from_typed(&lease("big", &format!("b{i}"))).unwrap())
        .collect();
    let rev0 = store.revision().unwrap();
    let t = Instant::now();
    store.apply_all(leases, &ApplyOptions::default()).unwrap();
    loop {
        let n = bound(&store, "b");
        if n == members as usize {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(900),
            "{n} of {members} bound"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let all = t.elapsed();
    let writes_per_claim = (store.revision().unwrap() - rev0) as f64 / f64::from(members);

    // 500 leases through the CLI, at once, on 500 free members.
    pool(&store, "cli", cli);
    std::thread::sleep(Duration::from_secs(2));
    let t = Instant::now();
    cli_acquires(dir.path(), "cli", "c", cli);
    let written = t.elapsed();
    loop {
        let n = bound(&store, "c");
        if n == cli as usize {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(900), "{n} of {cli} bound");
        std::thread::sleep(Duration::from_millis(50));
    }
    let cli_all = t.elapsed();

    // The limits, same run: the CLI alone (a pool that does not exist: nothing binds), and the
    // store's writes of a member-sized object.
    let t = Instant::now();
    cli_acquires(dir.path(), "nosuchpool", "n", cli);
    let cli_only = t.elapsed();
    let (wps, size) = member_writes_per_s(&store, 5000);

    println!("pools, fake backend (zero latency), `boxery serve`, 2 cores");
    println!("| measure | result | target |");
    println!("|---|---|---|");
    println!(
        "| claim latency, warm pool of 20: Lease written → Bound, p50 / p99 ({} claims) | {} / {} | ≤ 20 ms / ≤ 100 ms |",
        lat.len(),
        ms(pct(&mut lat, 0.5)),
        ms(pct(&mut lat, 0.99))
    );
    let claims = f64::from(members) / all.as_secs_f64();
    println!(
        "| {members} leases on {members} free members → all Bound | {:.1} s = {claims:.0} claims/s ({writes_per_claim:.1} store writes per claim) | ≥ 500/s |",
        all.as_secs_f64(),
    );
    println!(
        "| limit: store `update_status` of a member-sized object ({size} B), same run | {wps:.0} writes/s → {:.0} claims/s at {writes_per_claim:.1} writes per claim (claims reach {:.0} % of it) | |",
        wps / writes_per_claim,
        100.0 * claims / (wps / writes_per_claim)
    );
    println!(
        "| {cli} `boxery lease acquire` at once ({cli} processes) on {cli} free members → all Bound, end to end | {:.1} s = {:.0} leases/s (all written after {:.1} s) | |",
        cli_all.as_secs_f64(),
        f64::from(cli) / cli_all.as_secs_f64(),
        written.as_secs_f64()
    );
    println!(
        "| limit: the same {cli} CLI acquires on a pool that does not exist (nothing binds), same run | {:.1} s = {:.0} leases/s (CLI bound at {:.0} % of it) | |",
        cli_only.as_secs_f64(),
        f64::from(cli) / cli_only.as_secs_f64(),
        100.0 * cli_only.as_secs_f64() / cli_all.as_secs_f64()
    );
    println!(
        "| (setup) pool of {members} members created and clean-imaged | {:.1} s | |",
        made.as_secs_f64()
    );
}
