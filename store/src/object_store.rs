//! The object store as an async trait: what the controller runtime, the reconcilers and the
//! verbs need from a store, whatever keeps the objects. [`Store`] (SQLite) implements it and
//! does its blocking work on tokio's blocking pool, so async workers never wait on SQLite;
//! `boxery_remote::RemoteStore` (a home's store through its API, for contexts) is another,
//! `boxery_store_etcd::EtcdStore` (the objects on an etcd cluster) a third.
//! `store/tests/conformance/mod.rs` is the suite every implementation must pass unchanged
//! (`store/tests/conformance_sqlite.rs` runs it for [`Store`],
//! `remote/tests/conformance_remote.rs` for the remote store, `store-etcd/tests/
//! conformance_etcd.rs` against a 3-member etcd cluster).
//!
//! # Guarantees every implementation gives
//! - One global, increasing revision; each changed object's `resourceVersion` is the revision
//!   of its change; whoever saw revision N saw every change at or below N.
//! - Server fields (`uid`, `creationTimestamp`, `resourceVersion`, `generation`,
//!   `deletionTimestamp`) are the store's; `generation` grows only with a spec change.
//! - `update`/`update_status` with a `resourceVersion` are refused with `Conflict` when the
//!   object moved on; a write that changes nothing writes nothing.
//! - `delete` respects finalizers and cascades through ownerReferences (by uid).
//! - `apply_all` is all or nothing.
//! - `watch(kind, from)` yields every change after `from` in order, exactly once, from this
//!   process or another; `TooOld` when `from` is below the compaction floor (list again).
//! - `list` returns the revision it was read at: a watch from it misses nothing.
//! - `list_at(kind, rev)`, when it answers, is the list as it was at `rev` (a paged list's
//!   later pages); a store may answer `None` (it cannot read its past), never another list.
//!
//! # Caveats
//! - A call's future may be dropped after the store started the work: a write may then have
//!   committed anyway (the SQLite store finishes it on the blocking pool). Read again, or
//!   watch, to learn the outcome; a precondition (`resourceVersion`) keeps a retry safe.
//! - On [`Store`] itself the inherent synchronous methods (`get`, `list`, `create`, ...)
//!   shadow the trait's: async code holds an `Arc<dyn ObjectStore>` (or calls
//!   `ObjectStore::get(&store, ..)`).
//!
//! docs/store.md says how the SQLite store keeps these promises.

use std::time::Duration;

use async_trait::async_trait;
use boxery_api::{DynObject, Resource, Selector};
use futures::stream::BoxStream;

use crate::{
    ApplyAction, ApplyOptions, Candidate, DeleteOutcome, Leadership, Result, Store, StoreError,
    WatchEvent,
};

/// How much history boxery keeps in a store (its watchers resume within it; one further
/// behind lists again): the newest 10,000 revisions, trimmed every minute by the SQLite
/// store's own upkeep and by the controllers wherever they run.
pub const KEEP_REVISIONS: u64 = 10_000;

/// The key of one object. Objects are cluster-scoped today; the struct is non-exhaustive so a
/// namespace can join the key without breaking callers.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub struct ObjectRef {
    /// The kind (`Vm`).
    pub kind: String,
    /// The name.
    pub name: String,
}

impl ObjectRef {
    /// The object `name` of `kind`.
    pub fn new(kind: impl Into<String>, name: impl Into<String>) -> ObjectRef {
        ObjectRef {
            kind: kind.into(),
            name: name.into(),
        }
    }

    /// The object `name` of `R`'s kind.
    pub fn of<R: Resource>(name: impl Into<String>) -> ObjectRef {
        ObjectRef::new(R::INFO.kind, name)
    }

    /// The key of a stored object.
    pub fn to(obj: &DynObject) -> ObjectRef {
        ObjectRef::new(obj.kind.clone(), obj.metadata.name.clone())
    }
}

impl std::fmt::Display for ObjectRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.kind, self.name)
    }
}

