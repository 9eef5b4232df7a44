//! The `Grant` reconciler: a grant is in force ("Applied") only while a person's approval of
//! its current generation stands, its VM (or its lease, and the lease's VM) lives, and the
//! control plane can read its value. "In force" means, for now: the grant has an entry in the
//! control plane's grant state, `$BOXERY_HOME/grants/<vm>.json` (0600), which the credential
//! proxy (a later phase of issue 13) reads. An entry names the grant, its type, target, header
//! and `valueFrom` — where the value comes from, never the value.
//!
//! # Guarantees
//! - Phases: `PendingApproval` (no approval of the current generation, or approved but the
//!   value is not readable here: `Ready=False ValueUnavailable`) → `Applied` → `Revoked`
//!   (final: its VM was deleted or replaced, its lease ended or was deleted) or `Denied`. A spec
//!   change bumps `metadata.generation`, which voids the approval: the grant goes back to
//!   `PendingApproval` (event `SpecChanged`), its entry removed.
//! - Revocation removes the entry before anything else (before the status write; for a
//!   lease, the Lease reconciler removes its grants' entries before the member's reset starts;
//!   for a VM, the Vm reconciler removes them before the VM is removed). Deleting a Grant
//!   revokes it under the finalizer `boxery.dev/grant`.
//! - A grant is bound to the uid of its VM (and lease): another VM that takes the name later
//!   never inherits it.
//! - The state file matches the store after a crash: each reconcile writes its own entry, and
//!   [`keep_state`] rebuilds every file from the store when the controllers start and every
//!   30 s (an entry whose grant is gone, or no longer Applied, is dropped; one missing is
//!   written). Writes are atomic (temp file + rename).
//! - The value is never read by the reconciler (a variable's presence, a file's readability,
//!   a program's existence are checked), stored, logged or put in an event.
//!
//! # Assumptions
//! - Status is written only by this reconciler and by the approval path (`boxery grant
//!   approve|deny`, `boxery_verbs::grants`): `apply` drops status from manifests, and no MCP
//!   tool writes status.
//! - One control plane leads a store at a time, so one process edits the state files (the
//!   per-VM lock of [`Ctx::vm_lock`] serialises this process's edits).
//!
//! # Caveats
//! - `delete --force` of a Grant removes its entry from the CLI's process; a control plane's
//!   edit at the same moment could write it back, until the next [`keep_state`] pass.
//! - `valueFrom.env` names a variable of the control plane's environment (`boxery serve`, or
//!   the command running the controllers embedded), which may differ from the approver's.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use boxery_api::conditions::{READY, reasons};
use boxery_api::grant::{GrantPhase, GrantStatus};
use boxery_api::lease::LeasePhase;
use boxery_api::{ConditionStatus, Conditions, EventType, Grant, Lease, Resource, Vm};
use boxery_controller::{Action, CancellationToken, FinalizerEvent, finalizer};
use boxery_home::grants::{self, Entry};
use boxery_store::ObjectStoreExt;

use crate::context::Ctx;
use crate::error::ReconcileError;

/// The Grant finalizer.
pub const FINALIZER: &str = boxery_api::meta::finalizers::GRANT;

/// The kind's name, for wiring.
pub const KIND: &str = Grant::INFO.kind;

/// How often [`keep_state`] rebuilds the state files from the store.
pub const STATE_EVERY: Duration = Duration::from_secs(30);

type Result<T, E = ReconcileError> = std::result::Result<T, E>;

// The grant state files themselves (`$BOXERY_HOME/grants/<vm>.json`) are
// `boxery_home::grants`.

/// Change `vm`'s entries with `f` under the VM's grant lock; writes only when they changed.
async fn edit_state(ctx: &Ctx, vm: &str, f: impl FnOnce(&mut Vec<Entry>)) -> Result<bool> {
    let lock = ctx.vm_lock(&format!("grants:{vm}"));
    let _held = lock.lock().await;
    edit_state_locked(&ctx.home, vm, f)
}

fn edit_state_locked(home: &Path, vm: &str, f: impl FnOnce(&mut Vec<Entry>)) -> Result<bool> {
    grants::edit(home, vm, f).map_err(|e| state_error(vm, e))
}

fn state_error(vm: &str, e: std::io::Error) -> ReconcileError {
    ReconcileError::backend(
        "grant-state",
        format!("grants of VM {vm}"),
        boxery_backends::BackendError::io("writing the grant state", e),
    )
}

