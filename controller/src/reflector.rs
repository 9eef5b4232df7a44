//! The reflector: list a kind, then watch it from the list's revision, into an in-memory
//! [`Cache`] that mappers and resync read, emitting a [`Change`] per object that changed.
//!
//! # Guarantees
//! - After the first list the cache holds every object of the kind as of some revision, and
//!   [`Cache::is_ready`] is true; afterwards it follows the watch in order.
//! - Every change to the cache is emitted once, with the object before (`old`) and after
//!   (`new`), so a mapper can enqueue both the old and the new owner of a moved child.
//! - When the watch fails (`TooOld` after compaction, a database error, the stream ending)
//!   the reflector lists again and emits exactly the differences: objects whose
//!   resourceVersion changed, and objects that vanished (as deletions of the cached copy).
//!   Repeated failures back off exponentially; the first `TooOld` relists at once.
//!
//! # Assumptions
//! - The source's watch delivers every change after its start revision, in order, once
//!   (the store guarantees it), so following it keeps the cache exact.
//!
//! # Caveats
//! - The cache lags the store by the watch latency: decisions that must be exact (creating
//!   an object, taking a pool member) are made against the store, not the cache. The
//!   controller re-reads each object from the store before reconciling it.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use boxery_api::{DynObject, Selector};
use boxery_store::{Store, StoreError, WatchEvent};
use futures::StreamExt;
use futures::stream::BoxStream;
use tokio::sync::{mpsc, watch};

use crate::backoff::Backoff;

/// Where objects come from: the store, or a test double.
pub trait Source: Send + Sync + 'static {
    /// Every object of `kind`, and the revision the list was taken at.
    fn list(&self, kind: &str) -> Result<(Vec<DynObject>, u64), StoreError>;
    /// The changes to `kind` after revision `from`.
    fn watch(
        &self,
        kind: &str,
        from: u64,
    ) -> BoxStream<'static, Result<(u64, WatchEvent), StoreError>>;
    /// One object, as stored now.
    fn get(&self, kind: &str, name: &str) -> Result<Option<DynObject>, StoreError>;
}

impl Source for Store {
    fn list(&self, kind: &str) -> Result<(Vec<DynObject>, u64), StoreError> {
        Store::list(self, kind, &Selector::default())
    }
    fn watch(
        &self,
        kind: &str,
        from: u64,
    ) -> BoxStream<'static, Result<(u64, WatchEvent), StoreError>> {
        Store::watch(self, Some(kind), from)
    }
    fn get(&self, kind: &str, name: &str) -> Result<Option<DynObject>, StoreError> {
        Store::get(self, kind, name)
    }
}

/// One object's change, as the reflector saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct Change {
    /// The object before (none when it was added).
    pub old: Option<Arc<DynObject>>,
    /// The object after (none when it was deleted).
    pub new: Option<Arc<DynObject>>,
}

impl Change {
    /// The object's name.
    pub fn name(&self) -> &str {
        self.new
            .as_ref()
            .or(self.old.as_ref())
            .map(|o| o.metadata.name.as_str())
            .unwrap_or("")
    }

    /// The object after the change, or before it when it was deleted.
    pub fn latest(&self) -> Option<&Arc<DynObject>> {
        self.new.as_ref().or(self.old.as_ref())
    }
}

#[derive(Debug, Default)]
struct CacheState {
    objects: HashMap<String, Arc<DynObject>>,
}

/// The reflector's in-memory copy of one kind, shared and cheap to clone.
#[derive(Debug, Clone)]
pub struct Cache {
    kind: Arc<str>,
    state: Arc<RwLock<CacheState>>,
    ready: watch::Sender<bool>,
    metadata_only: bool,
}

impl Cache {
    /// An empty cache for `kind`, not ready.
    pub fn new(kind: &str) -> Self {
        Cache {
            kind: kind.into(),
            state: Arc::default(),
            ready: watch::Sender::new(false),
            metadata_only: false,
        }
    }

    /// An empty cache for `kind` that keeps only each object's metadata (its `spec`, `status`
    /// and other fields are dropped on the way in): for kinds a controller watches only to map
    /// changes to keys by name, labels or ownerReferences, at a fraction of the memory.
    pub fn metadata_only(kind: &str) -> Self {
        Cache {
            metadata_only: true,
            ..Cache::new(kind)
        }
    }

