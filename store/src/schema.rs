//! The SQLite file: connection settings and the schema.
//!
//! # Layout (schema version 2, kept in `PRAGMA user_version`)
//! - `identity(key, value)`: `uid`, the store's identity, made once with the file and never
//!   changed (recorded in the marks backends put on what boxery makes), and `created`.
//! - `tombstones(uid, kind, name, rev)`: the uid of every Vm and Image this store removed, so
//!   that only what this store knew and deleted is ever removed from a backend as an orphan.
//! - `meta(key, value)`: `revision` (the global counter, the last revision written) and
//!   `compacted` (the compaction floor: log rows at or below it may be gone).
//! - `objects(kind, name, uid, rev, json)`: the current object of every key (indexed by uid
//!   too, to check that an owner exists).
//! - `owners(owner_uid, kind, name)`: one row per ownerReference of a current object, so the
//!   cascade finds what an object owns without reading any JSON.
//! - `log(rev, kind, name, type, json)`: one row per change, `rev` is the revision; `type` is
//!   `Added`, `Modified` or `Deleted`; `json` is the object as of that change.
//! - `leaders(lock, holder, pid, boot_id, start_time, epoch, expires_ms)`: leader election.

use std::path::Path;
use std::time::{Duration, Instant};

use rusqlite::{Connection, ErrorCode, OpenFlags, TransactionBehavior};

use crate::{DbError, Result, StoreError};

/// The schema version this code reads and writes.
pub const SCHEMA_VERSION: i64 = 2;

const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value INTEGER NOT NULL
) WITHOUT ROWID;
INSERT OR IGNORE INTO meta (key, value) VALUES ('revision', 0), ('compacted', 0);

