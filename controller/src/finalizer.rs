//! Finalizers: make sure cleanup runs before an object is removed.
//!
//! [`finalizer`] wraps a reconcile the way kube-runtime's does: it adds the finalizer to a
//! live object before anything else, calls [`FinalizerEvent::Apply`] while the object lives,
//! and [`FinalizerEvent::Cleanup`] once deletion was requested, removing the finalizer only
//! after cleanup succeeded. [`ensure_finalizer`] and [`remove_finalizer`] are the two writes,
//! for reconcilers that want to do it by hand.
//!
//! # Guarantees
//! - Every write carries the object's `resourceVersion`: if the object changed since it was
//!   read, the write fails with `Conflict` (a [`FinalizerError`]), the reconcile errors and is
//!   retried with the fresh object. A finalizer is never added or removed on a stale view.
//! - `Cleanup` runs to success before the finalizer goes; a failed cleanup leaves the
//!   finalizer, so the object stays (with `deletionTimestamp` set) until cleanup succeeds.
//! - A finalizer is never added to an object already being deleted.
//! - After a successful `Cleanup`, [`finalizer`] removes the finalizer from the object as
//!   stored then (re-read, its resourceVersion the precondition), so status that the cleanup
//!   wrote does not make the removal conflict.
//!
//! # Assumptions
//! - Cleanup is idempotent: it may run again after a crash between cleanup and the removal
//!   of the finalizer, or after a `Conflict` on that removal.
//! - Finalizer names are unique per controller (`boxery.dev/vm`).
//!
//! # Caveats
//! - Removing the last finalizer of an object being deleted removes the object (and cascades
//!   to what it owns) in the same write.
//! - An object created and deleted before its first reconcile never gets the finalizer, and
//!   so never sees `Cleanup`: cleanup of something that was never set up.

use std::future::Future;
use std::sync::Arc;

use boxery_api::{DynObject, Resource};
use boxery_store::{ObjectRef, ObjectStore, StoreError};

use crate::action::{Action, ReconcileError};

/// A finalizer write that failed.
#[derive(Debug, thiserror::Error)]
pub enum FinalizerError {
    /// Adding the finalizer failed (a `Conflict` means the object changed: retry).
    #[error("cannot add finalizer {finalizer} to {key}")]
    Add {
        /// `Kind/name`.
        key: String,
        /// The finalizer.
        finalizer: String,
        /// The store's error.
        #[source]
        source: Box<StoreError>,
    },
    /// Removing the finalizer failed (a `Conflict` means the object changed: retry).
    #[error("cannot remove finalizer {finalizer} from {key}")]
    Remove {
        /// `Kind/name`.
        key: String,
        /// The finalizer.
        finalizer: String,
        /// The store's error.
        #[source]
        source: Box<StoreError>,
    },
    /// The typed object did not convert to its stored form.
    #[error("cannot write {key}: it does not convert to JSON")]
    Encode {
        /// `Kind/name`.
        key: String,
        /// The conversion error.
        #[source]
        source: serde_json::Error,
    },
}

impl ReconcileError for FinalizerError {}

impl FinalizerError {
    /// The store's error behind it, if any.
    pub fn store_error(&self) -> Option<&StoreError> {
        match self {
            FinalizerError::Add { source, .. } | FinalizerError::Remove { source, .. } => {
                Some(source)
            }
            FinalizerError::Encode { .. } => None,
        }
    }

    /// Whether the object had changed since it was read (retry with the fresh object).
    pub fn is_conflict(&self) -> bool {
        matches!(self.store_error(), Some(StoreError::Conflict { .. }))
    }
}

fn key<R: Resource>(obj: &R) -> String {
    format!("{}/{}", R::INFO.kind, obj.name())
}

fn to_dyn<R: Resource>(obj: &R) -> Result<DynObject, FinalizerError> {
    DynObject::from_typed(obj).map_err(|source| FinalizerError::Encode {
        source,
        key: key(obj),
    })
}

/// Which finalizer write failed.
#[derive(Clone, Copy)]
enum Write {
    Add,
    Remove,
}

/// The error of a store call made to add or remove `finalizer` on `key`.
fn failed(write: Write, key: String, finalizer: &str) -> impl FnOnce(StoreError) -> FinalizerError {
    let finalizer = finalizer.to_string();
    move |source| {
        let source = Box::new(source);
        match write {
            Write::Add => FinalizerError::Add {
                key,
                finalizer,
                source,
            },
            Write::Remove => FinalizerError::Remove {
                key,
                finalizer,
                source,
            },
        }
    }
}

