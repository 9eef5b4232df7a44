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
//!
//! Member Vms made from the template are named `<pool>-<n>`, owned by the pool and labelled
//! `boxery.dev/pool=<pool>`; adopted Vms (`spec.members`) get the label while they belong.

use std::sync::Arc;
use std::time::Duration;

use boxery_api::image::ImageSpec;
use boxery_api::pool::{MemberState, MemberStatus};
use boxery_api::vm::Restore;
use boxery_api::{
    ConditionStatus, Conditions, EventType, Image, ImagePhase, ImageSource, Lease, OwnerReference,
    Pool, Resource, Vm, now,
};
use boxery_controller::Action;
use boxery_store::StoreError;

use crate::context::Ctx;
use crate::error::ReconcileError;

/// The label on every member.
pub const POOL_LABEL: &str = "boxery.dev/pool";
/// How many reset attempts before a member is Broken.
pub const RESET_ATTEMPTS: u32 = 3;

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

/// Reconcile one Pool.
pub async fn reconcile(pool: Arc<Pool>, ctx: Arc<Ctx>) -> Result<Action> {
    let Some(mut pool) = ctx.store.get_as::<Pool>(pool.name())? else {
        return Ok(Action::await_change());
    };
    if pool.metadata.is_deleting() {
        return Ok(Action::await_change());
    }
    let generation = pool.metadata.generation;
    let name = pool.name().to_string();
    let mut requeue: Option<Duration> = None;
    let soon = |d: Duration, r: &mut Option<Duration>| *r = Some(r.map_or(d, |x| x.min(d)));
    let before = pool.status.clone();
    let wanted = wanted(&pool);

    // Members that left the spec: free ones go at once; held ones stay until their lease ends.
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
    for (member, created) in &wanted {
        if !table.iter().any(|m| m.name == *member) {
            table.push(MemberStatus {
                name: member.clone(),
                state: MemberState::Pending,
                generation: 0,
                lease: None,
                lease_uid: None,
                created: *created,
                reset_requested_at: None,
                message: String::new(),
            });
        }
    }

    let mut blocked: Vec<String> = Vec::new();
    for m in table.iter_mut() {
        let vm = ctx.store.get_as::<Vm>(&m.name)?;
        let in_spec = wanted.iter().any(|(n, _)| *n == m.name);
        // Make or adopt the Vm.
        let Some(vm) = vm else {
            if m.created && in_spec {
                let template = pool
                    .spec
                    .template
                    .as_ref()
                    .expect("created members come from the template");
                let mut v = Vm::new(&m.name, template.spec.clone());
                v.metadata.labels = template.labels.clone();
                v.metadata.labels.insert(POOL_LABEL.into(), name.clone());
                v.metadata.owner_references.push(owner(&pool));
                match ctx.store.create_as(&v) {
                    Ok(_) | Err(StoreError::AlreadyExists { .. }) => {}
                    Err(e) => return Err(e.into()),
                }
                set(m, MemberState::Pending, "creating the member VM");
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
            soon(Duration::from_secs(2), &mut requeue);
            continue;
        };
        if m.state == MemberState::Pending
            && let Some(why) = not_ours(&pool, m.created, &vm)
        {
            // Never adopted: a VM of another pool, or a person's VM whose name a template
            // member would take. The member waits until the way is clear.
            if m.message != why {
                ctx.event(&pool, EventType::Warning, "MemberConflict", &why);
            }
            m.message = why;
            blocked.push(m.name.clone());
            soon(Duration::from_secs(5), &mut requeue);
            continue;
        }
        if in_spec && !vm.metadata.labels.contains_key(POOL_LABEL) {
            let mut v = vm.clone();
            v.metadata.labels.insert(POOL_LABEL.into(), name.clone());
            ctx.store.update_as(&v)?;
            continue;
        }
        let ready = crate::vm::is_ready(&vm);
        match m.state {
            MemberState::Pending => {
                if !ready {
                    m.message = "waiting for the member VM to be Ready".into();
                    soon(Duration::from_secs(2), &mut requeue);
                    continue;
                }
                // Its clean image: captured once, when first Ready.
                let img_name = clean_image(&m.name);
                match ctx.store.get_as::<Image>(&img_name)? {
                    None => {
                        let mut img = Image::new(
                            &img_name,
                            ImageSpec {
                                source: ImageSource::Vm(m.name.clone()),
                            },
                        );
                        img.metadata.labels.insert(POOL_LABEL.into(), name.clone());
                        img.metadata.owner_references.push(vm_owner(&vm));
                        match ctx.store.create_as(&img) {
                            Ok(_) | Err(StoreError::AlreadyExists { .. }) => {}
                            Err(e) => return Err(e.into()),
                        }
                        m.message = "capturing the member's clean image".into();
                        soon(Duration::from_secs(1), &mut requeue);
                    }
                    Some(img) if img.status.phase == ImagePhase::Ready => {
                        set(m, MemberState::Free, "");
                        ctx.event(
                            &pool,
                            EventType::Normal,
                            "MemberReady",
                            &format!("{} is clean and free", m.name),
                        );
                    }
                    Some(_) => {
                        m.message = "capturing the member's clean image".into();
                        soon(Duration::from_secs(1), &mut requeue);
                    }
                }
            }
            MemberState::Acquiring | MemberState::Leased => {
                // The lease must still exist and be the one recorded; otherwise reset.
                let lease = match &m.lease {
                    Some(l) => ctx.store.get_as::<Lease>(l)?,
                    None => None,
                };
                let holds = lease
                    .as_ref()
                    .is_some_and(|l| l.metadata.uid == m.lease_uid && !l.metadata.is_deleting());
                if !holds {
                    start_reset(m, "its lease is gone");
                }
            }
            MemberState::Resetting => {
                if let Some(lease_uid) = &m.lease_uid {
                    crate::lease::revoke_token(ctx.as_ref(), &m.name, lease_uid);
                }
                match m.reset_requested_at {
                    None => {
                        // Ask the Vm to reimage from its clean image.
                        let at = now();
                        let mut v = vm.clone();
                        v.spec.restore = Some(Restore {
                            image: clean_image(&m.name),
                            requested_at: at,
                        });
                        match ctx.store.update_as(&v) {
                            Ok(_) => {
                                m.reset_requested_at = Some(at);
                                m.message = "reimaging from the clean image".into();
                            }
                            Err(StoreError::Conflict { .. }) => {}
                            Err(e) => return Err(e.into()),
                        }
                        soon(Duration::from_millis(200), &mut requeue);
                    }
                    Some(at) => {
                        let served = vm
                            .status
                            .last_restore
                            .as_ref()
                            .is_some_and(|r| r.requested_at == at);
                        let reverted_ok = vm
                            .status
                            .conditions
                            .get_condition("Reverted")
                            .is_none_or(|c| c.status == ConditionStatus::True);
                        if served && ready && reverted_ok {
                            m.lease = None;
                            m.lease_uid = None;
                            m.reset_requested_at = None;
                            set(m, MemberState::Free, "");
                            ctx.event(
                                &pool,
                                EventType::Normal,
                                "MemberReset",
                                &format!("{} was reset to its clean image and is free", m.name),
                            );
                        } else if vm.status.failures >= RESET_ATTEMPTS
                            || vm
                                .status
                                .conditions
                                .get_condition("Lost")
                                .is_some_and(|c| c.status == ConditionStatus::True)
                        {
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
                                &pool,
                                EventType::Warning,
                                "MemberBroken",
                                &format!("{}: reset failed: {why}", m.name),
                            );
                        } else {
                            soon(Duration::from_millis(500), &mut requeue);
                        }
                    }
                }
            }
            MemberState::Free | MemberState::Broken => {}
        }
    }

    // Adopted members that left the spec (and are not held) lose the label.
    for vm in ctx.store.list_as::<Vm>(
        &format!("{POOL_LABEL}={name}")
            .parse()
            .expect("a valid selector"),
    )? {
        if !table.iter().any(|m| m.name == vm.metadata.name) {
            let mut v = vm.clone();
            v.metadata.labels.remove(POOL_LABEL);
            ctx.store.update_as(&v)?;
        }
    }

    let count = |s: MemberState| table.iter().filter(|m| m.state == s).count() as u32;
    pool.status.replicas = table.len() as u32;
    pool.status.free = count(MemberState::Free);
    pool.status.leased = count(MemberState::Leased) + count(MemberState::Acquiring);
    pool.status.resetting = count(MemberState::Resetting);
    pool.status.broken = count(MemberState::Broken);
    pool.status.ready = pool.status.free + pool.status.leased;
    pool.status.updated = table.len() as u32;
    pool.status.members = table;
    pool.status.observed_generation = generation;
    let progressing = pool
        .status
        .members
        .iter()
        .any(|m| m.state == MemberState::Pending);
    pool.status.conditions.set_condition(
        "Ready",
        if pool.status.free > 0 {
            ConditionStatus::True
        } else {
            ConditionStatus::False
        },
        if pool.status.free > 0 {
            "MembersFree"
        } else {
            "NoFreeMember"
        },
        &format!(
            "{} free, {} leased, {} resetting, {} broken of {}",
            pool.status.free,
            pool.status.leased,
            pool.status.resetting,
            pool.status.broken,
            pool.status.replicas
        ),
        generation,
    );
    pool.status.conditions.set_condition(
        "Progressing",
        if progressing {
            ConditionStatus::True
        } else {
            ConditionStatus::False
        },
        if progressing {
            "MembersPending"
        } else {
            "Settled"
        },
        "",
        generation,
    );
    pool.status.conditions.set_condition(
        "MembersBlocked",
        if blocked.is_empty() {
            ConditionStatus::False
        } else {
            ConditionStatus::True
        },
        if blocked.is_empty() {
            "NoConflict"
        } else {
            "NameTaken"
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
    pool.status.conditions.set_condition(
        "Degraded",
        if pool.status.broken > 0 {
            ConditionStatus::True
        } else {
            ConditionStatus::False
        },
        if pool.status.broken > 0 {
            "MembersBroken"
        } else {
            "Healthy"
        },
        "",
        generation,
    );
    if pool.status != before {
        ctx.store.update_status_as(&pool)?;
    }
    Ok(requeue
        .map(Action::requeue)
        .unwrap_or_else(Action::await_change))
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
