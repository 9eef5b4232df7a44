//! The store's benchmark: single-object writes through the `Store` API against raw rusqlite
//! single-row INSERT transactions on the same file settings, and how fast a write by another
//! process reaches a watcher, and what opening an existing store costs (every CLI command
//! does it once) against a raw open of the same file.
//!
//! Run with `cargo bench -p boxery-store --bench store`. Targets: store write p99 ≤ 5 ms and
//! ≥ 3,000 writes/s; cross-process watch p99 ≤ 50 ms.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use boxery_api::{API_VERSION, DynObject};
use boxery_store::{ObjectRef, ObjectStore, Store, StoreOptions};
use futures::StreamExt;
use serde_json::json;

const CHILD_COUNT_ENV: &str = "BOXERY_STORE_BENCH_CHILD_COUNT";

/// Objects written per series: 5,000 under `cargo bench`; a quick 100 when the binary runs as
/// a test target (`cargo test --all-targets`), which passes no `--bench`.
fn writes() -> usize {
    if std::env::args().any(|a| a == "--bench") {
        5_000
    } else {
        100
    }
}

/// Objects the child process writes for the watch series.
fn watched() -> usize {
    match std::env::var(CHILD_COUNT_ENV) {
        Ok(n) => n.parse().expect("count"),
        Err(_) => writes() / 5,
    }
}
const CHILD_ENV: &str = "BOXERY_STORE_BENCH_CHILD_DB";

fn vm(name: &str) -> DynObject {
    serde_json::from_value(json!({
        "apiVersion": API_VERSION, "kind": "Vm",
        "metadata": {"name": name, "labels": {"team": "web", "bench": "yes"}},
        "spec": {"source": {"image": "debian-12"}, "resources": {"cpus": 2, "memory": "4Gi", "disk": "20Gi"}}
    }))
    .expect("fixture")
}

fn open(path: &Path) -> Store {
    Store::open_with(
        path,
        StoreOptions {
            auto_compact: None,
            ..Default::default()
        },
    )
    .expect("open store")
}

fn micros_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_micros() as u64
}

/// One measured series: per-operation latencies and the wall time of the whole run.
struct Series {
    name: &'static str,
    lat: Vec<Duration>,
    total: Duration,
}

impl Series {
    fn run(name: &'static str, n: usize, mut op: impl FnMut(usize)) -> Series {
        let mut lat = Vec::with_capacity(n);
        let start = Instant::now();
        for i in 0..n {
            let t = Instant::now();
            op(i);
            lat.push(t.elapsed());
        }
        Series {
            name,
            lat,
            total: start.elapsed(),
        }
    }

    fn pct(&self, p: f64) -> Duration {
        let mut l = self.lat.clone();
        l.sort_unstable();
        l[((l.len() as f64 - 1.0) * p).round() as usize]
    }

