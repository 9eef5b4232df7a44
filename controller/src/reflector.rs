//! The reflector: list a kind, then watch it from the list's revision, into an in-memory
//! [`Cache`] that the controller reconciles from and mappers and resync read, emitting a
//! [`Change`] per object that changed.
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
//! - A full cache keeps each object as its JSON text (one allocation, a fraction of a parsed
//!   tree's memory) and parses it when read: [`Cache::get`] and [`Cache::list`] return fresh
//!   parsed copies, [`Cache::get_as`] parses straight into a typed object. A metadata-only
//!   cache keeps each object's metadata parsed, without its annotations.
//! - The cache never goes back in time for an object: a copy put in by [`Cache::observe`]
//!   (a write of this process, see [`crate::write_through`]) is replaced only by a newer one,
//!   and an object [`Cache::observe_removed`] took out stays out until a newer revision of
//!   it arrives.
//! - The first list emits every object the cache then holds, also those put in by
//!   [`Cache::observe`] before it (an object created while its controller starts is
//!   reconciled at once, not at the next resync).
//!
//! # Assumptions
//! - The store's watch delivers every change after its start revision, in order, once (every
//!   [`ObjectStore`] guarantees it), so following it keeps the cache exact.
//!
//! # Caveats
//! - The cache lags the store by the watch latency for writes it did not see made: decisions
//!   that must be exact (creating an object, taking a pool member) are made against the
//!   store, not the cache, and every write carries a resourceVersion precondition.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use boxery_api::{DynObject, ObjectMeta, Selector};
use boxery_store::{ObjectStore, StoreError, WatchEvent};
use futures::StreamExt;
use serde::de::DeserializeOwned;
use tokio::sync::{mpsc, watch};

use crate::backoff::Backoff;

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

/// One cached object: its revision, and the object as JSON text (full caches) or as parsed
/// metadata (metadata-only caches).
#[derive(Debug, Clone)]
struct Entry {
    rv: u64,
    held: Held,
}

#[derive(Debug, Clone)]
enum Held {
    Json(Arc<str>),
    Meta(Arc<DynObject>),
}

impl Entry {
    /// The object, parsed (a metadata-only entry is shared, not copied).
    fn object(&self) -> Option<Arc<DynObject>> {
        match &self.held {
            Held::Meta(o) => Some(o.clone()),
            Held::Json(j) => parse(j).map(Arc::new),
        }
    }
}

/// What a metadata-only cache keeps of an object's metadata: all but its annotations and its
/// managed fields (the field owners' sets, the larger part of the metadata of an applied
/// object; issue 31 measured them at 2 MiB of an idle `serve` with 1,000 Vms).
fn slim(m: &ObjectMeta) -> ObjectMeta {
    ObjectMeta {
        name: m.name.clone(),
        uid: m.uid.clone(),
        resource_version: m.resource_version.clone(),
        generation: m.generation,
        creation_timestamp: m.creation_timestamp,
        deletion_timestamp: m.deletion_timestamp,
        labels: m.labels.clone(),
        annotations: Default::default(),
        finalizers: m.finalizers.clone(),
        owner_references: m.owner_references.clone(),
        managed_fields: Vec::new(),
    }
}

/// Parse a cached object's text, which this cache wrote from a `DynObject`: it reads back.
fn parse<T: serde::de::DeserializeOwned>(json: &str) -> Option<T> {
    match serde_json::from_str(json) {
        Ok(o) => Some(o),
        Err(e) => {
            tracing::error!(error = %e, "a cached object does not read back");
            None
        }
    }
}

#[derive(Debug, Default)]
struct CacheState {
    objects: HashMap<String, Entry>,
    /// Objects taken out by [`Cache::observe_removed`] before the watch said so: name → the
    /// revision of their removal. Older events of those names are ignored.
    removed: HashMap<String, u64>,
}

