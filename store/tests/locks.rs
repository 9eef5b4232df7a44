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