    fn admit(&self, mut obj: DynObject) -> DynObject {
        if self.metadata_only {
            obj.rest = Default::default();
        }
        obj
    }

    /// The kind it holds.
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// One object by name.
    pub fn get(&self, name: &str) -> Option<Arc<DynObject>> {
        self.read().objects.get(name).cloned()
    }

    /// Every object (in no particular order).
    pub fn list(&self) -> Vec<Arc<DynObject>> {
        self.read().objects.values().cloned().collect()
    }

    /// Every name, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.read().objects.keys().cloned().collect();
        names.sort();
        names
    }

    /// How many objects it holds.
    pub fn len(&self) -> usize {
        self.read().objects.len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the first list has been loaded.
    pub fn is_ready(&self) -> bool {
        *self.ready.borrow()
    }

    /// Wait until the first list has been loaded.
    pub async fn wait_ready(&self) {
        let mut rx = self.ready.subscribe();
        // The sender lives in `self`, so this cannot fail while we wait.
        let _ = rx.wait_for(|ready| *ready).await;
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, CacheState> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, CacheState> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Replace the contents with a fresh list; returns the differences.
    pub(crate) fn replace(&self, objects: Vec<DynObject>) -> Vec<Change> {
        let mut changes = Vec::new();
        {
            let mut state = self.write();
            let mut old = std::mem::take(&mut state.objects);
            for obj in objects {
                let obj = self.admit(obj);
                let name = obj.metadata.name.clone();
                let before = old.remove(&name);
                let new = Arc::new(obj);
                let same = before.as_ref().is_some_and(|b| {
                    b.metadata.resource_version.is_some()
                        && b.metadata.resource_version == new.metadata.resource_version
                });
                if same {
                    state.objects.insert(name, before.unwrap_or(new));
                } else {
                    state.objects.insert(name, new.clone());
                    changes.push(Change {
                        old: before,
                        new: Some(new),
                    });
                }
            }
            let mut gone: Vec<_> = old.into_values().collect();
            gone.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
            changes.extend(gone.into_iter().map(|o| Change {
                old: Some(o),
                new: None,
            }));
        }
        self.ready.send_replace(true);
        changes
    }

    /// Apply one watch event; returns the change.
    pub(crate) fn apply(&self, event: WatchEvent) -> Change {
        let mut state = self.write();
        match event {
            WatchEvent::Added(obj) | WatchEvent::Modified(obj) => {
                let new = Arc::new(self.admit(obj));
                let old = state.objects.insert(new.metadata.name.clone(), new.clone());
                Change {
                    old,
                    new: Some(new),
                }
            }
            WatchEvent::Deleted(obj) => {
                let cached = state.objects.remove(&obj.metadata.name);
                Change {
                    old: Some(cached.unwrap_or_else(|| Arc::new(self.admit(obj)))),
                    new: None,
                }
            }
        }
    }
}

/// Keep `cache` in step with `kind` in `source`, sending every change to `changes`. Runs
/// until `changes` is closed (or the task is dropped).
pub async fn reflect(
    source: Arc<dyn Source>,
    cache: Cache,
    changes: mpsc::UnboundedSender<Change>,
    backoff: Backoff,
) {
    let kind = cache.kind().to_string();
    let mut failures: u32 = 0;
    loop {
        let rev = match source.list(&kind) {
            Ok((objects, rev)) => {
                for change in cache.replace(objects) {
                    if changes.send(change).is_err() {
                        return;
                    }
                }
                rev
            }
            Err(e) => {
                tracing::warn!(kind, error = %e, "listing failed; retrying");
                failures = pause(&backoff, failures).await;
                continue;
            }
        };
        let mut stream = source.watch(&kind, rev);
        loop {
            match stream.next().await {
                Some(Ok((_rev, event))) => {
                    failures = 0;
                    if changes.send(cache.apply(event)).is_err() {
                        return;
                    }
                }
                Some(Err(StoreError::TooOld { requested, floor })) => {
                    tracing::info!(
                        kind,
                        requested,
                        floor,
                        "watch fell behind compaction; listing again"
                    );
                    if failures > 0 {
                        failures = pause(&backoff, failures).await;
                    } else {
                        failures = 1;
                    }
                    break;
                }
                Some(Err(e)) => {
                    tracing::warn!(kind, error = %e, "watch failed; listing again");
                    failures = pause(&backoff, failures).await;
                    break;
                }
                None => {
                    tracing::debug!(kind, "watch ended; listing again");
                    failures = pause(&backoff, failures).await;
                    break;
                }
            }
        }
    }
}

async fn pause(backoff: &Backoff, failures: u32) -> u32 {
    tokio::time::sleep(backoff.delay(failures)).await;
    failures.saturating_add(1)
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    use boxery_api::{API_VERSION, ObjectMeta};
    use serde_json::json;
    use tokio::sync::broadcast;

    use super::*;

    /// An in-memory source: a map, a revision counter, a broadcast of events, and a switch to
    /// fail the next watches with an error.
    #[derive(Clone)]
    pub(crate) struct FakeSource {
        inner: Arc<Mutex<FakeState>>,
        events: broadcast::Sender<(u64, WatchEvent)>,
    }

    #[derive(Default)]
    struct FakeState {
        rev: u64,
        objects: BTreeMap<(String, String), DynObject>,
        fail_watch: Option<fn() -> StoreError>,
        lists: usize,
    }

    pub(crate) fn obj(kind: &str, name: &str) -> DynObject {
        DynObject {
            api_version: API_VERSION.into(),
            kind: kind.into(),
            metadata: ObjectMeta::named(name),
            rest: json!({"spec": {"source": {"image": "debian-12"}}})
                .as_object()
                .cloned()
                .unwrap_or_default(),
        }
    }

    impl FakeSource {
        pub(crate) fn new() -> Self {
            FakeSource {
                inner: Arc::default(),
                events: broadcast::channel(1024).0,
            }
        }

        /// Create or replace an object; returns it as stored.
        pub(crate) fn put(&self, mut o: DynObject) -> DynObject {
            let mut s = self.inner.lock().unwrap();
            s.rev += 1;
            o.metadata.resource_version = Some(s.rev.to_string());
            let key = (o.kind.clone(), o.metadata.name.clone());
            let ev = if s.objects.insert(key, o.clone()).is_some() {
                WatchEvent::Modified(o.clone())
            } else {
                WatchEvent::Added(o.clone())
            };
            let _ = self.events.send((s.rev, ev));
            o
        }

        /// Delete silently (no event), as if the event was compacted away.
        pub(crate) fn remove_quietly(&self, kind: &str, name: &str) {
            let mut s = self.inner.lock().unwrap();
            s.rev += 1;
            s.objects.remove(&(kind.to_string(), name.to_string()));
        }

        /// Create or replace silently (no event).
        pub(crate) fn put_quietly(&self, mut o: DynObject) {
            let mut s = self.inner.lock().unwrap();
            s.rev += 1;
            o.metadata.resource_version = Some(s.rev.to_string());
            s.objects
                .insert((o.kind.clone(), o.metadata.name.clone()), o);
        }

        pub(crate) fn delete(&self, kind: &str, name: &str) {
            let mut s = self.inner.lock().unwrap();
            s.rev += 1;
            if let Some(o) = s.objects.remove(&(kind.to_string(), name.to_string())) {
                let _ = self.events.send((s.rev, WatchEvent::Deleted(o)));
            }
        }

        /// Break every open watch with `err`, and make new watches fail the same way once.
        pub(crate) fn break_watches(&self, err: fn() -> StoreError) {
            self.inner.lock().unwrap().fail_watch = Some(err);
            let _ = self
                .events
                .send((u64::MAX, WatchEvent::Deleted(obj("Break", "x"))));
        }

        pub(crate) fn lists(&self) -> usize {
            self.inner.lock().unwrap().lists
        }
    }

    impl Source for FakeSource {
        fn list(&self, kind: &str) -> Result<(Vec<DynObject>, u64), StoreError> {
            let mut s = self.inner.lock().unwrap();
            s.lists += 1;
            let objs = s
                .objects
                .values()
                .filter(|o| o.kind == kind)
                .cloned()
                .collect();
            Ok((objs, s.rev))
        }

        fn watch(
            &self,
            kind: &str,
            from: u64,
        ) -> BoxStream<'static, Result<(u64, WatchEvent), StoreError>> {
            let kind = kind.to_string();
            let rx = self.events.subscribe();
            let inner = self.inner.clone();
            if let Some(err) = inner.lock().unwrap().fail_watch.take() {
                return futures::stream::iter([Err(err())]).boxed();
            }
            futures::stream::unfold(rx, move |mut rx| {
                let kind = kind.clone();
                let inner = inner.clone();
                async move {
                    loop {
                        match rx.recv().await {
                            Ok((u64::MAX, _)) => {
                                let err = inner.lock().unwrap().fail_watch.take()?;
                                return Some((Err(err()), rx));
                            }
                            Ok((rev, ev)) => {
                                let o = match &ev {
                                    WatchEvent::Added(o)
                                    | WatchEvent::Modified(o)
                                    | WatchEvent::Deleted(o) => o,
                                };
                                if rev > from && o.kind == kind {
                                    return Some((Ok((rev, ev)), rx));
                                }
                            }
                            Err(_) => return None,
                        }
                    }
                }
            })
            .boxed()
        }

        fn get(&self, kind: &str, name: &str) -> Result<Option<DynObject>, StoreError> {
            Ok(self
                .inner
                .lock()
                .unwrap()
                .objects
                .get(&(kind.to_string(), name.to_string()))
                .cloned())
        }
    }

    async fn next(rx: &mut mpsc::UnboundedReceiver<Change>) -> (String, bool, bool) {
        let c = tokio::time::timeout(std::time::Duration::from_secs(30), rx.recv())
            .await
            .unwrap()
            .unwrap();
        (c.name().to_string(), c.old.is_some(), c.new.is_some())
    }

    #[tokio::test(start_paused = true)]
    async fn lists_then_follows_the_watch() {
        let src = FakeSource::new();
        src.put(obj("Vm", "a"));
        src.put(obj("Image", "i"));
        let cache = Cache::new("Vm");
        let (tx, mut rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(reflect(
            Arc::new(src.clone()),
            cache.clone(),
            tx,
            Backoff::default(),
        ));
        assert_eq!(next(&mut rx).await, ("a".into(), false, true));
        assert!(cache.is_ready());
        src.put(obj("Vm", "b"));
        assert_eq!(next(&mut rx).await, ("b".into(), false, true));
        src.put(obj("Vm", "a"));
        assert_eq!(next(&mut rx).await, ("a".into(), true, true));
        src.delete("Vm", "b");
        assert_eq!(next(&mut rx).await, ("b".into(), true, false));
        assert_eq!(cache.names(), ["a"]);
        task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn too_old_relists_and_emits_only_differences() {
        let src = FakeSource::new();
        src.put(obj("Vm", "a"));
        src.put(obj("Vm", "b"));
        let cache = Cache::new("Vm");
        let (tx, mut rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(reflect(
            Arc::new(src.clone()),
            cache.clone(),
            tx,
            Backoff::default(),
        ));
        next(&mut rx).await;
        next(&mut rx).await;
        // While the watch is broken: b vanishes, c appears, a stays as it was.
        src.remove_quietly("Vm", "b");
        src.put_quietly(obj("Vm", "c"));
        src.break_watches(|| StoreError::TooOld {
            requested: 1,
            floor: 5,
        });
        let mut got = vec![next(&mut rx).await, next(&mut rx).await];
        got.sort();
        assert_eq!(got, [("b".into(), true, false), ("c".into(), false, true)]);
        assert_eq!(cache.names(), ["a", "c"]);
        assert!(src.lists() >= 2);
        task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn errors_back_off_before_relisting() {
        let src = FakeSource::new();
        src.put(obj("Vm", "a"));
        let cache = Cache::new("Vm");
        let (tx, mut rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(reflect(
            Arc::new(src.clone()),
            cache.clone(),
            tx,
            Backoff::default(),
        ));
        next(&mut rx).await;
        let t0 = tokio::time::Instant::now();
        src.break_watches(|| StoreError::Json(serde_json::from_str::<u8>("x").unwrap_err()));
        src.put(obj("Vm", "z"));
        // The relist after the failure finds z, and it came after a backoff pause.
        assert_eq!(next(&mut rx).await.0, "z");
        assert!(
            t0.elapsed() >= std::time::Duration::from_millis(150),
            "{:?}",
            t0.elapsed()
        );
        task.abort();
    }
}
