//! The `Pool` reconciler: keeps a pool's members, captures each member's clean image, resets
//! members after every lease, removes members that leave, and keeps one `PoolMember` record
//! per member, which leases are claimed from.
//!
//! # Guarantees
//! - Each member has its own record (`PoolMember`, named after its VM, owned by the pool).
//!   Every change to a member is one `update_status` of that record with a resourceVersion
//!   precondition; the Lease reconciler claims members the same way, so a claim, a reset, a
//!   replacement and a removal racing on one member have exactly one winner. A claim and a
//!   fence check read and write one small record, never the whole pool.
//! - Every state change of a member bumps its `generation`: a lease acts on a member only
//!   while the member still carries the lease's uid and the generation it saw.
//! - A reset revokes the lease's token first, then reimages the member from
//!   `<member>.boxery-clean` (through the Vm's `spec.restore`), then frees it. A reset that
//!   fails marks the member Broken: excluded from claims, shown, repaired by `pool rm` + `pool add`.
//! - Template updates (`updateStrategy: ReplaceWhenFree`): a template member made from an
//!   older template is replaced only from Free (or instead of the reset that would free it
//!   after a lease). It first leaves Free for `Replacing` in one record update (the same
//!   precondition, so a claim racing with it has one winner); its VM and clean image are
//!   deleted only in a later pass, once that write has landed. The new VM is made only after
//!   the old clean image is gone, so a member is never freed on its old image. At most
//!   `spec.maxUnavailable` (default max(1, replicas/4)) members are `Replacing` at once. Adopted members are never replaced.
//! - Leaving (scaled down, taken out with `pool rm`, the pool deleted): a member leaves only
//!   when not held. It first moves to `Removing` (fenced as above), then a template member's
//!   VM and clean image are deleted (adopted VMs are unlabelled and kept), then its record
//!   goes, with a `MemberRemoving` and a `MemberRemoved` event. A leased member leaves after
//!   its lease ends (a template member is then deleted instead of reset).
//! - A deleted Pool (finalizer `boxery.dev/pool`) stays until every member has left, so
//!   deleting a pool with leased members waits for their leases to end. A deleted member VM
//!   that a lease holds stays until the lease ends ([`hold_deletion`], called by the Vm
//!   reconciler before it removes a VM).
//!
//! Member Vms made from the template are named `<pool>-<n>`, owned by the pool, labelled
//! `boxery.dev/pool=<pool>` and annotated `boxery.dev/pool-template=<hash>` (the template they
//! were made from, [`template_hash`]); adopted Vms (`spec.members`) get the label while they
//! belong.
//!
//! # Assumptions
//! - A member's `template` (mirrored from its VM's annotation when the VM has one) says
//!   which template it was made from. A record without one (written before boxery recorded it)
//!   is taken as made from the template current when it is first seen, and stamped so.
//! - Pools stored before per-member records carry their member table in `status.members`:
//!   the first reconcile moves it into records ([`migrate`]); until then leases on the pool
//!   wait.
//!
//! # Caveats
//! - The hash is over the template's stored JSON: a boxery upgrade that changed how a template
//!   serializes (a new field written even when defaulted) would replace every free member.
//!   New Vm spec fields must be skipped when defaulted.
//! - The counts in the Pool's status follow claims with a delay of up to a second (a claim
//!   writes its member's record, not the pool); `boxery pool ls` reads the records.

use std::sync::Arc;
use std::time::Duration;

use boxery_api::conditions::{self, READY, reasons};
use boxery_api::image::ImageSpec;
use boxery_api::pool::{
    MemberState, MemberStatus, POOL_LABEL, PoolMember, PoolMemberSpec, UpdateStrategy, VmTemplate,
};
use boxery_api::vm::Restore;
use boxery_api::{
    ConditionStatus, Conditions, EventType, Image, ImagePhase, ImageSource, Lease, OwnerReference,
    Pool, Resource, Vm, now,
};
use boxery_controller::{Action, Cache, ensure_finalizer, remove_finalizer};
use boxery_store::StoreError;

use boxery_store::{ObjectRef, ObjectStoreExt};

use crate::context::Ctx;
use crate::error::ReconcileError;

/// The annotation on every template member's Vm: the [`template_hash`] it was made from.
pub const TEMPLATE_ANNOTATION: &str = "boxery.dev/pool-template";
/// How many reset attempts before a member is Broken.
pub const RESET_ATTEMPTS: u32 = 3;

/// A hash of a template (FNV-1a, 64 bits, over its JSON as stored, in hex): what a member
/// records as the template it was made from. Stable across runs and builds.
pub fn template_hash(t: &VmTemplate) -> String {
    let json = serde_json::to_vec(t).expect("a template serializes");
    let h = json.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{h:016x}")
}

/// How many members may be `Replacing` at once: `spec.maxUnavailable`, else max(1, replicas/4).
pub fn replace_budget(pool: &Pool) -> usize {
    match pool.spec.max_unavailable {
        Some(n) => (n as usize).max(1),
        None => (pool.spec.replicas as usize / 4).max(1),
    }
}

type Result<T, E = ReconcileError> = std::result::Result<T, E>;

/// The clean image of a member.
pub fn clean_image(member: &str) -> String {
    format!("{member}.boxery-clean")
}

fn owner(pool: &Pool) -> OwnerReference {
    OwnerReference {
        api_version: boxery_api::API_VERSION.into(),
        kind: "Pool".into(),
        name: pool.metadata.name.clone(),
        uid: pool.metadata.uid.clone().unwrap_or_default(),
        controller: Some(true),
    }
}

fn vm_owner(vm: &Vm) -> OwnerReference {
    OwnerReference {
        api_version: boxery_api::API_VERSION.into(),
        kind: "Vm".into(),
        name: vm.metadata.name.clone(),
        uid: vm.metadata.uid.clone().unwrap_or_default(),
        controller: Some(true),
    }
}

/// The member names the spec asks for: `<pool>-0..replicas`, then the adopted ones.
pub fn wanted(pool: &Pool) -> Vec<(String, bool)> {
    let mut out: Vec<(String, bool)> = if pool.spec.template.is_some() {
        (0..pool.spec.replicas)
            .map(|i| (format!("{}-{i}", pool.metadata.name), true))
            .collect()
    } else {
        Vec::new()
    };
    for m in &pool.spec.members {
        if !out.iter().any(|(n, _)| *n == m.name) {
            out.push((m.name.clone(), false));
        }
    }
    out
}

/// When to look at a pool again: the earliest of what its members asked for.
#[derive(Debug, Default)]
struct Again(Option<Duration>);