/// A stream of changes: `(revision, event)`, or an error that ends it.
pub type WatchStream = BoxStream<'static, Result<(u64, WatchEvent)>>;

/// A versioned object store (see the module documentation for the guarantees).
#[async_trait]
pub trait ObjectStore: Send + Sync + std::fmt::Debug + 'static {
    /// The store's identity: made with the store, never changed (backends mark what they make
    /// with it).
    fn uid(&self) -> &str;

    /// The current object of a key; `None` when absent or when no object can have the name.
    async fn get(&self, key: &ObjectRef) -> Result<Option<DynObject>>;

    /// The objects of a kind whose labels match `selector`, sorted by name, and the revision
    /// they were read at.
    async fn list(&self, kind: &str, selector: &Selector) -> Result<(Vec<DynObject>, u64)>;

    /// The objects of a kind whose names start with `prefix`, sorted by name. The default
    /// reads the whole kind; a store with names in an ordered index reads only the range.
    async fn list_named_prefix(&self, kind: &str, prefix: &str) -> Result<Vec<DynObject>> {
        let (all, _) = self.list(kind, &Selector::default()).await?;
        Ok(all
            .into_iter()
            .filter(|o| o.metadata.name.starts_with(prefix))
            .collect())
    }

    /// The objects of a kind whose labels match `selector` as they were at revision `rev`,
    /// sorted by name (a paged list's later pages), when the store can read its past; `None`
    /// when it cannot (the default, and a store whose history no longer holds the version);
    /// `TooOld` when `rev` is below the compaction floor.
    async fn list_at(
        &self,
        kind: &str,
        selector: &Selector,
        rev: u64,
    ) -> Result<Option<Vec<DynObject>>> {
        let _ = (kind, selector, rev);
        Ok(None)
    }

    /// Create an object (validated, defaulted; the server fields set by the store).
    async fn create(&self, obj: DynObject) -> Result<DynObject> {
        self.create_by(obj, crate::UNNAMED_MANAGER).await
    }

    /// [`ObjectStore::create`] by a named field manager, which owns the fields it set
    /// (`metadata.managedFields`).
    async fn create_by(&self, obj: DynObject, manager: &str) -> Result<DynObject>;

    /// Create an object again with the uid it was made with (adopting an orphan); refused
    /// when a current object has the uid or the store removed the object that had it.
    async fn adopt(&self, obj: DynObject, uid: &str) -> Result<DynObject>;

    /// Replace everything but status (a `resourceVersion` in `obj` is a precondition).
    async fn update(&self, obj: DynObject) -> Result<DynObject> {
        self.update_by(obj, crate::UNNAMED_MANAGER).await
    }

    /// [`ObjectStore::update`] by a named field manager: the fields it changes become its own,
    /// the ones it removes leave every manager (`metadata.managedFields`).
    async fn update_by(&self, obj: DynObject, manager: &str) -> Result<DynObject>;

    /// What `update` would store, validated and checked, with nothing written.
    async fn update_dry_run(&self, obj: DynObject) -> Result<DynObject> {
        self.update_dry_run_by(obj, crate::UNNAMED_MANAGER).await
    }

    /// [`ObjectStore::update_dry_run`] by a named field manager.
    async fn update_dry_run_by(&self, obj: DynObject, manager: &str) -> Result<DynObject>;

    /// Replace only status (same precondition); never bumps `generation`.
    async fn update_status(&self, obj: DynObject) -> Result<DynObject>;

    /// Delete: mark while finalizers remain, else remove and cascade.
    async fn delete(&self, key: &ObjectRef) -> Result<DeleteOutcome>;

    /// Apply a set of manifests in one transaction (see `docs/store.md`, Apply).
    async fn apply_all(
        &self,
        objs: Vec<DynObject>,
        opts: &ApplyOptions,
    ) -> Result<Vec<(ApplyAction, DynObject)>>;

    /// The current revision.
    async fn revision(&self) -> Result<u64>;

    /// Every change after `from` (of one kind, or all), in order, then each new one.
    fn watch(&self, kind: Option<&str>, from: u64) -> WatchStream;

    /// Trim history to the newest `keep_revisions` revisions ([`KEEP_REVISIONS`] is what
    /// boxery keeps); returns the entries removed.
    async fn compact(&self, keep_revisions: u64) -> Result<u64>;

    /// The compaction floor: history holds every change after it.
    async fn compacted(&self) -> Result<u64>;

    /// Whether this store removed a Vm or Image with this uid.
    async fn was_removed(&self, uid: &str) -> Result<bool>;

    /// Take or renew the leader lock `lock` for `ttl`.
    async fn try_lead(&self, lock: &str, me: &Candidate, ttl: Duration) -> Result<Leadership>;

    /// Give up the leader lock if `me` holds it.
    async fn resign(&self, lock: &str, me: &Candidate) -> Result<()>;

    /// Who holds the leader lock `lock` now; `None` when it is free for the taking (never
    /// taken, given up, expired, or its holder's process is gone). Reads only.
    async fn leader(&self, lock: &str) -> Result<Option<String>>;
}

