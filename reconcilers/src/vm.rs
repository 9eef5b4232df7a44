//! The `Vm` reconciler: one idempotent step per call.
//!
//! # Guarantees
//! - Before a side effect that can be left half done (create, reimage), the intent is written
//!   to `status.operation` with a resourceVersion precondition; it is cleared after. A
//!   reconcile that finds an operation at its start knows no live worker owns it (reconciles of
//!   one object never overlap, and one control plane leads a store) and recovers: an
//!   interrupted create is adopted when the backend has the complete VM with our mark, and
//!   cleaned up (then retried) otherwise; an interrupted reimage is retried.
//! - Deletion: the finalizer `boxery.dev/vm` stays until the backend has removed the VM; images
//!   the VM owns are deleted by the store's ownerReference cascade.
//! - A VM gone from the backend behind our back is marked `Lost`, never silently recreated.
//! - Proxy tokens ([`boxery_home::tokens`]): a VM outside any pool has its own token, written before
//!   the backend creates it (the one its seed carries) and minted again by a later step if
//!   the file is gone; a pool member has none of its own. Deletion removes the VM's grant
//!   entries, then its token, before the backend removes the VM.

use std::sync::Arc;
use std::time::Duration;

use boxery_api::conditions::{self, READY, reasons};
use boxery_api::image::{BuildSpec, ImageSpec, LAYERED_LABEL, layered_image_name};
use boxery_api::vm::{Operation, OperationType, STOCK_IMAGES, SshStatus};
use boxery_api::{
    ConditionStatus, Conditions, EventType, Image, ImagePhase, ImageSource, OwnerReference,
    Resource, RunStrategy, Vm, VmPhase, VmSource, now,
};
use boxery_backends::VmInfo;
use boxery_backends::mark::Mark;
use boxery_backends::{BackendError, DiskSource, NewVm, PowerState, VmSize};
use boxery_controller::{Action, FinalizerEvent};
use boxery_store::StoreError;

use boxery_store::{ObjectRef, ObjectStoreExt};

use crate::context::Ctx;
use crate::error::ReconcileError;
use crate::recorded::{self, Recorded};

/// The Vm finalizer.
pub const FINALIZER: &str = <Vm as Recorded>::FINALIZER;

/// The name of the image a fork captures from its source.
pub fn fork_image_name(vm: &str) -> String {
    format!("{vm}.fork-source")
}

type Result<T, E = ReconcileError> = std::result::Result<T, E>;

fn size_of(vm: &Vm) -> VmSize {
    let s = vm.spec.resources.effective();
    VmSize {
        cpus: s.cpus,
        memory_mib: s.memory.as_mib(),
        disk_gib: s.disk.as_gib(),
    }
}

fn api_size(s: VmSize) -> boxery_api::vm::Size {
    boxery_api::vm::Size {
        cpus: s.cpus,
        memory: boxery_api::Quantity::mib(s.memory_mib),
        disk: boxery_api::Quantity::gib(s.disk_gib),
    }
}

/// Write the status; returns the stored object.
async fn save(ctx: &Ctx, vm: &Vm) -> Result<Vm> {
    recorded::save(ctx, vm).await
}

/// Reconcile one Vm: the shared boilerplate ([`recorded::reconcile`]: backoff, finalizer,
/// `Ready=Unknown` start, failures recorded in status) under the VM's lock, around one step.
pub async fn reconcile(vm: Arc<Vm>, ctx: Arc<Ctx>) -> Result<Action> {
    // A deleted VM that a lease holds stays until the lease ends (docs/pools.md).
    if vm.metadata.is_deleting()
        && let Some(wait) = crate::pool::hold_deletion(&ctx, &vm).await?
    {
        return Ok(wait);
    }
    let lock = ctx.vm_lock(vm.name());
    recorded::reconcile(vm, &ctx, Some(lock), async |event| match event {
        FinalizerEvent::Apply(vm) => step((*vm).clone(), &ctx).await,
        FinalizerEvent::Cleanup(vm) => finalize((*vm).clone(), &ctx).await,
    })
    .await
}

/// One step towards the spec, the first that applies: recover an interrupted operation,
/// create, revert, notice a loss, resize, start or stop, then report readiness.
async fn step(mut vm: Vm, ctx: &Ctx) -> Result<Action> {
    // The egress policy is in force before the VM first runs, and follows each spec change
    // while it runs (the proxy reads it per connection).
    boxery_home::egress::write(&ctx.home, vm.name(), &vm.spec.network.egress)
        .map_err(|e| state_error("egress", vm.name(), "writing the egress policy", e))?;
    if let Some(op) = vm.status.operation.clone() {
        return recover(vm, op, ctx).await;
    }
    if vm.status.created_at.is_none() {
        return create(vm, ctx).await;
    }
    keep_token(&vm, ctx)?;
    // a lease's or its pool's budget used up: held suspended or stopped (crate::budget), and
    // not restored (which would boot it) until it is let go
    let held = crate::budget::held(ctx, &vm);
    if let Some(r) = vm.spec.restore.clone().filter(|r| {
        vm.status
            .last_restore
            .as_ref()
            .is_none_or(|l| l.requested_at != r.requested_at)
    }) && held.is_none()
    {
        return restore(vm, r, ctx).await;
    }
    let name = vm.name().to_string();
    let Some(info) = ctx
        .backend
        .get(&name)
        .await
        .map_err(|e| ReconcileError::backend("get", format!("Vm/{name}"), e))?
    else {
        return lost(vm, ctx).await;
    };
    if vm.status.conditions.remove_condition(conditions::LOST) {
        ctx.event(
            &vm,
            EventType::Normal,
            "Found",
            "the VM is back in the backend",
        )
        .await;
    }
    // The VM's network follows its egress policy, live (libvirt: the NIC's nwfilter; a no-op
    // where the control plane's proxy enforces it), before it is resized, started or stopped.
    ctx.backend
        .set_egress(&name, vm.spec.network.egress.policy)
        .await
        .map_err(|e| ReconcileError::backend("set_egress", format!("Vm/{name}"), e))?;
    // A disk cannot shrink: that part of the spec is refused (said in a condition, and the VM
    // is not counted as converged); the rest of it is still carried out.
    let want = size_of(&vm);
    let fits = VmSize {
        disk_gib: want.disk_gib.max(info.size.disk_gib),
        ..want
    };
    if want.disk_gib < info.size.disk_gib {
        refuse_shrink(&mut vm, &info, ctx).await;
    } else if vm.status.conditions.remove_condition(conditions::RESIZED) {
        vm = save(ctx, &vm).await?;
    }
    // a suspended VM's saved memory holds its size: a new size applies once it runs again
    if info.size != fits && info.state != PowerState::Suspended {
        return resize(vm, fits, ctx).await;
    }
    let (changed, turned) = crate::budget::mark_vm(&mut vm, held.as_ref());
    if changed {
        vm = save(ctx, &vm).await?;
        if turned == Some(false) {
            ctx.event(
                &vm,
                EventType::Normal,
                "WithinBudget",
                crate::budget::UNHELD,
            )
            .await;
        }
    }
    if let Some((_, why)) = &held
        && vm.spec.run_strategy == RunStrategy::Running
    {
        return match info.state {
            PowerState::Running => budget_hold(vm, why, ctx).await,
            _ => settle(vm, &info, ctx).await,
        };
    }
    match (vm.spec.run_strategy, info.state) {
        // suspended while idle: it sleeps until it is used
        (RunStrategy::Running, PowerState::Suspended) if asleep(&vm, ctx) => {
            settle(vm, &info, ctx).await
        }
        (RunStrategy::Running, PowerState::Stopped | PowerState::Suspended) => {
            start(vm, &info, ctx).await
        }
        (RunStrategy::Running, PowerState::Running)
            if info.degraded.is_none() && layers_due(&vm) =>
        {
            layers(vm, &info, ctx).await
        }
        (RunStrategy::Running, PowerState::Running) if info.degraded.is_none() => {
            running(vm, &info, ctx).await
        }
        (RunStrategy::Stopped, PowerState::Running | PowerState::Suspended) => {
            stop(vm, &info, ctx).await
        }
        (RunStrategy::Suspended, PowerState::Running) => suspend(vm, ctx).await,
        (_, PowerState::Running) if info.degraded.is_some() => repair(vm, &info, ctx).await,
        _ => settle(vm, &info, ctx).await,
    }
}

/// A running VM with nothing to change: suspended when idle long enough, else settled.
async fn running(vm: Vm, info: &VmInfo, ctx: &Ctx) -> Result<Action> {
    match idle_for(&vm, ctx) {
        Some(Idleness::Due(since)) => idle_suspend(vm, since, ctx).await,
        Some(Idleness::In(left)) => {
            // look again when it would be due (a use in between moves that later)
            let next = settle(vm, info, ctx).await?;
            Ok(match next.requeue_after() {
                Some(d) if d <= left => next,
                _ => Action::requeue(left),
            })
        }
        None => settle(vm, info, ctx).await,
    }
}

/// Whether a running VM's `spec.layers` differ from the layers it has, and it is ready for a
/// layer to be added in place (its guest answers for this generation).
fn layers_due(vm: &Vm) -> bool {
    vm.spec.layers != vm.status.layers && is_ready(vm)
}

