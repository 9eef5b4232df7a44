//! A harness for a reconciler's decision tests, in the manner of kube-runtime's stub
//! watcher: a [`Ctx`] over a store in memory ([`Store::open_in_memory`]: the same SQLite
//! store as `serve`'s, so the same revisions, finalizers, conflicts and cascade) and the fake
//! backend, with no controller running. A test puts objects in, calls one reconcile function
//! once (or until it settles), and asserts on what it decided: the [`Action`] returned, the
//! status and conditions written, the events recorded, the backend calls made (the fake's
//! journal). Each test takes milliseconds.
//!
//! ```ignore
//! let h = Harness::new();
//! h.put(&vm); // Vm `a`, made from Image `base`, which is Ready (in the store and the fake)
//! let next = h.settle(vm::reconcile, "a").await.unwrap();
//! assert!(next.is_await_change());
//! assert_eq!(h.get::<Vm>("a").status.phase, VmPhase::Running);
//! assert_eq!(h.reasons::<Vm>("a"), ["Created"]);
//! assert_eq!(h.calls(), [(JournalOp::Create, "a".to_string())]);
//! ```
//!
//! For tests only (`#[doc(hidden)]`); `reconcilers/tests/decisions_*.rs` are the examples.
//! A decision test: build the objects with `serde_json::from_value` (the manifest as the
//! user writes it) and [`Harness::put`] them; call [`Harness::reconcile`] for one decision, or
//! [`Harness::settle`] to run it as the controller would until it waits; make what happens
//! elsewhere happen by hand ([`Harness::edit`] for a person's or another controller's write,
//! the fake's own helpers for the backend: `add_vm`, `degrade`, a removed directory,
//! [`Harness::fail`] for a failing step); then assert on the returned `Action`, the stored
//! status, [`Harness::reasons`]/[`Harness::warnings`] and [`Harness::calls`]. Other
//! reconcilers do not run unless the test calls them (a pool's members need the Vm and
//! Image reconcilers: `decisions_pool.rs`'s `rounds`).

use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use boxery_api::vm::{Operation, OperationType};
use boxery_api::{Event, EventType, Image, Resource, Vm};
use boxery_backends::fake::{FakeBackend, FaultAction, FaultConfig, FaultRule, JournalOp};
use boxery_controller::Action;
use boxery_controller::events::{INVOLVED_KIND, INVOLVED_NAME};
use boxery_store::Store;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::{Ctx, ReconcileError, Settings};

/// How many reconciles [`Harness::settle`] runs at most before it calls the object unsettled.
pub const SETTLE_LIMIT: usize = 30;

/// A control plane with no controllers: the store in memory, the fake backend and
/// `$BOXERY_HOME` in a temporary directory (removed on drop), and the [`Ctx`] the reconcilers
/// get.
pub struct Harness {
    /// The store, unwrapped (the reconcilers write through [`Ctx::store`]; both reach the same
    /// rows).
    pub store: Store,
    /// The fake backend the reconcilers drive.
    pub backend: Arc<FakeBackend>,
    /// What a reconcile gets.
    pub ctx: Arc<Ctx>,
    dir: tempfile::TempDir,
}

impl Default for Harness {
    fn default() -> Self {
        Harness::new()
    }
}

impl Harness {
    /// An empty control plane.
    pub fn new() -> Harness {
        // the fake builds nothing: no builder's outputs to read
        Harness::with_settings(Settings {
            build_outputs: None,
            ..Settings::default()
        })
    }

    /// An empty control plane with these settings.
    pub fn with_settings(settings: Settings) -> Harness {
        let dir = tempfile::tempdir().expect("a temp dir");
        let home = dir.path().join("home");
        std::fs::create_dir_all(&home).expect("a home in the temp dir");
        let store = Store::open_in_memory().expect("a store in memory");
        let backend = Arc::new(FakeBackend::new(dir.path().join("fake")));
        let ctx = Arc::new(Ctx::new(
            Arc::new(store.clone()),
            home,
            backend.clone(),
            "test".into(),
            settings,
        ));
        Harness {
            store,
            backend,
            ctx,
            dir,
        }
    }

