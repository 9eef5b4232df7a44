//! Watch: log rows after a revision, in batches, then a wait for a wake-up.
//!
//! Wake-ups come from a `tokio::sync::watch` channel that holds the newest revision known to
//! this process. In-process writes publish their revision right after commit; writes from
//! other processes are noticed by one poller thread per [`Store`](crate::Store), which reads
//! `PRAGMA data_version` on its own connection every few milliseconds and, when it changed,
//! publishes the file's revision. A watcher marks the channel seen *before* it reads, so a
//! write that commits after its read always wakes it.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Duration;

use futures::stream::{self, BoxStream, StreamExt};
use rusqlite::{Connection, params};
use tokio::sync::watch;

use crate::schema::{connect, meta, to_i64};
use crate::{Inner, Result, StoreError, WatchEvent};

/// Log rows read per batch.
pub(crate) const BATCH: usize = 512;

/// Rows of the log after `after` (of one kind, or all), at most `BATCH`, and the revision of
/// the snapshot they were read from. `TooOld` when compaction removed rows after `after`.
pub(crate) fn read_log(
    conn: &mut Connection,
    kind: Option<&str>,
    after: u64,
) -> Result<(Vec<(u64, WatchEvent)>, u64)> {
    let tx = conn.transaction()?;
    let floor = meta(&tx, "compacted")?;
    if after < floor {
        return Err(StoreError::TooOld {
            requested: after,
            floor,
        });
    }
    let mut out = Vec::new();
    {
        let mut stmt = match kind {
            Some(_) => tx.prepare_cached(
                "SELECT rev, type, json FROM log WHERE kind = ?1 AND rev > ?2 ORDER BY rev LIMIT ?3",
            )?,
            None => tx.prepare_cached(
                "SELECT rev, type, json FROM log WHERE ?1 IS NULL AND rev > ?2 ORDER BY rev LIMIT ?3",
            )?,
        };
        let mut rows = stmt.query(params![kind, to_i64(after), BATCH as i64])?;
        while let Some(r) = rows.next()? {
            let rev: i64 = r.get(0)?;
            let ty: String = r.get(1)?;
            let json: String = r.get(2)?;
            let obj = serde_json::from_str(&json)?;
            let ev = match ty.as_str() {
                "Added" => WatchEvent::Added(obj),
                "Deleted" => WatchEvent::Deleted(obj),
                _ => WatchEvent::Modified(obj),
            };
            out.push((rev.max(0) as u64, ev));
        }
    }
    let head = meta(&tx, "revision")?;
    tx.commit()?;
    Ok((out, head))
}

struct State {
    inner: Arc<Inner>,
    kind: Option<String>,
    /// Every change at or below this revision has been yielded (or did not match).
    pos: u64,
    rx: watch::Receiver<u64>,
    buf: VecDeque<(u64, WatchEvent)>,
    done: bool,
}

/// The stream behind `Store::watch`.
pub(crate) fn stream(
    inner: Arc<Inner>,
    kind: Option<String>,
    from: u64,
) -> BoxStream<'static, Result<(u64, WatchEvent)>> {
    let rx = inner.revisions.subscribe();
    let state = State {
        inner,
        kind,
        pos: from,
        rx,
        buf: VecDeque::new(),
        done: false,
    };
    stream::unfold(state, |mut s| async move {
        loop {
            if let Some(item) = s.buf.pop_front() {
                return Some((Ok(item), s));
            }
            if s.done {
                return None;
            }
            // Mark seen before reading: a commit after this read wakes the wait below.
            let known = *s.rx.borrow_and_update();
            if known > s.pos {
                match s
                    .inner
                    .with_reader(|c| read_log(c, s.kind.as_deref(), s.pos))
                {
                    Ok((rows, head)) => {
                        let full = rows.len() == BATCH;
                        if let Some((last, _)) = rows.last() {
                            s.pos = *last;
                        }
                        if !full {
                            // Everything up to the snapshot's head was read: rows of other
                            // kinds neither hold this watcher back nor make it too old after
                            // a compaction.
                            s.pos = s.pos.max(head);
                        }
                        if !rows.is_empty() {
                            s.buf.extend(rows);
                            continue;
                        }
                    }
                    Err(e) => {
                        s.done = true;
                        return Some((Err(e), s));
                    }
                }
            }
            if s.rx.changed().await.is_err() {
                return None;
            }
        }
    })
    // Polling again after the end is fine.
    .fuse()
    .boxed()
}

/// The poller: notices commits by other processes (and other connections of this one) and
/// publishes the file's revision. Stops when the store's last handle is dropped (its end of
/// `stop` disconnects).
pub(crate) fn spawn_poller(
    path: PathBuf,
    busy_timeout: Duration,
    interval: Duration,
    revisions: watch::Sender<u64>,
    stop: Receiver<()>,
) -> std::io::Result<()> {
    std::thread::Builder::new().name("boxery-poll".into()).spawn(move || {
        let conn = match connect(&path, busy_timeout) {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(error = %e, "the store's change poller cannot open the file; writes from other processes will not wake watchers");
                return;
            }
        };
        let mut last_version: Option<i64> = None;
        loop {
            match stop.recv_timeout(interval) {
                Err(RecvTimeoutError::Timeout) => {}
                _ => return,
            }
            let version: i64 = match conn.query_row("PRAGMA data_version", [], |r| r.get(0)) {
                Ok(v) => v,
                Err(e) => {
                    tracing::warn!(error = %e, "the store's change poller cannot read data_version");
                    continue;
                }
            };
            if last_version == Some(version) {
                continue;
            }
            match meta(&conn, "revision") {
                Ok(rev) => {
                    last_version = Some(version);
                    publish(&revisions, rev);
                }
                Err(e) => tracing::warn!(error = %e, "the store's change poller cannot read the revision"),
            }
        }
    })?;
    Ok(())
}

/// Raise the published revision to `rev` (never lower it).
pub(crate) fn publish(revisions: &watch::Sender<u64>, rev: u64) {
    revisions.send_if_modified(|v| {
        if rev > *v {
            *v = rev;
            true
        } else {
            false
        }
    });
}
