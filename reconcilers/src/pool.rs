//! The `Pool` reconciler: keeps a pool's members, captures each member's clean image, resets
//! members after every lease, and keeps the member table leases are claimed from.
//!
//! # Guarantees
//! - Every change to the member table is one `update_status` of the Pool with a
//!   resourceVersion precondition; the Lease reconciler claims members the same way, so a
//!   claim, a reset and a removal racing on one member have exactly one winner.
//! - Every state change of a member bumps its `generation`: a lease acts on a member only
//!   while the member still carries the lease's uid and the generation it saw.
//! - A reset revokes the lease's token first, then reimages the member from
//!   `<member>.boxery-clean` (through the Vm's `spec.restore`), then frees it. A reset that
//!   fails marks the member Broken: excluded from claims, shown, repaired by `pool rm` + `pool add`.
//! - Template updates (`updateStrategy: ReplaceWhenFree`): a template member made from an
//!   older template is replaced only from Free (or instead of the reset that would free it
//!   after a lease). It first leaves Free for `Replacing` in one status update (the same
//!   precondition, so a claim racing with it has one winner); its VM and clean image are
//!   deleted only in a later pass, once that write has landed. The new VM is made only after
//!   the old clean image is gone, so a member is never freed on its old image. At most
//!   max(1, replicas/4) members are `Replacing` at once. Adopted members are never replaced.
//!
//! Member Vms made from the template are named `<pool>-<n>`, owned by the pool, labelled
//! `boxery.dev/pool=<pool>` and annotated `boxery.dev/pool-template=<hash>` (the template they
//! were made from, [`template_hash`]); adopted Vms (`spec.members`) get the label while they
//! belong.
//!
//! # Assumptions
//! - A member row's `template` (mirrored from its VM's annotation when the VM has one) says
//!   which template it was made from. A row without one (written before boxery recorded it)
//!   is taken as made from the template current when it is first seen, and stamped so.
//!
//! # Caveats
//! - The hash is over the template's stored JSON: a boxery upgrade that changed how a template
//!   serializes (a new field written even when defaulted) would replace every free member.
//!   New Vm spec fields must be skipped when defaulted.

use std::sync::Arc;
use std::time::Duration;

use boxery_api::conditions::{self, READY, reasons};
use boxery_api::image::ImageSpec;
use boxery_api::pool::{MemberState, MemberStatus, UpdateStrategy, VmTemplate};
use boxery_api::vm::Restore;
use boxery_api::{
    ConditionStatus, Conditions, EventType, Image, ImagePhase, ImageSource, Lease, OwnerReference,
    Pool, Resource, Vm, now,
};
use boxery_controller::Action;
use boxery_store::StoreError;

use boxery_store::{ObjectRef, ObjectStoreExt};

use crate::context::Ctx;
use crate::error::ReconcileError;

/// The label on every member.
pub const POOL_LABEL: &str = "boxery.dev/pool";
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

