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

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use boxery_api::conditions::{READY, reasons};
use boxery_api::grant::{GrantPhase, GrantStatus, GrantType, ValueFrom};
use boxery_api::lease::LeasePhase;
use boxery_api::{ConditionStatus, Conditions, EventType, Grant, Lease, Resource, Vm};
use boxery_controller::{Action, CancellationToken, FinalizerEvent, finalizer};
use boxery_store::ObjectStoreExt;
use serde::{Deserialize, Serialize};

use crate::context::Ctx;
use crate::error::ReconcileError;

/// The Grant finalizer.
pub const FINALIZER: &str = boxery_api::meta::finalizers::GRANT;

/// The kind's name, for wiring.
pub const KIND: &str = Grant::INFO.kind;

/// How often [`keep_state`] rebuilds the state files from the store.
pub const STATE_EVERY: Duration = Duration::from_secs(30);

type Result<T, E = ReconcileError> = std::result::Result<T, E>;

/// One grant in force on a VM, as the proxy will read it: what is granted and where its value
/// comes from (never the value).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Entry {
    /// The Grant's name.
    pub name: String,
    /// The Grant's uid.
    pub uid: String,
    /// The approved generation.
    pub generation: i64,
    /// What kind of credential.
    #[serde(rename = "type")]
    pub type_: GrantType,
    /// What it grants.
    pub target: String,
    /// `http`: the header to add.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// Where the control plane reads the value.
    pub value_from: ValueFrom,
    /// The uid of the VM it is bound to.
    pub vm_uid: String,
    /// A lease's grant: the lease's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<String>,
    /// A lease's grant: the lease's uid (the proxy honours the grant only with that lease's
    /// token).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_uid: Option<String>,
}

/// A VM's grant state file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StateFile {
    /// The VM.
    pub vm: String,
    /// Its grants in force, by name.
    pub grants: Vec<Entry>,
}

/// `$BOXERY_HOME/grants`: the control plane's grant state (0700; files 0600).
pub fn state_dir(home: &Path) -> PathBuf {
    home.join("grants")
}

/// `$BOXERY_HOME/grants/<vm>.json`.
pub fn state_file(home: &Path, vm: &str) -> PathBuf {
    state_dir(home).join(format!("{vm}.json"))
}

/// The entries in force on `vm` (none when there is no file; an unreadable file counts as
/// none: it is rewritten from the store).
pub fn read_state(home: &Path, vm: &str) -> Vec<Entry> {
    std::fs::read(state_file(home, vm))
        .ok()
        .and_then(|b| serde_json::from_slice::<StateFile>(&b).ok())
        .map(|s| s.grants)
        .unwrap_or_default()
}

/// Write `vm`'s entries (sorted by name), atomically and 0600; no entries: no file.
fn write_state(home: &Path, vm: &str, mut entries: Vec<Entry>) -> std::io::Result<()> {
    let file = state_file(home, vm);
    if entries.is_empty() {
        return match std::fs::remove_file(&file) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        };
    }
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    let state = StateFile {
        vm: vm.to_string(),
        grants: entries,
    };
    let bytes = serde_json::to_vec_pretty(&state).map_err(std::io::Error::other)?;
    crate::private::write(&file, &bytes, true)
}

/// Change `vm`'s entries with `f` under the VM's grant lock; writes only when they changed.
async fn edit_state(ctx: &Ctx, vm: &str, f: impl FnOnce(&mut Vec<Entry>)) -> Result<bool> {
    let lock = ctx.vm_lock(&format!("grants:{vm}"));
    let _held = lock.lock().await;
    edit_state_locked(&ctx.home, vm, f)
}

