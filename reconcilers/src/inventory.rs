//! The inventory resync: compare what the backend has with what the store says.
//!
//! # Guarantees
//! - An unreachable backend is an error condition (`BackendReachable=False` on VMs), never
//!   "everything was deleted": nothing is marked Lost and nothing is removed.
//! - A VM the store knows as created but the backend lacks gets `Lost=True` and a Warning event.
//! - A VM last seen running, meant to run, that the backend reports stopped (guest power-off,
//!   hypervisor crash) gets `Ready=False` (`Exited`); that write wakes its controller, which
//!   starts it again. Without this, it would wait for the periodic resync.
//! - A running VM the backend reports degraded (qemu: its `boxery-net` died, so the guest has
//!   no network) gets `Ready=False` (`Degraded`) and a Warning event; that write wakes its
//!   controller, which repairs it without restarting the guest.
//! - A backend VM or image with no object is removed only when its mark names this store and
//!   an object this store remembers removing (a tombstone). Everything else is quarantined: left
//!   alone, logged, reported once as an `Orphaned` Warning event and listed by `boxery
//!   orphans` (marked by another store, by this store for an object it has no record of, by a
//!   store restored from an older backup, or before stores had an identity). So an emptied,
//!   replaced or rolled-back store never deletes a VM or an image. Unmarked ones are never
//!   touched.
//! - The backend is listed before the store, so a VM created in between is never seen as an
//!   orphan (objects are written before their backend VM exists).
//! - Passes run every `inventory_every`, and [`CHANGES_SETTLE`] after a change the backend
//!   reports itself (`Backend::changes`: Incus's events), so a VM deleted or stopped behind
//!   boxery's back there is seen in about a second.

use std::collections::HashMap;

use boxery_controller::Cache;

use boxery_api::conditions::{self, READY, reasons};
use boxery_api::{
    ConditionStatus, Conditions, EventType, Image, ImagePhase, RunStrategy, Vm, VmPhase,
};
use boxery_backends::mark::Mark;
use boxery_backends::{BackendError, PowerState, VmInfo};

use boxery_store::ObjectStoreExt;

use crate::context::Ctx;
use crate::error::ReconcileError;

/// What one pass found and did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Report {
    /// VMs marked Lost in this pass.
    pub lost_vms: Vec<String>,
    /// Images marked Lost in this pass.
    pub lost_images: Vec<String>,
    /// VMs found stopped that were running and are meant to run (started again by their
    /// controller).
    pub exited: Vec<String>,
    /// Running VMs found degraded (repaired by their controller).
    pub degraded: Vec<String>,
    /// Orphans removed from the backend: made for an object this store deleted.
    pub removed: Vec<String>,
    /// Orphans left alone and reported: marked by another store, by this store for an object
    /// it has no record of (a store restored from an older backup), or before stores had an
    /// identity; or in the way of an object of the same name.
    pub quarantined: Vec<String>,
    /// Unmarked things seen and left alone.
    pub foreign: Vec<String>,
    /// Whether the backend answered.
    pub reachable: bool,
}

/// The objects an inventory pass compares with the backend: the controllers' caches in a
/// running control plane. A pass reads them one at a time (parsed from the cached text when
/// it needs one), so it never holds a typed copy of every object at once; objects that do not
/// read as their kind are left out.
pub trait Objects {
    /// Every Vm's name.
    fn vm_names(&self) -> Vec<String>;
    /// One Vm.
    fn vm(&self, name: &str) -> Option<Vm>;
    /// Every Image's name.
    fn image_names(&self) -> Vec<String>;
    /// One Image.
    fn image(&self, name: &str) -> Option<Image>;
}

/// The controllers' caches.
#[derive(Debug, Clone)]
pub struct Caches {
    /// The Vm cache.
    pub vms: Cache,
    /// The Image cache.
    pub images: Cache,
}

impl Objects for Caches {
    fn vm_names(&self) -> Vec<String> {
        self.vms.names()
    }
    fn vm(&self, name: &str) -> Option<Vm> {
        self.vms.get_as(name).and_then(|(_, vm)| vm.ok())
    }
    fn image_names(&self) -> Vec<String> {
        self.images.names()
    }
    fn image(&self, name: &str) -> Option<Image> {
        self.images.get_as(name).and_then(|(_, img)| img.ok())
    }
}