/// A running, ready VM whose `spec.layers` changed (docs/images.md, "Layers on a running VM"):
/// a removed layer is refused (`LayersApplied=False`, what to do instead); an added one is
/// copied in from the layered build ([`crate::layers`]), waiting for that build first, and
/// recorded in `status.layers` and `status.buildInfo`.
async fn layers(mut vm: Vm, info: &VmInfo, ctx: &Ctx) -> Result<Action> {
    let name = vm.name().to_string();
    let removed = missing_from(&vm.status.layers, &vm.spec.layers);
    if !removed.is_empty() {
        let msg = format!(
            "layer {} cannot be removed from a VM (what it installed stays in the guest): put it back in spec.layers, or make a new VM without it (`boxery rm {name}`, then apply it again)",
            removed.join(", ")
        );
        return refuse_layers(vm, reasons::LAYER_REMOVAL_REFUSED, &msg, info, ctx).await;
    }
    let added = missing_from(&vm.spec.layers, &vm.status.layers);
    let whole: Vec<&str> = added
        .iter()
        .filter(|l| boxery_api::image::layer(l).is_some_and(|k| !k.in_place()))
        .map(String::as_str)
        .collect();
    if !whole.is_empty() {
        let msg = format!(
            "layer {} cannot be added to a running VM (it installs packages and services): take it out of spec.layers, or make a new VM with it (`boxery rm {name}`, then apply it again)",
            whole.join(", ")
        );
        return refuse_layers(vm, reasons::LAYER_NOT_IN_PLACE, &msg, info, ctx).await;
    }
    let what = added.join(", ");
    // the layered build with every layer the VM is to have
    let image = match layered_image(&vm, ctx).await? {
        Ok(image) => ctx
            .store
            .get_as::<Image>(&image)
            .await?
            .ok_or_else(|| format!("waiting for image {image} to be made")),
        Err(why) => Err(why),
    };
    let image = match image {
        Ok(img) if img.status.phase == ImagePhase::Ready && !img.metadata.is_deleting() => img,
        other => {
            let msg = match other {
                Ok(img) => format!(
                    "adding {what} in place: waiting for image {}: {}",
                    img.name(),
                    image_progress(&img)
                ),
                Err(why) => format!("adding {what} in place: {why}"),
            };
            if layers_condition(&mut vm, false, reasons::LAYERED_IMAGE_NOT_READY, &msg) {
                save(ctx, &vm).await?;
            }
            // Image changes wake us too (vms_for_image); poll slowly as a fallback
            return Ok(Action::requeue(Duration::from_secs(5)));
        }
    };
    let msg = format!("adding {what} in place from image {}", image.name());
    layers_condition(&mut vm, false, reasons::APPLYING_LAYERS, &msg);
    vm = save(ctx, &vm).await?;
    ctx.event(&vm, EventType::Normal, "AddingLayers", &msg)
        .await;
    let t = std::time::Instant::now();
    let (record, how) = match &ctx.ssh {
        Some(ssh) => {
            let done = crate::layers::apply(ctx, ssh, &vm, &image, &added)
                .await
                .map_err(|e| {
                    ReconcileError::backend(
                        "layers",
                        format!("Vm/{name}"),
                        BackendError::failed(format!("add layer {what} in place"), e),
                    )
                })?;
            let how = format!(
                " (staged in {:.1} s, {} MiB copied in {:.1} s)",
                done.staged.as_secs_f64(),
                done.bytes >> 20,
                done.copied.as_secs_f64()
            );
            (Some(done.record), how)
        }
        // no guest (the fake backend): the record is the layered build's
        None => (image.status.build_info.clone(), String::new()),
    };
    let msg = format!(
        "added {what} in place from image {} in {:.1} s{how}",
        image.name(),
        t.elapsed().as_secs_f64()
    );
    vm.status.layers = vm.spec.layers.clone();
    vm.status.build_info = record;
    layers_condition(&mut vm, true, reasons::LAYERS_APPLIED, &msg);
    let vm = save(ctx, &vm).await?;
    ctx.event(&vm, EventType::Normal, "LayersAdded", &msg).await;
    Ok(Action::requeue(Duration::ZERO))
}

/// A change of `spec.layers` that cannot be made: `LayersApplied=False` with `reason` and
/// `msg`, and a Warning of the same reason, once per generation; otherwise a running VM like
/// any other (idle suspend included).
async fn refuse_layers(
    mut vm: Vm,
    reason: &str,
    msg: &str,
    info: &VmInfo,
    ctx: &Ctx,
) -> Result<Action> {
    if layers_condition(&mut vm, false, reason, msg) {
        vm = save(ctx, &vm).await?;
        ctx.event(&vm, EventType::Warning, reason, msg).await;
    }
    running(vm, info, ctx).await
}

/// The layers of `a` that `b` does not have.
fn missing_from(a: &[String], b: &[String]) -> Vec<String> {
    a.iter().filter(|l| !b.contains(l)).cloned().collect()
}

/// Set `LayersApplied` for the VM's generation; whether it changed.
fn layers_condition(vm: &mut Vm, applied: bool, reason: &str, msg: &str) -> bool {
    let status = if applied {
        ConditionStatus::True
    } else {
        ConditionStatus::False
    };
    let generation = vm.metadata.generation;
    vm.status
        .conditions
        .set_condition(conditions::LAYERS_APPLIED, status, reason, msg, generation)
}

/// What an image not ready yet is doing: its `Ready` message (a build's progress), or its
/// phase.
fn image_progress(img: &Image) -> String {
    img.status
        .conditions
        .get_condition(READY)
        .map(|c| c.message.clone())
        .filter(|m| !m.is_empty())
        .unwrap_or_else(|| format!("{:?}", img.status.phase))
}

/// A running VM with a part down (qemu: its network helper died): bring that part back
/// without restarting the guest. `settle` then probes it again (ssh with the pinned key)
/// before it is `Ready` again.
async fn repair(vm: Vm, info: &VmInfo, ctx: &Ctx) -> Result<Action> {
    let name = vm.name().to_string();
    let why = info.degraded.as_deref().unwrap_or("a part is down");
    ctx.backend
        .repair(&name)
        .await
        .map_err(|e| ReconcileError::backend("repair", format!("Vm/{name}"), e))?;
    ctx.event(
        &vm,
        EventType::Normal,
        "Repaired",
        &format!("repaired without restarting the guest (it was degraded: {why})"),
    )
    .await;
    Ok(Action::requeue(Duration::ZERO))
}

/// Say that the spec's disk is smaller than the VM's (a disk cannot shrink): `Resized=False`
/// with what to do, and a warning event the first time for this generation. Saved with the
/// step's status.
async fn refuse_shrink(vm: &mut Vm, info: &VmInfo, ctx: &Ctx) {
    let generation = vm.metadata.generation;
    let msg = format!(
        "the disk cannot shrink from {}Gi to {}Gi: set spec.resources.disk to {}Gi or more",
        info.size.disk_gib,
        size_of(vm).disk_gib,
        info.size.disk_gib
    );
    let new = vm.status.conditions.set_condition(
        conditions::RESIZED,
        ConditionStatus::False,
        reasons::DISK_SHRINK_REFUSED,
        &msg,
        generation,
    );
    if new {
        ctx.event(vm, EventType::Warning, "DiskShrinkRefused", &msg)
            .await;
    }
}

/// Make the backend's size `want` (the spec's, with a disk that never shrinks).
async fn resize(mut vm: Vm, want: VmSize, ctx: &Ctx) -> Result<Action> {
    let name = vm.name().to_string();
    ctx.backend
        .resize(&name, want)
        .await
        .map_err(|e| ReconcileError::backend("resize", format!("Vm/{name}"), e))?;
    vm.status.size = Some(api_size(want));
    ctx.event(
        &vm,
        EventType::Normal,
        "Resized",
        &format!(
            "{} CPUs, {} MiB, {} GiB",
            want.cpus, want.memory_mib, want.disk_gib
        ),
    )
    .await;
    save(ctx, &vm).await?;
    Ok(Action::requeue(Duration::ZERO))
}

/// How long a running, ready VM with `spec.idle` has gone unused.
enum Idleness {
    /// Unused since then, for `suspendAfter` or longer: suspend it.
    Due(std::time::SystemTime),
    /// This long until it is due.
    In(Duration),
}

/// When the VM was last used: its activity mark (`boxery_home::activity`), or when it became
/// ready, whichever is later (a VM nobody has touched since it booted is idle from then).
fn last_use(vm: &Vm, ctx: &Ctx) -> Option<std::time::SystemTime> {
    let ready_since = vm
        .status
        .conditions
        .get_condition(READY)
        .and_then(|c| c.last_transition_time)
        .map(std::time::SystemTime::from);
    let mark = boxery_home::activity::last(&ctx.home, vm.name());
    ready_since.max(mark)
}

/// Whether a running VM with `spec.idle` is due to be suspended (`None`: no `spec.idle`, not
/// ready yet, or no time to measure from).
fn idle_for(vm: &Vm, ctx: &Ctx) -> Option<Idleness> {
    let after = vm.spec.idle.as_ref()?.after().ok()?;
    if !is_ready(vm) {
        return None;
    }
    let since = last_use(vm, ctx)?;
    let idle = std::time::SystemTime::now()
        .duration_since(since)
        .unwrap_or_default();
    Some(if idle >= after {
        Idleness::Due(since)
    } else {
        // a little past the due time: the mark has a coarse clock on some filesystems
        Idleness::In(after - idle + Duration::from_millis(200))
    })
}

