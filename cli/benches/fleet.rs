//! Claims and convergence with the store on a three-member etcd cluster, against the SQLite
//! store and etcd's own put rate, in one run (issue 35). Each store gets a real `boxery serve`
//! on the fake backend (zero latency), so what is measured is the store and the controllers:
//! - the floor: etcd puts of 1 KiB, one at a time (etcd-client), what every etcd write of the
//!   store stands on;
//! - per store, its write limit: `update_status` of a member-sized object, one at a time;
//! - per store, claims: N leases written at once on N free members → all Bound (claims/s, and
//!   the store writes each claim took);
//! - per store, convergence: V Vms written at once → all Running.
//!
//! Writes go in batches of 200 objects: a store on etcd takes at most `--max-txn-ops` / 5
//! objects in one write (4096 here: about 800), as `boxery apply` of a larger file would learn.
//!
//! `cargo bench -p boxery --bench fleet` (`BOXERY_BENCH_MEMBERS`, default 300;
//! `BOXERY_BENCH_VMS`, default 1000). docs/benchmarks.md has the figures.

#[path = "../../store-etcd/tests/cluster/mod.rs"]
mod cluster;
#[path = "support/fleet.rs"]
mod fleet;

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use boxery_api::lease::LeasePhase;
use boxery_api::pool::{PoolMember, PoolMemberSpec};
use boxery_api::vm::VmPhase;
use boxery_api::{DynObject, Lease, Pool, Vm};
use boxery_store::{ApplyOptions, ObjectStore, ObjectStoreExt};
use boxery_store_etcd::{EtcdConfig, EtcdStore};
use fleet::{Serve, lease, vms};

/// How many objects one write carries.
const BATCH: usize = 200;

