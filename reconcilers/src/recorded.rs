//! What every reconcile of a kind that records its failures in status (`Vm`, `Image`) does
//! around its own decisions, written once: the backoff check, the per-VM lock, the finalizer
//! (the controller's [`finalizer`] helper), the `Ready=Unknown` start, and the one
//! status-recording error policy.
//!
//! A reconciler then is a page of decisions:
//!
//! ```ignore
//! pub async fn reconcile(vm: Arc<Vm>, ctx: Arc<Ctx>) -> Result<Action> {
//!     let lock = ctx.vm_lock(vm.name());
//!     recorded::reconcile(vm, &ctx, Some(lock), async |event| match event {
//!         FinalizerEvent::Apply(vm) => apply((*vm).clone(), &ctx).await,
//!         FinalizerEvent::Cleanup(vm) => cleanup((*vm).clone(), &ctx).await,
//!     })
//!     .await
//! }
//! ```
//!
//! # Guarantees
//! - One backoff: after `n` consecutive failures the next step waits `200 ms × 2^(n−1)`, at
//!   most 60 s ([`crate::backoff`]), computed from `status.failures` and
//!   `status.lastFailure.at`, so it holds across restarts and is not cut short by the status
//!   write that recorded the failure (that write wakes the controller at once; the wake-up
//!   finds the wait and requeues for what is left of it). A failure the backend calls invalid
//!   (terminal) waits 60 s. A new generation of the spec, or a deletion asked for after the
//!   failure, goes ahead at once; so does one asked for while a step ran that then failed
//!   (that failure is told, not counted).
//! - One error policy: a failed step is recorded in the object's status (`failures`,
//!   `lastFailure`, `observedGeneration`, `Ready=False` with reason `StepFailed` or
//!   `InvalidRequest` and the whole cause chain, the kind's failed phase) and as a Warning
//!   event `StepFailed`; the reconcile then returns `requeue(the backoff)`. A failure that
//!   cannot be recorded — a `Conflict` (someone else wrote first: the fresh object is
//!   reconciled next), or a store that does not answer — is returned as the error, and the
//!   controller backs off in memory with the same policy.
//! - Every live object carries the kind's finalizer before its first step; on its first step
//!   its `Ready` condition is `Unknown` (reason `Reconciling`) if it had none.
//! - Cleanup runs while the finalizer holds the object, which goes once cleanup succeeded.
//!
//! # Assumptions
//! - Steps are idempotent and record an intent (`status.operation`) before a side effect that
//!   could be left half done.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use boxery_api::conditions::{READY, reasons};
use boxery_api::vm::Failure;
use boxery_api::{
    Condition, ConditionStatus, Conditions, EventType, Image, ImagePhase, Resource, Vm, VmPhase,
};
use boxery_controller::{Action, FinalizerEvent, finalizer};
use boxery_store::ObjectStoreExt;

use crate::context::Ctx;
use crate::error::ReconcileError;

type Result<T, E = ReconcileError> = std::result::Result<T, E>;

/// A kind whose reconciler records its failures in status.
pub trait Recorded: Resource + Clone + Send + Sync + 'static {
    /// The finalizer its reconciler holds objects with.
    const FINALIZER: &'static str;
    /// `status.failures`: consecutive failed steps.
    fn failures(&self) -> u32;
    /// `status.lastFailure`.
    fn last_failure(&self) -> Option<&Failure>;
    /// `status.observedGeneration`.
    fn observed_generation(&self) -> Option<i64>;
    /// `status.conditions`.
    fn conditions(&self) -> &Vec<Condition>;
    /// `status.conditions`, to change.
    fn conditions_mut(&mut self) -> &mut Vec<Condition>;
    /// Count `failure` in status (`failures`, `lastFailure`, `observedGeneration`) and move
    /// the phase to the kind's failed phase where that applies.
    fn count_failure(&mut self, failure: Failure);
    /// Write `status.printableStatus` from the rest of the status.
    fn refresh_printable(&mut self);
}

/// The accessors of [`Recorded`] that read the same status fields in every recorded kind
/// (`failures`, `lastFailure`, `observedGeneration`, `conditions`).
macro_rules! status_fields {
    () => {
        fn failures(&self) -> u32 {
            self.status.failures
        }
        fn last_failure(&self) -> Option<&Failure> {
            self.status.last_failure.as_ref()
        }
        fn observed_generation(&self) -> Option<i64> {
            self.status.observed_generation
        }
        fn conditions(&self) -> &Vec<Condition> {
            &self.status.conditions
        }
        fn conditions_mut(&mut self) -> &mut Vec<Condition> {
            &mut self.status.conditions
        }
    };
}

impl Recorded for Vm {
    const FINALIZER: &'static str = boxery_api::meta::finalizers::VM;
    status_fields!();
    fn count_failure(&mut self, failure: Failure) {
        self.status.failures += 1;
        self.status.last_failure = Some(failure);
        self.status.observed_generation = self.metadata.generation;
        if matches!(self.status.phase, VmPhase::Pending | VmPhase::Creating) {
            self.status.phase = VmPhase::Failed;
        }
    }
    fn refresh_printable(&mut self) {
        self.status.printable_status = Some(crate::vm::printable(self));
    }
}