/// Whether a VM the controller suspended for being idle has not been used since (then it
/// stays suspended although `runStrategy` is `Running`).
fn asleep(vm: &Vm, ctx: &Ctx) -> bool {
    let Some(at) = vm.status.idle_suspended_at else {
        return false;
    };
    let at = std::time::SystemTime::from(at);
    // woken by a use here (the activity mark) or through the store (a remote context's)
    let woken = vm
        .metadata
        .annotations
        .get(boxery_api::vm::WOKEN_AT)
        .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
        .map(std::time::SystemTime::from);
    let used = boxery_home::activity::last(&ctx.home, vm.name()).max(woken);
    used.is_none_or(|used| used <= at)
}

/// Suspend a VM nobody has used for `spec.idle.suspendAfter` (last used `since`); its next
/// use wakes it ([`asleep`]).
async fn idle_suspend(mut vm: Vm, since: std::time::SystemTime, ctx: &Ctx) -> Result<Action> {
    let name = vm.name().to_string();
    if let Some(why) = quota_refusal(&vm, ctx).await? {
        // it runs on; looked at again after another idle period
        ctx.event(&vm, EventType::Warning, "IdleSuspendRefused", &why)
            .await;
        let again = vm
            .spec
            .idle
            .as_ref()
            .and_then(|i| i.after().ok())
            .unwrap_or(Duration::from_secs(600));
        return Ok(Action::requeue(again));
    }
    ctx.backend
        .suspend(&name)
        .await
        .map_err(|e| ReconcileError::backend("suspend", format!("Vm/{name}"), e))?;
    vm.status.idle_suspended_at = Some(now());
    let after = vm
        .spec
        .idle
        .as_ref()
        .map(|i| i.suspend_after.clone())
        .unwrap_or_default();
    let since = boxery_api::Time::from(since).to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    ctx.event(
        &vm,
        EventType::Normal,
        "IdleSuspended",
        &format!(
            "nobody used the VM for {after} (last use {since}): suspended, its memory on disk; its next command, file or copy action, session, or `boxery resume`, resumes it"
        ),
    )
    .await;
    match save(ctx, &vm).await {
        Ok(_) => {}
        Err(e) if e.is_conflict() => {}
        Err(e) => return Err(e),
    }
    Ok(Action::requeue(Duration::ZERO))
}

/// Hold a running VM whose lease's (or pool's) budget is used up: suspended where the backend
/// can keep its memory (and the memory quota has room), else stopped; it runs again when the
/// budget allows ([`crate::budget`]).
async fn budget_hold(vm: Vm, why: &str, ctx: &Ctx) -> Result<Action> {
    let name = vm.name().to_string();
    let suspend =
        ctx.backend.capabilities().suspend && matches!(quota_refusal(&vm, ctx).await, Ok(None));
    let suspended = if suspend {
        match ctx.backend.suspend(&name).await {
            Ok(()) => true,
            Err(e) => {
                // held all the same: stopped
                tracing::warn!(vm = %name, error = %e.chain(), "suspending a VM past its budget failed: stopping it");
                false
            }
        }
    } else {
        false
    };
    let how = if suspended {
        "suspended, its memory on disk: it resumes where it was when the budget allows"
    } else {
        ctx.backend
            .stop(&name)
            .await
            .map_err(|e| ReconcileError::backend("stop", format!("Vm/{name}"), e))?;
        "stopped (this backend keeps no memory, or the memory quota is full): it boots again when the budget allows"
    };
    ctx.event(
        &vm,
        EventType::Warning,
        "BudgetExhausted",
        &format!("{why}; the VM was {how}"),
    )
    .await;
    Ok(Action::requeue(Duration::ZERO))
}

/// Save a running VM's memory to disk and end its hypervisor (`runStrategy: Suspended`).
async fn suspend(vm: Vm, ctx: &Ctx) -> Result<Action> {
    let name = vm.name();
    if let Some(why) = quota_refusal(&vm, ctx).await? {
        return Err(ReconcileError::backend(
            "suspend",
            format!("Vm/{name}"),
            // not terminal: room made elsewhere lets a later try through
            BackendError::failed(
                format!("suspend VM {name}"),
                format!("{why} (the VM runs on)"),
            ),
        ));
    }
    ctx.backend
        .suspend(name)
        .await
        .map_err(|e| ReconcileError::backend("suspend", format!("Vm/{name}"), e))?;
    let saved = ctx
        .backend
        .get(name)
        .await
        .ok()
        .flatten()
        .and_then(|i| i.memory);
    let msg = match saved {
        Some(m) => format!(
            "the VM was suspended: {} MiB of memory and device state saved, its hypervisor ended",
            m.bytes.div_ceil(1 << 20)
        ),
        None => "the VM was suspended".into(),
    };
    ctx.event(&vm, EventType::Normal, "Suspended", &msg).await;
    Ok(Action::requeue(Duration::ZERO))
}

/// Why saving VM `vm`'s memory would break the owner's quota on memory files.
async fn quota_refusal(vm: &Vm, ctx: &Ctx) -> Result<Option<String>> {
    let need = size_of(vm).memory_mib << 20;
    crate::quota::refusal(
        ctx.backend.as_ref(),
        ctx.settings.memory_quota,
        &format!("suspending VM {}", vm.name()),
        need,
    )
    .await
    .map_err(|e| ReconcileError::backend("quota", format!("Vm/{}", vm.name()), e))
}

/// Start a VM meant to run, or resume a suspended one from its memory. One last seen running
/// that stopped without being asked (a power-off in the guest, its hypervisor exited or
/// crashed) gets a `Restarted` warning.
async fn start(mut vm: Vm, info: &VmInfo, ctx: &Ctx) -> Result<Action> {
    let name = vm.name().to_string();
    if info.state == PowerState::Suspended {
        let t = std::time::Instant::now();
        ctx.backend
            .start(&name)
            .await
            .map_err(|e| ReconcileError::backend("resume", format!("Vm/{name}"), e))?;
        let why = if vm.status.idle_suspended_at.take().is_some() {
            " on its first use since it was suspended for being idle"
        } else {
            ""
        };
        ctx.event(
            &vm,
            EventType::Normal,
            "Resumed",
            &format!(
                "the VM was resumed from its saved memory in {:.2} s{why}: its processes carry on",
                t.elapsed().as_secs_f64()
            ),
        )
        .await;
        return booting(vm, "resumed: waiting for the guest to answer", ctx).await;
    }
    // Last seen on a boot before the host's last reboot: it did not stop on its own.
    let rebooted = vm
        .status
        .boot_id
        .as_deref()
        .is_some_and(|b| b != boxery_store::boot_id());
    let on_its_own = vm.status.phase == VmPhase::Running && !rebooted;
    // Read before the start, which begins a new log.
    let last_words = if on_its_own {
        ctx.backend.last_exit(&name).await
    } else {
        None
    };
    ctx.backend
        .start(&name)
        .await
        .map_err(|e| ReconcileError::backend("start", format!("Vm/{name}"), e))?;
    if on_its_own {
        let mut msg = String::from(
            "the VM had stopped on its own (a power-off in the guest, or its hypervisor \
             process exited or crashed) and was started again, as runStrategy is Running",
        );
        if let Some(w) = last_words {
            msg.push_str(&format!("; the hypervisor's last words: {w}"));
        }
        ctx.event(&vm, EventType::Warning, "Restarted", &msg).await;
    } else if rebooted {
        ctx.event(
            &vm,
            EventType::Normal,
            "StartedAfterReboot",
            "the host rebooted; the VM was started again on its own disk, as runStrategy is Running",
        )
        .await;
    } else {
        ctx.event(&vm, EventType::Normal, "Started", "the VM was started")
            .await;
    }
    booting(vm, "started again: waiting for the guest to answer", ctx).await
}

/// After a start or a resume: `Ready=False` (`Booting`, `why`) until the guest answers.
async fn booting(mut vm: Vm, why: &str, ctx: &Ctx) -> Result<Action> {
    // A Ready from before the stop describes a guest that is gone: until the new one
    // answers, nobody may take it as ready (a `wait --for=condition=Ready` would return
    // at once and the first command would meet a guest still booting). A conflict
    // means another writer (the inventory's `Exited`) got there first: re-read.
    let generation = vm.metadata.generation;
    vm.status.conditions.set_condition(
        READY,
        ConditionStatus::False,
        reasons::BOOTING,
        why,
        generation,
    );
    vm.status.printable_status = Some(printable(&vm));
    match save(ctx, &vm).await {
        Ok(_) => {}
        Err(e) if e.is_conflict() => {}
        Err(e) => return Err(e),
    }
    Ok(Action::requeue(Duration::ZERO))
}

/// Stop a VM meant to be stopped; a suspended one's saved memory is discarded.
async fn stop(vm: Vm, info: &VmInfo, ctx: &Ctx) -> Result<Action> {
    let name = vm.name();
    ctx.backend
        .stop(name)
        .await
        .map_err(|e| ReconcileError::backend("stop", format!("Vm/{name}"), e))?;
    let msg = if info.state == PowerState::Suspended {
        "the VM was stopped: its saved memory was discarded (its processes are gone)"
    } else {
        "the VM was stopped"
    };
    ctx.event(&vm, EventType::Normal, "Stopped", msg).await;
    Ok(Action::requeue(Duration::ZERO))
}