CREATE TABLE IF NOT EXISTS objects (
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    uid  TEXT NOT NULL,
    rev  INTEGER NOT NULL,
    json TEXT NOT NULL,
    PRIMARY KEY (kind, name)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS objects_by_uid ON objects (uid);

CREATE TABLE IF NOT EXISTS owners (
    owner_uid TEXT NOT NULL,
    kind      TEXT NOT NULL,
    name      TEXT NOT NULL,
    PRIMARY KEY (owner_uid, kind, name)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS owners_by_object ON owners (kind, name);

CREATE TABLE IF NOT EXISTS log (
    rev  INTEGER PRIMARY KEY,
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    type TEXT NOT NULL,
    json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS log_by_kind ON log (kind, rev);

CREATE TABLE IF NOT EXISTS identity (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS tombstones (
    uid  TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    rev  INTEGER NOT NULL
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS leaders (
    lock       TEXT PRIMARY KEY,
    holder     TEXT NOT NULL,
    pid        INTEGER NOT NULL,
    boot_id    TEXT NOT NULL,
    start_time INTEGER,
    epoch      INTEGER NOT NULL,
    expires_ms INTEGER NOT NULL
) WITHOUT ROWID;
"#;

/// Open one connection to the store's file with the settings every connection shares:
/// WAL, `synchronous=NORMAL`, a busy timeout, foreign keys off (the schema has none). Also
/// what boxery's other SQLite file, the usage ledger, opens with ([`crate::connect_sqlite`]).
pub fn connect(path: &Path, busy_timeout: Duration) -> Result<Connection> {
    let open_db = |source| StoreError::OpenDb {
        path: path.display().to_string(),
        source: DbError::new(source),
    };
    // Never SQLITE_OPEN_CREATE: a new store is made whole by `create_new`, so a missing file
    // here is an error, not a new empty store.
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_NO_MUTEX
        | OpenFlags::SQLITE_OPEN_URI;
    let conn = Connection::open_with_flags(path, flags).map_err(open_db)?;
    conn.busy_timeout(busy_timeout).map_err(open_db)?;
    // Every statement the store runs stays prepared.
    conn.set_prepared_statement_cache_capacity(64);
    // Switching to WAL needs a moment of exclusive access, and SQLite answers BUSY at once
    // (without its busy handler) when another connection opens the same new file: retry.
    let mode: String = retry_busy(busy_timeout, || {
        conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
    })
    .map_err(open_db)?;
    if !mode.eq_ignore_ascii_case("wal") {
        tracing::warn!(path = %path.display(), mode, "the store's file is not in WAL mode");
    }
    conn.pragma_update(None, "synchronous", "NORMAL")
        .map_err(open_db)?;
    // A small page cache per connection (SQLite's default is 2 MiB): the store has several
    // connections, the hot pages sit in the OS page cache anyway, and a control plane's
    // idle memory is a measured target (docs/benchmarks.md).
    conn.pragma_update(None, "cache_size", -512)
        .map_err(open_db)?;
    Ok(conn)
}

/// Run `f` again while SQLite answers BUSY or LOCKED without having waited (as it does while
/// another connection sets up a new file), for up to `timeout`.
fn retry_busy<T>(
    timeout: Duration,
    mut f: impl FnMut() -> rusqlite::Result<T>,
) -> rusqlite::Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        match f() {
            Err(rusqlite::Error::SqliteFailure(e, _))
                if matches!(e.code, ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked)
                    && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(2));
            }
            other => return other,
        }
    }
}

/// Make a new store at `path` unless a file is there: the schema and a fresh identity are
/// written into a temporary file beside it, which is then linked into place (so `path` is
/// always either absent or a whole boxery store, even when several processes race to make
/// it). Returns whether this call made it.
pub(crate) fn create_new(path: &Path) -> Result<bool> {
    let open_err = |source| StoreError::Open {
        path: path.display().to_string(),
        source,
    };
    if path.exists() || path.symlink_metadata().is_ok() {
        return Ok(false);
    }
    let file = path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_else(|| "store.db".into());
    let tmp = path.with_file_name(format!(
        ".{file}.new-{}-{}",
        std::process::id(),
        uuid::Uuid::new_v4().simple()
    ));
    let made = (|| -> Result<()> {
        let open_db = |source| StoreError::OpenDb {
            path: tmp.display().to_string(),
            source: DbError::new(source),
        };
        {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(open_err)?;
        }
        let mut conn = Connection::open(&tmp).map_err(open_db)?;
        let tx = conn.transaction().map_err(open_db)?;
        write_schema(&tx).map_err(open_db)?;
        tx.commit().map_err(open_db)?;
        conn.close().map_err(|(_, e)| open_db(e))?;
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(open_err)?;
        Ok(())
    })();
    let linked = made.and_then(|()| {
        // Under a lock, so that no other process is between its own check and link: a WAL
        // or shared-memory file left by a store that was moved or deleted belongs to that
        // store, and SQLite would replay it into the new one. Such files are moved aside.
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path.with_file_name(format!(".{file}.create-lock")))
            .map_err(open_err)?;
        lock.lock().map_err(open_err)?;
        if path.symlink_metadata().is_ok() {
            return Ok(false);
        }
        for suffix in ["-wal", "-shm"] {
            let stale = path.with_file_name(format!("{file}{suffix}"));
            if stale.symlink_metadata().is_ok() {
                let aside = path.with_file_name(format!(
                    "{file}{suffix}.stale-{}",
                    uuid::Uuid::new_v4().simple()
                ));
                std::fs::rename(&stale, &aside).map_err(open_err)?;
                tracing::warn!(from = %stale.display(), to = %aside.display(), "moved aside a file left by a removed store");
            }
        }
        match std::fs::hard_link(&tmp, path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(open_err(e)),
        }
    });
    let _ = std::fs::remove_file(&tmp);
    linked
}

/// Refuse, before writing a byte to it, a file that cannot be a boxery store: an empty file,
/// one without SQLite's header, or an SQLite database whose schema version is 0 (another
/// program's, or one whose header was lost).
///
/// The file is read through SQLite only, never through a descriptor of this function's own:
/// closing any descriptor of a file drops every POSIX lock this process holds on it. Among
/// them: the shared lock each SQLite connection keeps on the file in WAL mode (SQLite takes it
/// once per process and counts its users, so connections opened after such a close never take
/// it again), and the exclusive lock the last connection of all holds while it checkpoints and
/// deletes the WAL and the shared-memory index. Without them another process opens the WAL and
/// index just before they are deleted, or deletes them under this process: each side goes on
/// with a WAL of its own, reading frames through an index that is not theirs (garbled rows)
/// and checkpointing them into the file (a corrupted store). An open store is not the only
/// holder: a store dropped a moment ago still has its background threads closing their
/// connections (the last of them the one that deletes the WAL). The size comes from `stat`,
/// which opens nothing.
pub(crate) fn probe(path: &Path) -> Result<()> {
    let not_a_store = |why: &str| StoreError::NotAStore {
        path: path.display().to_string(),
        why: why.to_string(),
    };
    let size = std::fs::metadata(path)
        .map_err(|source| StoreError::Open {
            path: path.display().to_string(),
            source,
        })?
        .len();
    if size == 0 {
        return Err(not_a_store(
            "the file is empty (0 bytes): it was truncated or replaced",
        ));
    }
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let Ok(c) = Connection::open_with_flags(path, flags) else {
        // Opening it read-write says why (`connect`).
        return Ok(());
    };
    match c.query_row("PRAGMA user_version", [], |r| r.get::<_, i64>(0)) {
        Ok(0) => Err(not_a_store(
            "the file is an SQLite database without boxery's schema",
        )),
        Err(rusqlite::Error::SqliteFailure(e, _)) if e.code == ErrorCode::NotADatabase => Err(
            not_a_store("the file is not an SQLite database: it is corrupted or was replaced"),
        ),
        _ => Ok(()),
    }
}

