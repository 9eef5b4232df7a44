//! The SQLite file: connection settings and the schema.
//!
//! # Layout (schema version 1, kept in `PRAGMA user_version`)
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

use crate::{Result, StoreError};

/// The schema version this code reads and writes.
pub(crate) const SCHEMA_VERSION: i64 = 1;

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
/// WAL, `synchronous=NORMAL`, a busy timeout, foreign keys off (the schema has none).
pub(crate) fn connect(path: &Path, busy_timeout: Duration) -> Result<Connection> {
    let open_db = |source| StoreError::OpenDb {
        path: path.display().to_string(),
        source,
    };
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_CREATE
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

/// Create the schema if the file is new; refuse a file written by a newer boxery.
pub(crate) fn init(conn: &mut Connection, path: &Path, busy_timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + busy_timeout;
    loop {
        match init_once(conn, path) {
            Err(StoreError::OpenDb {
                source: rusqlite::Error::SqliteFailure(e, _),
                ..
            }) if matches!(e.code, ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked)
                && Instant::now() < deadline =>
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
        source,
    };
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
    if version < SCHEMA_VERSION {
        tx.execute_batch(SCHEMA).map_err(open_db)?;
        tx.pragma_update(None, "user_version", SCHEMA_VERSION)
            .map_err(open_db)?;
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
