//! Watch: the log's entries after a revision (`P/l/REV`, read in pages at one etcd revision),
//! then etcd's own watch of the log from the etcd revision after that read. The store's
//! revisions are dense (each is one log entry), so a revision that does not follow the last one
//! seen means compaction took entries this watcher had not read: `TooOld`, never a silent gap.

use std::sync::Arc;
use std::time::{Duration, Instant};

use boxery_store::{Result, StoreError, WatchEvent, WatchStream};
use etcd_client::{EventType, GetOptions, WatchOptions};
use futures::StreamExt;
use tokio::sync::mpsc;

use crate::keys::{log_rev, range_end};
use crate::log::Entry;
use crate::{Inner, etcd_error, parse_u64, ride};

/// Log entries read per request while catching up.
const PAGE: i64 = 500;

/// Every change after `from` (of `kind`, or of all), then each new one.
pub(crate) fn stream(inner: Arc<Inner>, kind: Option<String>, from: u64) -> WatchStream {
    let (tx, rx) = mpsc::channel(256);
    let handle = inner.handle.clone();
    handle.spawn(async move {
        let mut w = Watcher {
            inner,
            kind,
            from,
            tx,
        };
        // etcd unavailable for a while (a member lost, a new leader): the watch goes on from
        // where it was, unless it makes no progress for as long as a call rides it out
        let mut since = Instant::now();
        loop {
            let at = w.from;
            match w.run().await {
                Ok(()) => return,
                Err(e)
                    if ride::transient(&e) && (w.from > at || since.elapsed() < ride::RIDE_OUT) =>
                {
                    if w.from > at {
                        since = Instant::now();
                    }
                    tracing::debug!(error = %e, "the watch lost etcd; watching again");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => {
                    let _ = w.tx.send(Err(e)).await;
                    return;
                }
            }
        }
    });
    // fused: a stream that ended (an error, or the store gone) stays ended
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|i| (i, rx)) })
        .fuse()
        .boxed()
}

struct Watcher {
    inner: Arc<Inner>,
    kind: Option<String>,
    /// The last revision passed on (or skipped as another kind's).
    from: u64,
    tx: mpsc::Sender<Result<(u64, WatchEvent)>>,
}

impl Watcher {
    async fn too_old(&self) -> StoreError {
        let floor = self.inner.compacted_now().await.unwrap_or(self.from + 1);
        StoreError::TooOld {
            requested: self.from,
            floor: floor.max(self.from + 1),
        }
    }

    /// Take one log entry at `rev`: `Ok(false)` when the watcher went away.
    async fn take(&mut self, rev: u64, value: &[u8]) -> Result<bool> {
        if rev <= self.from {
            return Ok(true);
        }
        if rev != self.from + 1 {
            return Err(self.too_old().await);
        }
        self.from = rev;
        let entry: Entry = serde_json::from_slice(value)?;
        if self
            .kind
            .as_deref()
            .is_some_and(|k| k != entry.object_kind())
        {
            return Ok(true);
        }
        Ok(self.tx.send(Ok((rev, entry.event()?))).await.is_ok())
    }

    async fn run(&mut self) -> Result<()> {
        let keys = self.inner.keys.clone();
        let mut kv = self.inner.client.kv_client();
        let floor = self.inner.compacted_now().await?;
        if self.from < floor {
            return Err(StoreError::TooOld {
                requested: self.from,
                floor,
            });
        }
        // catch up, at one etcd revision
        let end = range_end(&keys.log());
        let mut snapshot = 0;
        loop {
            let mut opts = GetOptions::new().with_range(end.clone()).with_limit(PAGE);
            if snapshot > 0 {
                opts = opts.with_revision(snapshot);
            }
            let r = kv
                .get(keys.log_entry(self.from + 1), Some(opts))
                .await
                .map_err(etcd_error)?;
            if snapshot == 0 {
                snapshot = r.header().map_or(0, |h| h.revision());
            }
            for e in r.kvs() {
                let Some(rev) = log_rev(e.key()) else {
                    continue;
                };
                if !self.take(rev, e.value()).await? {
                    return Ok(());
                }
            }
            if !r.more() {
                break;
            }
        }
        // the store's revision at that etcd revision: entries up to it were all there to read
        let r = kv
            .get(keys.rev(), Some(GetOptions::new().with_revision(snapshot)))
            .await
            .map_err(etcd_error)?;
        let at = match r.kvs().first() {
            Some(kv) => parse_u64(kv.value())?,
            None => 0,
        };
        if self.from < at {
            return Err(self.too_old().await);
        }
        // then follow
        let mut w = self.inner.client.watch_client();
        let mut stream = w
            .watch(
                keys.log(),
                Some(
                    WatchOptions::new()
                        .with_prefix()
                        .with_start_revision(snapshot + 1),
                ),
            )
            .await
            .map_err(etcd_error)?;
        loop {
            let msg = tokio::select! {
                _ = self.tx.closed() => return Ok(()),
                m = stream.message() => m.map_err(etcd_error)?,
            };
            let Some(resp) = msg else {
                return Err(StoreError::Unavailable {
                    why: "etcd ended the watch".into(),
                });
            };
            if resp.compact_revision() > 0 {
                return Err(self.too_old().await);
            }
            if resp.canceled() {
                return Err(StoreError::Unavailable {
                    why: format!("etcd cancelled the watch: {}", resp.cancel_reason()),
                });
            }
            for ev in resp.events() {
                if ev.event_type() != EventType::Put {
                    // compaction deleting old entries
                    continue;
                }
                let Some(kv) = ev.kv() else { continue };
                let Some(rev) = log_rev(kv.key()) else {
                    continue;
                };
                if !self.take(rev, kv.value()).await? {
                    return Ok(());
                }
            }
        }
    }
}
