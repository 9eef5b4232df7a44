//! The store's identity and what it refuses to open: an emptied, truncated, corrupted or
//! foreign file is an error for every operation, never a new empty store.

mod common;

use boxery_store::{Store, StoreError};
use common::{image, open, store, vm};

fn not_a_store(path: &std::path::Path) -> String {
    match Store::open(path) {
        Err(e @ StoreError::NotAStore { .. }) => e.to_string(),
        Err(e) => panic!(
            "expected NotAStore, got {e}: {:?}",
            std::error::Error::source(&e)
        ),
        Ok(_) => panic!("{} opened as a store", path.display()),
    }
}

/// Wait until every connection of a dropped store is closed (its background threads stop on
/// their own; the last close checkpoints the WAL into the file and removes it).
fn closed(path: &std::path::Path) {
    let wal = path.with_extension("db-wal");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while wal.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the store's WAL stays"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

#[test]
fn a_store_keeps_its_identity_and_remembers_what_it_removed() {
    let (d, s) = store();
    let uid = s.uid().to_string();
    assert_eq!(uid.len(), 36, "{uid}");
    let v = s.create(vm("dev1")).unwrap();
    let i = s.create(image("dev1.snap")).unwrap();
    let vuid = v.metadata.uid.clone().unwrap();
    let iuid = i.metadata.uid.clone().unwrap();
    assert!(!s.was_removed(&vuid).unwrap());
    s.delete("Vm", "dev1").unwrap();
    s.delete("Image", "dev1.snap").unwrap();
    assert!(s.was_removed(&vuid).unwrap());
    assert!(s.was_removed(&iuid).unwrap());
    assert!(!s.was_removed("never-seen").unwrap());
    drop(s);
    let again = open(&d.path().join("store.db"));
    assert_eq!(again.uid(), uid, "the identity survives reopening");
    assert!(again.was_removed(&vuid).unwrap());
    // Another store (a new file) has another identity and none of these tombstones.
    let (_d2, other) = store();
    assert_ne!(other.uid(), uid);
    assert!(!other.was_removed(&vuid).unwrap());
}

#[test]
fn an_emptied_truncated_corrupted_or_foreign_file_is_refused() {
    let (d, s) = store();
    s.create(vm("dev1")).unwrap();
    drop(s);
    let path = d.path().join("store.db");
    closed(&path);
    let keep = std::fs::read(&path).unwrap();

    // Truncated to zero (`: > store.db`).
    std::fs::write(&path, b"").unwrap();
    let msg = not_a_store(&path);
    assert!(msg.contains("empty"), "{msg}");
    assert!(msg.contains("boxery orphans"), "{msg}");
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        0,
        "nothing written"
    );

    // Cut in the middle, or overwritten with garbage.
    std::fs::write(&path, &keep[..100]).unwrap();
    not_a_store(&path);
    std::fs::write(&path, vec![0x5a; 8192]).unwrap();
    let msg = not_a_store(&path);
    assert!(msg.contains("not an SQLite database"), "{msg}");

    // Another program's SQLite database.
    std::fs::remove_file(&path).unwrap();
    let c = rusqlite::Connection::open(&path).unwrap();
    c.execute_batch("CREATE TABLE t (x); INSERT INTO t VALUES (1);")
        .unwrap();
    drop(c);
    let msg = not_a_store(&path);
    assert!(msg.contains("without boxery's schema"), "{msg}");
}

#[test]
fn a_missing_file_is_made_whole_even_by_racing_processes() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("store.db");
    let uids: Vec<String> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..8)
            .map(|_| sc.spawn(|| open(&path).uid().to_string()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(uids.iter().all(|u| *u == uids[0]), "{uids:?}");
    let left: Vec<_> = std::fs::read_dir(d.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".new-"))
        .collect();
    assert!(left.is_empty(), "temporary files left: {left:?}");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the store is private to its owner");
}

#[test]
fn a_wave_one_store_is_upgraded_in_place() {
    let (d, s) = store();
    s.create(vm("dev1")).unwrap();
    drop(s);
    let path = d.path().join("store.db");
    closed(&path);
    // What wave 1 wrote: schema version 1, no identity, no tombstones.
    let c = rusqlite::Connection::open(&path).unwrap();
    c.execute_batch("DROP TABLE identity; DROP TABLE tombstones; PRAGMA user_version = 1;")
        .unwrap();
    drop(c);
    let s = open(&path);
    assert_eq!(s.uid().len(), 36);
    assert!(s.get("Vm", "dev1").unwrap().is_some(), "objects kept");
}