fn serve(home: &Path) -> Serve {
    let log = std::fs::File::create(home.join("serve.log")).expect("serve's log");
    Serve(
        Command::new(env!("CARGO_BIN_EXE_boxery"))
            .args(["serve", "--inventory-every", "30s"])
            .env("BOXERY_HOME", home)
            .env("BOXERY_BACKEND", "fake")
            .env("BOXERY_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("boxery serve"),
    )
}

fn manifest(yaml: &str) -> DynObject {
    boxery_api::codec::parse_manifests("bench", yaml.as_bytes())
        .expect("a manifest")
        .remove(0)
        .object
}

/// Write `objs` in batches of [`BATCH`].
async fn write_all(store: &dyn ObjectStore, objs: Vec<DynObject>) {
    let mut objs = objs.into_iter().peekable();
    while objs.peek().is_some() {
        let batch: Vec<DynObject> = objs.by_ref().take(BATCH).collect();
        store
            .apply_all(batch, &ApplyOptions::default())
            .await
            .expect("apply");
    }
}

/// Poll `done` every 100 ms until it holds; panics after `limit` saying `what`.
async fn until<F, Fut>(what: &str, limit: Duration, done: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let t = Instant::now();
    while !done().await {
        assert!(t.elapsed() < limit, "{what} not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn pool(store: &dyn ObjectStore, name: &str, n: u32) {
    write_all(store, vec![manifest(&format!(
        "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {{name: {name}}}\nspec:\n  replicas: {n}\n  template:\n    spec:\n      source: {{image: debian-12}}\n"
    ))])
    .await;
    until(
        &format!("pool {name} of {n} free"),
        Duration::from_secs(900),
        || async {
            store
                .get_as::<Pool>(name)
                .await
                .expect("get")
                .is_some_and(|p| p.status.free == n)
        },
    )
    .await;
}

/// `n` leases written at once on a pool of `n` free members → all Bound: how long, and the
/// store revisions each claim took.
async fn claims(store: &dyn ObjectStore, n: u32) -> (Duration, f64) {
    pool(store, "claims", n).await;
    let leases = (0..n)
        .map(|i| DynObject::from_typed(&lease("claims", &format!("c{i}"))).expect("a lease"))
        .collect();
    let rev0 = store.revision().await.expect("revision");
    let t = Instant::now();
    write_all(store, leases).await;
    until("every lease Bound", Duration::from_secs(900), || async {
        store
            .list_as::<Lease>(&Default::default())
            .await
            .expect("list")
            .iter()
            .filter(|l| l.status.phase == LeasePhase::Bound)
            .count()
            == n as usize
    })
    .await;
    let took = t.elapsed();
    let writes = (store.revision().await.expect("revision") - rev0) as f64 / f64::from(n);
    (took, writes)
}

/// `v` Vms written at once → all Running: how long.
async fn converge(store: &dyn ObjectStore, v: u32) -> Duration {
    let t = Instant::now();
    write_all(store, vms(v as usize)).await;
    until("every Vm Running", Duration::from_secs(1800), || async {
        store
            .list_as::<Vm>(&Default::default())
            .await
            .expect("list")
            .iter()
            .filter(|vm| vm.metadata.name.starts_with("vm-") && vm.status.phase == VmPhase::Running)
            .count()
            == v as usize
    })
    .await;
    t.elapsed()
}

/// `update_status` of a member-sized object, `n` times one after another: writes/s.
async fn member_writes(store: &dyn ObjectStore, n: u32) -> f64 {
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
    let mut m = store.create_as(&m).await.expect("create");
    let t = Instant::now();
    for i in 0..n {
        m.status.generation = u64::from(i) + 1;
        m.status.lease = Some(format!("b{i}"));
        m.status.lease_uid = Some(uuid::Uuid::new_v4().to_string());
        m = store.update_status_as(&m).await.expect("update_status");
    }
    f64::from(n) / t.elapsed().as_secs_f64()
}

/// One store's figures.
struct Figures {
    writes_per_s: f64,
    claims: Duration,
    writes_per_claim: f64,
    converge: Duration,
}

async fn measure(store: &dyn ObjectStore, members: u32, vms: u32) -> Figures {
    // the limit first, on a store the controllers have little to do with yet
    let writes_per_s = member_writes(store, 500).await;
    let (claims, writes_per_claim) = claims(store, members).await;
    let converge = converge(store, vms).await;
    Figures {
        writes_per_s,
        claims,
        writes_per_claim,
        converge,
    }
}

fn env_u32(name: &str, default: u32) -> u32 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let members = env_u32("BOXERY_BENCH_MEMBERS", 300);
    let vms = env_u32("BOXERY_BENCH_VMS", 1000);
    let cluster = cluster::Cluster::start(3);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let endpoints: Vec<String> = cluster.hosts().split(',').map(String::from).collect();

    // SQLite: a home of its own, its serve, the store opened beside it.
    let sqlite_home = tempfile::tempdir().expect("temp dir");
    let sqlite = {
        let _serve = serve(sqlite_home.path());
        rt.block_on(async {
            let store: Arc<dyn ObjectStore> = Arc::new(
                boxery_store::Store::open(&sqlite_home.path().join("store.db"))
                    .expect("the SQLite store"),
            );
            measure(&*store, members, vms).await
        })
    };

    // etcd: a home whose config.yaml points at the cluster.
    let etcd_home = tempfile::tempdir().expect("temp dir");
    std::fs::write(
        etcd_home.path().join("config.yaml"),
        format!(
            "store:\n  etcd:\n    endpoints: [{}]\n    prefix: /fleet-bench\n",
            endpoints.join(", ")
        ),
    )
    .expect("config.yaml");
    let (floor, etcd) = {
        let _serve = serve(etcd_home.path());
        rt.block_on(async {
            let urls: Vec<String> = endpoints.iter().map(|h| format!("http://{h}")).collect();
            let mut raw = etcd_client::Client::connect(&urls, None)
                .await
                .expect("etcd");
            let value = vec![b'x'; 1024];
            let t = Instant::now();
            for i in 0..500 {
                raw.put(format!("/fleet-bench-raw/{i}"), value.clone(), None)
                    .await
                    .expect("put");
            }
            let floor = 500.0 / t.elapsed().as_secs_f64();
            let store: Arc<dyn ObjectStore> = Arc::new(
                EtcdStore::connect(&EtcdConfig {
                    endpoints: urls,
                    prefix: "/fleet-bench".into(),
                    tls: None,
                })
                .await
                .expect("the etcd store"),
            );
            (floor, measure(&*store, members, vms).await)
        })
    };

    println!(
        "fleet: {members} claims and {vms} Vms through `boxery serve` (fake backend), SQLite vs a 3-member etcd, same run"
    );
    println!("| measure | SQLite store | store on etcd | etcd / SQLite |");
    println!("|---|---|---|---|");
    let ratio = |e: f64, s: f64| format!("{:.2}", e / s);
    println!("| floor: etcd put of 1 KiB, one at a time | — | {floor:.0} puts/s | |");
    println!(
        "| store limit: `update_status` of a member record, one at a time | {:.0} writes/s | {:.0} writes/s ({:.0} % of etcd's put rate) | {} |",
        sqlite.writes_per_s,
        etcd.writes_per_s,
        100.0 * etcd.writes_per_s / floor,
        ratio(etcd.writes_per_s, sqlite.writes_per_s)
    );
    let rate = |f: &Figures| f64::from(members) / f.claims.as_secs_f64();
    println!(
        "| {members} leases at once on {members} free members → all Bound | {:.1} s = {:.0} claims/s ({:.1} writes/claim) | {:.1} s = {:.0} claims/s ({:.1} writes/claim) | {} |",
        sqlite.claims.as_secs_f64(),
        rate(&sqlite),
        sqlite.writes_per_claim,
        etcd.claims.as_secs_f64(),
        rate(&etcd),
        etcd.writes_per_claim,
        ratio(rate(&etcd), rate(&sqlite))
    );
    println!(
        "| claims against the store's limit (writes/s ÷ writes per claim) | {:.0} % | {:.0} % | |",
        100.0 * rate(&sqlite) * sqlite.writes_per_claim / sqlite.writes_per_s,
        100.0 * rate(&etcd) * etcd.writes_per_claim / etcd.writes_per_s
    );
    println!(
        "| {vms} Vms at once → all Running | {:.1} s = {:.0} Vms/s | {:.1} s = {:.0} Vms/s | {} |",
        sqlite.converge.as_secs_f64(),
        f64::from(vms) / sqlite.converge.as_secs_f64(),
        etcd.converge.as_secs_f64(),
        f64::from(vms) / etcd.converge.as_secs_f64(),
        ratio(sqlite.converge.as_secs_f64(), etcd.converge.as_secs_f64())
    );
}