/// Add `finalizer` to `obj` unless it has it or is being deleted. Returns whether it wrote.
/// Fails with `Conflict` inside when `obj` is stale.
pub async fn ensure_finalizer<R: Resource>(
    store: &dyn ObjectStore,
    obj: &R,
    finalizer: &str,
) -> Result<bool, FinalizerError> {
    let meta = obj.meta();
    if meta.has_finalizer(finalizer) || meta.is_deleting() {
        return Ok(false);
    }
    let mut d = to_dyn(obj)?;
    d.metadata.finalizers.push(finalizer.to_string());
    store
        .update(d)
        .await
        .map_err(failed(Write::Add, key(obj), finalizer))?;
    Ok(true)
}

/// Remove `finalizer` from `obj` if it has it. Returns whether it wrote. When `obj` is being
/// deleted and this was its last finalizer, the object is removed. Fails with `Conflict`
/// inside when `obj` is stale.
pub async fn remove_finalizer<R: Resource>(
    store: &dyn ObjectStore,
    obj: &R,
    finalizer: &str,
) -> Result<bool, FinalizerError> {
    if !obj.meta().has_finalizer(finalizer) {
        return Ok(false);
    }
    let mut d = to_dyn(obj)?;
    d.metadata.finalizers.retain(|f| f != finalizer);
    store
        .update(d)
        .await
        .map_err(failed(Write::Remove, key(obj), finalizer))?;
    Ok(true)
}

/// What [`finalizer`] asks the wrapped reconcile to do.
#[derive(Debug, Clone)]
pub enum FinalizerEvent<R> {
    /// The object lives and carries the finalizer: converge it.
    Apply(Arc<R>),
    /// Deletion was requested: clean up; the finalizer goes when this succeeds.
    Cleanup(Arc<R>),
}

/// A reconcile wrapped by [`finalizer`] failed.
#[derive(Debug, thiserror::Error)]
pub enum Error<E: std::error::Error + 'static> {
    /// The `Apply` branch failed.
    #[error("reconcile failed")]
    ApplyFailed(#[source] E),
    /// The `Cleanup` branch failed; the finalizer stays.
    #[error("cleanup before deletion failed")]
    CleanupFailed(#[source] E),
    /// Adding or removing the finalizer failed.
    #[error(transparent)]
    Finalizer(#[from] FinalizerError),
}

impl<E: ReconcileError> ReconcileError for Error<E> {
    fn is_terminal(&self) -> bool {
        match self {
            Error::ApplyFailed(e) | Error::CleanupFailed(e) => e.is_terminal(),
            Error::Finalizer(_) => false,
        }
    }
}

/// Run `reconcile` under the finalizer `name`:
///
/// | object | finalizer | what happens |
/// |---|---|---|
/// | live | absent | the finalizer is added; `await_change` (the write queues the object again) |
/// | live | present | `reconcile(Apply(obj))` |
/// | deleting | present | `reconcile(Cleanup(obj))`; on success the finalizer is removed |
/// | deleting | absent | nothing; `await_change` |
pub async fn finalizer<R, E, F, Fut>(
    store: &dyn ObjectStore,
    name: &str,
    obj: Arc<R>,
    reconcile: F,
) -> Result<Action, Error<E>>
where
    R: Resource,
    E: std::error::Error + 'static,
    F: FnOnce(FinalizerEvent<R>) -> Fut,
    Fut: Future<Output = Result<Action, E>>,
{
    let meta = obj.meta();
    match (meta.is_deleting(), meta.has_finalizer(name)) {
        (false, false) => {
            ensure_finalizer(store, &*obj, name).await?;
            Ok(Action::await_change())
        }
        (false, true) => reconcile(FinalizerEvent::Apply(obj))
            .await
            .map_err(Error::ApplyFailed),
        (true, true) => {
            let action = reconcile(FinalizerEvent::Cleanup(obj.clone()))
                .await
                .map_err(Error::CleanupFailed)?;
            // Cleanup may have written status: drop the finalizer from the object as it is now.
            let current = store
                .get(&ObjectRef::of::<R>(obj.name()))
                .await
                .map_err(failed(Write::Remove, key(&*obj), name))?;
            if let Some(mut current) = current.filter(|c| c.metadata.has_finalizer(name)) {
                current.metadata.finalizers.retain(|f| f != name);
                store
                    .update(current)
                    .await
                    .map_err(failed(Write::Remove, key(&*obj), name))?;
            }
            Ok(action)
        }
        (true, false) => Ok(Action::await_change()),
    }
}