impl Recorded for Image {
    const FINALIZER: &'static str = boxery_api::meta::finalizers::IMAGE;
    status_fields!();
    fn count_failure(&mut self, failure: Failure) {
        self.status.failures += 1;
        self.status.last_failure = Some(failure);
        if self.status.phase != ImagePhase::Ready && !self.metadata.is_deleting() {
            self.status.phase = ImagePhase::Failed;
        }
        self.status.observed_generation = self.metadata.generation;
    }
    fn refresh_printable(&mut self) {
        self.status.printable_status = Some(crate::image::printable(self));
    }
}

/// How long `obj` must still wait after its last failure, or `None` to go ahead now.
pub fn backoff_left<R: Recorded>(obj: &R) -> Option<Duration> {
    crate::backoff::remaining(
        obj.failures(),
        obj.last_failure(),
        obj.observed_generation(),
        obj.meta().generation,
        obj.meta().deletion_timestamp,
    )
}

/// Write `obj`'s status; returns it as stored.
pub async fn save<R: Recorded>(ctx: &Ctx, obj: &R) -> Result<R> {
    Ok(ctx.store.update_status_as(obj).await?)
}

/// Reconcile `obj` with the shared boilerplate (see the module docs) around `step`, which
/// gets `Apply` with the object (its `Ready` condition set) or `Cleanup` while it is being
/// deleted. `lock`, when given, is held for the whole step.
pub async fn reconcile<R, F, Fut>(
    obj: Arc<R>,
    ctx: &Ctx,
    lock: Option<Arc<tokio::sync::Mutex<()>>>,
    step: F,
) -> Result<Action>
where
    R: Recorded,
    F: FnOnce(FinalizerEvent<R>) -> Fut,
    Fut: Future<Output = Result<Action>>,
{
    if let Some(wait) = backoff_left(&*obj) {
        return Ok(Action::requeue(wait));
    }
    let _held = match &lock {
        Some(l) => Some(l.lock().await),
        None => None,
    };
    let name = obj.name().to_string();
    let cleanup = obj.meta().is_deleting();
    let done = finalizer(
        ctx.store.as_ref(),
        R::FINALIZER,
        obj,
        async |event| match event {
            FinalizerEvent::Apply(obj) => {
                let obj = begin(obj, ctx).await?;
                step(FinalizerEvent::Apply(obj)).await
            }
            cleanup => step(cleanup).await,
        },
    )
    .await
    .map_err(ReconcileError::from);
    match done {
        Err(e) if !e.is_conflict() => record_failure::<R>(ctx, &name, cleanup, e).await,
        other => other,
    }
}

/// The first step of an object sets its `Ready` condition to `Unknown`.
async fn begin<R: Recorded>(obj: Arc<R>, ctx: &Ctx) -> Result<Arc<R>> {
    if obj.conditions().get_condition(READY).is_some() {
        return Ok(obj);
    }
    let mut o = (*obj).clone();
    let generation = o.meta().generation;
    o.conditions_mut().set_condition(
        READY,
        ConditionStatus::Unknown,
        reasons::RECONCILING,
        "",
        generation,
    );
    o.refresh_printable();
    Ok(Arc::new(save(ctx, &o).await?))
}

/// The one error policy: record the failure in the object's status and as an event, and
/// requeue after the backoff; a failure that cannot be recorded is returned. `cleanup`: the
/// failed step was the deletion's cleanup.
///
/// A step that began before a deletion was asked for and failed after it is told (condition,
/// event) but not counted: its backoff would hold back the cleanup the user asked for since.
async fn record_failure<R: Recorded>(
    ctx: &Ctx,
    name: &str,
    cleanup: bool,
    e: ReconcileError,
) -> Result<Action> {
    let key = format!("{}/{name}", R::INFO.kind);
    tracing::warn!(object = %key, error = %e.chain(), "reconcile failed");
    let mut cur = match ctx.store.get_as::<R>(name).await {
        Ok(Some(cur)) => cur,
        Ok(None) => return Err(e),
        Err(read) => {
            tracing::warn!(object = %key, error = %read, "cannot record the failure");
            return Err(e);
        }
    };
    let r = e.recorded();
    if cleanup || !cur.meta().is_deleting() {
        cur.count_failure(r.failure);
    }
    let generation = cur.meta().generation;
    cur.conditions_mut().set_condition(
        READY,
        ConditionStatus::False,
        r.reason,
        &r.message,
        generation,
    );
    cur.refresh_printable();
    let written = ctx.store.update_status_as(&cur).await;
    ctx.event(&cur, EventType::Warning, reasons::STEP_FAILED, &r.message)
        .await;
    match written {
        // The write wakes the controller at once; that reconcile finds the wait.
        Ok(stored) => Ok(Action::requeue(
            backoff_left(&stored).unwrap_or(crate::backoff::BASE),
        )),
        Err(write) => {
            tracing::warn!(object = %key, error = %write, "cannot record the failure");
            Err(e)
        }
    }
}