/// Typed helpers over any [`ObjectStore`].
#[async_trait]
pub trait ObjectStoreExt: ObjectStore {
    /// [`ObjectStore::get`], typed.
    async fn get_as<R: Resource>(&self, name: &str) -> Result<Option<R>> {
        match self.get(&ObjectRef::of::<R>(name)).await? {
            Some(o) => Ok(Some(o.to_typed()?)),
            None => Ok(None),
        }
    }

    /// [`ObjectStore::list`], typed (without the revision).
    async fn list_as<R: Resource>(&self, selector: &Selector) -> Result<Vec<R>> {
        let (objs, _) = self.list(R::INFO.kind, selector).await?;
        objs.iter()
            .map(|o| o.to_typed().map_err(StoreError::from))
            .collect()
    }

    /// [`ObjectStore::create`], typed.
    async fn create_as<R: Resource>(&self, obj: &R) -> Result<R> {
        Ok(self.create(DynObject::from_typed(obj)?).await?.to_typed()?)
    }

    /// [`ObjectStore::update`], typed.
    async fn update_as<R: Resource>(&self, obj: &R) -> Result<R> {
        Ok(self.update(DynObject::from_typed(obj)?).await?.to_typed()?)
    }

    /// [`ObjectStore::create_by`], typed.
    async fn create_as_by<R: Resource>(&self, obj: &R, manager: &str) -> Result<R> {
        Ok(self
            .create_by(DynObject::from_typed(obj)?, manager)
            .await?
            .to_typed()?)
    }

    /// [`ObjectStore::update_by`], typed.
    async fn update_as_by<R: Resource>(&self, obj: &R, manager: &str) -> Result<R> {
        Ok(self
            .update_by(DynObject::from_typed(obj)?, manager)
            .await?
            .to_typed()?)
    }

    /// [`ObjectStore::update_status`], typed.
    async fn update_status_as<R: Resource>(&self, obj: &R) -> Result<R> {
        Ok(self
            .update_status(DynObject::from_typed(obj)?)
            .await?
            .to_typed()?)
    }
}

impl<S: ObjectStore + ?Sized> ObjectStoreExt for S {}

/// The future an [`ObjectStore`] method returns, as `async_trait` makes it (for
/// [`reads_from!`](crate::reads_from)).
#[doc(hidden)]
pub type Boxed<'t, T> = std::pin::Pin<Box<dyn std::future::Future<Output = Result<T>> + Send + 't>>;