/// Nothing to change: report phase and readiness (probing ssh where the backend runs sshd),
/// and poll while the guest boots.
async fn settle(mut vm: Vm, info: &VmInfo, ctx: &Ctx) -> Result<Action> {
    let generation = vm.metadata.generation;
    let readiness = match (&info.state, &info.ssh) {
        // started from another VM's memory: its own identity first (crate::adopt)
        (PowerState::Running, Some(endpoint)) if info.inherited => {
            match crate::adopt::take(ctx, vm.name(), endpoint).await {
                Ok(()) => Readiness::Booting("the guest took its own identity".into()),
                Err(why) => Readiness::Booting(why),
            }
        }
        (PowerState::Running, Some(endpoint)) if ctx.backend.capabilities().ssh => {
            match probe(ctx, &vm, endpoint).await {
                Ok(()) => Readiness::Ready(reasons::SSH_REACHABLE),
                Err(why) => crate::boot::explain(ctx, &vm, why).await.into(),
            }
        }
        // (a guest that never configures its network has no address, on libvirt no endpoint)
        (PowerState::Running, None) if ctx.backend.capabilities().ssh => {
            let why = "the backend reports no ssh endpoint yet".to_string();
            crate::boot::explain(ctx, &vm, why).await.into()
        }
        _ => Readiness::Ready(reasons::RUNNING),
    };
    let before = vm.status.clone();
    vm.status.size = Some(api_size(info.size));
    note_memory(&mut vm, info);
    // a removed layer put back: nothing is refused any more
    if vm.spec.layers == vm.status.layers
        && vm
            .status
            .conditions
            .get_condition(conditions::LAYERS_APPLIED)
            .is_some_and(|c| c.status == ConditionStatus::False)
    {
        layers_condition(
            &mut vm,
            true,
            reasons::LAYERS_APPLIED,
            "the VM has the layers of spec.layers",
        );
    }
    finish_status(
        &mut vm,
        &info.state,
        info.ssh.clone(),
        &readiness,
        generation,
    );
    vm.status.failures = 0;
    vm.status.last_failure = None;
    let mut display_again = None;
    if matches!(readiness, Readiness::Ready(_)) {
        // (not at each of a booting VM's polls)
        crate::budget::vm(ctx, &mut vm).await;
        if info.state == PowerState::Running {
            display_again = crate::display::check(ctx, &mut vm).await;
        }
    }
    if vm.status != before {
        save(ctx, &vm).await?;
    }
    match readiness {
        Readiness::Booting(_) => return Ok(Action::requeue(Duration::from_millis(100))),
        // its console says it will not answer: still looked at, less often
        Readiness::NotAnswering(_) => return Ok(Action::requeue(Duration::from_secs(5))),
        Readiness::Ready(_) => {}
    }
    let usage_again = (info.state == PowerState::Running && ctx.backend.capabilities().usage)
        // status.usage grows while it runs (the backend's use is sampled)
        .then_some(crate::budget::VM_REFRESH_EVERY);
    Ok(match (usage_again, display_again) {
        (Some(a), Some(b)) => Action::requeue(a.min(b)),
        (Some(a), None) | (None, Some(a)) => Action::requeue(a),
        (None, None) => Action::await_change(),
    })
}

/// Check that a running VM answers over ssh with its pinned host key. A VM found ready for
/// this generation at this endpoint is not asked again: every start sets `Ready=False`, and
/// every change that can restart the guest (a revert, a resize) is a new generation. So the
/// probe runs while a VM boots, not on every later reconcile, where its session would
/// overlap the first commands of whoever waited for Ready (and cost an ssh process each time).
async fn probe(ctx: &Ctx, vm: &Vm, endpoint: &str) -> Result<(), String> {
    let Some(ssh) = &ctx.ssh else { return Ok(()) };
    let ready = vm.status.conditions.get_condition(READY).is_some_and(|c| {
        c.status == ConditionStatus::True
            && c.reason == reasons::SSH_REACHABLE
            && c.observed_generation == vm.metadata.generation
    });
    let same_endpoint =
        vm.status.ssh.as_ref().and_then(|s| s.endpoint.as_deref()) == Some(endpoint);
    if ready && same_endpoint {
        return Ok(());
    }
    let Some(host_key) = vm.status.ssh.as_ref().and_then(|s| s.host_key.clone()) else {
        return Err("no pinned host key is recorded for this VM (it was not made by boxery's identity step)".into());
    };
    let target = crate::ssh::Target {
        name: vm.name().to_string(),
        endpoint: endpoint.to_string(),
        host_key,
    };
    ssh.write(&target).map_err(|e| e.to_string())?;
    ssh.probe(&target).await.map_err(|e| match e {
        crate::ssh::SshError::Unreachable { reason, .. } => reason,
        e => e.to_string(),
    })
}

/// How ready a running VM is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Readiness {
    /// Reachable (over ssh with the pinned key, where the backend runs sshd).
    Ready(&'static str),
    /// Running but not answering yet.
    Booting(String),
    /// Running, and its console says it will not answer ([`crate::boot`]).
    NotAnswering(String),
}

impl From<crate::boot::Explained> for Readiness {
    fn from(e: crate::boot::Explained) -> Self {
        match e {
            crate::boot::Explained::Booting(why) => Readiness::Booting(why),
            crate::boot::Explained::NotAnswering(why) => Readiness::NotAnswering(why),
        }
    }
}

/// Phase, Ready, ssh, observedGeneration and the printable status after a successful step.
fn finish_status(
    vm: &mut Vm,
    state: &PowerState,
    ssh: Option<String>,
    readiness: &Readiness,
    generation: Option<i64>,
) {
    let (phase, ready, reason, msg) = match (state, readiness) {
        (PowerState::Running, Readiness::Ready(reason)) => (
            VmPhase::Running,
            ConditionStatus::True,
            *reason,
            "the VM is running".to_string(),
        ),
        (PowerState::Running, Readiness::Booting(why)) => (
            VmPhase::Running,
            ConditionStatus::False,
            reasons::BOOTING,
            format!("the VM is running but not reachable yet: {why}"),
        ),
        (PowerState::Running, Readiness::NotAnswering(why)) => (
            VmPhase::Running,
            ConditionStatus::False,
            reasons::GUEST_NOT_ANSWERING,
            format!("the VM is running but will not answer: {why}"),
        ),
        (PowerState::Stopped, _) => (
            VmPhase::Stopped,
            ConditionStatus::False,
            reasons::STOPPED,
            match (
                boxery_api::usage::exhausted(&vm.status.conditions),
                vm.spec.run_strategy,
            ) {
                (Some(c), RunStrategy::Running) => format!("the VM is held stopped: {}", c.message),
                (_, RunStrategy::Suspended) => {
                    "the VM is stopped: there is no memory to suspend (start it, then suspend it)"
                        .to_string()
                }
                _ => "the VM is stopped (runStrategy: Stopped)".to_string(),
            },
        ),
        (PowerState::Suspended, _) => (
            VmPhase::Suspended,
            ConditionStatus::False,
            reasons::SUSPENDED,
            if let Some(c) = boxery_api::usage::exhausted(&vm.status.conditions) {
                format!("the VM is held suspended: {}", c.message)
            } else if vm.status.idle_suspended_at.is_some() {
                "the VM is suspended because nobody used it for spec.idle.suspendAfter: its memory is on disk; its next use resumes it".to_string()
            } else {
                "the VM is suspended: its memory is on disk (runStrategy: Running resumes it)"
                    .to_string()
            },
        ),
    };
    // A part of the spec the backend refused: not converged, whatever the power state. Ready
    // says why and the observed generation stays at the last one carried out in full. (Ready
    // is set once: set to True and back, its lastTransitionTime would change on every
    // reconcile, and so would the status, each write waking the next reconcile.)
    let refused = vm
        .status
        .conditions
        .get_condition(conditions::RESIZED)
        .filter(|c| c.status == ConditionStatus::False)
        .map(|c| (c.reason.clone(), c.message.clone()));
    vm.status.phase = phase;
    // a display is asked about only while the VM is Ready (crate::display)
    if !matches!(
        (state, readiness),
        (PowerState::Running, Readiness::Ready(_))
    ) {
        vm.status
            .conditions
            .remove_condition(conditions::DISPLAY_READY);
    }
    match &refused {
        Some((reason, msg)) => vm.status.conditions.set_condition(
            READY,
            ConditionStatus::False,
            reason,
            msg,
            generation,
        ),
        None => vm
            .status
            .conditions
            .set_condition(READY, ready, reason, &msg, generation),
    };
    vm.status.boot_id = Some(boxery_store::boot_id());
    let host_key = vm.status.ssh.as_ref().and_then(|s| s.host_key.clone());
    vm.status.ssh = (ssh.is_some() || host_key.is_some()).then_some(SshStatus {
        endpoint: ssh,
        host_key,
    });
    if refused.is_none() {
        vm.status.observed_generation = generation;
    }
    vm.status.printable_status = Some(printable(vm));
}

