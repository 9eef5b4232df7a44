//! Concurrent writers never lose an update: read-modify-write with resourceVersion
//! preconditions, retried on Conflict, from threads sharing one handle and from threads with
//! their own handles (their own SQLite connections, as separate processes would have).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use boxery_store::{Store, StoreError};
use common::{store, vm};

const THREADS: usize = 4;
const INCREMENTS: usize = 50;

fn increment(s: &Store, conflicts: &AtomicUsize) {
    loop {
        let mut o = s.get("Vm", "counter").unwrap().unwrap();
        let n: usize = o
            .metadata
            .annotations
            .get("count")
            .map_or(0, |c| c.parse().unwrap());
        o.metadata
            .annotations
            .insert("count".into(), (n + 1).to_string());
        match s.update(o) {
            Ok(_) => return,
            Err(StoreError::Conflict { .. }) => {
                conflicts.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => panic!("update failed: {e}"),
        }
    }
}

fn run(handles: Vec<Store>) -> usize {
    let conflicts = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = handles
        .into_iter()
        .map(|s| {
            let conflicts = conflicts.clone();
            std::thread::spawn(move || {
                for _ in 0..INCREMENTS {
                    increment(&s, &conflicts);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    conflicts.load(Ordering::Relaxed)
}

fn check(s: &Store, conflicts: usize, label: &str) {
    let o = s.get("Vm", "counter").unwrap().unwrap();
    let total = THREADS * INCREMENTS;
    assert_eq!(
        o.metadata.annotations["count"],
        total.to_string(),
        "{label}: no update lost"
    );
    assert_eq!(
        s.revision().unwrap(),
        1 + total as u64,
        "{label}: one revision per successful update"
    );
    eprintln!("{label}: {total} updates, {conflicts} conflicts retried");
}

#[test]
fn threads_sharing_a_handle_never_lose_an_update() {
    let (_d, s) = store();
    s.create(vm("counter")).unwrap();
    let conflicts = run((0..THREADS).map(|_| s.clone()).collect());
    check(&s, conflicts, "shared handle");
}

#[test]
fn threads_with_their_own_connections_never_lose_an_update() {
    let (d, s) = store();
    s.create(vm("counter")).unwrap();
    let path = d.path().join("store.db");
    let conflicts = run((0..THREADS).map(|_| common::open(&path)).collect());
    check(&s, conflicts, "own handles");
}

#[test]
fn many_handles_can_create_the_same_new_file_at_once() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("new.db");
    let barrier = Arc::new(std::sync::Barrier::new(6));
    let threads: Vec<_> = (0..6)
        .map(|i| {
            let (path, barrier) = (path.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let s = common::open(&path);
                s.create(vm(&format!("v{i}"))).unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let s = common::open(&path);
    assert_eq!(s.list("Vm", &Default::default()).unwrap().0.len(), 6);
}