/// Create what is missing of the schema, an identity if there is none, and the version.
fn write_schema(tx: &rusqlite::Transaction<'_>) -> rusqlite::Result<()> {
    tx.execute_batch(SCHEMA)?;
    tx.execute(
        "INSERT OR IGNORE INTO identity (key, value) VALUES ('uid', ?1), ('created', ?2)",
        [
            uuid::Uuid::new_v4().to_string(),
            boxery_api::now().to_rfc3339(),
        ],
    )?;
    tx.pragma_update(None, "user_version", SCHEMA_VERSION)
}

/// A new store in memory: one private connection, with the schema and a fresh identity
/// written as [`create_new`] writes them into a new file.
pub(crate) fn memory() -> rusqlite::Result<Connection> {
    let mut conn = Connection::open_in_memory()?;
    conn.set_prepared_statement_cache_capacity(64);
    let tx = conn.transaction()?;
    write_schema(&tx)?;
    tx.commit()?;
    Ok(conn)
}

/// The store's identity (its `uid`).
pub(crate) fn identity(conn: &Connection) -> rusqlite::Result<String> {
    conn.query_row("SELECT value FROM identity WHERE key = 'uid'", [], |r| {
        r.get(0)
    })
}

/// Check that the file is a boxery store and bring an older schema up to date; refuse a
/// file written by a newer boxery, and any file that is not a boxery store (empty, truncated,
/// another program's database).
pub(crate) fn init(conn: &mut Connection, path: &Path, busy_timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + busy_timeout;
    loop {
        match init_once(conn, path) {
            Err(e @ StoreError::OpenDb { .. })
                if matches!(
                    e.sqlite_code(),
                    Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked)
                ) && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(2));
            }
            other => return other,
        }
    }
}

fn init_once(conn: &mut Connection, path: &Path) -> Result<()> {
    let open_db = |source| StoreError::OpenDb {
        path: path.display().to_string(),
        source: DbError::new(source),
    };
    // A store already at this version (every open but the first after an upgrade) is only
    // read: opening never takes the write lock, so a command that only reads never waits for
    // writers, nor holds them up.
    let current: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(open_db)?;
    if current == SCHEMA_VERSION {
        return Ok(());
    }
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(open_db)?;
    let version: i64 = tx
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(open_db)?;
    if version > SCHEMA_VERSION {
        return Err(StoreError::SchemaTooNew {
            path: path.display().to_string(),
            found: version,
            supported: SCHEMA_VERSION,
        });
    }
    if version == 0 {
        let size = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
        return Err(StoreError::NotAStore {
            path: path.display().to_string(),
            why: if size == 0 {
                "the file is empty (0 bytes): it was truncated or replaced".into()
            } else {
                "the file is an SQLite database without boxery's schema".into()
            },
        });
    }
    if version < SCHEMA_VERSION {
        // Version 1 (wave 1) lacks the identity and the tombstones: add them. Its backend
        // objects carry marks without a store identity; see `docs/store.md`.
        write_schema(&tx).map_err(open_db)?;
    }
    tx.commit().map_err(open_db)?;
    Ok(())
}

/// Read one `meta` value.
pub(crate) fn meta(conn: &Connection, key: &str) -> rusqlite::Result<u64> {
    let v: i64 = conn
        .prepare_cached("SELECT value FROM meta WHERE key = ?1")?
        .query_row([key], |r| r.get(0))?;
    Ok(v.max(0) as u64)
}

/// Write one `meta` value.
pub(crate) fn set_meta(conn: &Connection, key: &str, value: u64) -> rusqlite::Result<()> {
    conn.prepare_cached("UPDATE meta SET value = ?2 WHERE key = ?1")?
        .execute(rusqlite::params![key, to_i64(value)])?;
    Ok(())
}

/// A revision as SQLite stores it (revisions never come near `i64::MAX`).
pub(crate) fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}
