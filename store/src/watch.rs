//! Watch: log rows after a revision, in batches, then a wait for a wake-up.
//!
//! Wake-ups come from a `tokio::sync::watch` channel that holds the newest revision known to
//! this process. In-process writes publish their revision right after commit; writes from
//! other processes are noticed by one poller thread per [`Store`](crate::Store) (started by its
//! first watch), which reads `PRAGMA data_version` on its own connection every few
//! milliseconds and, when it changed, publishes the file's revision. A watcher marks the channel seen *before* it reads, so a
//! write that commits after its read always wakes it.
//!
//! A watcher of one kind reads the log only when its kind may have changed: [`KindRevs`]
//! holds the newest revision of each kind, complete up to a revision (in-process writes record
//! their kinds at commit; the poller reads the kinds of the others' from the log). Without it
//! every write woke every watcher into a read (eight kinds, eight reads per write).
//!
//! The log is read in windows of [`BATCH`] revisions, the rows sorted here: no statement of
//! the store has an `ORDER BY` or a bound `LIMIT`, with which the bundled SQLite (3.54,
//! STAT4) re-prepared the statement on every run with new parameters (`sqlite3Reprepare` was
//! 7 % of `serve`'s CPU while claiming leases).
//!
//! The log reads are blocking SQLite calls: on a multi-thread tokio runtime they run on the
//! blocking pool, elsewhere (a current-thread runtime, `futures::executor`, no runtime at all)
//! inline, so the stream needs no particular runtime.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use futures::stream::{self, BoxStream, StreamExt};
use rusqlite::{Connection, params};
use tokio::sync::watch;

use crate::object_store::off_workers;
use crate::schema::{connect, meta, to_i64};
use crate::{Inner, Result, StoreError, WatchEvent};

/// Revisions read per batch (so at most this many rows).
pub(crate) const BATCH: usize = 512;

/// The newest revision of each kind, for every revision up to `known_to`.
#[derive(Debug)]
pub(crate) struct KindRevs {
    known_to: u64,
    /// Revisions up to here have kinds no one knows (compacted before the poller read them):
    /// any kind may have changed there.
    unknown_to: u64,
    by_kind: HashMap<String, u64>,
}

impl KindRevs {
    /// Nothing known past `rev` (the store's revision when it was opened).
    pub(crate) fn new(rev: u64) -> KindRevs {
        KindRevs {
            known_to: rev,
            unknown_to: 0,
            by_kind: HashMap::new(),
        }
    }

    fn record(&mut self, kind: &str, rev: u64) {
        match self.by_kind.get_mut(kind) {
            Some(r) => *r = (*r).max(rev),
            None => {
                self.by_kind.insert(kind.to_string(), rev);
            }
        }
    }

    /// An in-process commit from revision `start` to `rev` wrote `kinds`. Everything up to
    /// `rev` is known only if everything up to `start` was (else another process wrote in
    /// between, and the poller fills that in).
    pub(crate) fn wrote(&mut self, start: u64, rev: u64, kinds: &[(String, u64)]) {
        for (k, r) in kinds {
            self.record(k, *r);
        }
        if self.known_to >= start {
            self.known_to = self.known_to.max(rev);
        }
    }

    /// The log's rows after `after` up to `head`, as the poller read them (all of them; when
    /// compaction had removed some, `complete` is false and those revisions stay unknown).
    fn read(&mut self, rows: &[(String, u64)], head: u64, complete: bool) {
        for (k, r) in rows {
            self.record(k, *r);
        }
        if !complete {
            self.unknown_to = self.unknown_to.max(head);
        }
        self.known_to = self.known_to.max(head);
    }

    /// Whether no revision of `kind` lies in `(after, head]`, as far as is known.
    pub(crate) fn unchanged(&self, kind: &str, after: u64, head: u64) -> bool {
        self.known_to >= head
            && after >= self.unknown_to
            && self.by_kind.get(kind).is_none_or(|r| *r <= after)
    }
}

/// A window of the log: its rows in order, the window's last revision, the snapshot's head.
type Window = (Vec<(u64, WatchEvent)>, u64, u64);

/// The kinds of the log's rows after a revision, the snapshot's head, and whether no row
/// after that revision had been compacted away.
type Kinds = (Vec<(String, u64)>, u64, bool);

