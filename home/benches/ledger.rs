//! What a budget's check costs (docs/benchmarks.md, "Budgets"): `Ledger::totals` of one lease,
//! one VM and one pool, on a ledger holding a month of use of 1,000 VMs (720 hours × 1,000
//! VMs of compute rows, and an LLM row per VM and hour), against the cheapest read SQLite does
//! on the same file (one row by its primary key) in the same run.
//!
//!   cargo bench -p boxery-home --bench ledger

use std::time::{Duration, Instant};

use boxery_home::usage::{ComputeUse, Ledger, LlmUse, Owner, Scope, this_hour};

const VMS: usize = 1000;
const HOURS: i64 = 720;
const POOLS: usize = 10;

fn p50(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn time(n: usize, mut f: impl FnMut()) -> Duration {
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        f();
        v.push(t.elapsed());
    }
    p50(v)
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger::open(dir.path()).unwrap();
    let now = this_hour();
    let t = Instant::now();
    // each VM held by one lease all month, 100 leases to a pool
    let owners: Vec<Owner> = (0..VMS)
        .map(|i| Owner {
            uid: format!("lease-{i}"),
            kind: "Lease".into(),
            name: format!("l{i}"),
            holder: format!("agent-{}", i % 50),
            pool: format!("p{}", i % POOLS),
        })
        .collect();
    ledger.note_owners(&owners).unwrap();
    for h in (now - HOURS + 1)..=now {
        let compute: Vec<ComputeUse> = (0..VMS)
            .map(|i| ComputeUse {
                hour: h,
                vm: format!("vm-{i}"),
                owner: format!("lease-{i}"),
                vcpu_seconds: 3600.0,
                gib_seconds: 3600.0,
                cpu_seconds: 100.0,
            })
            .collect();
        ledger.add_compute(&compute).unwrap();
        let llm: Vec<LlmUse> = (0..VMS)
            .map(|i| LlmUse {
                hour: h,
                vm: format!("vm-{i}"),
                owner: format!("lease-{i}"),
                grant_uid: format!("g{i}"),
                grant: format!("g{i}"),
                provider: "anthropic".into(),
                model: "claude".into(),
                requests: 3,
                input: 1000,
                output: 200,
            })
            .collect();
        ledger.add_llm(&llm).unwrap();
    }
    let rows = HOURS as usize * VMS;
    eprintln!(
        "ledger: {rows} compute and {rows} llm rows, written in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let raw = rusqlite::Connection::open(boxery_home::layout::usage_db(dir.path())).unwrap();
    let mut k = 0usize;
    let reference = time(2000, || {
        k = (k + 1) % VMS;
        let v: f64 = raw
            .query_row(
                "SELECT vcpu_seconds FROM compute WHERE hour = ?1 AND vm = ?2 AND owner = ?3",
                rusqlite::params![now, format!("vm-{k}"), format!("lease-{k}")],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(v, 3600.0);
    });
    let mut i = 0usize;
    let lease = time(500, || {
        i = (i + 1) % VMS;
        let t = ledger
            .totals(&Scope::Owner(format!("lease-{i}")), 0)
            .unwrap();
        assert_eq!(t.vcpu_seconds, 3600.0 * HOURS as f64);
    });
    let vm = time(500, || {
        i = (i + 1) % VMS;
        let t = ledger
            .totals(&Scope::Vm(format!("vm-{i}")), now - HOURS)
            .unwrap();
        assert_eq!(t.llm[0].1, 3 * HOURS as u64);
    });
    let pool = time(20, || {
        i = (i + 1) % POOLS;
        let t = ledger
            .totals(&Scope::Pool(format!("p{i}")), now - HOURS)
            .unwrap();
        assert_eq!(
            t.vcpu_seconds,
            3600.0 * (HOURS as usize * VMS / POOLS) as f64
        );
    });
    // 1,000 leases with budgets, each checked every 15 s, and 10 pools
    let per_second = (VMS as f64 * lease.as_secs_f64() + POOLS as f64 * pool.as_secs_f64()) / 15.0;
    println!(
        "one row by primary key (the reference): p50 {:.1} µs",
        reference.as_secs_f64() * 1e6
    );
    println!(
        "a lease's totals (its life, {HOURS} hours): p50 {:.1} µs = {:.1}× the reference",
        lease.as_secs_f64() * 1e6,
        lease.as_secs_f64() / reference.as_secs_f64()
    );
    println!(
        "a VM's totals (a month): p50 {:.1} µs = {:.1}× the reference",
        vm.as_secs_f64() * 1e6,
        vm.as_secs_f64() / reference.as_secs_f64()
    );
    println!(
        "a pool's totals (a month, {} leases): p50 {:.2} ms",
        VMS / POOLS,
        pool.as_secs_f64() * 1e3
    );
    println!(
        "budget checks of {VMS} leases and {POOLS} pools every 15 s: {:.2} % of one core",
        per_second * 100.0
    );
}
