//! Compaction and upkeep: the log is trimmed in small batches, each its own short write
//! transaction, so a writer never waits long behind it (the failure k3s users hit when
//! compaction held the write lock); the WAL is checkpointed from a background thread.
//!
//! # How the file stays bounded
//! Current objects live in `objects`; everything else is history in `log`, including the only
//! trace of deleted objects (and of the many `Event` objects, which churn). Compaction deletes
//! log rows older than the newest `keep_revisions` and raises the floor, so the file holds the
//! live objects plus a window of history. SQLite reuses the freed pages, so the file's size
//! follows its peak rather than growing without end.

use std::path::PathBuf;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use rusqlite::{Connection, TransactionBehavior, params};

use crate::schema::{connect, meta, set_meta, to_i64};
use crate::{AutoCompact, Result};

/// Log rows deleted per compaction transaction.
pub(crate) const COMPACT_BATCH: i64 = 1000;

/// One compaction step: delete up to `COMPACT_BATCH` log rows at or below
/// `current revision - keep` and raise the floor in the same transaction. Returns the rows
/// deleted and whether the target is reached.
pub(crate) fn compact_batch(conn: &mut Connection, keep: u64) -> Result<(u64, bool)> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let current = meta(&tx, "revision")?;
    let floor = meta(&tx, "compacted")?;
    let target = current.saturating_sub(keep);
    if target <= floor {
        return Ok((0, true));
    }
    // The highest revision of this batch: the target, or the last of the next COMPACT_BATCH rows.
    let (rows, last): (i64, Option<i64>) = tx
        .prepare_cached(
            "SELECT count(*), max(rev) FROM \
             (SELECT rev FROM log WHERE rev > ?1 AND rev <= ?2 ORDER BY rev LIMIT ?3)",
        )?
        .query_row(params![to_i64(floor), to_i64(target), COMPACT_BATCH], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })?;
    // A full batch ends at its last row; a short one reaches the target.
    let (upto, done) = match last {
        Some(l) if rows == COMPACT_BATCH && (l.max(0) as u64) < target => (l as u64, false),
        _ => (target, true),
    };
    let deleted = tx
        .prepare_cached("DELETE FROM log WHERE rev > ?1 AND rev <= ?2")?
        .execute(params![to_i64(floor), to_i64(upto)])?;
    set_meta(&tx, "compacted", upto)?;
    tx.commit()?;
    Ok((deleted as u64, done))
}

/// The upkeep thread: a passive WAL checkpoint when the file changed (so writers rarely pay
/// for one), auto-compaction when configured, and every [`crate::RELEASE_EVERY`] the idle
/// memory of the store's connections given back ([`crate::Inner::release_memory`]). Stops when
/// the store's last handle is dropped.
pub(crate) fn spawn_upkeep(
    path: PathBuf,
    busy_timeout: Duration,
    auto: Option<AutoCompact>,
    store: std::sync::Weak<crate::Inner>,
    stop: Receiver<()>,
) -> std::io::Result<()> {
    std::thread::Builder::new().name("boxery-upkeep".into()).spawn(move || {
        let mut conn = match connect(&path, busy_timeout) {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(error = %e, "the store's upkeep thread cannot open the file; the log will not be compacted");
                return;
            }
        };
        let tick = Duration::from_secs(1);
        let mut last_version: Option<i64> = None;
        let mut next_compact = auto.as_ref().map(|a| Instant::now() + a.every);
        let mut next_release = Instant::now() + crate::RELEASE_EVERY;
        loop {
            match stop.recv_timeout(tick) {
                Err(RecvTimeoutError::Timeout) => {}
                _ => return,
            }
            if Instant::now() >= next_release {
                next_release = Instant::now() + crate::RELEASE_EVERY;
                match store.upgrade() {
                    Some(inner) => inner.release_memory(),
                    None => return,
                }
                let _ = conn.execute_batch("PRAGMA shrink_memory");
            }
            if let Ok(v) = conn.query_row("PRAGMA data_version", [], |r| r.get::<_, i64>(0))
                && last_version != Some(v)
            {
                last_version = Some(v);
                if let Err(e) = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
                    tracing::debug!(error = %e, "WAL checkpoint skipped");
                }
            }
            if let (Some(a), Some(at)) = (&auto, next_compact)
                && Instant::now() >= at
            {
                next_compact = Some(Instant::now() + a.every);
                // One batch at a time, checking for shutdown between batches.
                loop {
                    match compact_batch(&mut conn, a.keep_revisions) {
                        Ok((n, done)) => {
                            if n > 0 {
                                tracing::debug!(rows = n, "compacted the store's log");
                            }
                            if done {
                                break;
                            }
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "compacting the store's log failed; retrying later");
                            break;
                        }
                    }
                    if !matches!(stop.try_recv(), Err(std::sync::mpsc::TryRecvError::Empty)) {
                        return;
                    }
                }
            }
        }
    })?;
    Ok(())
}
