//! Opening a store twice in one process keeps the first one's locks on the file.
//!
//! SQLite in WAL mode keeps a shared POSIX lock on the database file for as long as a
//! connection is open; closing any descriptor of the file in the same process drops it (POSIX
//! locks belong to the process, not to the descriptor). Without that lock another process's
//! last connection takes the file as unused, checkpoints and deletes the WAL under the first
//! store: a corrupted database (`database disk image is malformed`, seen in
//! `tests/pools.rs`'s kill loop). A second [`Store::open`] used to read the file's header
//! through a descriptor of its own and so dropped the lock.
//!
//! The check runs in another process (a process never sees its own locks as conflicting): a
//! small Python program asks for SQLite's exclusive lock on the file without waiting.

use std::path::Path;
use std::process::Command;

use boxery_store::Store;

/// Whether another process could take the file's exclusive lock now (`free`) or not.
fn others_see(path: &Path) -> String {
    let probe = r#"
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
try:
    # SQLite's unix VFS: a shared lock is a read lock on 510 bytes from PENDING_BYTE + 2.
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 510, 0x40000002, 0)
    print("free")
except OSError:
    print("locked")
"#;
    let out = Command::new("python3")
        .args(["-c", probe])
        .arg(path)
        .output()
        .expect("python3 runs this check (apt-get install python3)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn a_second_open_in_one_process_keeps_the_first_ones_lock() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.db");
    let first = Store::open(&path).unwrap();
    first.revision().unwrap();
    assert_eq!(
        others_see(&path),
        "locked",
        "an open store holds its shared lock"
    );
    for _ in 0..3 {
        let second = Store::open(&path).unwrap();
        second.revision().unwrap();
        drop(second);
        assert_eq!(
            others_see(&path),
            "locked",
            "opening (and dropping) a second handle dropped the first one's lock"
        );
    }
    first.revision().unwrap();
    drop(first);
    assert_eq!(
        others_see(&path),
        "free",
        "the check itself can see a free file"
    );
}

/// An SQLite connection of this process that no open store owns (a dropped store's background
/// thread closing its own, another library's): opening the store must not drop its lock
/// either. The store's header check used to read the file through a descriptor of its own
/// whenever no open store had the file, and closing it dropped the lock of every connection.
#[test]
fn opening_a_store_keeps_the_lock_of_a_connection_no_store_owns() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.db");
    drop(Store::open(&path).unwrap());
    let other = rusqlite::Connection::open(&path).unwrap();
    other
        .query_row("SELECT count(*) FROM objects", [], |r| r.get::<_, i64>(0))
        .unwrap();
    assert_eq!(others_see(&path), "locked", "a connection holds its lock");
    let s = Store::open(&path).unwrap();
    s.revision().unwrap();
    assert_eq!(
        others_see(&path),
        "locked",
        "opening the store dropped the lock of this process's connection"
    );
    drop(other);
    s.revision().unwrap();
    assert_eq!(others_see(&path), "locked", "the store holds the lock");
}

/// A store opened again right after the last handle of another was dropped, as a test or a
/// command that opens the store for each read does: the dropped store's background thread
/// may still be closing its connection then. Each new store must hold the lock.
#[test]
fn a_store_opened_right_after_another_was_dropped_holds_the_lock() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.db");
    let mut lost = 0;
    for _ in 0..40 {
        let first = Store::open(&path).unwrap();
        first.revision().unwrap();
        drop(first);
        let second = Store::open(&path).unwrap();
        second.revision().unwrap();
        // The first store's threads are gone by now; the second store's connections must
        // still hold the lock.
        std::thread::sleep(std::time::Duration::from_millis(20));
        second.revision().unwrap();
        if others_see(&path) != "locked" {
            lost += 1;
        }
    }
    assert_eq!(lost, 0, "stores opened without holding the lock, of 40");
}
