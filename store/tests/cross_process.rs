//! A write from another process reaches a watcher within 50 ms. In its own test binary so
//! that the other tests' load does not skew the timing.

mod common;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use boxery_store::WatchEvent;
use common::{ChildGuard, store, vm};
use futures::StreamExt;

const CHILD_ENV: &str = "BOXERY_STORE_TEST_CHILD_DB";
const WRITES: usize = 60;

fn micros_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

/// Not a test on its own: the child process of `writes_from_another_process_reach_watchers`.
#[test]
fn child_writer() {
    let Ok(path) = std::env::var(CHILD_ENV) else {
        return;
    };
    let s = common::open(std::path::Path::new(&path));
    for i in 0..WRITES {
        let mut o = vm(&format!("x{i}"));
        o.metadata
            .annotations
            .insert("test/sent-us".into(), micros_now().to_string());
        s.create(o).unwrap();
        std::thread::sleep(Duration::from_millis(7));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_from_another_process_reach_watchers_within_50ms() {
    let (d, s) = store();
    let path = d.path().join("store.db");
    let mut w = s.watch(Some("Vm"), s.revision().unwrap());
    let _child = ChildGuard::spawn(
        std::process::Command::new(std::env::current_exe().unwrap())
            .args(["child_writer", "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, &path)
            .stdout(std::process::Stdio::null()),
    );
    let started = Instant::now();
    let mut lat = Vec::new();
    while lat.len() < WRITES {
        let (_, ev) = tokio::time::timeout(Duration::from_secs(30), w.next())
            .await
            .expect("the child's writes arrive")
            .expect("stream open")
            .unwrap();
        let now = micros_now();
        let sent: u64 = WatchEvent::object(&ev).metadata.annotations["test/sent-us"]
            .parse()
            .unwrap();
        lat.push(now.saturating_sub(sent));
    }
    lat.sort_unstable();
    let p50 = lat[lat.len() / 2];
    let p95 = lat[lat.len() * 95 / 100];
    eprintln!(
        "cross-process watch latency: p50 {p50} µs, p95 {p95} µs, max {} µs ({:?})",
        lat[lat.len() - 1],
        started.elapsed()
    );
    assert!(p95 < 50_000, "p95 {p95} µs: {lat:?}");
}