/// One inventory pass: the backend is listed first, then each backend thing is checked for
/// an owner and each object for its backend thing.
pub async fn pass(ctx: &Ctx, objects: &impl Objects) -> Result<Report, ReconcileError> {
    let mut report = Report::default();
    let backend_vms = ctx.backend.list().await;
    let backend_images = ctx.backend.images().await;
    let (backend_vms, backend_images) = match (backend_vms, backend_images) {
        (Ok(v), Ok(i)) => (v, i),
        (Err(e), _) | (_, Err(e)) => {
            unreachable(ctx, &e).await?;
            return Err(ReconcileError::backend("inventory", "backend", e));
        }
    };
    report.reachable = true;
    // Backend → store: orphans.
    for info in &backend_vms {
        let owner = objects.vm(&info.name);
        orphan_vm(ctx, info, owner.as_ref(), &mut report).await?;
    }
    for info in &backend_images {
        let owner = objects.image(&info.name);
        orphan_image(ctx, info, owner.as_ref(), &mut report).await?;
    }
    // Store → backend: lost things, stopped ones, and reachability restored.
    let present: HashMap<&str, &VmInfo> =
        backend_vms.iter().map(|v| (v.name.as_str(), v)).collect();
    for name in objects.vm_names() {
        let Some(vm) = objects.vm(&name) else {
            continue;
        };
        check_vm(ctx, &vm, present.get(name.as_str()).copied(), &mut report).await?;
    }
    for name in objects.image_names() {
        if backend_images.iter().any(|i| i.name == name) {
            continue;
        }
        if let Some(img) = objects.image(&name) {
            lost_image(ctx, &img, &mut report).await?;
        }
    }
    Ok(report)
}

/// Whether a backend thing marked `mark` belongs to the object `owner` of its name.
fn owned(mark: Option<&str>, owner: Option<&boxery_api::ObjectMeta>) -> bool {
    owner.is_some_and(|o| mark.is_none() || Mark::is_for(mark, o.uid.as_deref()))
}

/// A backend VM no object owns: removed, quarantined or left alone ([`orphan_verdict`]),
/// decided under the VM's lock against the store itself, not the snapshot.
async fn orphan_vm(
    ctx: &Ctx,
    info: &VmInfo,
    owner: Option<&Vm>,
    report: &mut Report,
) -> Result<(), ReconcileError> {
    if owned(info.mark.as_deref(), owner.map(|o| &o.metadata)) {
        return Ok(());
    }
    let name = &info.name;
    let lock = ctx.vm_lock(name);
    let _g = lock.lock().await;
    let current = ctx.store.get_as::<Vm>(name).await?;
    match orphan_verdict(
        ctx,
        info.mark.as_deref(),
        current.as_ref().map(|v| &v.metadata),
    )
    .await?
    {
        Verdict::Owned => {}
        Verdict::Removable => {
            ctx.backend
                .remove(name)
                .await
                .map_err(|e| ReconcileError::backend("remove", format!("Vm/{name}"), e))?;
            ctx.backend
                .cleanup_new(name)
                .await
                .map_err(|e| ReconcileError::backend("cleanup_new", format!("Vm/{name}"), e))?;
            tracing::warn!(vm = %name, "removed a VM boxery made for an object this store deleted");
            report.removed.push(format!("vm/{name}"));
        }
        Verdict::Quarantined(why) => {
            quarantine(ctx, "Vm", name, &why).await;
            report.quarantined.push(format!("vm/{name}"));
        }
        Verdict::Foreign => {
            tracing::warn!(vm = %name, "the backend has a VM that no object describes and that boxery did not make; left alone");
            report.foreign.push(format!("vm/{name}"));
        }
    }
    Ok(())
}

/// A backend image no object owns (see [`orphan_vm`]).
async fn orphan_image(
    ctx: &Ctx,
    info: &boxery_backends::ImageInfo,
    owner: Option<&Image>,
    report: &mut Report,
) -> Result<(), ReconcileError> {
    if owned(info.mark.as_deref(), owner.map(|o| &o.metadata)) {
        return Ok(());
    }
    let name = &info.name;
    let current = ctx.store.get_as::<Image>(name).await?;
    match orphan_verdict(
        ctx,
        info.mark.as_deref(),
        current.as_ref().map(|i| &i.metadata),
    )
    .await?
    {
        Verdict::Owned => {}
        Verdict::Removable => {
            ctx.backend
                .remove_image(name)
                .await
                .map_err(|e| ReconcileError::backend("remove_image", format!("Image/{name}"), e))?;
            tracing::warn!(image = %name, "removed an image boxery made for an object this store deleted");
            report.removed.push(format!("image/{name}"));
        }
        Verdict::Quarantined(why) => {
            quarantine(ctx, "Image", name, &why).await;
            report.quarantined.push(format!("image/{name}"));
        }
        Verdict::Foreign => report.foreign.push(format!("image/{name}")),
    }
    Ok(())
}