/// Revoke every grant of lease `lease_uid` on `vm` at once (the Lease reconciler, before it
/// resets the member): their entries leave the state file; the grants turn `Revoked` when
/// this reconciler next sees them.
pub async fn revoke_lease(ctx: &Ctx, vm: &str, lease_uid: &str) -> Result<()> {
    edit_state(ctx, vm, |es| {
        es.retain(|e| e.lease_uid.as_deref() != Some(lease_uid))
    })
    .await?;
    Ok(())
}

/// Revoke every grant on VM `vm` whose uid is `vm_uid` (the Vm reconciler, before it removes
/// the VM).
pub async fn revoke_vm(ctx: &Ctx, vm: &str, vm_uid: &str) -> Result<()> {
    edit_state(ctx, vm, |es| es.retain(|e| e.vm_uid != vm_uid)).await?;
    Ok(())
}

/// The entry a grant in force has.
fn entry_of(g: &Grant) -> Option<Entry> {
    Some(Entry {
        name: g.metadata.name.clone(),
        uid: g.metadata.uid.clone()?,
        generation: g.metadata.generation?,
        spec: g.spec.clone(),
        vm_uid: g.status.vm_uid.clone()?,
        lease_uid: g.status.lease_uid.clone(),
    })
}

/// Whether a stored grant's status says it is in force now (what [`keep_state`] writes).
fn in_force(g: &Grant) -> bool {
    g.status.phase == GrantPhase::Applied
        && g.status.approved_for(g.metadata.generation)
        && !g.metadata.is_deleting()
        && g.status.vm.is_some()
}

/// Remove the grant's entry from every VM it may sit on (its recorded VM and its spec's VM).
async fn drop_entry(ctx: &Ctx, g: &Grant) -> Result<()> {
    let Some(uid) = g.metadata.uid.as_deref() else {
        return Ok(());
    };
    let mut vms: Vec<&str> = g.status.vm.iter().map(String::as_str).collect();
    if let Some(v) = g.spec.vm.as_deref()
        && !vms.contains(&v)
    {
        vms.push(v);
    }
    for vm in vms {
        edit_state(ctx, vm, |es| es.retain(|e| e.uid != uid)).await?;
    }
    Ok(())
}

/// Reconcile one Grant, under its finalizer: a deleted grant is revoked before it goes.
pub async fn reconcile(grant: Arc<Grant>, ctx: Arc<Ctx>) -> Result<Action> {
    let done = finalizer(
        ctx.store.as_ref(),
        FINALIZER,
        grant,
        async |event| match event {
            FinalizerEvent::Apply(g) => step((*g).clone(), &ctx).await,
            FinalizerEvent::Cleanup(g) => {
                drop_entry(&ctx, &g).await?;
                tracing::info!(grant = %g.name(), "revoked: the grant was deleted");
                Ok(Action::await_change())
            }
        },
    )
    .await;
    Ok(done?)
}

