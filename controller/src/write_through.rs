//! Reading your own writes from a cache: [`WriteThrough`] is an [`ObjectStore`] that puts the
//! object every successful write returns into the [`Cache`]s registered for its kind, before
//! the write returns.
//!
//! A controller reconciles from its cache, which follows the store's watch. Without this, the
//! reconcile that follows a reconcile's own write (a `requeue(0)`, a retry) could start before
//! the watch delivered that write, and act on the object as it was before it — for a
//! reconciler that records intents in status (`status.operation`), that could mean doing a
//! finished side effect again. Give the reconcilers a `WriteThrough` over the store and
//! register each controller's cache with it: then every reconcile sees every write its
//! predecessors made.
//!
//! # Guarantees
//! - After `create`, `adopt`, `update`, `update_status` or `apply_all` (created and configured
//!   objects) returns, every cache registered for the object's kind holds that object or a
//!   newer revision of it.
//! - After a write removed an object (`delete` without finalizers left, or the removal of the
//!   last finalizer of an object being deleted), the caches no longer hold it, and older
//!   watch events cannot bring it back.
//! - Reads (`get`, `list`, `watch`, …) go to the store unchanged.
//!
//! # Caveats
//! - Only writes made through this wrapper are seen early; writes of other processes reach
//!   the caches with the watch latency (resourceVersion preconditions fence decisions made on
//!   such a stale copy). Objects the store's cascade removed go with the watch too.
//! - The caches' change events still come from the watch, so a reconcile's own write queues
//!   its object once more, as it always did.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use boxery_api::DynObject;
use boxery_store::{
    ApplyAction, ApplyOptions, Candidate, DeleteOutcome, Leadership, ObjectRef, ObjectStore, Result,
};

use crate::reflector::Cache;

/// An [`ObjectStore`] whose writes go into registered caches at once (see the module docs).
#[derive(Debug)]
pub struct WriteThrough {
    inner: Arc<dyn ObjectStore>,
    caches: RwLock<HashMap<String, Vec<Cache>>>,
}

impl WriteThrough {
    /// A write-through wrapper over `store`, with no cache registered yet.
    pub fn new(store: Arc<dyn ObjectStore>) -> Self {
        WriteThrough {
            inner: store,
            caches: RwLock::default(),
        }
    }

    /// The store it writes to.
    pub fn inner(&self) -> &Arc<dyn ObjectStore> {
        &self.inner
    }

    /// Put every later write of `cache`'s kind into `cache` too.
    pub fn register(&self, cache: Cache) {
        self.caches
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .entry(cache.kind().to_string())
            .or_default()
            .push(cache);
    }

    fn each(&self, kind: &str, f: impl Fn(&Cache)) {
        if let Some(caches) = self
            .caches
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(kind)
        {
            caches.iter().for_each(f);
        }
    }

    /// Record what a write returned: the object as stored, or as removed.
    fn observe(&self, obj: &DynObject) {
        // The store removes an object whose deletion was asked for once its last finalizer
        // goes; the write then returns it as removed.
        let removed = obj.metadata.is_deleting() && obj.metadata.finalizers.is_empty();
        self.each(&obj.kind, |c| {
            if removed {
                c.observe_removed(obj)
            } else {
                c.observe(obj)
            }
        });
    }

    fn observed(&self, r: Result<DynObject>) -> Result<DynObject> {
        if let Ok(obj) = &r {
            self.observe(obj);
        }
        r
    }
}

#[async_trait]
impl ObjectStore for WriteThrough {
    boxery_store::reads_from!(inner);
    async fn create_by(&self, obj: DynObject, manager: &str) -> Result<DynObject> {
        self.observed(self.inner.create_by(obj, manager).await)
    }
    async fn adopt(&self, obj: DynObject, uid: &str) -> Result<DynObject> {
        self.observed(self.inner.adopt(obj, uid).await)
    }
    async fn update_by(&self, obj: DynObject, manager: &str) -> Result<DynObject> {
        self.observed(self.inner.update_by(obj, manager).await)
    }
    async fn update_dry_run_by(&self, obj: DynObject, manager: &str) -> Result<DynObject> {
        self.inner.update_dry_run_by(obj, manager).await
    }
    async fn update_status(&self, obj: DynObject) -> Result<DynObject> {
        self.observed(self.inner.update_status(obj).await)
    }
    async fn delete(&self, key: &ObjectRef) -> Result<DeleteOutcome> {
        let out = self.inner.delete(key).await?;
        match &out {
            DeleteOutcome::Marked(o) => self.observe(o),
            DeleteOutcome::Removed(o) => self.each(&o.kind, |c| c.observe_removed(o)),
        }
        Ok(out)
    }
    async fn apply_all(
        &self,
        objs: Vec<DynObject>,
        opts: &ApplyOptions,
    ) -> Result<Vec<(ApplyAction, DynObject)>> {
        let out = self.inner.apply_all(objs, opts).await?;
        for (action, obj) in &out {
            if matches!(action, ApplyAction::Created | ApplyAction::Configured) {
                self.observe(obj);
            }
        }
        Ok(out)
    }
    async fn compact(&self, keep_revisions: u64) -> Result<u64> {
        self.inner.compact(keep_revisions).await
    }
    async fn try_lead(&self, lock: &str, me: &Candidate, ttl: Duration) -> Result<Leadership> {
        self.inner.try_lead(lock, me, ttl).await
    }
    async fn resign(&self, lock: &str, me: &Candidate) -> Result<()> {
        self.inner.resign(lock, me).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reflector::tests::{FakeSource, obj};

    #[tokio::test]
    async fn writes_are_in_the_cache_before_the_watch_and_never_go_back() {
        let src = FakeSource::new();
        let cache = Cache::new("Vm");
        cache.replace(vec![], 0);
        let wt = WriteThrough::new(Arc::new(src.clone()));
        wt.register(cache.clone());
        let a1 = wt.create(obj("Vm", "a")).await.unwrap();
        assert_eq!(cache.get("a").unwrap().metadata.rv(), a1.metadata.rv());
        let a2 = wt.update(a1.clone()).await.unwrap();
        assert_eq!(cache.get("a").unwrap().metadata.rv(), a2.metadata.rv());
        // The watch delivers the first write late: the cache keeps the newer copy.
        cache.apply(
            a1.metadata.rv(),
            boxery_store::WatchEvent::Added(a1.clone()),
        );
        assert_eq!(cache.get("a").unwrap().metadata.rv(), a2.metadata.rv());
        // Other kinds are not ours.
        wt.create(obj("Image", "i")).await.unwrap();
        assert!(cache.get("i").is_none());
        // A removal: late events of older revisions do not bring it back.
        wt.delete(&ObjectRef::new("Vm", "a")).await.unwrap();
        assert!(cache.get("a").is_none());
        cache.apply(
            a2.metadata.rv(),
            boxery_store::WatchEvent::Modified(a2.clone()),
        );
        assert!(cache.get("a").is_none(), "a stale event resurrected it");
        // A relist from before the removal does not either.
        cache.replace(vec![a2.clone()], a2.metadata.rv());
        assert!(cache.get("a").is_none());
        // A newer object of that name does.
        let a3 = wt.create(obj("Vm", "a")).await.unwrap();
        assert_eq!(cache.get("a").unwrap().metadata.rv(), a3.metadata.rv());
    }
}