fn edit_state_locked(home: &Path, vm: &str, f: impl FnOnce(&mut Vec<Entry>)) -> Result<bool> {
    let before = read_state(home, vm);
    let mut after = before.clone();
    f(&mut after);
    after.sort_by(|a, b| a.name.cmp(&b.name));
    let mut sorted = before;
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    if after == sorted && (state_file(home, vm).exists() || after.is_empty()) {
        return Ok(false);
    }
    write_state(home, vm, after).map_err(|e| state_error(vm, e))?;
    Ok(true)
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

/// Remove the entries `drop` picks from `vm`'s state file, from outside the controllers
/// (`delete --force` of a Grant, a lease ended by [`crate::lease::end_now`]). Best effort
/// against a concurrent control plane: see the module's caveats.
pub fn remove_entries(home: &Path, vm: &str, drop: impl Fn(&Entry) -> bool) -> std::io::Result<()> {
    let mut es = read_state(home, vm);
    let n = es.len();
    es.retain(|e| !drop(e));
    if es.len() == n {
        return Ok(());
    }
    write_state(home, vm, es)
}

/// Whether the control plane can read the value `v` names, without reading it: the variable
/// is set (non-empty) in this process's environment, the file can be opened (and is not one of
/// boxery's own files under `home`), the program exists and is executable. `Err` says why
/// not. Never returns or logs the value.
pub fn value_available(v: &ValueFrom, home: &Path) -> std::result::Result<(), String> {
    match v {
        ValueFrom::Env(name) => {
            if std::env::var_os(name).is_some_and(|v| !v.is_empty()) {
                Ok(())
            } else {
                Err(format!("the environment variable {name} is not set here"))
            }
        }
        ValueFrom::File(path) => {
            let p = Path::new(path);
            let real = p
                .canonicalize()
                .map_err(|e| format!("cannot read {path}: {e}"))?;
            if let Ok(h) = home.canonicalize()
                && real.starts_with(&h)
            {
                return Err(format!(
                    "{path} is inside boxery's home ({}): the control plane's own keys and tokens are never granted",
                    h.display()
                ));
            }
            if !real.is_file() {
                return Err(format!("{path} is not a regular file"));
            }
            std::fs::File::open(&real)
                .map(drop)
                .map_err(|e| format!("cannot read {path}: {e}"))
        }
        ValueFrom::Command(argv) => {
            let program = argv.first().map(String::as_str).unwrap_or("");
            let found = if program.contains('/') {
                Some(PathBuf::from(program))
            } else {
                std::env::var_os("PATH").and_then(|paths| {
                    std::env::split_paths(&paths)
                        .map(|d| d.join(program))
                        .find(|p| executable(p))
                })
            };
            match found {
                Some(p) if executable(&p) => Ok(()),
                _ => Err(format!(
                    "the program {program} is not found or not executable here"
                )),
            }
        }
    }
}

fn executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The entry a grant in force has.
fn entry_of(g: &Grant) -> Option<Entry> {
    Some(Entry {
        name: g.metadata.name.clone(),
        uid: g.metadata.uid.clone()?,
        generation: g.metadata.generation?,
        type_: g.spec.type_,
        target: g.spec.target.clone(),
        header: g.spec.header.clone(),
        value_from: g.spec.value_from.clone(),
        vm_uid: g.status.vm_uid.clone()?,
        lease: g.spec.lease.clone(),
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

async fn subject(ctx: &Ctx, g: &Grant) -> Result<Subject> {
    let vm_of = async |name: &str| -> Result<Option<Vm>> {
        Ok(ctx
            .store
            .get_as::<Vm>(name)
            .await?
            .filter(|v| !v.metadata.is_deleting()))
    };
    if let Some(vm) = &g.spec.vm {
        let Some(v) = vm_of(vm).await? else {
            // Bound to a VM that is gone: final. Never bound: the VM may come (a manifest
            // applied before its VM's).
            if g.status.vm_uid.is_none() {
                return Ok(Subject::Wait(
                    reasons::VM_NOT_FOUND,
                    format!("VM {vm} does not exist (yet)"),
                    None,
                ));
            }
            return Ok(Subject::Gone(
                reasons::VM_GONE,
                format!("VM {vm} is gone (or being deleted)"),
            ));
        };
        let uid = v.metadata.uid.clone().unwrap_or_default();
        if g.status.vm_uid.as_ref().is_some_and(|u| *u != uid) {
            return Ok(Subject::Gone(
                reasons::VM_GONE,
                format!("VM {vm} was deleted; the VM now called {vm} is another one"),
            ));
        }
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
        return Ok(Subject::Vm {
            name: vm.clone(),
            uid,
            lease_uid: None,
        });
    }
    let lease = g.spec.lease.clone().unwrap_or_default();
    let Some(l) = ctx
        .store
        .get_as::<Lease>(&lease)
        .await?
        .filter(|l| !l.metadata.is_deleting())
    else {
        if g.status.lease_uid.is_none() {
            return Ok(Subject::Wait(
                reasons::LEASE_NOT_BOUND,
                format!("lease {lease} does not exist (yet)"),
                None,
            ));
        }
        return Ok(Subject::Gone(
            reasons::LEASE_ENDED,
            format!("lease {lease} is gone (released)"),
        ));
    };
    let luid = l.metadata.uid.clone().unwrap_or_default();
    if g.status.lease_uid.as_ref().is_some_and(|u| *u != luid) {
        return Ok(Subject::Gone(
            reasons::LEASE_ENDED,
            format!("lease {lease} was released; the lease now called {lease} is another one"),
        ));
    }
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
    let Some(v) = vm_of(vm).await? else {
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
            return settle(
                g,
                &original,
                ctx,
                GrantPhase::PendingApproval,
                reason,
                &msg,
                None,
            )
            .await;
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
        let ev = (EventType::Normal, "Denied");
        return settle(
            g,
            &original,
            ctx,
            GrantPhase::Denied,
            reasons::DENIED,
            &msg,
            Some(ev),
        )
        .await;
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
        let ev = (EventType::Normal, "ApprovalNeeded");
        let reason = reasons::PENDING_APPROVAL;
        return settle(
            g,
            &original,
            ctx,
            GrantPhase::PendingApproval,
            reason,
            &msg,
            Some(ev),
        )
        .await;
    }
    if let Err(why) = value_available(&g.spec.value_from, &ctx.home) {
        drop_entry(ctx, &g).await?;
        let msg = format!(
            "approved, but the control plane cannot read the value ({why}): it applies once it can"
        );
        let ev = (EventType::Warning, "ValueUnavailable");
        let reason = reasons::VALUE_UNAVAILABLE;
        settle(
            g,
            &original,
            ctx,
            GrantPhase::PendingApproval,
            reason,
            &msg,
            Some(ev),
        )
        .await?;
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
    let ev = (EventType::Normal, "Applied");
    settle(
        g,
        &original,
        ctx,
        GrantPhase::Applied,
        reasons::APPLIED,
        &msg,
        Some(ev),
    )
    .await
}

/// Write `phase` and `Ready` (True only for `Applied`) for the current generation, with an
/// event when the condition changed.
async fn settle(
    mut g: Grant,
    original: &GrantStatus,
    ctx: &Ctx,
    phase: GrantPhase,
    reason: &str,
    msg: &str,
    event: Option<(EventType, &str)>,
) -> Result<Action> {
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
async fn revoke(g: Grant, ctx: &Ctx, reason: &str, msg: &str) -> Result<Action> {
    drop_entry(ctx, &g).await?;
    let original = g.status.clone();
    let msg = format!("revoked: {msg}");
    let ev = Some((EventType::Normal, "Revoked"));
    settle(g, &original, ctx, GrantPhase::Revoked, reason, &msg, ev).await
}

/// Rebuild every VM's grant state file from the store: the entries of the grants whose
/// status says they are in force, nothing else. Returns the VMs whose file changed.
pub async fn sweep(ctx: &Ctx) -> Result<Vec<String>> {
    let mut vms: std::collections::BTreeSet<String> = std::fs::read_dir(state_dir(&ctx.home))
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