    /// The temporary directory (`home/` and `fake/` are in it).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Create `obj` in the store (its status kept as given); returns it as stored.
    pub fn put<R: Resource + Serialize + DeserializeOwned>(&self, obj: &R) -> R {
        self.store.create_as(obj).expect("the object is created")
    }

    /// Image `name`, Ready: in the store (a `tiny` build, its status Ready) and in the fake
    /// backend, for VMs to be made from.
    pub fn ready_image(&self, name: &str) {
        let img: Image = serde_json::from_value(serde_json::json!({
            "apiVersion": boxery_api::API_VERSION, "kind": "Image", "metadata": {"name": name},
            "spec": {"source": {"build": {"base": "tiny"}}}, "status": {"phase": "Ready"},
        }))
        .expect("an Image");
        self.put(&img);
        self.backend
            .add_image(name, None)
            .expect("the image is in the fake");
    }

    /// The object `name` of kind `R` as stored now (panics when there is none).
    pub fn get<R: Resource + DeserializeOwned>(&self, name: &str) -> R {
        self.find(name)
            .unwrap_or_else(|| panic!("{} {name} is not in the store", R::INFO.kind))
    }

    /// The object `name` of kind `R` as stored now, if any.
    pub fn find<R: Resource + DeserializeOwned>(&self, name: &str) -> Option<R> {
        self.store.get_as(name).expect("the store reads")
    }

    /// Change the stored object with `change`, and write `part` of it: its metadata and spec
    /// (one `update`, as a person's edit would) or its status (one `update_status`, as
    /// another part of boxery would).
    pub fn edit<R: Resource + Serialize + DeserializeOwned>(
        &self,
        name: &str,
        part: Part,
        change: impl FnOnce(&mut R),
    ) -> R {
        let mut obj: R = self.get(name);
        change(&mut obj);
        match part {
            Part::Spec => self.store.update_as(&obj),
            Part::Status => self.store.update_status_as(&obj),
        }
        .expect("the object is written")
    }

    /// Ask for the deletion of `name` (its finalizers keep it, marked, until they go).
    pub fn delete<R: Resource>(&self, name: &str) {
        self.store
            .delete(R::INFO.kind, name)
            .expect("the deletion is recorded");
    }

    /// Ask for the deletion of `name`, then reconcile it once: its finalizer's cleanup runs
    /// and the finalizer goes. Panics when the object is still there after.
    pub async fn remove<R: Resource + DeserializeOwned>(
        &self,
        reconcile: impl Reconciler<R>,
        name: &str,
    ) -> Action {
        self.delete::<R>(name);
        let next = self
            .reconcile(reconcile, name)
            .await
            .expect("the cleanup succeeds");
        assert!(
            self.find::<R>(name).is_none(),
            "{} {name} is still there",
            R::INFO.kind
        );
        next
    }

    /// One reconcile of `name` by `reconcile`, on the object as stored now.
    pub async fn reconcile<R: Resource + DeserializeOwned>(
        &self,
        reconcile: impl Reconciler<R>,
        name: &str,
    ) -> Result<Action, ReconcileError> {
        let obj: R = self.get(name);
        reconcile(Arc::new(obj), self.ctx.clone()).await
    }