/// `status.memory` and the `MemoryRestorable` condition from what the backend reports:
/// present while the VM is suspended, gone once it is not.
fn note_memory(vm: &mut Vm, info: &VmInfo) {
    let generation = vm.metadata.generation;
    match &info.memory {
        Some(m) => {
            vm.status.memory = Some(boxery_api::vm::SavedMemory {
                saved_at: m.saved_at,
                bytes: m.bytes,
            });
            let (status, reason, msg) = match &m.stale {
                Some(why) => (
                    ConditionStatus::False,
                    reasons::STALE_MEMORY,
                    format!(
                        "the saved memory cannot be restored: {why}; it is kept. To boot the VM cold instead (its processes are lost): `boxery stop {0}` (discards the memory), then `boxery start {0}`",
                        vm.name()
                    ),
                ),
                None => (
                    ConditionStatus::True,
                    reasons::MEMORY_SAVED,
                    "the saved memory matches this host's hypervisor: a resume restores it".into(),
                ),
            };
            vm.status.conditions.set_condition(
                conditions::MEMORY_RESTORABLE,
                status,
                reason,
                &msg,
                generation,
            );
        }
        None => {
            vm.status.memory = None;
            vm.status
                .conditions
                .remove_condition(conditions::MEMORY_RESTORABLE);
        }
    }
    // asleep only while suspended with runStrategy Running (a suspend or stop asked for
    // since, or a resume, ends it)
    if info.state != PowerState::Suspended || vm.spec.run_strategy != RunStrategy::Running {
        vm.status.idle_suspended_at = None;
    }
}

/// The one word `boxery get` shows.
pub fn printable(vm: &Vm) -> String {
    if vm.metadata.is_deleting() {
        return "Terminating".into();
    }
    if vm
        .status
        .conditions
        .get_condition(conditions::LOST)
        .is_some_and(|c| c.status == ConditionStatus::True)
    {
        return "Lost".into();
    }
    if let Some(c) = vm
        .status
        .conditions
        .get_condition(conditions::IMAGE_AVAILABLE)
        && c.status == ConditionStatus::False
    {
        return c.reason.clone();
    }
    if vm
        .status
        .conditions
        .get_condition(conditions::MEMORY_RESTORABLE)
        .is_some_and(|c| c.status == ConditionStatus::False)
    {
        return reasons::STALE_MEMORY.into();
    }
    if vm.status.phase == VmPhase::Failed {
        return if vm.status.last_failure.is_some() {
            "ErrorBackoff".into()
        } else {
            "Failed".into()
        };
    }
    format!("{:?}", vm.status.phase)
}

/// The VM is gone from the backend: `Lost=True` (saying what to do), `Ready=False`, phase
/// `Lost`. Returns whether `Lost` is new. The Vm reconciler and the inventory both mark it so.
pub(crate) fn set_lost(vm: &mut Vm) -> bool {
    let generation = vm.metadata.generation;
    let changed = vm.status.conditions.set_condition(
        conditions::LOST,
        ConditionStatus::True,
        reasons::NOT_IN_BACKEND,
        "the backend no longer has this VM: delete it (`boxery rm NAME`) and create it again, or revert it from an image",
        generation,
    );
    vm.status.conditions.set_condition(
        READY,
        ConditionStatus::False,
        reasons::LOST,
        "the VM is gone from the backend",
        generation,
    );
    vm.status.phase = VmPhase::Lost;
    changed
}

/// The Warning event of a VM found gone from the backend.
pub(crate) async fn lost_event(ctx: &Ctx, vm: &Vm) {
    ctx.event(
        vm,
        EventType::Warning,
        "Lost",
        "the VM is missing from the backend",
    )
    .await;
}

async fn lost(mut vm: Vm, ctx: &Ctx) -> Result<Action> {
    let changed = set_lost(&mut vm);
    if let Some(ssh) = vm.status.ssh.as_mut() {
        ssh.endpoint = None;
    }
    vm.status.printable_status = Some(printable(&vm));
    if changed {
        let vm = save(ctx, &vm).await?;
        lost_event(ctx, &vm).await;
    }
    Ok(Action::await_change())
}

/// Deletion: remove the VM from the backend (only one made for this object) and close its
/// ssh ControlMaster; the finalizer goes after ([`recorded::reconcile`]).
async fn finalize(mut vm: Vm, ctx: &Ctx) -> Result<Action> {
    let name = vm.name().to_string();
    if vm.status.phase != VmPhase::Terminating {
        vm.status.phase = VmPhase::Terminating;
        vm.status.printable_status = Some("Terminating".into());
        vm = save(ctx, &vm).await?;
    }
    let obj = format!("Vm/{name}");
    // Its grants leave the grant state before the VM goes (the Grant reconciler then marks
    // them Revoked).
    if let Some(uid) = vm.metadata.uid.as_deref() {
        crate::grant::revoke_vm(ctx, &name, uid).await?;
        boxery_home::tokens::revoke(&ctx.home, &name, uid).map_err(|e| token_error(&name, e))?;
    }
    boxery_home::egress::remove(&ctx.home, &name)
        .map_err(|e| state_error("egress", &name, "removing the egress policy", e))?;
    boxery_home::activity::forget(&ctx.home, &name);
    // Only remove what is ours: a backend VM with another object's mark is not this VM.
    match ctx.backend.get(&name).await {
        Ok(Some(info))
            if info.mark.is_some()
                && !Mark::is_for(info.mark.as_deref(), vm.metadata.uid.as_deref()) => {}
        Ok(_) => {
            ctx.backend
                .remove(&name)
                .await
                .map_err(|e| ReconcileError::backend("remove", &obj, e))?;
            ctx.backend
                .cleanup_new(&name)
                .await
                .map_err(|e| ReconcileError::backend("cleanup_new", &obj, e))?;
        }
        Err(e) => return Err(ReconcileError::backend("get", &obj, e)),
    }
    if let Some(ssh) = &ctx.ssh {
        ssh.close(&name).await;
    }
    // No event: events belong to their object and go with it.
    tracing::info!(vm = %name, "removed from the backend");
    Ok(Action::await_change())
}

async fn recover(vm: Vm, op: Operation, ctx: &Ctx) -> Result<Action> {
    match op.type_ {
        OperationType::Create => recover_create(vm, op, ctx).await,
        OperationType::Reimage => recover_reimage(vm, op, ctx).await,
        OperationType::Capture | OperationType::Build => {
            // Not a Vm operation; drop it.
            let mut vm = vm;
            vm.status.operation = None;
            save(ctx, &vm).await?;
            Ok(Action::requeue(Duration::ZERO))
        }
    }
}

/// An interrupted create: adopt the VM when the backend has it complete with this object's
/// uid, stop with `NameTaken` when it has another one of that name, else clean up and retry.
async fn recover_create(mut vm: Vm, op: Operation, ctx: &Ctx) -> Result<Action> {
    let name = vm.name().to_string();
    let obj = format!("Vm/{name}");
    let existing = ctx
        .backend
        .get(&name)
        .await
        .map_err(|e| ReconcileError::backend("get", &obj, e))?;
    match existing {
        Some(info) if Mark::is_for(info.mark.as_deref(), vm.metadata.uid.as_deref()) => {
            // The create finished before the crash: adopt it.
            vm.status.operation = None;
            vm.status.created_at = Some(now());
            vm.status.source_image = op.image.clone();
            vm.status.size = Some(api_size(info.size));
            vm.status.backend = Some(ctx.backend.name().to_string());
            vm.status.acceleration = ctx.backend.accelerator();
            vm.status.instance_type = ctx
                .backend
                .capabilities()
                .instance_type(vm.spec.instance_type)
                .ok();
            let vm = save(ctx, &vm).await?;
            ctx.event(
                &vm,
                EventType::Normal,
                "Recovered",
                "an interrupted create had finished; the VM was adopted",
            )
            .await;
        }
        Some(_) => {
            let msg = format!(
                "the backend has a VM named {name} that boxery did not make for this object: remove it or pick another name"
            );
            vm.status.operation = None;
            vm.status.phase = VmPhase::Failed;
            vm.status.conditions.set_condition(
                READY,
                ConditionStatus::False,
                reasons::NAME_TAKEN,
                &msg,
                vm.metadata.generation,
            );
            vm.status.printable_status = Some("NameTaken".into());
            let vm = save(ctx, &vm).await?;
            ctx.event(&vm, EventType::Warning, "NameTaken", &msg).await;
            return Ok(Action::await_change());
        }
        None => {
            ctx.backend
                .cleanup_new(&name)
                .await
                .map_err(|e| ReconcileError::backend("cleanup_new", &obj, e))?;
            vm.status.operation = None;
            let vm = save(ctx, &vm).await?;
            ctx.event(
                &vm,
                EventType::Normal,
                "Recovered",
                "an interrupted create was cleaned up and will be retried",
            )
            .await;
        }
    }
    Ok(Action::requeue(Duration::ZERO))
}

/// An interrupted reimage: run it again (reimage is retryable; `Unchanged` drops the intent).
async fn recover_reimage(mut vm: Vm, op: Operation, ctx: &Ctx) -> Result<Action> {
    let name = vm.name().to_string();
    let obj = format!("Vm/{name}");
    let image = op.image.clone().unwrap_or_default();
    let identity = identity_for(&vm);
    // with memory when the revert in the spec asked for it
    let memory = vm
        .spec
        .restore
        .as_ref()
        .is_some_and(|r| r.memory && r.image == image);
    let reimaged = if memory {
        ctx.backend.reimage_memory(&name, &image, &identity).await
    } else {
        ctx.backend.reimage(&name, &image, &identity).await
    };
    let (ty, reason, msg) = match reimaged {
        Ok(()) => (
            EventType::Normal,
            "Reverted",
            format!("an interrupted revert to {image} was finished"),
        ),
        Err(BackendError::Unchanged(msg)) => (
            EventType::Warning,
            "RevertFailed",
            format!("revert to {image} failed before changing the VM: {msg}"),
        ),
        Err(e) => return Err(ReconcileError::backend("reimage", &obj, e)),
    };
    // Done or refused before touching the VM: either way the intent is settled.
    vm.status.operation = None;
    vm.status.last_restore = vm.spec.restore.clone();
    let vm = save(ctx, &vm).await?;
    ctx.event(&vm, ty, reason, &msg).await;
    Ok(Action::requeue(Duration::ZERO))
}