    fn row(&self) -> String {
        let rate = if self.total.is_zero() {
            0.0
        } else {
            self.lat.len() as f64 / self.total.as_secs_f64()
        };
        format!(
            "| {:<44} | {:>6} | {:>10.0} | {:>9.3} | {:>9.3} | {:>9.3} |",
            self.name,
            self.lat.len(),
            rate,
            ms(self.pct(0.50)),
            ms(self.pct(0.99)),
            ms(self.pct(1.0)),
        )
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The child process: writes objects stamped with their send time, paced 2 ms apart.
fn child(path: &str) {
    let s = open(Path::new(path));
    for i in 0..watched() {
        let mut o = vm(&format!("w{i}"));
        o.metadata
            .annotations
            .insert("bench/sent-us".into(), micros_now().to_string());
        s.create(o).expect("child write");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn store_writes(dir: &Path) -> (Series, Series, Series) {
    let s = open(&dir.join("store.db"));
    let n = writes();
    let mut objs = Vec::with_capacity(n);
    let create = Series::run("Store::create (validate + write)", n, |i| {
        objs.push(s.create(vm(&format!("vm{i}"))).expect("create"));
    });
    let update = Series::run("Store::update (spec change, rv precondition)", n, |i| {
        let mut o = objs[i].clone();
        o.rest.get_mut("spec").expect("spec")["resources"]["cpus"] = json!(4);
        objs[i] = s.update(o).expect("update");
    });
    let status = Series::run("Store::update_status", n, |i| {
        let mut o = objs[i].clone();
        o.rest.insert(
            "status".into(),
            json!({"phase": "Running", "observedGeneration": 2}),
        );
        objs[i] = s.update_status(o).expect("update_status");
    });
    (create, update, status)
}

fn raw_inserts(dir: &Path) -> Series {
    let conn = rusqlite::Connection::open(dir.join("raw.db")).expect("open raw");
    conn.busy_timeout(Duration::from_secs(5))
        .expect("busy timeout");
    let _: String = conn
        .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
        .expect("wal");
    conn.pragma_update(None, "synchronous", "NORMAL")
        .expect("synchronous");
    conn.execute_batch(
        "CREATE TABLE kv (id INTEGER PRIMARY KEY, name TEXT NOT NULL, json TEXT NOT NULL)",
    )
    .expect("table");
    let json = serde_json::to_string(&vm("raw")).expect("json");
    let n = writes();
    let mut stmt = conn
        .prepare("INSERT INTO kv (name, json) VALUES (?1, ?2)")
        .expect("prepare");
    Series::run("raw rusqlite INSERT, one row per transaction", n, |i| {
        conn.execute_batch("BEGIN IMMEDIATE").expect("begin");
        stmt.execute(rusqlite::params![format!("vm{i}"), json])
            .expect("insert");
        conn.execute_batch("COMMIT").expect("commit");
    })
}

/// `get` through the async trait (`Arc<dyn ObjectStore>`): on a multi-thread runtime each
/// call goes through tokio's blocking pool (what the controller pays), on a current-thread
/// runtime it runs inline. Against `Store::get` this is the price of keeping SQLite off the
/// async workers.
fn trait_reads(dir: &Path) -> (Series, Series) {
    let s: Arc<dyn ObjectStore> = Arc::new(open(&dir.join("store.db")));
    let n = writes();
    let run = |name: &'static str, rt: tokio::runtime::Runtime| {
        let mut lat = Vec::with_capacity(n);
        let start = Instant::now();
        rt.block_on(async {
            for i in 0..n {
                let key = ObjectRef::new("Vm", format!("vm{i}"));
                let t = Instant::now();
                s.get(&key).await.expect("get").expect("present");
                lat.push(t.elapsed());
            }
        });
        Series {
            name,
            lat,
            total: start.elapsed(),
        }
    };
    let multi = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let current = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    (
        run("dyn ObjectStore::get (multi-thread rt)", multi),
        run("dyn ObjectStore::get (current-thread rt)", current),
    )
}

fn reads(dir: &Path) -> (Series, Series) {
    let s = open(&dir.join("store.db"));
    let n = writes();
    let get = Series::run("Store::get", n, |i| {
        s.get("Vm", &format!("vm{i}"))
            .expect("get")
            .expect("present");
    });
    let sel = "team=web".parse().expect("selector");
    let list = Series::run("Store::list (all Vms, selector)", 20, |_| {
        assert_eq!(s.list("Vm", &sel).expect("list").0.len(), n);
    });
    (get, list)
}

/// What every CLI command pays to open an existing store (the check that it is a boxery store,
/// its identity, the schema check, the background threads), against opening the same file
/// with rusqlite and reading one value: the floor.
fn opens(dir: &Path) -> (Series, Series) {
    let path = dir.join("store.db");
    let n = writes() / 25;
    let store = Series::run("Store::open (existing store)", n, |_| {
        drop(open(&path));
    });
    let raw = Series::run("raw rusqlite open + one SELECT (limit)", n, |_| {
        let c = rusqlite::Connection::open(&path).expect("open");
        let v: i64 = c
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .expect("read");
        assert_eq!(v, 2);
    });
    (store, raw)
}

fn watch_latency(dir: &Path) -> Series {
    let path = dir.join("watch.db");
    let n = watched();
    let s = open(&path);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut w = s.watch(Some("Vm"), s.revision().expect("revision"));
    let mut child = std::process::Command::new(std::env::current_exe().expect("own path"))
        .env(CHILD_ENV, &path)
        .env(CHILD_COUNT_ENV, n.to_string())
        .spawn()
        .expect("spawn the writer process");
    let start = Instant::now();
    let mut lat = Vec::with_capacity(n);
    rt.block_on(async {
        while lat.len() < n {
            let next = tokio::time::timeout(Duration::from_secs(30), w.next()).await;
            let Ok(Some(Ok((_, ev)))) = next else {
                panic!("watch ended or stalled: {next:?}")
            };
            let now = micros_now();
            let sent: u64 = ev.object().metadata.annotations["bench/sent-us"]
                .parse()
                .expect("stamp");
            lat.push(Duration::from_micros(now.saturating_sub(sent)));
        }
    });
    let total = start.elapsed();
    let _ = child.wait();
    Series {
        name: "cross-process write -> watcher (2 ms pacing)",
        lat,
        total,
    }
}

fn main() {
    if let Ok(path) = std::env::var(CHILD_ENV) {
        child(&path);
        return;
    }
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let (create, update, status) = store_writes(dir.path());
    let raw = raw_inserts(dir.path());
    let (get, list) = reads(dir.path());
    let (trait_get, trait_get_inline) = trait_reads(dir.path());
    let (opened, raw_open) = opens(dir.path());
    let watch = watch_latency(dir.path());
    println!();
    println!(
        "| {:<44} | {:>6} | {:>10} | {:>9} | {:>9} | {:>9} |",
        "operation", "ops", "ops/s", "p50 ms", "p99 ms", "max ms"
    );
    println!(
        "|{:-<46}|{:->8}|{:->12}|{:->11}|{:->11}|{:->11}|",
        "", "", "", "", "", ""
    );
    for s in [
        &create,
        &update,
        &status,
        &raw,
        &get,
        &trait_get,
        &trait_get_inline,
        &list,
        &opened,
        &raw_open,
        &watch,
    ] {
        println!("{}", s.row());
    }
    println!(
        "\n(ops/s of the watch row is the child's paced write rate; its latencies include the child's create call)"
    );
    if writes() < 5_000 {
        println!(
            "quick smoke run (no --bench): run `cargo bench -p boxery-store --bench store` for figures"
        );
        return;
    }
    println!(
        "targets: store write p99 <= 5 ms: {}; >= 3,000 writes/s: {}; watch p99 <= 50 ms: {}",
        ok(create.pct(0.99) <= Duration::from_millis(5)
            && update.pct(0.99) <= Duration::from_millis(5)),
        ok(rate(&create) >= 3000.0 && rate(&update) >= 3000.0),
        ok(watch.pct(0.99) <= Duration::from_millis(50)),
    );
}

fn rate(s: &Series) -> f64 {
    s.lat.len() as f64 / s.total.as_secs_f64()
}

fn ok(b: bool) -> &'static str {
    if b { "met" } else { "MISSED" }
}