/// One Vm against what the backend has (`info`): `BackendReachable` cleared, `Lost` when a
/// settled VM is missing, `Exited` when one meant to run stopped. Each verdict is re-checked
/// under the VM's lock, which is held until the status is written.
async fn check_vm(
    ctx: &Ctx,
    cached: &Vm,
    info: Option<&VmInfo>,
    report: &mut Report,
) -> Result<(), ReconcileError> {
    let mut vm = cached.clone();
    let mut changed = vm
        .status
        .conditions
        .remove_condition(conditions::BACKEND_REACHABLE);
    let settled = vm.status.created_at.is_some()
        && vm.status.operation.is_none()
        && !vm.metadata.is_deleting();
    // Held until the status is written: a reconcile must not change the VM in between.
    let mut _held = None;
    if settled && info.is_none() && vm.status.phase != VmPhase::Lost {
        let Some((guard, cur, now)) = recheck(ctx, &vm.metadata.name).await? else {
            return Ok(());
        };
        let still = cur.status.created_at.is_some()
            && cur.status.operation.is_none()
            && !cur.metadata.is_deleting();
        if still && now.is_none() {
            _held = Some(guard);
            vm = cur;
            mark_lost(ctx, &mut vm).await;
            changed = true;
            report.lost_vms.push(vm.metadata.name.clone());
        }
    }
    let stopped_here = info.is_some_and(|i| i.state == PowerState::Stopped);
    if settled && stopped_here && runs(&vm) {
        // A reconcile may be stopping it (a resize) or may have just started it again.
        let Some((guard, mut cur, now)) = recheck(ctx, &vm.metadata.name).await? else {
            return Ok(());
        };
        let state = now.map(|i| i.state);
        tracing::debug!(vm = %cur.metadata.name, ?state, runs = runs(&cur), "listed as stopped; re-checked under its lock");
        if runs(&cur) && state == Some(PowerState::Stopped) {
            _held = Some(guard);
            mark_exited(&mut cur);
            vm = cur;
            changed = true;
            report.exited.push(vm.metadata.name.clone());
        }
    }
    let degraded_here =
        info.is_some_and(|i| i.state == PowerState::Running && i.degraded.is_some());
    if settled && runs(&vm) && degraded_here && !marked_degraded(&vm) {
        // Its controller may be repairing it (under the lock) right now.
        let Some((guard, mut cur, now)) = recheck(ctx, &vm.metadata.name).await? else {
            return Ok(());
        };
        if let Some(why) = now.and_then(|i| i.degraded).filter(|_| runs(&cur)) {
            _held = Some(guard);
            mark_degraded(ctx, &mut cur, &why).await;
            vm = cur;
            changed = true;
            report.degraded.push(vm.metadata.name.clone());
        }
    }
    if changed {
        match ctx.store.update_status_as(&vm).await {
            Ok(_)
            | Err(boxery_store::StoreError::Conflict { .. })
            | Err(boxery_store::StoreError::NotFound { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// A settled VM the backend no longer has: `Lost` (never recreated silently).
async fn mark_lost(ctx: &Ctx, vm: &mut Vm) {
    vm.status
        .conditions
        .remove_condition(conditions::BACKEND_REACHABLE);
    crate::vm::set_lost(vm);
    vm.status.ssh = None;
    vm.status.printable_status = Some("Lost".into());
    crate::vm::lost_event(ctx, vm).await;
}

/// A VM meant to run that stopped on its own: `Ready=False` (`Exited`). The status write
/// wakes the Vm controller, which starts it again.
fn mark_exited(vm: &mut Vm) {
    let generation = vm.metadata.generation;
    vm.status
        .conditions
        .remove_condition(conditions::BACKEND_REACHABLE);
    vm.status.conditions.set_condition(
        READY,
        ConditionStatus::False,
        reasons::EXITED,
        "the VM stopped without being asked (a power-off in the guest, or its hypervisor process exited or crashed); it is being started again",
        generation,
    );
    vm.status.printable_status = Some("Exited".into());
}

/// Whether `vm` already says it is degraded.
fn marked_degraded(vm: &Vm) -> bool {
    vm.status
        .conditions
        .get_condition(READY)
        .is_some_and(|c| c.status == ConditionStatus::False && c.reason == reasons::DEGRADED)
}

/// A running VM with a part down: `Ready=False` (`Degraded`) and a Warning event. The status
/// write wakes the Vm controller, which repairs it.
async fn mark_degraded(ctx: &Ctx, vm: &mut Vm, why: &str) {
    let generation = vm.metadata.generation;
    let msg = format!("the VM runs, but {why}; it is being repaired");
    vm.status.conditions.set_condition(
        READY,
        ConditionStatus::False,
        reasons::DEGRADED,
        &msg,
        generation,
    );
    vm.status.printable_status = Some("Degraded".into());
    ctx.event(&*vm, EventType::Warning, "Degraded", &msg).await;
}

/// A ready image the backend no longer has: `Lost`.
async fn lost_image(ctx: &Ctx, img: &Image, report: &mut Report) -> Result<(), ReconcileError> {
    if img.status.phase != ImagePhase::Ready
        || img.status.operation.is_some()
        || img.metadata.is_deleting()
    {
        return Ok(());
    }
    let mut img = img.clone();
    let generation = img.metadata.generation;
    img.status.phase = ImagePhase::Lost;
    img.status.conditions.set_condition(
        READY,
        ConditionStatus::False,
        reasons::LOST,
        "the backend no longer has this image",
        generation,
    );
    img.status.printable_status = Some("Lost".into());
    match ctx.store.update_status_as(&img).await {
        Ok(img) => {
            ctx.event(
                &img,
                EventType::Warning,
                "Lost",
                "the image is missing from the backend",
            )
            .await
        }
        Err(boxery_store::StoreError::Conflict { .. })
        | Err(boxery_store::StoreError::NotFound { .. }) => {}
        Err(e) => return Err(e.into()),
    }
    report.lost_images.push(img.metadata.name.clone());
    Ok(())
}

/// A VM re-read under its lock (a reconcile may have just changed it): the held lock, the
/// stored object and what the backend has now; `None` when the object is gone.
async fn recheck(
    ctx: &Ctx,
    name: &str,
) -> Result<Option<(tokio::sync::OwnedMutexGuard<()>, Vm, Option<VmInfo>)>, ReconcileError> {
    let guard = ctx.vm_lock(name).lock_owned().await;
    let Some(cur) = ctx.store.get_as::<Vm>(name).await? else {
        return Ok(None);
    };
    let info = ctx
        .backend
        .get(name)
        .await
        .map_err(|e| ReconcileError::backend("get", format!("Vm/{name}"), e))?;
    Ok(Some((guard, cur, info)))
}

/// What to do with a backend VM or image that no object of this store owns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// An object owns it after all (it was written since the snapshot).
    Owned,
    /// This store made it for an object it has since removed: remove it.
    Removable,
    /// Leave it and report it (`boxery orphans`), saying why.
    Quarantined(String),
    /// boxery did not make it: never touched.
    Foreign,
}

/// Decide about a backend thing marked `mark` whose name's object is `current` (read from the
/// store under the object's lock). Only what this very store remembers removing is removable:
/// a store that was emptied, replaced or rolled back to an older backup has no tombstone for
/// the things made after it, so they are quarantined, never deleted.
pub async fn orphan_verdict(
    ctx: &Ctx,
    mark: Option<&str>,
    current: Option<&boxery_api::ObjectMeta>,
) -> Result<Verdict, ReconcileError> {
    let Some(raw) = mark else {
        return Ok(match current {
            Some(_) => Verdict::Owned,
            None => Verdict::Foreign,
        });
    };
    let m = Mark::parse(raw);
    if let Some(meta) = current {
        if Mark::is_for(Some(raw), meta.uid.as_deref()) {
            return Ok(Verdict::Owned);
        }
        return Ok(Verdict::Quarantined(format!(
            "it was made for another object (uid {}) than the one of this name (uid {}): remove one of them",
            m.object,
            meta.uid.as_deref().unwrap_or("?")
        )));
    }
    let ours = m.store == Some(ctx.store.uid());
    if ours && ctx.store.was_removed(m.object).await? {
        return Ok(Verdict::Removable);
    }
    Ok(Verdict::Quarantined(match m.store {
        Some(s) if s == ctx.store.uid() => format!(
            "this store has no record of its object (uid {}): the store was probably restored from an older backup",
            m.object
        ),
        Some(s) => format!(
            "it was made by another store ({s}), not this one ({}): the store was replaced or emptied, or two homes share a backend",
            ctx.store.uid()
        ),
        None => format!(
            "it carries a mark from before stores had an identity (object uid {}) and this store has no record of it",
            m.object
        ),
    }))
}

/// Report a quarantined orphan: a log line, and a Warning event once per process.
async fn quarantine(ctx: &Ctx, kind: &str, name: &str, why: &str) {
    tracing::warn!(
        kind,
        name,
        why,
        "an orphan in the backend is quarantined (left alone)"
    );
    if ctx.first_report(&format!("{kind}/{name}")) {
        let msg = format!(
            "{kind} {name} in the backend has no object here and is left alone: {why}. `boxery orphans` lists such things; `boxery orphans adopt` or `boxery orphans delete` settles them"
        );
        ctx.recorder
            .publish(
                &boxery_api::InvolvedObject {
                    kind: kind.to_string(),
                    name: name.to_string(),
                    // No uid: an Event owned by a uid no object has could not be written.
                    uid: None,
                },
                EventType::Warning,
                "Orphaned",
                &msg,
            )
            .await;
    }
}

/// Settled, last seen running, and meant to run.
fn runs(vm: &Vm) -> bool {
    vm.status.created_at.is_some()
        && vm.status.operation.is_none()
        && !vm.metadata.is_deleting()
        && vm.status.phase == VmPhase::Running
        && vm.spec.run_strategy == RunStrategy::Running
}

/// Record an unreachable backend on every Vm (`BackendReachable=False`, a Warning event once):
/// what an inventory pass does when the backend does not answer. Changes nothing else.
pub async fn unreachable(ctx: &Ctx, e: &BackendError) -> Result<(), ReconcileError> {
    let msg = format!(
        "{}: boxery cannot see its VMs and changes nothing until the backend answers",
        e.chain()
    );
    for mut vm in ctx.store.list_as::<Vm>(&Default::default()).await? {
        let generation = vm.metadata.generation;
        if vm.status.conditions.set_condition(
            conditions::BACKEND_REACHABLE,
            ConditionStatus::False,
            reasons::BACKEND_UNREACHABLE,
            &msg,
            generation,
        ) {
            match ctx.store.update_status_as(&vm).await {
                Ok(vm) => {
                    ctx.event(&vm, EventType::Warning, "BackendUnreachable", &msg)
                        .await
                }
                Err(boxery_store::StoreError::Conflict { .. })
                | Err(boxery_store::StoreError::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(())
}

/// How long a change the backend reports ([`Backend::changes`]) waits for more before the
/// pass it causes: a pool reset stops, copies and starts several VMs, one pass sees them all.
///
/// [`Backend::changes`]: boxery_backends::Backend::changes
pub const CHANGES_SETTLE: std::time::Duration = std::time::Duration::from_millis(300);

/// Run passes every `ctx.settings.inventory_every`, and soon after each change the backend
/// reports where it has such a feed, until `shutdown` resolves.
pub async fn run(
    ctx: std::sync::Arc<Ctx>,
    objects: impl Objects,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let mut tick = tokio::time::interval(ctx.settings.inventory_every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut changes = ctx.backend.changes();
    loop {
        let changed = async {
            match changes.as_mut() {
                Some(c) => c.changed().await.is_ok(),
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = &mut shutdown => return,
            _ = tick.tick() => {}
            still = changed => {
                if !still {
                    changes = None; // the feed ended: the periodic passes go on
                    continue;
                }
                tokio::select! {
                    _ = &mut shutdown => return,
                    _ = tokio::time::sleep(CHANGES_SETTLE) => {}
                }
                if let Some(c) = changes.as_mut() {
                    c.borrow_and_update();
                }
                tick.reset();
            }
        }
        if let Err(e) = pass(&ctx, &objects).await {
            tracing::warn!(error = %e.chain(), "inventory pass failed");
        }
    }
}