/// Whether `vm` is a pool's member (its tokens are the leases').
fn pool_member(vm: &Vm) -> bool {
    vm.metadata
        .labels
        .contains_key(boxery_api::pool::POOL_LABEL)
}

/// The VM's own proxy token: a VM outside any pool has one (minted here when it has none: a
/// VM made before tokens were recorded, or whose file was lost); a pool member has none of
/// its own (a VM that joined a pool loses it; its leases bring theirs).
fn keep_token(vm: &Vm, ctx: &Ctx) -> Result<()> {
    let (name, Some(uid)) = (vm.name(), vm.metadata.uid.as_deref()) else {
        return Ok(());
    };
    let held = boxery_home::tokens::read(&ctx.home, name);
    if pool_member(vm) {
        boxery_home::tokens::revoke(&ctx.home, name, uid).map_err(|e| token_error(name, e))?;
    } else if held.is_none_or(|(owner, _)| owner != uid) {
        let token = boxery_backends::identity::proxy_token();
        boxery_home::tokens::write(&ctx.home, name, uid, &token)
            .map_err(|e| token_error(name, e))?;
        tracing::info!(vm = %name, "minted the VM's proxy token");
    }
    Ok(())
}

fn token_error(vm: &str, e: std::io::Error) -> ReconcileError {
    state_error("token", vm, "writing the token store", e)
}

/// A control-plane state file (`$BOXERY_HOME/tokens`, `egress`) could not be written.
fn state_error(
    step: &'static str,
    vm: &str,
    what: &'static str,
    e: std::io::Error,
) -> ReconcileError {
    ReconcileError::backend(
        step,
        format!("Vm/{vm}"),
        boxery_backends::BackendError::io(what, e),
    )
}