/// The read half of [`ObjectStore`] in a wrapper that only checks or follows writes (the
/// store's `guard::Guarded`, the controllers' `WriteThrough`): `uid`, `get`, `list`,
/// `list_named_prefix`, `revision`, `watch`, `compacted`, `was_removed` and `leader`,
/// answered by the wrapped store in the field `$inner`, unchanged. Written inside the
/// wrapper's `#[async_trait] impl ObjectStore`, beside its own methods; it spells the boxed
/// futures `async_trait` makes of the trait's `async fn`s, as the macro is expanded after it.
#[macro_export]
macro_rules! reads_from {
    ($inner:ident) => {
        fn uid(&self) -> &str {
            self.$inner.uid()
        }
        fn watch(&self, kind: Option<&str>, from: u64) -> $crate::WatchStream {
            self.$inner.watch(kind, from)
        }
        $crate::reads_from!(@read $inner, get<'k>(key: &'k $crate::ObjectRef)
            -> Option<$crate::__private::DynObject>);
        $crate::reads_from!(@read $inner, list<'k, 'l>(kind: &'k str,
            selector: &'l $crate::__private::Selector) -> (Vec<$crate::__private::DynObject>, u64));
        $crate::reads_from!(@read $inner, list_named_prefix<'k, 'p>(kind: &'k str,
            prefix: &'p str) -> Vec<$crate::__private::DynObject>);
        $crate::reads_from!(@read $inner, revision<>() -> u64);
        $crate::reads_from!(@read $inner, compacted<>() -> u64);
        $crate::reads_from!(@read $inner, was_removed<'u>(uid: &'u str) -> bool);
        $crate::reads_from!(@read $inner, leader<'l>(lock: &'l str) -> Option<String>);
    };
    // One method, with the lifetimes `async_trait` gives it: one per reference, and `'t`,
    // the future's, which they all outlive.
    (@read $inner:ident, $name:ident<$($l:lifetime),*>($($arg:ident: $t:ty),*) -> $out:ty) => {
        fn $name<'s, $($l,)* 't>(&'s self, $($arg: $t),*) -> $crate::__private::Boxed<'t, $out>
        where
            's: 't,
            $($l: 't,)*
            Self: 't,
        {
            self.$inner.$name($($arg),*)
        }
    };
}

/// Run blocking store work on tokio's blocking pool when a multi-thread runtime is current
/// (so async workers never wait on SQLite's locks or disk), inline otherwise (a plain thread,
/// `futures::executor`, a current-thread runtime). Used by every [`ObjectStore`] method of
/// [`Store`] and by the watch stream's log reads.
///
/// Cancellation: once started, `f` runs to its end even when the returned future is dropped
/// (its result is then discarded), so a connection it borrows is always given back in a clean
/// state and nothing it commits is half done.
pub(crate) async fn off_workers<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() != tokio::runtime::RuntimeFlavor::CurrentThread => {
            match handle.spawn_blocking(f).await {
                Ok(out) => out,
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                Err(_) => Err(StoreError::Unavailable {
                    why: "the runtime is shutting down".into(),
                }),
            }
        }
        // A current-thread runtime (tests, short CLI commands) has no workers to protect and
        // may have no blocking pool to spare: run inline.
        _ => f(),
    }
}

/// [`blocking`] for a write of `obj` with one string argument (a field manager, a uid).
async fn write_with(
    store: &Store,
    obj: DynObject,
    arg: &str,
    write: fn(&Store, DynObject, &str) -> Result<DynObject>,
) -> Result<DynObject> {
    let arg = arg.to_string();
    blocking(store, move |s| write(s, obj, &arg)).await
}

/// `write`, timed into the store's write latency (`boxery_store_write_duration_seconds`) as
/// its caller waits for it: queueing for the blocking pool and the write lock included.
async fn timed<T>(operation: &'static str, write: impl Future<Output = Result<T>>) -> Result<T> {
    let histogram = boxery_metrics::METRICS
        .store
        .write_duration
        .get_or_create_owned(&boxery_metrics::OperationLabel { operation });
    let _timed = boxery_metrics::Timer::start(&histogram);
    write.await
}

/// [`off_workers`] for a call on a clone of `store`.
async fn blocking<T: Send + 'static>(
    store: &Store,
    f: impl FnOnce(&Store) -> Result<T> + Send + 'static,
) -> Result<T> {
    let store = store.clone();
    off_workers(move || f(&store)).await
}