impl Again {
    fn within(&mut self, d: Duration) {
        self.0 = Some(self.0.map_or(d, |x| x.min(d)));
    }
    fn action(self) -> Action {
        self.0
            .map(Action::requeue)
            .unwrap_or_else(Action::await_change)
    }
}

/// What one pass over a pool's members found, besides the member table.
#[derive(Debug, Default)]
struct Pass {
    again: Again,
    /// Members whose VM cannot join (another pool's, or a person's).
    blocked: Vec<String>,
    /// The current template's hash (None: the pool has no template).
    template: Option<String>,
    /// How many more members may start `Replacing` in this pass.
    replace_slots: usize,
    /// Members that left: their records are deleted.
    gone: Vec<String>,
}

impl Pass {
    /// Whether `m` was made from an older template and the pool replaces such members.
    fn outdated(&self, pool: &Pool, in_spec: bool, m: &MemberStatus) -> bool {
        pool.spec.update_strategy == UpdateStrategy::ReplaceWhenFree
            && m.created
            && in_spec
            && self.template.is_some()
            && m.template.is_some()
            && m.template != self.template
    }

    /// Take one of the pass's replacement slots, if one is left.
    fn take_slot(&mut self) -> bool {
        let ok = self.replace_slots > 0;
        self.replace_slots = self.replace_slots.saturating_sub(1);
        ok
    }
}

/// Reconcile one Pool (under its finalizer, added by hand: a deleted pool stays until every
/// member has left): bring each member one step on (make or adopt its VM, capture its clean
/// image, reset it after a lease, remove it when it leaves), write each member's record that
/// changed (one small `update_status` each, with a resourceVersion precondition), then the
/// counts and conditions into the Pool's status.
pub async fn reconcile(pool: Arc<Pool>, ctx: Arc<Ctx>) -> Result<Action> {
    let deleting = pool.metadata.is_deleting();
    match (deleting, pool.metadata.has_finalizer(FINALIZER)) {
        (false, false) => {
            ensure_finalizer(ctx.store.as_ref(), &*pool, FINALIZER).await?;
            return Ok(Action::await_change());
        }
        (true, false) => return Ok(Action::await_change()),
        _ => {}
    }
    let mut pool = (*pool).clone();
    if !pool.status.members.is_empty() {
        return migrate(&ctx, pool).await;
    }
    let before = pool.status.clone();
    let wanted = if deleting { Vec::new() } else { wanted(&pool) };
    let records = records(&ctx, pool.name()).await?;
    let mut table = Vec::with_capacity(records.len());
    let mut stored = std::collections::HashMap::with_capacity(records.len());
    for r in records {
        table.push(MemberStatus::of(&r));
        stored.insert(r.metadata.name.clone(), r);
    }
    let replacing = table
        .iter()
        .filter(|m| m.state == MemberState::Replacing)
        .count();
    let mut pass = Pass {
        template: pool.spec.template.as_ref().map(template_hash),
        replace_slots: replace_budget(&pool).saturating_sub(replacing),
        ..Pass::default()
    };
    join(&ctx, &pool, &wanted, &mut table, &mut stored, &mut pass).await?;
    for m in table.iter_mut() {
        let in_spec = wanted.iter().any(|(n, _)| *n == m.name);
        if in_spec {
            member(&ctx, &pool, m, &mut pass).await?;
        } else {
            leave(&ctx, &pool, m, &mut pass).await?;
        }
    }
    let conflicts = write_records(&ctx, &mut pool, &mut table, &stored, &pass).await?;
    if conflicts {
        // A claim (or a VM's deletion) changed a member meanwhile: look again at once.
        pass.again.within(Duration::ZERO);
    }
    unlabel_departed(&ctx, &pool, &table).await?;
    if deleting && table.is_empty() {
        remove_finalizer(ctx.store.as_ref(), &pool, FINALIZER).await?;
        return Ok(Action::await_change());
    }
    summarize(&mut pool, table, &pass);
    // what its leases used this month, and its budget (crate::budget), while it has
    // members (a pool being deleted keeps its leased members until their leases end)
    if let (_, Some(check)) = crate::budget::pool(&ctx, &mut pool).await {
        pass.again.within(check);
    }
    if pool.status != before {
        ctx.store.update_status_as(&pool).await?;
    }
    Ok(pass.again.action())
}

/// The text a cached object naming pool `name` in its spec holds (`"pool":"NAME"`): the
/// prefilter of [`boxery_controller::Cache::list_containing`] for a pool's members and leases.
pub(crate) fn pool_needle(name: &str) -> String {
    format!(
        "\"pool\":{}",
        serde_json::to_string(name).unwrap_or_default()
    )
}