    /// Reconcile `name` as the controller would while nothing else happens: again while the
    /// last reconcile wrote the object (its write would wake the controller) or asked to be
    /// requeued at once, until it waits (for a change, or a requeue later), fails, or the
    /// object is gone. Returns the last outcome; panics after [`SETTLE_LIMIT`] reconciles.
    pub async fn settle<R: Resource + DeserializeOwned>(
        &self,
        reconcile: impl Reconciler<R>,
        name: &str,
    ) -> Result<Action, ReconcileError> {
        let version = |h: &Harness| h.find::<R>(name).map(|o| o.meta().resource_version.clone());
        for _ in 0..SETTLE_LIMIT {
            let Some(before) = version(self) else {
                return Ok(Action::await_change());
            };
            let next = self.reconcile(&reconcile, name).await?;
            let after = version(self);
            if after.is_none()
                || (after == Some(before) && next.requeue_after() != Some(Duration::ZERO))
            {
                return Ok(next);
            }
        }
        panic!(
            "{} {name} did not settle in {SETTLE_LIMIT} reconciles",
            R::INFO.kind
        )
    }

    /// The events recorded about `name`, oldest first.
    pub fn events<R: Resource>(&self, name: &str) -> Vec<Event> {
        let selector = format!("{INVOLVED_KIND}={},{INVOLVED_NAME}={name}", R::INFO.kind)
            .parse()
            .expect("a valid selector");
        let mut events: Vec<Event> = self.store.list_as(&selector).expect("the store lists");
        events.sort_by_key(|e| e.metadata.rv());
        events
    }

    /// The reasons of the events recorded about `name`, oldest first.
    pub fn reasons<R: Resource>(&self, name: &str) -> Vec<String> {
        self.events::<R>(name)
            .into_iter()
            .map(|e| e.reason)
            .collect()
    }

    /// The reasons of the Warning events recorded about `name`, oldest first.
    pub fn warnings<R: Resource>(&self, name: &str) -> Vec<String> {
        self.events::<R>(name)
            .into_iter()
            .filter(|e| e.type_ == EventType::Warning)
            .map(|e| e.reason)
            .collect()
    }

    /// The backend calls that changed something, oldest first: the fake's journal as
    /// `(operation, name)`.
    pub fn calls(&self) -> Vec<(JournalOp, String)> {
        self.backend
            .journal()
            .expect("the fake's journal reads")
            .into_iter()
            .map(|e| (e.op, e.name))
            .collect()
    }

    /// Make every call of the backend's `step` (one of the fake's steps, `create`,
    /// `start`, …) fail from now on.
    pub fn fail(&self, step: &str) {
        self.backend
            .set_faults(&FaultConfig {
                latency_ms: 0,
                rules: vec![FaultRule::new(step, FaultAction::Fail)],
            })
            .expect("the fault is set");
    }

    /// Take back every fault [`Harness::fail`] set.
    pub fn heal(&self) {
        self.backend.clear_faults().expect("the faults are cleared");
    }
}

/// What [`Harness::edit`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// Metadata and spec (`update`).
    Spec,
    /// Status (`update_status`).
    Status,
}

/// A reconcile function of kind `R` (`vm::reconcile`, `pool::reconcile`, …).
pub trait Reconciler<R>: Fn(Arc<R>, Arc<Ctx>) -> Self::Step {
    /// Its future.
    type Step: Future<Output = Result<Action, ReconcileError>>;
}

impl<R, F, Fut> Reconciler<R> for F
where
    F: Fn(Arc<R>, Arc<Ctx>) -> Fut,
    Fut: Future<Output = Result<Action, ReconcileError>>,
{
    type Step = Fut;
}

/// Vm `name` made from image `image`, as a user writes it (the store fills in the defaults).
pub fn vm(name: &str, image: &str) -> Vm {
    serde_json::from_value(serde_json::json!({
        "apiVersion": boxery_api::API_VERSION, "kind": "Vm", "metadata": {"name": name},
        "spec": {"source": {"image": image}},
    }))
    .expect("a Vm")
}

/// An operation (`status.operation`) of type `type_` on `image`, as a control plane that
/// crashed in the middle of it left it: what a recovery test puts in status.
pub fn interrupted(type_: OperationType, image: &str) -> Operation {
    Operation {
        type_,
        image: Some(image.into()),
        original_state: None,
        started_at: boxery_api::now(),
        holder: "a control plane that crashed".into(),
    }
}