/// Who a grant is for, as the store says now.
enum Subject {
    /// This VM (with its uid), through this lease (name, uid) if it is a lease's grant.
    Vm {
        name: String,
        uid: String,
        lease_uid: Option<String>,
    },
    /// Not yet (its VM or lease does not exist yet, a lease not bound yet): the reason, the
    /// message, and the lease's uid once the lease exists (recorded: the grant is bound to it).
    Wait(&'static str, String, Option<String>),
    /// Never again: revoke (reason, message).
    Gone(&'static str, String),
}

/// What a grant names (its VM or its lease), for [`bound`]'s messages.
struct Named<'a> {
    /// "VM" or "lease".
    kind: &'static str,
    name: &'a str,
    /// The uid the grant is bound to, once it is.
    bound: Option<&'a String>,
    /// The reason while it does not exist yet, and once it is gone.
    waiting: &'static str,
    gone: &'static str,
    /// How it went: "or being deleted" / "released"; "deleted" / "released".
    gone_how: &'static str,
    replaced_how: &'static str,
}

/// The object a grant names and its uid, when it lives (`found`) and is the one the grant
/// is bound to (or the grant is not bound yet); else what the grant waits for, or that it is
/// gone for good (bound to one that is gone, or to one since replaced under its name).
fn bound<T: Resource>(n: &Named, found: Option<T>) -> std::result::Result<(T, String), Subject> {
    let (kind, name) = (n.kind, n.name);
    let Some(found) = found else {
        // Never bound: it may come (a manifest applied before its VM's or lease's).
        return Err(match n.bound {
            None => Subject::Wait(
                n.waiting,
                format!("{kind} {name} does not exist (yet)"),
                None,
            ),
            Some(_) => Subject::Gone(n.gone, format!("{kind} {name} is gone ({})", n.gone_how)),
        });
    };
    let uid = found.meta().uid.clone().unwrap_or_default();
    if n.bound.is_some_and(|u| *u != uid) {
        return Err(Subject::Gone(
            n.gone,
            format!(
                "{kind} {name} was {}; the {kind} now called {name} is another one",
                n.replaced_how
            ),
        ));
    }
    Ok((found, uid))
}

/// A VM that lives (not being deleted).
async fn live_vm(ctx: &Ctx, name: &str) -> Result<Option<Vm>> {
    Ok(ctx
        .store
        .get_as::<Vm>(name)
        .await?
        .filter(|v| !v.metadata.is_deleting()))
}

async fn subject(ctx: &Ctx, g: &Grant) -> Result<Subject> {
    match &g.spec.vm {
        Some(vm) => vm_subject(ctx, g, vm).await,
        None => lease_subject(ctx, g).await,
    }
}

/// A VM's grant: the VM, unless it is a pool member (whose token is its lease's).
async fn vm_subject(ctx: &Ctx, g: &Grant, vm: &str) -> Result<Subject> {
    let named = Named {
        kind: "VM",
        name: vm,
        bound: g.status.vm_uid.as_ref(),
        waiting: reasons::VM_NOT_FOUND,
        gone: reasons::VM_GONE,
        gone_how: "or being deleted",
        replaced_how: "deleted",
    };
    let (v, uid) = match bound(&named, live_vm(ctx, vm).await?) {
        Ok(found) => found,
        Err(s) => return Ok(s),
    };
    // A pool member's token is its lease's: a VM grant there would never be used.
    if let Some(pool) = v
        .metadata
        .owner_references
        .iter()
        .find(|o| o.kind == "Pool")
    {
        return Ok(Subject::Wait(
            reasons::POOL_MEMBER,
            format!(
                "VM {vm} is a member of pool {}, whose VMs use only their leases' grants: grant the lease instead (`boxery grant --lease LEASE TYPE:TARGET …`); this grant is in force only if the VM leaves the pool",
                pool.name
            ),
            None,
        ));
    }
    Ok(Subject::Vm {
        name: vm.to_string(),
        uid,
        lease_uid: None,
    })
}

/// A lease's grant: the lease's VM while the lease is bound to it.
async fn lease_subject(ctx: &Ctx, g: &Grant) -> Result<Subject> {
    let lease = g.spec.lease.clone().unwrap_or_default();
    let l = ctx
        .store
        .get_as::<Lease>(&lease)
        .await?
        .filter(|l| !l.metadata.is_deleting());
    let named = Named {
        kind: "lease",
        name: &lease,
        bound: g.status.lease_uid.as_ref(),
        waiting: reasons::LEASE_NOT_BOUND,
        gone: reasons::LEASE_ENDED,
        gone_how: "released",
        replaced_how: "released",
    };
    let (l, luid) = match bound(&named, l) {
        Ok(found) => found,
        Err(s) => return Ok(s),
    };
    if l.status.phase.ended() {
        return Ok(Subject::Gone(
            reasons::LEASE_ENDED,
            format!("lease {lease} ended ({:?})", l.status.phase),
        ));
    }
    let (LeasePhase::Bound, Some(vm)) = (l.status.phase, &l.status.vm) else {
        return Ok(Subject::Wait(
            reasons::LEASE_NOT_BOUND,
            format!("lease {lease} holds no VM yet"),
            Some(luid),
        ));
    };
    let Some(v) = live_vm(ctx, vm).await? else {
        return Ok(Subject::Wait(
            reasons::LEASE_NOT_BOUND,
            format!("lease {lease}'s VM {vm} is gone; the lease ends"),
            Some(luid),
        ));
    };
    Ok(Subject::Vm {
        name: vm.clone(),
        uid: v.metadata.uid.clone().unwrap_or_default(),
        lease_uid: Some(luid),
    })
}

async fn save(ctx: &Ctx, g: &Grant) -> Result<Grant> {
    Ok(ctx.store.update_status_as(g).await?)
}

/// One step: settle who the grant is for, then apply, pend, deny or revoke it.
async fn step(mut g: Grant, ctx: &Ctx) -> Result<Action> {
    let generation = g.metadata.generation;
    let name = g.name().to_string();
    let original = g.status.clone();
    if g.status.phase == GrantPhase::Revoked {
        drop_entry(ctx, &g).await?;
        return Ok(Action::await_change());
    }
    let (vm, vm_uid, lease_uid) = match subject(ctx, &g).await? {
        Subject::Gone(reason, msg) => return revoke(g, ctx, reason, &msg).await,
        Subject::Wait(reason, msg, lease_uid) => {
            drop_entry(ctx, &g).await?;
            if lease_uid.is_some() {
                g.status.lease_uid = lease_uid;
            }
            let msg = if reason == reasons::POOL_MEMBER {
                msg
            } else {
                format!("{msg}; the grant applies once it does (if approved)")
            };
            return settle(g, &original, ctx, Verdict::Waiting(reason), &msg).await;
        }
        Subject::Vm {
            name,
            uid,
            lease_uid,
        } => (name, uid, lease_uid),
    };
    g.status.vm = Some(vm.clone());
    g.status.vm_uid = Some(vm_uid);
    if lease_uid.is_some() {
        g.status.lease_uid = lease_uid;
    }
    if g.status.denied_for(generation) {
        drop_entry(ctx, &g).await?;
        let msg = format!(
            "denied by {}: a spec change asks again",
            g.status.denied_by.clone().unwrap_or_default()
        );
        return settle(g, &original, ctx, Verdict::Denied, &msg).await;
    }
    if !g.status.approved_for(generation) {
        drop_entry(ctx, &g).await?;
        let was_approved = g.status.approved_generation.is_some();
        let msg = format!(
            "waiting for a person to approve it: `boxery grant approve {name}` in a terminal on the control plane's host"
        );
        if was_approved && g.status.phase != GrantPhase::PendingApproval {
            let m = format!(
                "the spec changed (generation {}): the approval of generation {} no longer holds; {msg}",
                generation.unwrap_or_default(),
                g.status.approved_generation.unwrap_or_default()
            );
            ctx.event(&g, EventType::Normal, "SpecChanged", &m).await;
        }
        return settle(g, &original, ctx, Verdict::ApprovalNeeded, &msg).await;
    }
    if let Err(why) = boxery_home::values::available_for(&g.spec, &ctx.home) {
        drop_entry(ctx, &g).await?;
        let msg = format!(
            "approved, but the control plane cannot read the value ({why}): it applies once it can"
        );
        settle(g, &original, ctx, Verdict::ValueUnavailable, &msg).await?;
        return Ok(Action::requeue(Duration::from_secs(30)));
    }
    // In force: the entry first, then the status that says so (both under the VM's lock, so
    // that a rebuild of the file never runs between them).
    let entry = entry_of(&g).expect("a stored grant has a uid and generation; vm_uid is set");
    let lock = ctx.vm_lock(&format!("grants:{vm}"));
    let _held = lock.lock().await;
    let changed = edit_state_locked(&ctx.home, &vm, |es| {
        es.retain(|e| e.uid != entry.uid);
        es.push(entry.clone());
    })?;
    // Into the guest before the grant says Applied (the guest loop would within seconds; a
    // failure here is left to it). Still under the lock: a push is bounded (guest::PUSH_TIMEOUT).
    if changed
        && let Some(v) = ctx.store.get_as::<Vm>(&vm).await?
        && let Err(e) = crate::guest::sync(ctx, &v).await
    {
        tracing::warn!(vm = %vm, grant = %name, error = %e, "the guest push failed; retrying");
    }
    let msg = format!(
        "in force for VM {vm}: approved by {}",
        g.status.approved_by.clone().unwrap_or_default()
    );
    crate::limits::warn(ctx, &g).await;
    settle(g, &original, ctx, Verdict::Applied, &msg).await
}

/// Where a step leaves a grant.
#[derive(Debug, Clone, Copy)]
enum Verdict {
    /// Pending, no event: waiting for its VM or lease (or on a pool member); the reason.
    Waiting(&'static str),
    Denied,
    ApprovalNeeded,
    ValueUnavailable,
    Applied,
    /// Revoked for good: the reason.
    Revoked(&'static str),
}

impl Verdict {
    /// Its phase, `Ready`'s reason, and the event recorded when `Ready` changes.
    fn parts(self) -> (GrantPhase, &'static str, Option<(EventType, &'static str)>) {
        use EventType::{Normal, Warning};
        use GrantPhase::{Applied, Denied, PendingApproval, Revoked};
        match self {
            Verdict::Waiting(why) => (PendingApproval, why, None),
            Verdict::Denied => (Denied, reasons::DENIED, Some((Normal, "Denied"))),
            Verdict::ApprovalNeeded => {
                let event = Some((Normal, "ApprovalNeeded"));
                (PendingApproval, reasons::PENDING_APPROVAL, event)
            }
            Verdict::ValueUnavailable => {
                let event = Some((Warning, "ValueUnavailable"));
                (PendingApproval, reasons::VALUE_UNAVAILABLE, event)
            }
            Verdict::Applied => (Applied, reasons::APPLIED, Some((Normal, "Applied"))),
            Verdict::Revoked(why) => (Revoked, why, Some((Normal, "Revoked"))),
        }
    }
}

/// Write the verdict's phase and `Ready` (True only for `Applied`) for the current
/// generation, with its event when the condition changed.
async fn settle(
    mut g: Grant,
    original: &GrantStatus,
    ctx: &Ctx,
    to: Verdict,
    msg: &str,
) -> Result<Action> {
    let (phase, reason, event) = to.parts();
    let generation = g.metadata.generation;
    let status = if phase == GrantPhase::Applied {
        ConditionStatus::True
    } else {
        ConditionStatus::False
    };
    let changed = g
        .status
        .conditions
        .set_condition(READY, status, reason, msg, generation);
    g.status.phase = phase;
    g.status.observed_generation = generation;
    if g.status != *original {
        g = save(ctx, &g).await?;
    }
    if changed && let Some((t, r)) = event {
        ctx.event(&g, t, r, msg).await;
    }
    Ok(Action::await_change())
}

/// Its VM or lease is gone: the entry goes first, then `Revoked` (final) with an event.
async fn revoke(g: Grant, ctx: &Ctx, reason: &'static str, msg: &str) -> Result<Action> {
    drop_entry(ctx, &g).await?;
    let original = g.status.clone();
    let msg = format!("revoked: {msg}");
    settle(g, &original, ctx, Verdict::Revoked(reason), &msg).await
}

/// Rebuild every VM's grant state file from the store: the entries of the grants whose
/// status says they are in force, nothing else. Returns the VMs whose file changed.
pub async fn sweep(ctx: &Ctx) -> Result<Vec<String>> {
    let mut vms: std::collections::BTreeSet<String> =
        std::fs::read_dir(boxery_home::layout::grants(&ctx.home))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                e.file_name()
                    .to_str()
                    .and_then(|n| n.strip_suffix(".json"))
                    .filter(|n| boxery_api::name::check_label_name(n).is_ok())
                    .map(str::to_string)
            })
            .collect();
    let grants = ctx.store.list_as::<Grant>(&Default::default()).await?;
    vms.extend(
        grants
            .iter()
            .filter(|g| in_force(g))
            .filter_map(|g| g.status.vm.clone()),
    );
    let mut changed = Vec::new();
    for vm in vms {
        let lock = ctx.vm_lock(&format!("grants:{vm}"));
        let _held = lock.lock().await;
        // Read again under the lock: a reconcile may have just written an entry and its status.
        let grants = ctx.store.list_as::<Grant>(&Default::default()).await?;
        let want: Vec<Entry> = grants
            .iter()
            .filter(|g| in_force(g) && g.status.vm.as_deref() == Some(vm.as_str()))
            .filter_map(entry_of)
            .collect();
        if edit_state_locked(&ctx.home, &vm, |es| *es = want)? {
            tracing::info!(vm = %vm, "grant state rebuilt from the store");
            changed.push(vm);
        }
    }
    Ok(changed)
}