impl CacheState {
    /// Whether what is known of `name` is at `rev` or newer (so an event at `rev` is old).
    fn newer_than(&self, name: &str, rev: u64) -> bool {
        self.objects.get(name).is_some_and(|o| o.rv > rev)
            || self.removed.get(name).is_some_and(|r| *r > rev)
    }
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

    /// An empty cache for `kind` that keeps only each object's metadata, without its
    /// annotations and managed fields (its `spec`, `status`, other fields, annotations and
    /// `managedFields` are dropped on the way in, from the changes it emits too): for kinds a controller watches only to map changes
    /// to keys by name, labels or ownerReferences, at a fraction of the memory.
    pub fn metadata_only(kind: &str) -> Self {
        Cache {
            metadata_only: true,
            ..Cache::new(kind)
        }
    }

    /// The entry this cache keeps for `obj`: its text, or its metadata without annotations.
    fn admit(&self, obj: &DynObject) -> Entry {
        let rv = obj.metadata.rv();
        if self.metadata_only {
            return Entry {
                rv,
                held: Held::Meta(Arc::new(DynObject {
                    api_version: obj.api_version.clone(),
                    kind: obj.kind.clone(),
                    metadata: slim(&obj.metadata),
                    rest: Default::default(),
                })),
            };
        }
        let json = match serde_json::to_string(obj) {
            Ok(j) => j,
            // A DynObject always serializes (string keys, JSON values); keep the metadata if
            // it ever did not.
            Err(e) => {
                tracing::error!(error = %e, name = obj.metadata.name, "an object does not serialize");
                return Entry {
                    rv,
                    held: Held::Meta(Arc::new(DynObject {
                        rest: Default::default(),
                        ..obj.clone()
                    })),
                };
            }
        };
        Entry {
            rv,
            held: Held::Json(json.into()),
        }
    }

    /// The object as a change carries it: as admitted (metadata only, for those caches).
    fn as_admitted(&self, obj: DynObject) -> Arc<DynObject> {
        if self.metadata_only {
            Arc::new(DynObject {
                metadata: slim(&obj.metadata),
                rest: Default::default(),
                ..obj
            })
        } else {
            Arc::new(obj)
        }
    }

    /// The kind it holds.
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// One object by name (a copy parsed from the cached text).
    pub fn get(&self, name: &str) -> Option<Arc<DynObject>> {
        let entry = self.read().objects.get(name).cloned()?;
        entry.object()
    }

    /// One object by name, parsed as `R`, with its revision: `Err` when it does not read as
    /// one. Cheaper than [`Cache::get`] and a conversion.
    pub fn get_as<R: DeserializeOwned>(
        &self,
        name: &str,
    ) -> Option<(u64, Result<R, serde_json::Error>)> {
        let entry = self.read().objects.get(name).cloned()?;
        let typed = match &entry.held {
            Held::Json(j) => serde_json::from_str(j),
            Held::Meta(o) => serde_json::to_value(&**o).and_then(serde_json::from_value),
        };
        Some((entry.rv, typed))
    }

    /// Every object (in no particular order), parsed.
    pub fn list(&self) -> Vec<Arc<DynObject>> {
        let entries: Vec<Entry> = self.read().objects.values().cloned().collect();
        entries.iter().filter_map(Entry::object).collect()
    }

    /// The objects (in no particular order) whose cached JSON text holds `needle`, parsed:
    /// a prefilter that spares parsing every object to find the few that can match (say, the
    /// one naming a uid). A needle is a fragment as `serde_json` writes it; callers still
    /// check the parsed fields. Metadata-only caches keep no text: every object is returned.
    pub fn list_containing(&self, needle: &str) -> Vec<Arc<DynObject>> {
        self.list_containing_all(&[needle])
    }