#[async_trait]
impl ObjectStore for Store {
    fn uid(&self) -> &str {
        Store::uid(self)
    }
    async fn get(&self, key: &ObjectRef) -> Result<Option<DynObject>> {
        let key = key.clone();
        blocking(self, move |s| s.get(&key.kind, &key.name)).await
    }
    async fn list(&self, kind: &str, selector: &Selector) -> Result<(Vec<DynObject>, u64)> {
        let (kind, selector) = (kind.to_string(), selector.clone());
        blocking(self, move |s| s.list(&kind, &selector)).await
    }
    async fn list_named_prefix(&self, kind: &str, prefix: &str) -> Result<Vec<DynObject>> {
        let (kind, prefix) = (kind.to_string(), prefix.to_string());
        blocking(self, move |s| s.list_named_prefix(&kind, &prefix)).await
    }
    async fn list_at(
        &self,
        kind: &str,
        selector: &Selector,
        rev: u64,
    ) -> Result<Option<Vec<DynObject>>> {
        let (kind, selector) = (kind.to_string(), selector.clone());
        blocking(self, move |s| s.list_at(&kind, &selector, rev)).await
    }
    async fn create_by(&self, obj: DynObject, manager: &str) -> Result<DynObject> {
        timed("create", write_with(self, obj, manager, Store::create_by)).await
    }
    async fn adopt(&self, obj: DynObject, uid: &str) -> Result<DynObject> {
        timed("adopt", write_with(self, obj, uid, Store::adopt)).await
    }
    async fn update_by(&self, obj: DynObject, manager: &str) -> Result<DynObject> {
        timed("update", write_with(self, obj, manager, Store::update_by)).await
    }
    async fn update_dry_run_by(&self, obj: DynObject, manager: &str) -> Result<DynObject> {
        write_with(self, obj, manager, Store::update_dry_run_by).await
    }
    async fn update_status(&self, obj: DynObject) -> Result<DynObject> {
        timed(
            "update_status",
            blocking(self, move |s| s.update_status(obj)),
        )
        .await
    }
    async fn delete(&self, key: &ObjectRef) -> Result<DeleteOutcome> {
        let key = key.clone();
        timed(
            "delete",
            blocking(self, move |s| s.delete(&key.kind, &key.name)),
        )
        .await
    }
    async fn apply_all(
        &self,
        objs: Vec<DynObject>,
        opts: &ApplyOptions,
    ) -> Result<Vec<(ApplyAction, DynObject)>> {
        let opts = opts.clone();
        timed("apply", blocking(self, move |s| s.apply_all(objs, &opts))).await
    }
    async fn revision(&self) -> Result<u64> {
        blocking(self, |s| s.revision()).await
    }
    fn watch(&self, kind: Option<&str>, from: u64) -> WatchStream {
        Store::watch(self, kind, from)
    }
    async fn compact(&self, keep_revisions: u64) -> Result<u64> {
        blocking(self, move |s| s.compact(keep_revisions)).await
    }
    async fn compacted(&self) -> Result<u64> {
        blocking(self, |s| s.compacted()).await
    }
    async fn was_removed(&self, uid: &str) -> Result<bool> {
        let uid = uid.to_string();
        blocking(self, move |s| s.was_removed(&uid)).await
    }
    async fn try_lead(&self, lock: &str, me: &Candidate, ttl: Duration) -> Result<Leadership> {
        let (lock, me) = (lock.to_string(), me.clone());
        blocking(self, move |s| s.try_lead(&lock, &me, ttl)).await
    }
    async fn resign(&self, lock: &str, me: &Candidate) -> Result<()> {
        let (lock, me) = (lock.to_string(), me.clone());
        blocking(self, move |s| s.resign(&lock, &me)).await
    }
    async fn leader(&self, lock: &str) -> Result<Option<String>> {
        let lock = lock.to_string();
        blocking(self, move |s| s.leader(&lock)).await
    }
}
