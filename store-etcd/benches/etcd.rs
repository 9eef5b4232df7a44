//! The store on etcd against its floor, in one run: a three-member etcd cluster on loopback
//! (store-etcd/tests/cluster), the SQLite store in a temp dir.
//!
//! - `etcd put`: etcd-client puts of a 1 KiB value, one at a time and from 16 tasks: what etcd
//!   itself allows here (the floor).
//! - `create`: `ObjectStore::create` of a Vm, one at a time and from 8 tasks, on etcd and on
//!   SQLite.
//! - `update (CAS)`: conditional updates (each with the resourceVersion it read), 8 tasks each
//!   on objects of their own: the shape of lease claims and status writes.
//!
//! `cargo bench -p boxery-store-etcd --bench etcd` (N=400 by default; `N=…` to change).
//! docs/benchmarks.md has the figures.

#[path = "../tests/cluster/mod.rs"]
mod cluster;

use std::sync::Arc;
use std::time::Instant;

use boxery_api::DynObject;
use boxery_store::{ObjectRef, ObjectStore};
use boxery_store_etcd::{EtcdConfig, EtcdStore};
use serde_json::json;

fn vm(name: &str) -> DynObject {
    serde_json::from_value(json!({
        "apiVersion": "boxery.dev/v1alpha1",
        "kind": "Vm",
        "metadata": {"name": name, "labels": {"bench": "yes"}},
        "spec": {"source": {"image": "tiny"}, "resources": {"cpus": 1, "memory": "256Mi"}}
    }))
    .expect("a Vm")
}

/// `n` operations from `tasks` tasks: operations per second.
async fn rate<F, Fut>(n: usize, tasks: usize, op: F) -> f64
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let op = Arc::new(op);
    let started = Instant::now();
    let mut joins = Vec::new();
    for t in 0..tasks {
        let op = op.clone();
        joins.push(tokio::spawn(async move {
            let mut i = t;
            while i < n {
                op(i).await;
                i += tasks;
            }
        }));
    }
    for j in joins {
        j.await.expect("task");
    }
    n as f64 / started.elapsed().as_secs_f64()
}

async fn creates(store: Arc<dyn ObjectStore>, n: usize, tasks: usize, tag: &str) -> f64 {
    let tag = tag.to_string();
    rate(n, tasks, move |i| {
        let (store, name) = (store.clone(), format!("{tag}-{i}"));
        async move {
            store.create(vm(&name)).await.expect("create");
        }
    })
    .await
}

async fn updates(store: Arc<dyn ObjectStore>, n: usize, tasks: usize, tag: &str) -> f64 {
    for t in 0..tasks {
        store
            .create(vm(&format!("{tag}-u{t}")))
            .await
            .expect("create");
    }
    let tag = tag.to_string();
    rate(n, tasks, move |i| {
        let (store, name) = (store.clone(), format!("{tag}-u{}", i % tasks));
        async move {
            let key = ObjectRef::new("Vm", name);
            let mut obj = store.get(&key).await.expect("get").expect("there");
            obj.metadata
                .annotations
                .insert("bench".into(), i.to_string());
            store.update(obj).await.expect("conditional update");
        }
    })
    .await
}

fn main() {
    let n: usize = std::env::var("N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400);
    let cluster = cluster::Cluster::start(3);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let dir = tempfile::tempdir().expect("temp dir");
    let rows: Vec<(&str, f64)> = rt.block_on(async {
        let endpoints: Vec<String> = cluster
            .hosts()
            .split(',')
            .map(|h| format!("http://{h}"))
            .collect();
        let raw = etcd_client::Client::connect(&endpoints, None)
            .await
            .expect("etcd");
        let value = vec![b'x'; 1024];
        let put = |tasks: usize, tag: &'static str| {
            let (raw, value) = (raw.clone(), value.clone());
            rate(n, tasks, move |i| {
                let (mut raw, value) = (raw.clone(), value.clone());
                async move {
                    raw.put(format!("/bench-raw/{tag}/{i}"), value, None)
                        .await
                        .expect("put");
                }
            })
        };
        let put1 = put(1, "a").await;
        let put16 = put(16, "b").await;
        let etcd: Arc<dyn ObjectStore> = Arc::new(
            EtcdStore::connect(&EtcdConfig {
                endpoints: endpoints.clone(),
                prefix: "/bench".into(),
                tls: None,
            })
            .await
            .expect("the etcd store"),
        );
        let sqlite: Arc<dyn ObjectStore> = Arc::new(
            boxery_store::Store::open(&dir.path().join("store.db")).expect("the SQLite store"),
        );
        vec![
            ("etcd put, 1 at a time", put1),
            ("etcd put, 16 at a time", put16),
            (
                "etcd store create, 1 at a time",
                creates(etcd.clone(), n, 1, "a").await,
            ),
            (
                "etcd store create, 8 at a time",
                creates(etcd.clone(), n, 8, "b").await,
            ),
            (
                "etcd store update (CAS), 8 at a time",
                updates(etcd.clone(), n, 8, "c").await,
            ),
            (
                "SQLite store create, 1 at a time",
                creates(sqlite.clone(), n, 1, "a").await,
            ),
            (
                "SQLite store create, 8 at a time",
                creates(sqlite.clone(), n, 8, "b").await,
            ),
            (
                "SQLite store update (CAS), 8 at a time",
                updates(sqlite.clone(), n, 8, "c").await,
            ),
        ]
    });
    let floor = rows[0].1;
    println!("N={n}; ratios against `etcd put, 1 at a time` in this run");
    println!("{:<40} {:>10} {:>8}", "operation", "ops/s", "ratio");
    for (what, r) in rows {
        println!("{what:<40} {r:>10.0} {:>8.2}", r / floor);
    }
    drop(cluster);
}