    /// The objects whose cached text holds every one of `needles` (see
    /// [`Cache::list_containing`]), parsed: say, the members of one pool that are free.
    pub fn list_containing_all(&self, needles: &[&str]) -> Vec<Arc<DynObject>> {
        // A vectorised substring search, built once: this scans every object of the kind.
        let finders: Vec<memchr::memmem::Finder<'_>> = needles
            .iter()
            .map(|n| memchr::memmem::Finder::new(n.as_bytes()))
            .collect();
        let entries: Vec<Entry> = self
            .read()
            .objects
            .values()
            .filter(|e| match &e.held {
                Held::Json(j) => finders.iter().all(|f| f.find(j.as_bytes()).is_some()),
                Held::Meta(_) => true,
            })
            .cloned()
            .collect();
        entries.iter().filter_map(Entry::object).collect()
    }

    /// Every object (in no particular order) that reads as `R`, parsed straight from the
    /// cached text.
    pub fn list_as<R: DeserializeOwned>(&self) -> Vec<R> {
        let entries: Vec<Entry> = self.read().objects.values().cloned().collect();
        entries
            .iter()
            .filter_map(|e| match &e.held {
                Held::Json(j) => serde_json::from_str(j).ok(),
                Held::Meta(o) => serde_json::to_value(&**o)
                    .and_then(serde_json::from_value)
                    .ok(),
            })
            .collect()
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

    /// Put in an object as a write of this process stored it, unless the cache already has
    /// it at that revision or newer. Emits nothing: the watch brings the change later, and
    /// that is what queues the object.
    pub fn observe(&self, obj: &DynObject) {
        if obj.kind != *self.kind {
            return;
        }
        let rev = obj.metadata.rv();
        let mut state = self.write();
        let name = &obj.metadata.name;
        if state.newer_than(name, rev.saturating_sub(1)) {
            return;
        }
        let entry = self.admit(obj);
        state.removed.remove(name);
        state.objects.insert(name.clone(), entry);
    }

    /// Take out an object a write of this process removed (`obj` as removed, carrying the
    /// revision of its removal), unless the cache has a newer revision of that name.
    pub fn observe_removed(&self, obj: &DynObject) {
        if obj.kind != *self.kind {
            return;
        }
        let rev = obj.metadata.rv();
        let mut state = self.write();
        let name = &obj.metadata.name;
        if state.newer_than(name, rev.saturating_sub(1)) {
            return;
        }
        state.objects.remove(name);
        state.removed.insert(name.clone(), rev);
    }

    /// Replace the contents with a fresh list taken at revision `rev`; returns the
    /// differences. Objects observed at a newer revision than the list are kept.
    pub(crate) fn replace(&self, objects: Vec<DynObject>, rev: u64) -> Vec<Change> {
        let mut changes = Vec::new();
        // Before the first list, what the cache holds came from this process's writes
        // (`observe`), never as a change: every object listed (or kept) then is a change, or an
        // object created by a write that raced the first list would never be reconciled.
        let first = !*self.ready.borrow();
        {
            let mut state = self.write();
            let mut old = std::mem::take(&mut state.objects);
            let removed = std::mem::take(&mut state.removed);
            for obj in objects {
                let name = obj.metadata.name.clone();
                if removed.get(&name).is_some_and(|r| *r > rev) {
                    continue;
                }
                let before = old.remove(&name);
                if let Some(b) = before.as_ref().filter(|b| b.rv > rev) {
                    state.objects.insert(name, b.clone());
                    continue;
                }
                let same = before.as_ref().is_some_and(|b| {
                    obj.metadata.resource_version.is_some() && b.rv == obj.metadata.rv()
                });
                if same {
                    if let Some(b) = before {
                        state.objects.insert(name, b);
                    }
                    if first {
                        changes.push(Change {
                            old: None,
                            new: Some(self.as_admitted(obj)),
                        });
                    }
                } else {
                    state.objects.insert(name, self.admit(&obj));
                    changes.push(Change {
                        old: before.and_then(|b| b.object()),
                        new: Some(self.as_admitted(obj)),
                    });
                }
            }
            // Written since the list by this process: still there.
            let (kept, mut gone): (Vec<_>, Vec<_>) = old.into_iter().partition(|(_, o)| o.rv > rev);
            for (name, o) in kept {
                if first && let Some(obj) = o.object() {
                    changes.push(Change {
                        old: None,
                        new: Some(obj),
                    });
                }
                state.objects.insert(name, o);
            }
            state.removed = removed.into_iter().filter(|(_, r)| *r > rev).collect();
            gone.sort_by(|a, b| a.0.cmp(&b.0));
            changes.extend(gone.into_iter().filter_map(|(_, o)| {
                Some(Change {
                    old: Some(o.object()?),
                    new: None,
                })
            }));
        }
        self.ready.send_replace(true);
        changes
    }

    /// Apply one watch event at revision `rev`; returns the change. An event older than what
    /// the cache already has of that name (observed from a write of this process) leaves the
    /// cache as it is; the change then shows the cached object as both old and new.
    pub(crate) fn apply(&self, rev: u64, event: WatchEvent) -> Change {
        let name = match &event {
            WatchEvent::Added(o) | WatchEvent::Modified(o) | WatchEvent::Deleted(o) => {
                o.metadata.name.clone()
            }
        };
        // The text is made outside the lock.
        let entry = match &event {
            WatchEvent::Added(o) | WatchEvent::Modified(o) => Some(self.admit(o)),
            WatchEvent::Deleted(_) => None,
        };
        let before = {
            let mut state = self.write();
            if state.newer_than(&name, rev) {
                let cached = state.objects.get(&name).cloned();
                drop(state);
                let cached = cached.and_then(|c| c.object());
                return Change {
                    old: cached.clone(),
                    new: cached,
                };
            }
            state.removed.remove(&name);
            match entry {
                Some(e) => state.objects.insert(name, e),
                None => state.objects.remove(&name),
            }
        };
        match event {
            WatchEvent::Added(obj) | WatchEvent::Modified(obj) => Change {
                old: before.and_then(|b| b.object()),
                new: Some(self.as_admitted(obj)),
            },
            WatchEvent::Deleted(obj) => Change {
                old: Some(
                    before
                        .and_then(|b| b.object())
                        .unwrap_or_else(|| self.as_admitted(obj)),
                ),
                new: None,
            },
        }
    }
}

/// Keep `cache` in step with `kind` in `source`, sending every change to `changes`. Runs
/// until `changes` is closed (or the task is dropped).
pub async fn reflect(
    store: Arc<dyn ObjectStore>,
    cache: Cache,
    changes: mpsc::UnboundedSender<Change>,
    backoff: Backoff,
) {
    let kind = cache.kind().to_string();
    let mut failures: u32 = 0;
    loop {
        let rev = match store.list(&kind, &Selector::default()).await {
            Ok((objects, rev)) => {
                for change in cache.replace(objects, rev) {
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
        let mut stream = store.watch(Some(&kind), rev);
        loop {
            match stream.next().await {
                Some(Ok((rev, event))) => {
                    failures = 0;
                    if changes.send(cache.apply(rev, event)).is_err() {
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
    use boxery_store::{
        ApplyAction, ApplyOptions, Candidate, DeleteOutcome, Leadership, ObjectRef, WatchStream,
    };
    use serde_json::json;
    use tokio::sync::broadcast;

    use super::*;

    /// An in-memory store for the runtime's tests: a map, a revision counter, a broadcast of events, and a switch to
    /// fail the next watches with an error.
    #[derive(Clone, Debug)]
    pub(crate) struct FakeSource {
        inner: Arc<Mutex<FakeState>>,
        events: broadcast::Sender<(u64, WatchEvent)>,
    }

    #[derive(Default, Debug)]
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

        pub(crate) fn delete(&self, kind: &str, name: &str) -> Option<DynObject> {
            let mut s = self.inner.lock().unwrap();
            s.rev += 1;
            let mut o = s.objects.remove(&(kind.to_string(), name.to_string()))?;
            o.metadata.resource_version = Some(s.rev.to_string());
            let _ = self.events.send((s.rev, WatchEvent::Deleted(o.clone())));
            Some(o)
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

    fn unsupported<T>(what: &str) -> Result<T, StoreError> {
        Err(StoreError::Unavailable {
            why: format!("the test store does not {what}"),
        })
    }

    #[async_trait::async_trait]
    impl ObjectStore for FakeSource {
        fn uid(&self) -> &str {
            "fake-store"
        }

        async fn get(&self, key: &ObjectRef) -> Result<Option<DynObject>, StoreError> {
            Ok(self
                .inner
                .lock()
                .unwrap()
                .objects
                .get(&(key.kind.clone(), key.name.clone()))
                .cloned())
        }

        async fn list(
            &self,
            kind: &str,
            _selector: &Selector,
        ) -> Result<(Vec<DynObject>, u64), StoreError> {
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

        async fn create_by(&self, obj: DynObject, _: &str) -> Result<DynObject, StoreError> {
            Ok(self.put(obj))
        }
        async fn adopt(&self, _: DynObject, _: &str) -> Result<DynObject, StoreError> {
            unsupported("adopt")
        }
        async fn update_by(&self, obj: DynObject, _: &str) -> Result<DynObject, StoreError> {
            Ok(self.put(obj))
        }
        async fn update_dry_run_by(&self, _: DynObject, _: &str) -> Result<DynObject, StoreError> {
            unsupported("dry-run updates")
        }
        async fn update_status(&self, obj: DynObject) -> Result<DynObject, StoreError> {
            Ok(self.put(obj))
        }
        async fn delete(&self, key: &ObjectRef) -> Result<DeleteOutcome, StoreError> {
            let gone = FakeSource::delete(self, &key.kind, &key.name);
            gone.map(DeleteOutcome::Removed)
                .ok_or_else(|| StoreError::NotFound {
                    kind: key.kind.clone(),
                    name: key.name.clone(),
                    plural: String::new(),
                })
        }
        async fn apply_all(
            &self,
            _: Vec<DynObject>,
            _: &ApplyOptions,
        ) -> Result<Vec<(ApplyAction, DynObject)>, StoreError> {
            unsupported("apply")
        }
        async fn revision(&self) -> Result<u64, StoreError> {
            Ok(self.inner.lock().unwrap().rev)
        }

        fn watch(&self, kind: Option<&str>, from: u64) -> WatchStream {
            let kind = kind.unwrap_or_default().to_string();
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

        async fn compact(&self, _: u64) -> Result<u64, StoreError> {
            unsupported("compact")
        }
        async fn compacted(&self) -> Result<u64, StoreError> {
            Ok(0)
        }
        async fn was_removed(&self, _: &str) -> Result<bool, StoreError> {
            Ok(false)
        }
        async fn try_lead(
            &self,
            _: &str,
            _: &Candidate,
            _: std::time::Duration,
        ) -> Result<Leadership, StoreError> {
            unsupported("lead")
        }
        async fn resign(&self, _: &str, _: &Candidate) -> Result<(), StoreError> {
            unsupported("lead")
        }
        async fn leader(&self, _: &str) -> Result<Option<String>, StoreError> {
            unsupported("lead")
        }
    }

    async fn next(rx: &mut mpsc::UnboundedReceiver<Change>) -> (String, bool, bool) {
        let c = tokio::time::timeout(std::time::Duration::from_secs(30), rx.recv())
            .await
            .unwrap()
            .unwrap();
        (c.name().to_string(), c.old.is_some(), c.new.is_some())
    }

    /// A source holding `objects`, and a reflector of its Vms into a new cache, running.
    fn reflect_vms(
        objects: impl IntoIterator<Item = DynObject>,
    ) -> (
        FakeSource,
        Cache,
        mpsc::UnboundedReceiver<Change>,
        tokio::task::JoinHandle<()>,
    ) {
        let src = FakeSource::new();
        for o in objects {
            src.put(o);
        }
        let cache = Cache::new("Vm");
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(reflect(
            Arc::new(src.clone()),
            cache.clone(),
            tx,
            Backoff::default(),
        ));
        (src, cache, rx, task)
    }

    #[tokio::test(start_paused = true)]
    async fn lists_then_follows_the_watch() {
        let (src, cache, mut rx, task) = reflect_vms([obj("Vm", "a"), obj("Image", "i")]);
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

    /// A write of this process that lands in a cache before its first list (a reconciler of
    /// another kind creating the object while this controller starts) is still a change of
    /// that list, at the same revision or newer: nothing is left unreconciled until a resync.
    /// A later list does not repeat what the cache already delivered.
    #[test]
    fn writes_observed_before_the_first_list_are_changes_of_it() {
        let src = FakeSource::new();
        let a = src.put(obj("Image", "a"));
        let b = src.put(obj("Image", "b"));
        let c = Cache::new("Image");
        c.observe(&a);
        c.observe(&b);
        // The list was taken after a's write, before b's.
        let changes = c.replace(vec![a.clone()], a.metadata.rv());
        let mut names: Vec<&str> = changes.iter().map(|ch| ch.name()).collect();
        names.sort();
        assert_eq!(names, ["a", "b"]);
        assert!(c.get("a").is_some() && c.get("b").is_some());
        // A relist with nothing new says nothing.
        assert!(
            c.replace(vec![a.clone(), b.clone()], b.metadata.rv())
                .is_empty()
        );
    }

    #[test]
    fn full_caches_read_back_what_went_in_and_metadata_caches_keep_less() {
        let src = FakeSource::new();
        let mut a = obj("Vm", "a");
        a.metadata.annotations.insert("note".into(), "kept".into());
        a.metadata.labels.insert("app".into(), "x".into());
        let a = src.put(a);
        let full = Cache::new("Vm");
        let meta = Cache::metadata_only("Vm");
        for c in [&full, &meta] {
            c.replace(vec![a.clone()], a.metadata.rv());
        }
        // Full: the object as stored, parsed again on every read, typed or not.
        assert_eq!(*full.get("a").unwrap(), a);
        assert_eq!(full.list(), [Arc::new(a.clone())]);
        let (rv, vm) = full.get_as::<boxery_api::Vm>("a").unwrap();
        assert_eq!(rv, a.metadata.rv());
        assert_eq!(vm.unwrap().metadata, a.metadata);
        assert_eq!(full.list_as::<boxery_api::Vm>().len(), 1);
        // Metadata only: no spec, no annotations; labels and the revision stay.
        let m = meta.get("a").unwrap();
        assert!(m.rest.is_empty() && m.metadata.annotations.is_empty());
        assert_eq!(m.metadata.labels, a.metadata.labels);
        assert_eq!(m.metadata.rv(), a.metadata.rv());
        // A change carries the objects as the cache keeps them.
        let b = src.put(a.clone());
        let change = meta.apply(b.metadata.rv(), WatchEvent::Modified(b.clone()));
        assert!(change.new.unwrap().metadata.annotations.is_empty());
        let change = full.apply(b.metadata.rv(), WatchEvent::Modified(b.clone()));
        assert_eq!(*change.old.unwrap(), a);
        assert_eq!(*change.new.unwrap(), b);
    }

    #[tokio::test(start_paused = true)]
    async fn too_old_relists_and_emits_only_differences() {
        let (src, cache, mut rx, task) = reflect_vms([obj("Vm", "a"), obj("Vm", "b")]);
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
        let (src, _cache, mut rx, task) = reflect_vms([obj("Vm", "a")]);
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