/// Run [`sweep`] now and every [`STATE_EVERY`] until `shutdown`.
pub async fn keep_state(ctx: Arc<Ctx>, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(STATE_EVERY);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {
                if let Err(e) = sweep(&ctx).await {
                    tracing::warn!(error = %e.chain(), "rebuilding the grant state failed");
                }
            }
        }
    }
}

/// Map a Vm change to the grants that name it (by spec, or as a lease's VM).
pub fn grants_of_vm(grants: &boxery_controller::Cache, vm: &boxery_api::DynObject) -> Vec<String> {
    let name = vm.metadata.name.as_str();
    grants
        .list_containing(name)
        .iter()
        .filter(|g| {
            g.spec()["vm"].as_str() == Some(name) || g.status()["vm"].as_str() == Some(name)
        })
        .map(|g| g.metadata.name.clone())
        .collect()
}

/// Map a Lease change to the grants that name it.
pub fn grants_of_lease(
    grants: &boxery_controller::Cache,
    lease: &boxery_api::DynObject,
) -> Vec<String> {
    let name = lease.metadata.name.as_str();
    grants
        .list_containing(name)
        .iter()
        .filter(|g| g.spec()["lease"].as_str() == Some(name))
        .map(|g| g.metadata.name.clone())
        .collect()
}