/// Delete a member's VM and its clean image (either may be gone already).
async fn delete_member_vm(ctx: &Ctx, name: &str) -> Result<()> {
    for key in [
        ObjectRef::of::<Image>(clean_image(name)),
        ObjectRef::of::<Vm>(name),
    ] {
        match ctx.store.delete(&key).await {
            Ok(_) | Err(StoreError::NotFound { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// The Pool finalizer.
pub const FINALIZER: &str = boxery_api::meta::finalizers::POOL;

/// The member records of pool `name`: from the member cache when the runtime keeps one (it
/// holds this process's own writes at once; every write is fenced by a resourceVersion
/// precondition, so a stale copy only costs a retry), else from the store.
pub(crate) async fn records(ctx: &Ctx, name: &str) -> Result<Vec<PoolMember>> {
    if let Some(c) = ctx.pool_caches()
        && c.members.is_ready()
    {
        let mut out: Vec<PoolMember> = c
            .members
            .list_containing(&pool_needle(name))
            .iter()
            .filter(|o| o.spec()["pool"].as_str() == Some(name))
            .filter_map(|o| o.to_typed().ok())
            .collect();
        out.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        return Ok(out);
    }
    let selector = format!("{POOL_LABEL}={name}")
        .parse()
        .expect("a valid selector");
    Ok(ctx
        .store
        .list_as::<PoolMember>(&selector)
        .await?
        .into_iter()
        .filter(|m| m.spec.pool == name)
        .collect())
}

/// Members new in the spec get their record (Pending); a record of that name belonging to
/// another pool blocks the member (a VM is in one pool at a time).
async fn join(
    ctx: &Ctx,
    pool: &Pool,
    wanted: &[(String, bool)],
    table: &mut Vec<MemberStatus>,
    stored: &mut std::collections::HashMap<String, PoolMember>,
    pass: &mut Pass,
) -> Result<()> {
    for (name, created) in wanted {
        if table.iter().any(|m| m.name == *name) {
            continue;
        }
        let mut r = PoolMember::new(
            name,
            PoolMemberSpec {
                pool: pool.name().into(),
                created: *created,
            },
        );
        r.metadata
            .labels
            .insert(POOL_LABEL.into(), pool.name().into());
        r.metadata.owner_references.push(owner(pool));
        r.status.message = "joining the pool".into();
        match ctx.store.create_as(&r).await {
            Ok(r) => {
                table.push(MemberStatus::of(&r));
                stored.insert(r.metadata.name.clone(), r);
            }
            Err(StoreError::AlreadyExists { .. }) => {
                let other = ctx
                    .store
                    .get_as::<PoolMember>(name)
                    .await?
                    .map(|o| o.spec.pool)
                    .unwrap_or_default();
                if other != pool.name() {
                    pass.blocked.push(name.clone());
                    if ctx.first_report(&format!("member-conflict:{}:{name}", pool.name())) {
                        ctx.event(
                            pool,
                            EventType::Warning,
                            "MemberConflict",
                            &format!(
                                "VM {name} is a member of pool {other}: a VM is in one pool at a time (`boxery pool rm {other} {name}` first)"
                            ),
                        )
                        .await;
                    }
                }
                pass.again.within(Duration::from_secs(5));
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Write every member record that changed, each with its own resourceVersion precondition
/// (records whose member left are deleted instead). Returns whether a write lost a race.
async fn write_records(
    ctx: &Ctx,
    pool: &mut Pool,
    table: &mut Vec<MemberStatus>,
    stored: &std::collections::HashMap<String, PoolMember>,
    pass: &Pass,
) -> Result<bool> {
    let mut conflicts = false;
    let mut kept = Vec::with_capacity(table.len());
    for m in table.drain(..) {
        let Some(r) = stored.get(&m.name) else {
            continue;
        };
        if pass.gone.contains(&m.name) {
            match ctx
                .store
                .delete(&ObjectRef::of::<PoolMember>(m.name.as_str()))
                .await
            {
                Ok(_) | Err(StoreError::NotFound { .. }) => {
                    pool.status.epoch += 1;
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
        }
        let status = m.record();
        if status == r.status {
            kept.push(m);
            continue;
        }
        let mut w = r.clone();
        w.status = status;
        match ctx.store.update_status_as(&w).await {
            Ok(_) => kept.push(m),
            Err(StoreError::Conflict { .. } | StoreError::NotFound { .. }) => {
                // Someone else moved it first: this pass's step for it is void.
                conflicts = true;
                kept.push(MemberStatus::of(r));
            }
            Err(e) => return Err(e.into()),
        }
    }
    *table = kept;
    Ok(conflicts)
}

/// Move a pool stored before per-member records to them: one `PoolMember` per row of
/// `status.members` (its state, generation and lease kept, so a lease bound before the
/// upgrade stays bound), then the table is emptied with the pool's resourceVersion as the
/// precondition (a stale read is redone: the records are written again from the fresh one).
async fn migrate(ctx: &Ctx, mut pool: Pool) -> Result<Action> {
    for row in &pool.status.members {
        let mut r = PoolMember::new(
            &row.name,
            PoolMemberSpec {
                pool: pool.name().into(),
                created: row.created,
            },
        );
        r.metadata
            .labels
            .insert(POOL_LABEL.into(), pool.name().into());
        r.metadata.owner_references.push(owner(&pool));
        r.status = row.record();
        match ctx.store.create_as(&r).await {
            Ok(_) => {}
            Err(StoreError::AlreadyExists { .. }) => {
                let Some(mut cur) = ctx.store.get_as::<PoolMember>(&row.name).await? else {
                    continue;
                };
                if cur.spec.pool == pool.name() && cur.status != r.status {
                    cur.status = r.status;
                    ctx.store.update_status_as(&cur).await?;
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    let n = pool.status.members.len();
    pool.status.members.clear();
    ctx.store.update_status_as(&pool).await?;
    tracing::info!(pool = %pool.name(), members = n, "member table moved to PoolMember records");
    Ok(Action::requeue(Duration::ZERO))
}

/// One step for one member the spec wants, by its state.
async fn member(ctx: &Ctx, pool: &Pool, m: &mut MemberStatus, pass: &mut Pass) -> Result<()> {
    let Some(vm) = ctx.store.get_as::<Vm>(&m.name).await? else {
        return missing_vm(ctx, pool, true, m, pass).await;
    };
    if vm.metadata.is_deleting() {
        // Someone deleted the member's VM: a held member keeps it until its lease ends (the
        // Vm reconciler waits, [`hold_deletion`]); any other waits, out of the free set,
        // until it is gone (then a template member is made again).
        match m.state {
            MemberState::Acquiring | MemberState::Leased => held(ctx, m).await?,
            _ => {
                if m.state != MemberState::Pending {
                    if let Some(uid) = &m.lease_uid {
                        crate::lease::revoke_token(ctx, &m.name, uid);
                    }
                    m.lease = None;
                    m.lease_uid = None;
                    m.reset_requested_at = None;
                    set(m, MemberState::Pending, VM_DELETING);
                }
                m.message = VM_DELETING.into();
                pass.again.within(Duration::from_secs(1));
            }
        }
        return Ok(());
    }
    if matches!(m.state, MemberState::Pending | MemberState::Replacing)
        && let Some(why) = not_ours(pool, m.created, &vm)
    {
        // Never adopted: a VM of another pool, or a person's VM whose name a template
        // member would take. The member waits until the way is clear.
        if m.message != why {
            ctx.event(pool, EventType::Warning, "MemberConflict", &why)
                .await;
        }
        m.message = why;
        pass.blocked.push(m.name.clone());
        pass.again.within(Duration::from_secs(5));
        return Ok(());
    }
    if !vm.metadata.labels.contains_key(POOL_LABEL) {
        let mut v = vm.clone();
        v.metadata
            .labels
            .insert(POOL_LABEL.into(), pool.name().into());
        ctx.store.update_as(&v).await?;
        return Ok(());
    }
    if m.created {
        // Which template it was made from: its VM's annotation, else the record's, else
        // (a record from before boxery recorded it) the current one.
        let made_from = vm.metadata.annotations.get(TEMPLATE_ANNOTATION).cloned();
        m.template = made_from.or(m.template.take()).or(pass.template.clone());
    }
    match m.state {
        MemberState::Pending => pending(ctx, pool, &vm, m, pass).await,
        MemberState::Acquiring | MemberState::Leased => held(ctx, m).await,
        MemberState::Resetting => resetting(ctx, pool, true, &vm, m, pass).await,
        MemberState::Replacing => replacing(ctx, pool, &vm, m, pass).await,
        MemberState::Free => {
            if pass.outdated(pool, true, m) && pass.take_slot() {
                start_replace(ctx, pool, m, "it is free").await;
                pass.again.within(Duration::from_millis(200));
            }
            Ok(())
        }
        // Back in the spec while leaving (a scale-down undone): it joins again.
        MemberState::Removing => {
            set(m, MemberState::Pending, "rejoining the pool");
            pass.again.within(Duration::from_millis(200));
            Ok(())
        }
        MemberState::Broken => Ok(()),
    }
}

/// The message of a member whose VM is being deleted.
const VM_DELETING: &str = "its VM is being deleted";

/// One step for a member the spec no longer wants (scaled down, `pool rm`, the pool being
/// deleted). A held member stays until its lease ends; an adopted member is reset first (the
/// holder's files do not go back to its owner); then it moves to `Removing` (fenced), and in a
/// later pass a template member's VM and clean image are deleted and, once the VM is gone,
/// its record.
async fn leave(ctx: &Ctx, pool: &Pool, m: &mut MemberStatus, pass: &mut Pass) -> Result<()> {
    let vm = ctx.store.get_as::<Vm>(&m.name).await?;
    match m.state {
        MemberState::Acquiring | MemberState::Leased => {
            m.message = "leaving the pool when its lease ends".into();
            return held(ctx, m).await;
        }
        MemberState::Resetting if !m.created => {
            if let Some(vm) = vm.filter(|v| !v.metadata.is_deleting()) {
                return resetting(ctx, pool, false, &vm, m, pass).await;
            }
        }
        MemberState::Removing => return removing(ctx, pool, vm.as_ref(), m, pass).await,
        _ => {}
    }
    if let Some(uid) = &m.lease_uid {
        crate::lease::revoke_token(ctx, &m.name, uid);
    }
    m.lease = None;
    m.lease_uid = None;
    m.reset_requested_at = None;
    let why = if pool.metadata.is_deleting() {
        "the pool is being deleted"
    } else {
        "the pool no longer asks for it"
    };
    let what = if m.created {
        "deleting its VM and clean image"
    } else {
        "an adopted VM: kept, without the pool's label"
    };
    set(m, MemberState::Removing, &format!("leaving: {why}"));
    ctx.event(
        pool,
        EventType::Normal,
        "MemberRemoving",
        &format!("{} leaves the pool ({why}): {what}", m.name),
    )
    .await;
    pass.again.within(Duration::from_millis(200));
    Ok(())
}

/// Removing (the move to it has landed): delete a template member's VM and clean image, and
/// once the VM is gone, the record (an adopted VM is unlabelled by [`unlabel_departed`]).
async fn removing(
    ctx: &Ctx,
    pool: &Pool,
    vm: Option<&Vm>,
    m: &mut MemberStatus,
    pass: &mut Pass,
) -> Result<()> {
    let ours = vm.is_some_and(|v| {
        v.metadata
            .owner_references
            .iter()
            .any(|o| o.kind == "Pool" && Some(&o.uid) == pool.metadata.uid.as_ref())
    });
    if m.created && ours {
        delete_member_vm(ctx, &m.name).await?;
        m.message = "leaving: its VM is being deleted".into();
        pass.again.within(Duration::from_secs(1));
        return Ok(());
    }
    pass.gone.push(m.name.clone());
    ctx.event(
        pool,
        EventType::Normal,
        "MemberRemoved",
        &format!("{} left the pool", m.name),
    )
    .await;
    Ok(())
}

/// Take a member out of the free set to be made again from the current template. Only the
/// member table changes here: its VM is deleted in a later pass, once this change has been
/// written (with the resourceVersion precondition a claim would have beaten).
async fn start_replace(ctx: &Ctx, pool: &Pool, m: &mut MemberStatus, why: &str) {
    m.lease = None;
    m.lease_uid = None;
    m.reset_requested_at = None;
    set(
        m,
        MemberState::Replacing,
        "replacing: it was made from an older template",
    );
    ctx.event(
        pool,
        EventType::Normal,
        "MemberReplacing",
        &format!(
            "{} was made from an older template and {why}: making it again from the current one",
            m.name
        ),
    )
    .await;
}

/// Replacing, with a VM: the VM made from the current template is clean-imaged and freed
/// (as a Pending member is); an older one is deleted with its clean image.
async fn replacing(
    ctx: &Ctx,
    pool: &Pool,
    vm: &Vm,
    m: &mut MemberStatus,
    pass: &mut Pass,
) -> Result<()> {
    if vm.metadata.is_deleting() {
        m.message = "deleting the VM made from the older template".into();
        pass.again.within(Duration::from_secs(1));
        return Ok(());
    }
    let current = pass.template.is_some()
        && vm.metadata.annotations.get(TEMPLATE_ANNOTATION) == pass.template.as_ref();
    if current {
        return pending(ctx, pool, vm, m, pass).await;
    }
    delete_member_vm(ctx, &m.name).await?;
    m.message = "deleting the VM made from the older template".into();
    pass.again.within(Duration::from_secs(1));
    Ok(())
}

/// Where a new member of a warm pool (`cleanState: Memory`) starts from: the clean memory
/// image of a member made from the same template (`template`, its hash), when one is ready
/// and the backend can start VMs from memory. The new member then continues that member's
/// clean instant with its own identity (crate::adopt) instead of booting; `None`: it boots.
async fn warm_source(ctx: &Ctx, pool: &Pool, template: &str) -> Result<Option<String>> {
    if pool.spec.clean_state != boxery_api::pool::CleanState::Memory
        || !ctx.backend.capabilities().memory_snapshots
    {
        return Ok(None);
    }
    let selector = format!("{POOL_LABEL}={}", pool.name())
        .parse()
        .expect("a valid selector");
    let mut images = ctx.store.list_as::<Image>(&selector).await?;
    images.sort_by(|a, b| a.name().cmp(b.name()));
    for img in images {
        let usable = img.status.phase == ImagePhase::Ready
            && !img.metadata.is_deleting()
            && img.spec.memory
            && img.status.memory_bytes.is_some();
        let Some(member) = img.name().strip_suffix(".boxery-clean") else {
            continue;
        };
        if !usable || clean_image(member) != img.name() {
            continue;
        }
        let same_template = ctx.store.get_as::<Vm>(member).await?.is_some_and(|vm| {
            vm.metadata
                .annotations
                .get(TEMPLATE_ANNOTATION)
                .map(String::as_str)
                == Some(template)
                && !vm.metadata.is_deleting()
        });
        if same_template {
            return Ok(Some(img.name().to_string()));
        }
    }
    Ok(None)
}

/// A member without its VM: make it from the template, or (an adopted one) mark it Broken.
async fn missing_vm(
    ctx: &Ctx,
    pool: &Pool,
    in_spec: bool,
    m: &mut MemberStatus,
    pass: &mut Pass,
) -> Result<()> {
    let name = pool.name();
    if m.created && in_spec {
        // A clean image left from an earlier VM of this name (a replaced member's) must be
        // gone first: the new member would otherwise be freed, and reset, on the old one.
        if let Some(img) = ctx.store.get_as::<Image>(&clean_image(&m.name)).await? {
            if !img.metadata.is_deleting() {
                match ctx.store.delete(&ObjectRef::of::<Image>(img.name())).await {
                    Ok(_) | Err(StoreError::NotFound { .. }) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            m.message = "deleting the clean image of the member's previous VM".into();
            pass.again.within(Duration::from_secs(1));
            return Ok(());
        }
        let template = pool
            .spec
            .template
            .as_ref()
            .expect("created members come from the template");
        let hash = template_hash(template);
        let mut v = Vm::new(&m.name, template.spec.clone());
        if let Some(img) = warm_source(ctx, pool, &hash).await? {
            // a warm pool grows by forking a clean member's memory, not by booting
            v.metadata
                .annotations
                .insert(boxery_api::vm::START_FROM_MEMORY.into(), img);
        }
        v.metadata.labels = template.labels.clone();
        v.metadata.labels.insert(POOL_LABEL.into(), name.into());
        v.metadata
            .annotations
            .insert(TEMPLATE_ANNOTATION.into(), hash.clone());
        v.metadata.owner_references.push(owner(pool));
        match ctx.store.create_as(&v).await {
            Ok(_) | Err(StoreError::AlreadyExists { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        m.template = Some(hash);
        if let Some(uid) = &m.lease_uid {
            crate::lease::revoke_token(ctx, &m.name, uid);
        }
        m.lease = None;
        m.lease_uid = None;
        m.reset_requested_at = None;
        if m.state == MemberState::Replacing {
            m.message = "creating the member VM from the current template".into();
        } else {
            set(m, MemberState::Pending, "creating the member VM");
        }
    } else if in_spec {
        set(
            m,
            MemberState::Broken,
            &format!(
                "VM {} does not exist: create it, or `boxery pool rm {name} {}`",
                m.name, m.name
            ),
        );
    }
    pass.again.within(Duration::from_secs(2));
    Ok(())
}

/// Pending: wait for the VM to be Ready, capture its clean image once, then it is Free.
async fn pending(
    ctx: &Ctx,
    pool: &Pool,
    vm: &Vm,
    m: &mut MemberStatus,
    pass: &mut Pass,
) -> Result<()> {
    if !crate::vm::is_ready(vm) {
        m.message = "waiting for the member VM to be Ready".into();
        pass.again.within(Duration::from_secs(2));
        return Ok(());
    }
    let img_name = clean_image(&m.name);
    match ctx.store.get_as::<Image>(&img_name).await? {
        None => {
            // a backend without memory snapshots keeps the disk only (and says so once per
            // member): a reset then boots, as with `cleanState: Disk`
            let wants_memory = pool.spec.clean_state == boxery_api::pool::CleanState::Memory;
            let memory = wants_memory && ctx.backend.capabilities().memory_snapshots;
            if wants_memory && !memory {
                ctx.event(
                    pool,
                    EventType::Warning,
                    "CleanStateOnDisk",
                    &format!(
                        "the {} backend cannot snapshot memory: {}'s clean state is its disk only, and its resets boot (cleanState: Memory needs qemu)",
                        ctx.backend.name(),
                        m.name
                    ),
                )
                .await;
            }
            let mut img = Image::new(
                &img_name,
                ImageSpec {
                    source: ImageSource::Vm(m.name.clone()),
                    memory,
                },
            );
            img.metadata
                .labels
                .insert(POOL_LABEL.into(), pool.name().into());
            img.metadata.owner_references.push(vm_owner(vm));
            match ctx.store.create_as(&img).await {
                Ok(_) | Err(StoreError::AlreadyExists { .. }) => {}
                Err(e) => return Err(e.into()),
            }
            m.message = "capturing the member's clean image".into();
            pass.again.within(Duration::from_secs(1));
        }
        Some(img) if img.status.phase == ImagePhase::Ready && !img.metadata.is_deleting() => {
            let msg = format!("{} is clean and free", m.name);
            free(ctx, pool, m, "MemberReady", &msg).await;
        }
        Some(_) => {
            m.message = "capturing the member's clean image".into();
            pass.again.within(Duration::from_secs(1));
        }
    }
    Ok(())
}

/// The member is clean and holds no lease: Free, with a Normal event `reason` on the pool.
async fn free(ctx: &Ctx, pool: &Pool, m: &mut MemberStatus, reason: &str, msg: &str) {
    m.lease = None;
    m.lease_uid = None;
    m.reset_requested_at = None;
    set(m, MemberState::Free, "");
    ctx.event(pool, EventType::Normal, reason, msg).await;
}

/// Acquiring or Leased: the lease must still exist, be the one recorded and not have ended;
/// otherwise reset.
async fn held(ctx: &Ctx, m: &mut MemberStatus) -> Result<()> {
    let holds = match (&m.lease, &m.lease_uid) {
        (Some(l), Some(uid)) => lease_holds(ctx, l, uid).await?,
        _ => false,
    };
    if !holds {
        start_reset(m, "its lease is gone");
    }
    Ok(())
}

/// Whether lease `name` (uid `uid`) still holds its member: it exists and has not ended. A
/// lease being deleted holds it until its own cleanup says `Released` and lets it go: were
/// the pool to reset the member first, it could give it to another lease while the deleted
/// one still read `Bound` (two leases on one VM, seen on a loaded store). Read from the lease
/// cache when the runtime keeps one; a "no" is confirmed against the store before a member
/// is taken from its lease.
pub async fn lease_holds(ctx: &Ctx, name: &str, uid: &str) -> Result<bool> {
    let holds = |l: &boxery_api::DynObject| {
        l.metadata.uid.as_deref() == Some(uid)
            && !matches!(
                l.status()["phase"].as_str(),
                Some("Expired" | "Released" | "Lost")
            )
    };
    if let Some(c) = ctx.pool_caches()
        && c.leases.is_ready()
        && c.leases.get(name).is_some_and(|l| holds(&l))
    {
        return Ok(true);
    }
    Ok(ctx
        .store
        .get(&ObjectRef::of::<Lease>(name))
        .await?
        .is_some_and(|l| holds(&l)))
}

/// Resetting: revoke the token, ask the Vm to reimage from the clean image, and once it has
/// (and is Ready) the member is Free; a reset that keeps failing makes it Broken. A member
/// made from an older template is replaced instead of reset (when the pool replaces, and a
/// replacement slot is free).
async fn resetting(
    ctx: &Ctx,
    pool: &Pool,
    in_spec: bool,
    vm: &Vm,
    m: &mut MemberStatus,
    pass: &mut Pass,
) -> Result<()> {
    let name = pool.name();
    if let Some(lease_uid) = &m.lease_uid {
        crate::lease::revoke_token(ctx, &m.name, lease_uid);
    }
    if m.reset_requested_at.is_none() && pass.outdated(pool, in_spec, m) && pass.take_slot() {
        start_replace(ctx, pool, m, "its lease ended").await;
        pass.again.within(Duration::from_millis(200));
        return Ok(());
    }
    let Some(at) = m.reset_requested_at else {
        // Ask the Vm to reimage from its clean image.
        let at = now();
        let mut v = vm.clone();
        // and to be its template's again: what a holder changed through its lease token
        // (size, power, egress, labels) ends with the lease, as its files do
        if m.created
            && vm.metadata.annotations.get(TEMPLATE_ANNOTATION) == pass.template.as_ref()
            && let Some(t) = &pool.spec.template
        {
            v.spec = t.spec.clone();
            v.metadata.labels = t.labels.clone();
            v.metadata.labels.insert(POOL_LABEL.into(), name.into());
        }
        // back running from the clean instant when the clean image holds its memory
        let clean = ctx.store.get_as::<Image>(&clean_image(&m.name)).await?;
        v.spec.restore = Some(Restore {
            image: clean_image(&m.name),
            requested_at: at,
            memory: clean.is_some_and(|i| i.spec.memory),
        });
        match ctx.store.update_as(&v).await {
            Ok(_) => {
                m.reset_requested_at = Some(at);
                m.message = "reimaging from the clean image".into();
            }
            Err(StoreError::Conflict { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        pass.again.within(Duration::from_millis(200));
        return Ok(());
    };
    let served = vm
        .status
        .last_restore
        .as_ref()
        .is_some_and(|r| r.requested_at == at);
    let reverted_ok = vm
        .status
        .conditions
        .get_condition(conditions::REVERTED)
        .is_none_or(|c| c.status == ConditionStatus::True);
    let lost = vm
        .status
        .conditions
        .get_condition(conditions::LOST)
        .is_some_and(|c| c.status == ConditionStatus::True);
    if served && crate::vm::is_ready(vm) && reverted_ok {
        let msg = format!("{} was reset to its clean image and is free", m.name);
        free(ctx, pool, m, "MemberReset", &msg).await;
    } else if vm.status.failures >= RESET_ATTEMPTS || lost {
        let why = vm
            .status
            .last_failure
            .as_ref()
            .map(|f| f.message.clone())
            .unwrap_or_else(|| "the VM is lost".into());
        // The lease it was reset after has ended: a Broken member names no lease (its token
        // was revoked when the reset began).
        m.lease = None;
        m.lease_uid = None;
        set(
            m,
            MemberState::Broken,
            &format!(
                "reset failed: {why}; repair with `boxery pool rm {name} {}` and `boxery pool add {name} {}`",
                m.name, m.name
            ),
        );
        ctx.event(
            pool,
            EventType::Warning,
            "MemberBroken",
            &format!("{}: reset failed: {why}", m.name),
        )
        .await;
    } else {
        pass.again.within(Duration::from_millis(500));
    }
    Ok(())
}

/// Adopted members that left the spec (and are not held) lose the pool's label.
async fn unlabel_departed(ctx: &Ctx, pool: &Pool, table: &[MemberStatus]) -> Result<()> {
    let selector = format!("{POOL_LABEL}={}", pool.name())
        .parse()
        .expect("a valid selector");
    for vm in ctx.store.list_as::<Vm>(&selector).await? {
        if !table.iter().any(|m| m.name == vm.metadata.name) {
            let mut v = vm.clone();
            v.metadata.labels.remove(POOL_LABEL);
            ctx.store.update_as(&v).await?;
        }
    }
    Ok(())
}

/// The member table, the counts and the conditions, into the pool's status.
fn summarize(pool: &mut Pool, table: Vec<MemberStatus>, pass: &Pass) {
    let blocked = &pass.blocked;
    let generation = pool.metadata.generation;
    let count = |s: MemberState| table.iter().filter(|m| m.state == s).count() as u32;
    let st = &mut pool.status;
    st.replicas = table.len() as u32;
    st.free = count(MemberState::Free);
    st.leased = count(MemberState::Leased) + count(MemberState::Acquiring);
    st.resetting = count(MemberState::Resetting);
    st.broken = count(MemberState::Broken);
    st.removing = count(MemberState::Removing);
    st.ready = st.free + st.leased;
    let made = table.iter().filter(|m| m.created).count();
    st.updated = table
        .iter()
        .filter(|m| m.created && pass.template.is_some() && m.template == pass.template)
        .count() as u32;
    let replacing = count(MemberState::Replacing) > 0;
    let progressing =
        replacing || st.removing > 0 || table.iter().any(|m| m.state == MemberState::Pending);
    st.observed_generation = generation;
    let yes_no = |b: bool| {
        if b {
            ConditionStatus::True
        } else {
            ConditionStatus::False
        }
    };
    let summary = format!(
        "{} free, {} leased, {} resetting, {} broken of {}",
        st.free, st.leased, st.resetting, st.broken, st.replicas
    );
    let (free, broken, updated) = (st.free > 0, st.broken > 0, st.updated);
    let c = &mut st.conditions;
    c.set_condition(
        READY,
        yes_no(free),
        if free {
            reasons::MEMBERS_FREE
        } else {
            reasons::NO_FREE_MEMBER
        },
        &summary,
        generation,
    );
    c.set_condition(
        conditions::PROGRESSING,
        yes_no(progressing),
        if replacing {
            reasons::MEMBERS_REPLACING
        } else if st.removing > 0 {
            reasons::MEMBERS_REMOVING
        } else if progressing {
            reasons::MEMBERS_PENDING
        } else {
            reasons::SETTLED
        },
        &if made == 0 {
            String::new()
        } else {
            format!("{updated} of {made} template members made from the current template")
        },
        generation,
    );
    c.set_condition(
        conditions::MEMBERS_BLOCKED,
        yes_no(!blocked.is_empty()),
        if blocked.is_empty() {
            reasons::NO_CONFLICT
        } else {
            reasons::NAME_TAKEN
        },
        &if blocked.is_empty() {
            String::new()
        } else {
            format!(
                "{} cannot join: see each member's message (`boxery pool ls`)",
                blocked.join(", ")
            )
        },
        generation,
    );
    c.set_condition(
        conditions::DEGRADED,
        yes_no(broken),
        if broken {
            reasons::MEMBERS_BROKEN
        } else {
            reasons::HEALTHY
        },
        "",
        generation,
    );
}

/// Why `vm` may not become a member of `pool`, if it may not: it belongs to another pool (its
/// `boxery.dev/pool` label), or it is a template member's name (`created`) that this pool did
/// not make (a person's VM is never taken over by a name collision; only an explicit
/// `members:` entry, or `boxery pool add`, adopts a VM).
pub fn not_ours(pool: &Pool, created: bool, vm: &Vm) -> Option<String> {
    let name = pool.name();
    if let Some(other) = vm.metadata.labels.get(POOL_LABEL)
        && other != name
    {
        return Some(format!(
            "VM {} belongs to pool {other}: a VM is in one pool at a time (`boxery pool rm {other} {}` first)",
            vm.name(),
            vm.name()
        ));
    }
    let made_here = vm
        .metadata
        .owner_references
        .iter()
        .any(|o| o.kind == "Pool" && Some(&o.uid) == pool.metadata.uid.as_ref());
    if created && !made_here {
        return Some(format!(
            "a VM named {} exists that this pool did not make: it is never taken over; rename or remove it, or adopt it explicitly with `boxery pool add {name} {}` after lowering replicas",
            vm.name(),
            vm.name()
        ));
    }
    None
}

fn set(m: &mut MemberStatus, state: MemberState, message: &str) {
    if m.state != state {
        m.generation += 1;
    }
    m.state = state;
    m.message = message.to_string();
}

/// Move a held member to Resetting (bumping its generation, so its old lease is fenced out).
pub fn start_reset(m: &mut MemberStatus, why: &str) {
    set(m, MemberState::Resetting, &format!("resetting: {why}"));
    m.reset_requested_at = None;
}

/// Map a Vm change to its pool (by label).
pub fn pool_of_vm(vm: &boxery_api::DynObject) -> Vec<String> {
    vm.metadata
        .labels
        .get(POOL_LABEL)
        .cloned()
        .into_iter()
        .collect()
}

/// Map a Lease change to its pool, only when the lease is ending (deleted, being deleted,
/// ended): claims and binds update the member records themselves, so a pool reconcile per
/// lease change would only re-read every member for nothing.
pub fn pool_of_ending_lease(lease: &boxery_api::DynObject) -> Vec<String> {
    let ending = lease.metadata.is_deleting()
        || matches!(
            lease.status()["phase"].as_str(),
            Some("Expired" | "Released" | "Lost")
        );
    if ending {
        lease.spec()["pool"]
            .as_str()
            .map(str::to_string)
            .into_iter()
            .collect()
    } else {
        Vec::new()
    }
}

/// The caches the pool and lease reconcilers read when the runtime keeps them
/// ([`crate::runtime::run`]): every member record, every lease. Without them they read the
/// store.
#[derive(Debug, Clone)]
pub struct Caches {
    /// Every `PoolMember`, kept by [`follow_members`] (and this process's writes at once).
    pub members: Cache,
    /// Every `Lease` (the Lease controller's cache).
    pub leases: Cache,
}

/// What each member record was when [`follow_members`] last mapped it: its pool, state and
/// holder. Transitions are judged against this, not against the change's `old`: this
/// process's own writes (a claim by the Lease reconciler, a reset by the Pool reconciler) go
/// into the members cache before the watch brings them (`Ctx::read_own_writes`), so the
/// watch's change then shows the new record as both old and new, and a claim compared that
/// way woke no pool (its counts waited for the resync, a minute; issue 30, class 1).
#[derive(Debug, Default)]
struct Seen(std::collections::HashMap<String, MemberSeen>);

#[derive(Debug, Clone, PartialEq, Eq)]
struct MemberSeen {
    pool: String,
    state: Option<String>,
    holder: Option<String>,
}

impl MemberSeen {
    fn of(o: &boxery_api::DynObject) -> Option<MemberSeen> {
        Some(MemberSeen {
            pool: o.spec()["pool"].as_str()?.to_string(),
            state: o.status()["state"].as_str().map(str::to_string),
            holder: o.status()["lease"].as_str().map(str::to_string),
        })
    }
}

/// What a member record's change asks of the controllers: which pool to look at (now, or
/// soon: claims only move counts), and which leases to look at (a new holder binds; a member
/// coming free lets the oldest waiting leases of its pool claim).
fn member_change(
    change: &boxery_controller::Change,
    seen: &mut Seen,
    pools: &boxery_controller::Trigger,
    leases: &boxery_controller::Trigger,
    lease_cache: &Cache,
) {
    let Some(name) = change
        .new
        .as_ref()
        .or(change.old.as_ref())
        .map(|o| o.metadata.name.clone())
    else {
        return;
    };
    let now = change.new.as_ref().and_then(|o| MemberSeen::of(o));
    // A record not seen before is new here (its `old`, if any, may be this very write).
    let before = match &now {
        Some(n) => seen.0.insert(name, n.clone()),
        None => seen.0.remove(&name),
    };
    let Some(pool) = now
        .as_ref()
        .or(before.as_ref())
        .map(|m| m.pool.clone())
        .or_else(|| {
            change
                .old
                .as_ref()
                .and_then(|o| MemberSeen::of(o))
                .map(|m| m.pool)
        })
    else {
        return;
    };
    let (old, new) = (
        before.as_ref().and_then(|m| m.state.clone()),
        now.as_ref().and_then(|m| m.state.clone()),
    );
    let (old_holder, new_holder) = (
        before.as_ref().and_then(|m| m.holder.clone()),
        now.as_ref().and_then(|m| m.holder.clone()),
    );
    let claim_only = matches!(
        (old.as_deref(), new.as_deref()),
        (Some("Free"), Some("Acquiring" | "Leased")) | (Some("Acquiring"), Some("Leased"))
    );
    if claim_only {
        pools.enqueue_after(&pool, Duration::from_secs(1));
    } else if old != new || change.new.is_none() {
        pools.enqueue(&pool);
    }
    if let Some(l) = new_holder
        && old_holder.as_ref() != Some(&l)
    {
        leases.enqueue(&l);
    }
    if new.as_deref() == Some("Free") && old.as_deref() != Some("Free") {
        let mut waiting: Vec<Arc<boxery_api::DynObject>> = lease_cache
            .list_containing(&pool_needle(&pool))
            .into_iter()
            .filter(|l| {
                l.spec()["pool"].as_str() == Some(pool.as_str())
                    && l.status()["phase"].as_str().is_none_or(|p| p == "Pending")
                    && !l.metadata.is_deleting()
            })
            .collect();
        waiting.sort_by(|a, b| {
            (a.metadata.creation_timestamp, &a.metadata.name)
                .cmp(&(b.metadata.creation_timestamp, &b.metadata.name))
        });
        for l in waiting.iter().take(4) {
            leases.enqueue(&l.metadata.name);
        }
    }
}

/// Keep `cache` holding every `PoolMember` (list, then watch) and map each change to the
/// pools and leases it concerns, until `shutdown`.
pub async fn follow_members(
    store: Arc<dyn boxery_store::ObjectStore>,
    cache: Cache,
    pools: boxery_controller::Trigger,
    leases: boxery_controller::Trigger,
    lease_cache: Cache,
    shutdown: boxery_controller::CancellationToken,
) {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let reflect = boxery_controller::reflector::reflect(
        store,
        cache,
        tx,
        boxery_controller::Backoff::default(),
    );
    let map = async {
        let mut seen = Seen::default();
        while let Some(change) = rx.recv().await {
            member_change(&change, &mut seen, &pools, &leases, &lease_cache);
        }
    };
    tokio::select! {
        _ = shutdown.cancelled() => {}
        _ = reflect => {}
        _ = map => {}
    }
}

/// Before the Vm reconciler removes a deleted VM: a VM that a lease holds stays until the
/// lease ends (released, expired; `delete --force` ends it first). Returns the action to wait
/// with, or `None` when the VM may go, in which case its member (if any) has been moved out
/// of the free set first (fenced, so no claim can take a VM being removed).
pub async fn hold_deletion(ctx: &Ctx, vm: &Vm) -> Result<Option<Action>> {
    for _ in 0..10 {
        let Some(mut rec) = ctx.store.get_as::<PoolMember>(vm.name()).await? else {
            return Ok(None);
        };
        let st = &rec.status;
        if let (MemberState::Acquiring | MemberState::Leased, Some(l), Some(uid)) =
            (st.state, &st.lease, &st.lease_uid)
            && lease_holds(ctx, l, uid).await?
        {
            if ctx.first_report(&format!(
                "hold:{}:{uid}",
                vm.metadata.uid.as_deref().unwrap_or_default()
            )) {
                ctx.event(
                    vm,
                    EventType::Normal,
                    "WaitingForLease",
                    &format!(
                        "lease {l} holds {}: the VM is removed when the lease ends (`boxery lease release {l}`), or at once with `boxery delete vm {} --force`, which ends the lease",
                        vm.name(),
                        vm.name()
                    ),
                )
                .await;
            }
            return Ok(Some(Action::requeue(Duration::from_secs(2))));
        }
        if matches!(st.state, MemberState::Removing)
            || (st.state == MemberState::Pending && st.message == VM_DELETING)
        {
            return Ok(None);
        }
        let mut row = MemberStatus::of(&rec);
        if let Some(uid) = &row.lease_uid {
            crate::lease::revoke_token(ctx, &row.name, uid);
        }
        row.lease = None;
        row.lease_uid = None;
        row.reset_requested_at = None;
        set(&mut row, MemberState::Pending, VM_DELETING);
        rec.status = row.record();
        match ctx.store.update_status_as(&rec).await {
            Ok(_) | Err(StoreError::NotFound { .. }) => return Ok(None),
            Err(StoreError::Conflict { .. }) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(Some(Action::requeue(Duration::from_millis(200))))
}

/// The kind's name, for wiring.
pub const KIND: &str = Pool::INFO.kind;

#[cfg(test)]
mod tests {
    use super::*;
    use boxery_api::pool::PoolSpec;

    fn pool(strategy: &str, replicas: u32, cpus: u32) -> Pool {
        let spec: PoolSpec = serde_json::from_value(serde_json::json!({
            "replicas": replicas,
            "updateStrategy": strategy,
            "template": {"spec": {"source": {"image": "debian-12"}, "resources": {"cpus": cpus}}},
        }))
        .unwrap();
        let mut p = Pool::new("p", spec);
        p.normalize().unwrap();
        p
    }

    fn row(created: bool, template: Option<String>) -> MemberStatus {
        MemberStatus {
            name: "p-0".into(),
            state: MemberState::Free,
            generation: 1,
            lease: None,
            lease_uid: None,
            created,
            template,
            reset_requested_at: None,
            message: String::new(),
        }
    }

    fn pass(p: &Pool) -> Pass {
        Pass {
            template: p.spec.template.as_ref().map(template_hash),
            replace_slots: replace_budget(p),
            ..Pass::default()
        }
    }

    #[test]
    fn template_hash_is_pinned() {
        // A stored template's hash must not change across boxery versions: if this fails, a
        // change altered how a template serializes, and every free member of every pool would
        // be replaced on upgrade. Skip the new field when it is defaulted instead.
        let t = pool("ReplaceWhenFree", 3, 1).spec.template.unwrap();
        assert_eq!(template_hash(&t), template_hash(&t.clone()));
        assert_eq!(template_hash(&t), "37e7dc6b83518aaa");
        let other = pool("ReplaceWhenFree", 3, 2).spec.template.unwrap();
        assert_ne!(template_hash(&t), template_hash(&other));
    }

    #[test]
    fn only_template_members_of_an_older_template_are_outdated() {
        let old = pool("ReplaceWhenFree", 3, 1);
        let new = pool("ReplaceWhenFree", 3, 2);
        let on_create = pool("OnCreate", 3, 2);
        let old_hash = old.spec.template.as_ref().map(template_hash);
        let p = pass(&new);
        assert!(p.outdated(&new, true, &row(true, old_hash.clone())));
        assert!(!p.outdated(&new, true, &row(true, p.template.clone())));
        // No record (a row from before records): taken as current, never replaced.
        assert!(!p.outdated(&new, true, &row(true, None)));
        // Adopted members, members leaving the spec, and OnCreate pools: never.
        assert!(!p.outdated(&new, true, &row(false, old_hash.clone())));
        assert!(!p.outdated(&new, false, &row(true, old_hash.clone())));
        assert!(!pass(&on_create).outdated(&on_create, true, &row(true, old_hash)));
    }

    #[test]
    fn replacements_are_a_quarter_of_the_pool_at_a_time() {
        for (replicas, budget) in [(0, 1), (1, 1), (3, 1), (4, 1), (8, 2), (10, 2), (100, 25)] {
            assert_eq!(
                replace_budget(&pool("ReplaceWhenFree", replicas, 1)),
                budget
            );
        }
        let mut p = pass(&pool("ReplaceWhenFree", 8, 1));
        assert!(p.take_slot());
        assert!(p.take_slot());
        assert!(!p.take_slot());
        assert!(!p.take_slot());
        // spec.maxUnavailable says otherwise.
        let mut three = pool("ReplaceWhenFree", 8, 1);
        three.spec.max_unavailable = Some(3);
        assert_eq!(replace_budget(&three), 3);
        let mut p = pass(&three);
        assert!(p.take_slot() && p.take_slot() && p.take_slot());
        assert!(!p.take_slot());
    }
}