/// A new VM's identity. Backends whose VMs run sshd get a host key made here (ssh-keygen)
/// and the control plane's key; the fake backend, which has no guests, gets names only.
async fn new_identity(ctx: &Ctx, name: &str) -> Result<boxery_backends::Identity> {
    let Some(ssh) = ctx.ssh.clone() else {
        return Ok(boxery_backends::Identity {
            hostname: name.to_string(),
            ..Default::default()
        });
    };
    let vm = name.to_string();
    let made = tokio::task::spawn_blocking(move || -> Result<boxery_backends::Identity, String> {
        let keys = ssh.authorized_lines().map_err(|e| e.to_string())?;
        boxery_backends::identity::generate(&vm, &keys).map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| e.to_string())
    .and_then(|r| r);
    made.map_err(|e| {
        ReconcileError::backend(
            "identity",
            format!("Vm/{name}"),
            boxery_backends::BackendError::failed("identity", e),
        )
    })
}

/// The identity passed to `reimage`: names only, so the VM keeps its seed (host key, MAC).
fn identity_for(vm: &Vm) -> boxery_backends::Identity {
    boxery_backends::Identity {
        hostname: vm.name().to_string(),
        ..Default::default()
    }
}

/// The cycle `vm` is in when the not-yet-made VMs it forks from lead back to it (`a → b → a`).
async fn fork_cycle(vm: &Vm, ctx: &Ctx) -> Result<Option<Vec<String>>> {
    let mut chain = vec![vm.name().to_string()];
    let mut src = match &vm.spec.source {
        VmSource::Vm(s) => s.clone(),
        _ => return Ok(None),
    };
    for _ in 0..64 {
        if chain.contains(&src) {
            chain.push(src);
            return Ok(Some(chain));
        }
        let Some(next) = ctx.store.get_as::<Vm>(&src).await? else {
            return Ok(None);
        };
        if next.status.created_at.is_some() {
            return Ok(None);
        }
        chain.push(src);
        src = match next.spec.source {
            VmSource::Vm(s) => s,
            _ => return Ok(None),
        };
    }
    Ok(None)
}

/// Resolve the image a new VM is made from; `Ok(None)` means wait (status already written).
async fn source_image(vm: &mut Vm, ctx: &Ctx) -> Result<Option<String>> {
    let (image_name, wait_msg) = match &vm.spec.source {
        VmSource::Image(_) | VmSource::Base(_) if !vm.spec.layers.is_empty() => {
            match layered_image(vm, ctx).await? {
                Ok(img) => (img, None),
                Err(msg) => {
                    set_waiting(vm, reasons::IMAGE_NOT_FOUND, &msg, ctx).await?;
                    return Ok(None);
                }
            }
        }
        VmSource::Image(n) | VmSource::Base(n) => (n.clone(), None),
        VmSource::Vm(src) => {
            let src = src.clone();
            match fork_source(vm, &src, ctx).await? {
                Some(img) => (img, Some(format!("capturing the source VM {src}"))),
                None => return Ok(None),
            }
        }
    };
    match ctx.store.get_as::<Image>(&image_name).await? {
        None if STOCK_IMAGES.contains(&image_name.as_str()) => {
            build_stock(vm, &image_name, ctx).await?;
            Ok(None)
        }
        None => {
            let msg = format!(
                "image {image_name} does not exist: create it (`boxery snap VM LABEL`, or `boxery apply -f` an Image), or point spec.source at an image from `boxery get images`"
            );
            let changed = vm
                .status
                .conditions
                .get_condition(conditions::IMAGE_AVAILABLE)
                .is_none_or(|c| c.reason != reasons::IMAGE_NOT_FOUND);
            set_waiting(vm, reasons::IMAGE_NOT_FOUND, &msg, ctx).await?;
            if changed {
                ctx.event(vm, EventType::Warning, "ImageNotFound", &msg)
                    .await;
            }
            Ok(None)
        }
        Some(img) if img.metadata.is_deleting() => {
            set_waiting(
                vm,
                reasons::IMAGE_NOT_FOUND,
                &format!("image {image_name} is being deleted"),
                ctx,
            )
            .await?;
            Ok(None)
        }
        Some(img) if img.status.phase != ImagePhase::Ready => {
            // Show the image's own progress (a build's phase, a capture) while waiting.
            let progress = image_progress(&img);
            let msg = match wait_msg {
                Some(w) => format!("{w}: {progress}"),
                None => format!("waiting for image {image_name}: {progress}"),
            };
            set_waiting(vm, reasons::IMAGE_NOT_READY, &msg, ctx).await?;
            Ok(None)
        }
        Some(_) => Ok(Some(image_name)),
    }
}

/// A fork's source: the capture `NAME.fork-source` of the source VM, owned by the fork and made
/// here on first visit. `None` (with a waiting condition) when it cannot be made.
async fn fork_source(vm: &mut Vm, src: &str, ctx: &Ctx) -> Result<Option<String>> {
    let img = fork_image_name(vm.name());
    if let Some(cycle) = fork_cycle(vm, ctx).await? {
        let msg = format!(
            "the VMs fork from each other in a cycle ({}): none of them can ever be made; give one of them an image as its source",
            cycle.join(" → ")
        );
        set_waiting(vm, reasons::FORK_CYCLE, &msg, ctx).await?;
        return Ok(None);
    }
    if ctx.store.get_as::<Image>(&img).await?.is_none() {
        if ctx.store.get_as::<Vm>(src).await?.is_none() {
            let msg = format!("the source VM {src} does not exist: `boxery get vms` lists VMs");
            set_waiting(vm, reasons::SOURCE_VM_NOT_FOUND, &msg, ctx).await?;
            return Ok(None);
        }
        let mut image = Image::new(
            &img,
            ImageSpec {
                source: ImageSource::Vm(src.to_string()),
                memory: false,
            },
        );
        image
            .metadata
            .labels
            .insert("boxery.dev/fork-of".into(), src.to_string());
        image.metadata.owner_references.push(owner_ref(vm));
        match ctx.store.create_as(&image).await {
            Ok(_) | Err(StoreError::AlreadyExists { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(Some(img))
}

/// The Image a VM's `spec.layers` asks for: the stock base built with those layers
/// (`debian-12-agents`), made here when it does not exist, shared by every VM that asks for the
/// same and owned by none (labelled [`boxery_api::image::LAYERED_LABEL`]). `Err(why)` when an
/// Image of that name is something else.
async fn layered_image(vm: &Vm, ctx: &Ctx) -> Result<Result<String, String>> {
    let base = vm.spec.source.name().to_string();
    let layers = vm.spec.layers.clone();
    let name = layered_image_name(&base, &layers);
    let want = ImageSource::Build(BuildSpec {
        base: base.clone(),
        layers: layers.clone(),
    });
    match ctx.store.get_as::<Image>(&name).await? {
        Some(img) if img.spec.source == want => return Ok(Ok(name)),
        Some(_) => {
            return Ok(Err(format!(
                "spec.layers needs image {name} built from {base} with {}, but an image of that name is something else: delete or rename it (`boxery get image {name} -o yaml`)",
                layers.join(", ")
            )));
        }
        None => {}
    }
    let mut image = Image::new(
        &name,
        ImageSpec {
            source: want,
            memory: false,
        },
    );
    image
        .metadata
        .labels
        .insert(LAYERED_LABEL.into(), layers.join("."));
    let why = format!(
        "image {name} ({base} with {}) is built for spec.layers, once for every VM that asks for the same",
        layers.join(", ")
    );
    build_for(vm, &image, &why, ctx).await?;
    Ok(Ok(name))
}

/// Whether a new VM from an image starts from the memory the image carries.
enum MemoryStart {
    /// It does.
    Yes,
    /// No memory to start from: the image carries none, or the VM is to stay stopped.
    None,
    /// The image carries memory the backend cannot start this VM from: why.
    Refused(String),
}

async fn memory_start(vm: &Vm, image: &str, size: VmSize, ctx: &Ctx) -> Result<MemoryStart> {
    let carries = ctx
        .store
        .get_as::<Image>(image)
        .await?
        .is_some_and(|i| i.spec.memory && i.status.memory_bytes.is_some());
    if !carries || vm.spec.run_strategy == RunStrategy::Stopped {
        return Ok(MemoryStart::None);
    }
    let refusal = ctx
        .backend
        .memory_start_refusal(image, size.cpus, size.memory_mib)
        .await
        .map_err(|e| {
            ReconcileError::backend("memory_start_refusal", format!("Vm/{}", vm.name()), e)
        })?;
    Ok(refusal.map_or(MemoryStart::Yes, MemoryStart::Refused))
}

/// The image a new VM is made from, and whether it starts from that image's memory: a warm
/// pool's member from the clean memory image of another member ([`warm_image`]) when it
/// can, else `spec.source`'s image (`image`), from its memory when it carries some the VM
/// can start from; when it cannot, a Normal event `BootsCold` says why.
async fn start_from(vm: &Vm, image: String, size: VmSize, ctx: &Ctx) -> Result<(String, bool)> {
    if let Some(warm) = warm_image(vm, ctx).await?
        && let MemoryStart::Yes = memory_start(vm, &warm, size, ctx).await?
    {
        return Ok((warm, true));
    }
    match memory_start(vm, &image, size, ctx).await? {
        MemoryStart::Yes => Ok((image, true)),
        MemoryStart::None => Ok((image, false)),
        MemoryStart::Refused(why) => {
            ctx.event(
                vm,
                EventType::Normal,
                "BootsCold",
                &format!("{why}; the VM boots from the image's disk instead"),
            )
            .await;
            Ok((image, false))
        }
    }
}

/// The image named by the VM's [`boxery_api::vm::START_FROM_MEMORY`] annotation, when it is
/// the clean image of a member of the VM's own pool (the annotation is honoured for nothing
/// else), ready and not being deleted.
async fn warm_image(vm: &Vm, ctx: &Ctx) -> Result<Option<String>> {
    let (Some(name), Some(pool)) = (
        vm.metadata
            .annotations
            .get(boxery_api::vm::START_FROM_MEMORY),
        vm.metadata.labels.get(boxery_api::pool::POOL_LABEL),
    ) else {
        return Ok(None);
    };
    if !name.ends_with(".boxery-clean") {
        return Ok(None);
    }
    let usable = ctx.store.get_as::<Image>(name).await?.is_some_and(|i| {
        i.metadata.labels.get(boxery_api::pool::POOL_LABEL) == Some(pool)
            && i.status.phase == ImagePhase::Ready
            && !i.metadata.is_deleting()
    });
    Ok(usable.then(|| name.clone()))
}

/// A fork's memory image ([`boxery_api::image::MEMORY_FORK_LABEL`]) is deleted once every VM made from it
/// exists: each VM's memory is its own copy from then on.
async fn forget_fork_image(image: &str, ctx: &Ctx) -> Result<()> {
    let Some(img) = ctx.store.get_as::<Image>(image).await? else {
        return Ok(());
    };
    // only the image a fork made: labelled with its own source VM
    let forked = matches!(
        (&img.spec.source, img.metadata.labels.get(boxery_api::image::MEMORY_FORK_LABEL)),
        (ImageSource::Vm(src), Some(of)) if src == of
    );
    if !forked || img.metadata.is_deleting() {
        return Ok(());
    }
    let vms: Vec<Vm> = ctx.store.list_as::<Vm>(&Default::default()).await?;
    let waiting = vms.iter().any(|v| {
        matches!(&v.spec.source, VmSource::Image(i) if i == image) && v.status.created_at.is_none()
    });
    if waiting {
        return Ok(());
    }
    match ctx.store.delete(&ObjectRef::of::<Image>(image)).await {
        Ok(_) | Err(StoreError::NotFound { .. }) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Create the Image `image` (a build) that VM `vm` waits for, unless it exists already, and say
/// so on the VM (`BuildingImage`, `why`).
async fn build_for(vm: &Vm, image: &Image, why: &str, ctx: &Ctx) -> Result<()> {
    match ctx.store.create_as(image).await {
        Ok(_) | Err(StoreError::AlreadyExists { .. }) => {}
        Err(e) => return Err(e.into()),
    }
    ctx.event(vm, EventType::Normal, "BuildingImage", why).await;
    Ok(())
}

/// A stock image (`debian-12`, `tiny`) is built on first use: its Image is made here.
async fn build_stock(vm: &mut Vm, image_name: &str, ctx: &Ctx) -> Result<()> {
    let image = Image::new(
        image_name,
        ImageSpec {
            source: ImageSource::Build(BuildSpec {
                base: image_name.to_string(),
                layers: vec![],
            }),
            memory: false,
        },
    );
    let why = format!("the stock image {image_name} is built on first use");
    build_for(vm, &image, &why, ctx).await?;
    set_waiting(
        vm,
        reasons::IMAGE_NOT_READY,
        &format!("waiting for the stock image {image_name} to be built"),
        ctx,
    )
    .await?;
    Ok(())
}

fn owner_ref(vm: &Vm) -> OwnerReference {
    OwnerReference {
        api_version: boxery_api::API_VERSION.into(),
        kind: "Vm".into(),
        name: vm.name().to_string(),
        uid: vm.metadata.uid.clone().unwrap_or_default(),
        controller: Some(true),
    }
}

async fn set_waiting(vm: &mut Vm, reason: &str, msg: &str, ctx: &Ctx) -> Result<()> {
    let generation = vm.metadata.generation;
    let mut changed = vm.status.conditions.set_condition(
        conditions::IMAGE_AVAILABLE,
        ConditionStatus::False,
        reason,
        msg,
        generation,
    );
    changed |=
        vm.status
            .conditions
            .set_condition(READY, ConditionStatus::False, reason, msg, generation);
    vm.status.phase = VmPhase::Pending;
    vm.status.observed_generation = generation;
    vm.status.printable_status = Some(printable(vm));
    if changed {
        *vm = save(ctx, vm).await?;
    }
    Ok(())
}

async fn create(mut vm: Vm, ctx: &Ctx) -> Result<Action> {
    let name = vm.name().to_string();
    let obj = format!("Vm/{name}");
    let generation = vm.metadata.generation;
    // the kind of instance first: a backend that cannot make the one asked for refuses the VM
    // before an image is built for it or anything is made
    let instance_type = ctx
        .backend
        .capabilities()
        .instance_type(vm.spec.instance_type)
        .map_err(|why| ReconcileError::backend("create", &obj, BackendError::Invalid(why)))?;
    let Some(image) = source_image(&mut vm, ctx).await? else {
        // Image changes wake us (the controller watches Images); poll slowly as a fallback.
        return Ok(Action::requeue(Duration::from_secs(5)));
    };
    // a warm pool's member continues a clean member's memory where it can
    let size = size_of(&vm);
    let (image, memory) = start_from(&vm, image, size, ctx).await?;
    vm.status.conditions.set_condition(
        conditions::IMAGE_AVAILABLE,
        ConditionStatus::True,
        reasons::IMAGE_READY,
        &format!("made from image {image}"),
        generation,
    );
    // A fresh identity, made on the host: a new host key (pinned in status before the VM
    // exists, so no ssh ever trusts on first use), machine-id and token, and the control
    // plane's key as the only authorized key.
    let mut identity = new_identity(ctx, &name).await?;
    // a desktop starts at its size at the first boot (the control plane's push comes later)
    identity.display = (!vm.spec.headless).then_some(vm.spec.display).flatten();
    // A VM outside any pool has its own proxy token from birth (the one in its seed); a pool
    // member gets one per lease instead, so its clean image carries none that works.
    if !pool_member(&vm)
        && let Some(uid) = vm.metadata.uid.clone()
    {
        let token = identity
            .proxy_token
            .get_or_insert_with(boxery_backends::identity::proxy_token);
        boxery_home::tokens::write(&ctx.home, &name, &uid, token)
            .map_err(|e| token_error(&name, e))?;
    } else {
        identity.proxy_token = None;
    }
    vm.status.ssh = Some(SshStatus {
        endpoint: None,
        host_key: identity
            .host_key
            .as_ref()
            .map(|(_, public)| public.trim().to_string()),
    });
    // Intent first, with a resourceVersion precondition: a stale writer gets a Conflict here.
    vm.status.operation = Some(Operation {
        type_: OperationType::Create,
        image: Some(image.clone()),
        original_state: None,
        started_at: now(),
        holder: ctx.holder.clone(),
    });
    vm.status.phase = VmPhase::Creating;
    vm.status.printable_status = Some("Creating".into());
    vm = save(ctx, &vm).await?;

    let req = NewVm {
        name: name.clone(),
        uid: ctx.mark(&vm.metadata),
        source: DiskSource::Image(image.clone()),
        cpus: size.cpus,
        memory_mib: size.memory_mib,
        disk_gib: size.disk_gib,
        start: vm.spec.run_strategy == RunStrategy::Running,
        identity,
        egress: vm.spec.network.egress.policy,
        memory,
    };
    if let Err(e) = ctx.backend.create(&req).await {
        // Leave nothing half made; the operation is cleared so the next try starts clean.
        let cleanup = ctx.backend.cleanup_new(&name).await;
        if cleanup.is_ok() {
            vm.status.operation = None;
            save(ctx, &vm).await?;
        }
        return Err(ReconcileError::backend("create", &obj, e));
    }
    vm.status.operation = None;
    vm.status.created_at = Some(now());
    vm.status.source_image = Some(image.clone());
    // what the guest has: the layers it was made with and its image's build record
    vm.status.layers = vm.spec.layers.clone();
    vm.status.build_info = ctx
        .store
        .get_as::<Image>(&image)
        .await?
        .and_then(|i| i.status.build_info);
    vm.status.backend = Some(ctx.backend.name().to_string());
    vm.status.acceleration = ctx.backend.accelerator();
    vm.status.instance_type = Some(instance_type);
    vm.status.size = Some(api_size(size));
    vm.status.failures = 0;
    vm.status.last_failure = None;
    // A revert requested before the VM existed is moot: the disk is fresh.
    vm.status.last_restore = vm.spec.restore.clone();
    let vm = save(ctx, &vm).await?;
    let how = if memory {
        format!("created from image {image}'s memory, continuing from its instant")
    } else {
        format!("created from image {image}")
    };
    ctx.event(
        &vm,
        EventType::Normal,
        "Created",
        &match &vm.status.acceleration {
            Some(a) => format!("{how}; {a}"),
            None => how,
        },
    )
    .await;
    if memory {
        forget_fork_image(&image, ctx).await?;
    }
    if matches!(vm.spec.source, VmSource::Vm(_)) {
        // The fork's capture is not needed any more: images are independent.
        match ctx
            .store
            .delete(&ObjectRef::of::<Image>(fork_image_name(&name)))
            .await
        {
            Ok(_) | Err(StoreError::NotFound { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(Action::requeue(Duration::ZERO))
}

async fn restore(mut vm: Vm, r: boxery_api::vm::Restore, ctx: &Ctx) -> Result<Action> {
    let name = vm.name().to_string();
    let obj = format!("Vm/{name}");
    let generation = vm.metadata.generation;
    let image = ctx.store.get_as::<Image>(&r.image).await?;
    let ready = image
        .as_ref()
        .is_some_and(|i| i.status.phase == ImagePhase::Ready && !i.metadata.is_deleting());
    if !ready {
        let msg = match image {
            None => format!(
                "cannot revert: image {} does not exist (`boxery get images` lists them)",
                r.image
            ),
            Some(i) => format!(
                "cannot revert yet: image {} is {:?}",
                r.image, i.status.phase
            ),
        };
        if vm.status.conditions.set_condition(
            conditions::REVERTED,
            ConditionStatus::False,
            reasons::IMAGE_NOT_READY,
            &msg,
            generation,
        ) {
            vm = save(ctx, &vm).await?;
            ctx.event(&vm, EventType::Warning, "RevertWaiting", &msg)
                .await;
        }
        return Ok(Action::requeue(Duration::from_secs(5)));
    }
    vm.status.operation = Some(Operation {
        type_: OperationType::Reimage,
        image: Some(r.image.clone()),
        original_state: None,
        started_at: now(),
        holder: ctx.holder.clone(),
    });
    vm.status.phase = VmPhase::Restoring;
    vm.status.printable_status = Some("Restoring".into());
    vm = save(ctx, &vm).await?;
    let reimaged = if r.memory {
        ctx.backend
            .reimage_memory(&name, &r.image, &identity_for(&vm))
            .await
    } else {
        ctx.backend
            .reimage(&name, &r.image, &identity_for(&vm))
            .await
    };
    match reimaged {
        Ok(()) => {
            vm.status.operation = None;
            vm.status.last_restore = Some(r.clone());
            vm.status.conditions.set_condition(
                conditions::REVERTED,
                ConditionStatus::True,
                reasons::REVERTED,
                &format!("reverted to {}", r.image),
                generation,
            );
            let vm = save(ctx, &vm).await?;
            ctx.event(
                &vm,
                EventType::Normal,
                "Reverted",
                &format!("the disk was replaced from image {}", r.image),
            )
            .await;
            Ok(Action::requeue(Duration::ZERO))
        }
        Err(BackendError::Unchanged(msg)) => {
            // Nothing changed: drop the intent rather than finish it later over newer data.
            vm.status.operation = None;
            save(ctx, &vm).await?;
            Err(ReconcileError::backend(
                "reimage",
                &obj,
                BackendError::Unchanged(msg),
            ))
        }
        Err(e) => Err(ReconcileError::backend("reimage", &obj, e)),
    }
}

/// Map an Image change to the Vms waiting on it: its owner (a fork's capture), Vms not yet
/// created from it, and Vms asking to revert to it. Reads the Vm cache: no store round trip.
pub fn vms_for_image(vms: &boxery_controller::Cache, image: &boxery_api::DynObject) -> Vec<String> {
    let name = image.metadata.name.as_str();
    let mut out: Vec<String> = image
        .metadata
        .owner_references
        .iter()
        .filter(|o| o.kind == "Vm")
        .map(|o| o.name.clone())
        .collect();
    // Only Vms whose text names the image are parsed: this runs on every Image change.
    let needle = serde_json::to_string(name).unwrap_or_default();
    let mut candidates = vms.list_containing(&needle);
    if image.metadata.labels.contains_key(LAYERED_LABEL) {
        // made for spec.layers: the Vms asking for it name its base and layers, not it
        candidates.extend(vms.list_containing("\"layers\":"));
    }
    for vm in candidates {
        let spec = vm.spec();
        let waiting = vm.status()["createdAt"].is_null()
            && spec["source"]
                .as_object()
                .and_then(|m| m.values().next())
                .and_then(|v| v.as_str())
                == Some(name);
        let reverting = spec["restore"]["image"].as_str() == Some(name);
        let layered = spec["layers"].as_array().is_some_and(|l| {
            let layers: Vec<String> = l
                .iter()
                .filter_map(|x| x.as_str().map(String::from))
                .collect();
            let base = spec["source"]
                .as_object()
                .and_then(|m| m.values().next())
                .and_then(|v| v.as_str())
                .unwrap_or_default();
            !layers.is_empty() && layered_image_name(base, &layers) == name
        });
        if waiting || reverting || layered {
            out.push(vm.metadata.name.clone());
        }
    }
    out.sort();
    out.dedup();
    out
}

/// Whether a Vm's `Ready` holds for its current generation.
pub fn is_ready(vm: &Vm) -> bool {
    vm.status
        .conditions
        .is_true_for(READY, vm.metadata.generation)
}

/// The kind info, re-exported for wiring.
pub const KIND: &str = Vm::INFO.kind;

#[cfg(test)]
mod probe_tests {
    use super::*;

    const KEY: &str =
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl";

    /// An endpoint that sends an SSH banner and hangs up: the banner check passes, the ssh
    /// command fails at once. A probe that runs there fails; one that is skipped succeeds.
    fn banner_then_close() -> String {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            for c in l.incoming().flatten() {
                let mut c = c;
                let _ = std::io::Write::write_all(&mut c, b"SSH-2.0-test\r\n");
            }
        });
        addr
    }

    /// A VM Ready (ssh reachable) for this generation at this endpoint is not probed again:
    /// no session of the control plane overlaps the first commands of whoever waited for it.
    /// Another generation (a revert, a resize) or another endpoint is probed.
    #[tokio::test]
    async fn a_ready_vm_is_not_probed_again() {
        let dir = tempfile::tempdir().unwrap();
        let store = boxery_store::Store::open(&dir.path().join("store.db")).unwrap();
        let backend = Arc::new(boxery_backends::fake::FakeBackend::new(
            dir.path().join("fake"),
        ));
        let mut ctx = Ctx::new(
            Arc::new(store),
            dir.path().to_path_buf(),
            backend,
            "test".into(),
            Default::default(),
        );
        ctx.ssh = Some(crate::ssh::SshDir::new(dir.path()));
        let endpoint = banner_then_close();
        let mut vm: Vm = serde_json::from_value(serde_json::json!({
            "apiVersion": "boxery.dev/v1alpha1", "kind": "Vm",
            "metadata": {"name": "a", "generation": 2},
            "spec": {"source": {"image": "tiny"}},
            "status": {"ssh": {"endpoint": endpoint, "hostKey": KEY}},
        }))
        .unwrap();
        let ready = |vm: &mut Vm, generation: i64| {
            vm.status.conditions.set_condition(
                READY,
                ConditionStatus::True,
                reasons::SSH_REACHABLE,
                "",
                Some(generation),
            );
        };
        assert!(
            probe(&ctx, &vm, &endpoint).await.is_err(),
            "not Ready yet: probed"
        );
        ready(&mut vm, 2);
        probe(&ctx, &vm, &endpoint)
            .await
            .expect("Ready for this generation and endpoint: not probed");
        vm.metadata.generation = Some(3);
        assert!(
            probe(&ctx, &vm, &endpoint).await.is_err(),
            "a new generation is probed"
        );
        ready(&mut vm, 3);
        let other = banner_then_close();
        assert!(
            probe(&ctx, &vm, &other).await.is_err(),
            "a new endpoint is probed"
        );
    }
}