/// Rows of the log in `(after, end]` (of one kind, or all) in order, where `end` is at most
/// `BATCH` revisions on and at most the head of the snapshot read; and `end` and that head.
/// `TooOld` when compaction removed rows after `after`.
pub(crate) fn read_log(conn: &mut Connection, kind: Option<&str>, after: u64) -> Result<Window> {
    let tx = conn.transaction()?;
    let floor = meta(&tx, "compacted")?;
    if after < floor {
        return Err(StoreError::TooOld {
            requested: after,
            floor,
        });
    }
    let head = meta(&tx, "revision")?;
    let end = head.min(after.saturating_add(BATCH as u64));
    let mut out = Vec::new();
    {
        let mut stmt = match kind {
            Some(_) => tx.prepare_cached(
                "SELECT rev, type, json FROM log WHERE kind = ?1 AND rev > ?2 AND rev <= ?3",
            )?,
            None => tx.prepare_cached(
                "SELECT rev, type, json FROM log WHERE ?1 IS NULL AND rev > ?2 AND rev <= ?3",
            )?,
        };
        let mut rows = stmt.query(params![kind, to_i64(after), to_i64(end)])?;
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
    tx.commit()?;
    out.sort_unstable_by_key(|(rev, _)| *rev);
    Ok((out, end, head))
}

/// The kind of each log row after `after`, and the head of the snapshot read (the poller's
/// read for [`KindRevs`]: no JSON).
fn read_kinds(conn: &mut Connection, after: u64) -> Result<Kinds> {
    let tx = conn.transaction()?;
    let head = meta(&tx, "revision")?;
    let complete = meta(&tx, "compacted")? <= after;
    let mut out = Vec::new();
    {
        let mut stmt =
            tx.prepare_cached("SELECT kind, rev FROM log WHERE rev > ?1 AND rev <= ?2")?;
        let mut rows = stmt.query(params![to_i64(after), to_i64(head)])?;
        while let Some(r) = rows.next()? {
            let rev: i64 = r.get(1)?;
            out.push((r.get(0)?, rev.max(0) as u64));
        }
    }
    tx.commit()?;
    Ok((out, head, complete))
}

struct State {
    inner: Arc<Inner>,
    kind: Option<String>,
    /// Every change at or below this revision has been yielded (or did not match).
    pos: u64,
    rx: watch::Receiver<Published>,
    buf: VecDeque<(u64, WatchEvent)>,
    done: bool,
    /// Woken by a new revision (not the first read of a watch, which catches up from `from`):
    /// its read counts into the watch lag.
    woken: bool,
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
        woken: false,
    };
    stream::unfold(state, |mut s| async move {
        loop {
            if let Some(item) = s.buf.pop_front() {
                return Some((Ok(item), s));
            }
            if s.done {
                return None;
            }
            // Drained: a burst's batch (up to BATCH objects, about 100 KiB) is not kept for a
            // watcher that may then idle for hours.
            s.buf.shrink_to(0);
            // Mark seen before reading: a commit after this read wakes the wait below.
            let Published { rev: known, at } = *s.rx.borrow_and_update();
            let woken = std::mem::take(&mut s.woken);
            if known > s.pos
                && let Some(kind) = &s.kind
                && crate::lock(&s.inner.kind_revs).unchanged(kind, s.pos, known)
            {
                // Only other kinds changed: nothing to read.
                s.pos = known;
            }
            if known > s.pos {
                // Off the async workers when a multi-thread runtime runs this stream. If the
                // stream is dropped while the read runs, the read still finishes and gives its
                // connection back; its rows are discarded and `pos` never moved, so nothing
                // was yielded that a resume from the last revision seen would repeat or miss.
                let (inner, kind, pos) = (s.inner.clone(), s.kind.clone(), s.pos);
                let read =
                    off_workers(move || inner.with_reader(|c| read_log(c, kind.as_deref(), pos)));
                match read.await {
                    Ok((rows, end, head)) => {
                        // Every row up to `end` was read: rows of other kinds neither hold
                        // this watcher back nor make it too old after a compaction.
                        s.pos = s.pos.max(end);
                        if !rows.is_empty() {
                            if woken {
                                boxery_metrics::METRICS
                                    .store
                                    .watch_lag
                                    .observe(at.elapsed().as_secs_f64());
                            }
                            s.buf.extend(rows);
                            continue;
                        }
                        if end < head {
                            // An empty window short of the head: read the next at once.
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
            s.woken = true;
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
    revisions: watch::Sender<Published>,
    kind_revs: Arc<std::sync::Mutex<KindRevs>>,
    stop: Receiver<()>,
) -> std::io::Result<()> {
    std::thread::Builder::new().name("boxery-poll".into()).spawn(move || {
        let mut conn = match connect(&path, busy_timeout) {
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
            // The kinds of the revisions this process did not write (or has not recorded
            // yet), so watchers of other kinds need not read the log.
            let after = crate::lock(&kind_revs).known_to;
            match read_kinds(&mut conn, after) {
                Ok((rows, rev, complete)) => {
                    last_version = Some(version);
                    crate::lock(&kind_revs).read(&rows, rev, complete);
                    publish(&revisions, rev);
                }
                Err(e) => tracing::warn!(error = %e, "the store's change poller cannot read the log"),
            }
        }
    })?;
    Ok(())
}

/// The newest revision known to this process, and when it became known here (its commit
/// here, or the poller's notice of another process's commit).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Published {
    pub(crate) rev: u64,
    pub(crate) at: Instant,
}

impl Published {
    /// `rev`, known now.
    pub(crate) fn now(rev: u64) -> Self {
        Published {
            rev,
            at: Instant::now(),
        }
    }
}

/// Raise the published revision to `rev` (never lower it).
pub(crate) fn publish(revisions: &watch::Sender<Published>, rev: u64) {
    revisions.send_if_modified(|v| {
        if rev > v.rev {
            *v = Published::now(rev);
            true
        } else {
            false
        }
    });
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use futures::StreamExt;

    use crate::{MAX_IDLE_READERS, Store, StoreOptions, WatchEvent, lock};

    #[test]
    fn kind_revs_skip_only_what_is_known_to_be_other_kinds() {
        let mut k = super::KindRevs::new(10);
        k.wrote(10, 12, &[("Vm".into(), 11), ("Image".into(), 12)]);
        assert!(k.unchanged("Lease", 10, 12), "no Lease in 11..=12");
        assert!(!k.unchanged("Vm", 10, 12));
        assert!(k.unchanged("Vm", 11, 12));
        assert!(!k.unchanged("Lease", 10, 13), "13 is not known yet");
        // Another process wrote 13 and 14: this process's 15 does not make them known.
        k.wrote(14, 15, &[("Vm".into(), 15)]);
        assert!(!k.unchanged("Lease", 12, 15));
        // The poller reads them: a Lease at 13.
        k.read(&[("Lease".into(), 13), ("Image".into(), 14)], 15, true);
        assert!(!k.unchanged("Lease", 12, 15));
        assert!(k.unchanged("Lease", 13, 15));
        // Rows compacted before the poller read them: any kind may have changed up to there.
        k.read(&[], 20, false);
        assert!(!k.unchanged("Pool", 15, 20));
        assert!(k.unchanged("Pool", 20, 20));
    }

    fn vm(name: &str) -> boxery_api::DynObject {
        serde_json::from_value(serde_json::json!({
            "apiVersion": boxery_api::API_VERSION, "kind": "Vm", "metadata": {"name": name},
            "spec": {"source": {"image": "debian-12"}}
        }))
        .unwrap()
    }

    fn open(dir: &tempfile::TempDir) -> Store {
        let opts = StoreOptions {
            auto_compact: None,
            ..Default::default()
        };
        Store::open_with(&dir.path().join("s.db"), opts).unwrap()
    }

    fn runtime(workers: usize) -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn log_reads_leave_the_async_workers_free() {
        let d = tempfile::tempdir().unwrap();
        let s = open(&d);
        s.create(vm("a")).unwrap();
        let rt = runtime(1);
        let (got_tx, got) = mpsc::channel();
        let (ran_tx, ran) = mpsc::channel();
        // With every reader connection held, a log read blocks until released.
        let held = lock(&s.inner.readers);
        let mut w = s.watch(None, 0);
        rt.spawn(async move {
            let _ = got_tx.send(w.next().await.map(|r| r.map(|(rev, _)| rev)));
        });
        std::thread::sleep(Duration::from_millis(50));
        // The runtime's only worker is free while the read waits.
        rt.spawn(async move {
            let _ = ran_tx.send(());
        });
        let free = ran.recv_timeout(Duration::from_secs(2));
        drop(held);
        assert!(free.is_ok(), "a log read blocked the async worker");
        let rev = got.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(rev.unwrap().unwrap(), 1);
    }

    #[test]
    fn a_watch_dropped_mid_read_loses_nothing_and_returns_its_connection() {
        let d = tempfile::tempdir().unwrap();
        let s = open(&d);
        for i in 0..600 {
            s.create(vm(&format!("v{i}"))).unwrap();
        }
        let rt = runtime(2);
        rt.block_on(async {
            // Read one batch, then drop the stream while its second read runs.
            let mut w = s.watch(Some("Vm"), 0);
            let mut last = 0;
            for _ in 0..super::BATCH {
                last = w.next().await.unwrap().unwrap().0;
            }
            let held = lock(&s.inner.readers);
            assert!(
                futures::FutureExt::now_or_never(w.next()).is_none(),
                "the read waits for a connection"
            );
            drop(w);
            drop(held);
            // The abandoned read finishes on the blocking pool and gives its connection back.
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while lock(&s.inner.readers).is_empty() {
                assert!(std::time::Instant::now() < deadline, "connection returned");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            {
                let idle = lock(&s.inner.readers);
                assert!(idle.len() <= MAX_IDLE_READERS);
                assert!(
                    idle.iter().all(|c| c.is_autocommit()),
                    "no open transaction"
                );
            }
            // A resume from the last revision seen gets the rest, once each, in order.
            let mut again = s.watch(Some("Vm"), last);
            for want in last + 1..=600 {
                let (rev, ev) = again.next().await.unwrap().unwrap();
                assert_eq!(rev, want);
                assert!(matches!(ev, WatchEvent::Added(_)));
            }
            s.create(vm("late")).unwrap();
            assert_eq!(again.next().await.unwrap().unwrap().0, 601);
        });
    }
}