/// How many members may be `Replacing` at once: max(1, replicas/4).
pub fn replace_budget(pool: &Pool) -> usize {
    (pool.spec.replicas as usize / 4).max(1)
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

/// Reconcile one Pool: bring each member one step on (make or adopt its VM, capture its clean
/// image, reset it after a lease), then write the member table and the counts in one status
/// update with a resourceVersion precondition.
pub async fn reconcile(pool: Arc<Pool>, ctx: Arc<Ctx>) -> Result<Action> {
    if pool.metadata.is_deleting() {
        return Ok(Action::await_change());
    }
    let mut pool = (*pool).clone();
    let before = pool.status.clone();
    let wanted = wanted(&pool);
    let mut table = member_table(&mut pool, &wanted);
    let replacing = table
        .iter()
        .filter(|m| m.state == MemberState::Replacing)
        .count();
    let mut pass = Pass {
        template: pool.spec.template.as_ref().map(template_hash),
        replace_slots: replace_budget(&pool).saturating_sub(replacing),
        ..Pass::default()
    };
    for m in table.iter_mut() {
        let in_spec = wanted.iter().any(|(n, _)| *n == m.name);
        member(&ctx, &pool, in_spec, m, &mut pass).await?;
    }
    unlabel_departed(&ctx, &pool, &table).await?;
    summarize(&mut pool, table, &pass);
    if pool.status != before {
        ctx.store.update_status_as(&pool).await?;
    }
    Ok(pass.again.action())
}

/// The member table: members that left the spec go when free (held ones stay until their
/// lease ends); members new in the spec join as Pending.
fn member_table(pool: &mut Pool, wanted: &[(String, bool)]) -> Vec<MemberStatus> {
    let mut table = std::mem::take(&mut pool.status.members);
    table.retain(|m| {
        let keep = wanted.iter().any(|(n, _)| *n == m.name)
            || matches!(
                m.state,
                MemberState::Acquiring | MemberState::Leased | MemberState::Resetting
            );
        if !keep {
            pool.status.epoch += 1;
        }
        keep
    });
    for (member, created) in wanted {
        if !table.iter().any(|m| m.name == *member) {
            table.push(MemberStatus {
                name: member.clone(),
                state: MemberState::Pending,
                generation: 0,
                lease: None,
                lease_uid: None,
                created: *created,
                template: None,
                reset_requested_at: None,
                message: String::new(),
            });
        }
    }
    table
}

/// One step for one member, by its state.
async fn member(
    ctx: &Ctx,
    pool: &Pool,
    in_spec: bool,
    m: &mut MemberStatus,
    pass: &mut Pass,
) -> Result<()> {
    let Some(vm) = ctx.store.get_as::<Vm>(&m.name).await? else {
        return missing_vm(ctx, pool, in_spec, m, pass).await;
    };
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
    if in_spec && !vm.metadata.labels.contains_key(POOL_LABEL) {
        let mut v = vm.clone();
        v.metadata
            .labels
            .insert(POOL_LABEL.into(), pool.name().into());
        ctx.store.update_as(&v).await?;
        return Ok(());
    }
    if m.created && in_spec {
        // Which template it was made from: its VM's annotation, else the row's record, else
        // (a row from before boxery recorded it) the current one.
        let made_from = vm.metadata.annotations.get(TEMPLATE_ANNOTATION).cloned();
        m.template = made_from.or(m.template.take()).or(pass.template.clone());
    }
    match m.state {
        MemberState::Pending => pending(ctx, pool, &vm, m, pass).await,
        MemberState::Acquiring | MemberState::Leased => held(ctx, m).await,
        MemberState::Resetting => resetting(ctx, pool, in_spec, &vm, m, pass).await,
        MemberState::Replacing => replacing(ctx, pool, &vm, m, pass).await,
        MemberState::Free => {
            if pass.outdated(pool, in_spec, m) && pass.take_slot() {
                start_replace(ctx, pool, m, "it is free").await;
                pass.again.within(Duration::from_millis(200));
            }
            Ok(())
        }
        MemberState::Broken => Ok(()),
    }
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
    for key in [
        ObjectRef::of::<Image>(clean_image(&m.name)),
        ObjectRef::of::<Vm>(&m.name),
    ] {
        match ctx.store.delete(&key).await {
            Ok(_) | Err(StoreError::NotFound { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    m.message = "deleting the VM made from the older template".into();
    pass.again.within(Duration::from_secs(1));
    Ok(())
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
            let mut img = Image::new(
                &img_name,
                ImageSpec {
                    source: ImageSource::Vm(m.name.clone()),
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
            set(m, MemberState::Free, "");
            ctx.event(
                pool,
                EventType::Normal,
                "MemberReady",
                &format!("{} is clean and free", m.name),
            )
            .await;
        }
        Some(_) => {
            m.message = "capturing the member's clean image".into();
            pass.again.within(Duration::from_secs(1));
        }
    }
    Ok(())
}

/// Acquiring or Leased: the lease must still exist and be the one recorded; otherwise reset.
async fn held(ctx: &Ctx, m: &mut MemberStatus) -> Result<()> {
    let lease = match &m.lease {
        Some(l) => ctx.store.get_as::<Lease>(l).await?,
        None => None,
    };
    let holds = lease
        .as_ref()
        .is_some_and(|l| l.metadata.uid == m.lease_uid && !l.metadata.is_deleting());
    if !holds {
        start_reset(m, "its lease is gone");
    }
    Ok(())
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
        v.spec.restore = Some(Restore {
            image: clean_image(&m.name),
            requested_at: at,
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
        m.lease = None;
        m.lease_uid = None;
        m.reset_requested_at = None;
        set(m, MemberState::Free, "");
        ctx.event(
            pool,
            EventType::Normal,
            "MemberReset",
            &format!("{} was reset to its clean image and is free", m.name),
        )
        .await;
    } else if vm.status.failures >= RESET_ATTEMPTS || lost {
        let why = vm
            .status
            .last_failure
            .as_ref()
            .map(|f| f.message.clone())
            .unwrap_or_else(|| "the VM is lost".into());
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
    st.ready = st.free + st.leased;
    let made = table.iter().filter(|m| m.created).count();
    st.updated = table
        .iter()
        .filter(|m| m.created && pass.template.is_some() && m.template == pass.template)
        .count() as u32;
    let replacing = count(MemberState::Replacing) > 0;
    let progressing = replacing || table.iter().any(|m| m.state == MemberState::Pending);
    st.members = table;
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

/// Map a Vm change to its pool (by label), and a Lease change to its pool.
pub fn pool_of_vm(vm: &boxery_api::DynObject) -> Vec<String> {
    vm.metadata
        .labels
        .get(POOL_LABEL)
        .cloned()
        .into_iter()
        .collect()
}

/// Map a Lease change to its pool, only when the lease is ending (deleted, being deleted,
/// expired): claims and binds update the member table themselves, so a pool reconcile per
/// lease change would only re-read every member for nothing.
pub fn pool_of_ending_lease(lease: &boxery_api::DynObject) -> Vec<String> {
    let ending = lease.metadata.is_deleting()
        || matches!(
            lease.status()["phase"].as_str(),
            Some("Expired" | "Released")
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

/// Whether a Pool's member is Free.
pub fn free_member(pool: &Pool) -> Option<&MemberStatus> {
    pool.status
        .members
        .iter()
        .find(|m| m.state == MemberState::Free)
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
    }
}
