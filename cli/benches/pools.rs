//! Pool benchmarks on the zero-latency fake backend, through a real `boxery serve`:
//! - warm-pool claim latency: Lease written → Bound (the store and runtime alone), p50/p99;
//! - claims per second with 1,000 members (1,000 Leases written at once → all Bound).
//!
//! `cargo bench -p boxery --bench pools`. `BOXERY_BENCH_MEMBERS=N` (default 1000).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use boxery_api::lease::{LeasePhase, LeaseSpec};
use boxery_api::{DynObject, Lease, Pool};
use boxery_store::{ApplyOptions, Store};

const KEY: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHb0uMmDhD7Z3hSR6rW9q2x5Zk2kq3w5b5dB8kKTtJxk bench";

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_boxery")
}

struct Serve(std::process::Child);
impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
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

fn lease(pool: &str, name: &str) -> Lease {
    Lease::new(
        name,
        LeaseSpec {
            pool: pool.into(),
            holder_identity: "bench".into(),
            lease_duration_seconds: 1800,
            renew_time: None,
            public_key: KEY.into(),
        },
    )
}

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

fn main() {
    let members: u32 = std::env::var("BOXERY_BENCH_MEMBERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000);
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
    let t = Instant::now();
    store.apply_all(leases, &ApplyOptions::default()).unwrap();
    loop {
        let bound = store
            .list_as::<Lease>(&Default::default())
            .unwrap()
            .iter()
            .filter(|l| l.status.phase == LeasePhase::Bound)
            .count();
        if bound == members as usize {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(900),
            "{bound} of {members} bound"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let all = t.elapsed();

    println!("pools, fake backend (zero latency), `boxery serve`, 2 cores");
    println!("| measure | result | target |");
    println!("|---|---|---|");
    println!(
        "| claim latency, warm pool of 20: Lease written → Bound, p50 / p99 ({} claims) | {} / {} | ≤ 20 ms / ≤ 100 ms |",
        lat.len(),
        ms(pct(&mut lat, 0.5)),
        ms(pct(&mut lat, 0.99))
    );
    println!(
        "| {members} leases on {members} free members → all Bound | {:.1} s = {:.0} claims/s | ≥ 500/s |",
        all.as_secs_f64(),
        members as f64 / all.as_secs_f64()
    );
    println!(
        "| (setup) pool of {members} members created and clean-imaged | {:.1} s | |",
        made.as_secs_f64()
    );
}
