//! The `Lease` reconciler: claims a free pool member, installs the holder's key and a fresh
//! token, expires, renews, and hands the member back for a reset when the lease ends.
//!
//! # Guarantees
//! - A claim is one update of the member's own record (`PoolMember`) with a resourceVersion
//!   precondition: of concurrent claims on one member exactly one wins; the others go on to
//!   another member. Claims on a pool are made in batches, oldest waiting lease first.
//! - Fencing: the lease records the member's generation and the pool's epoch when it binds.
//!   It moves the member on (Acquiring → Leased, → Resetting) only while the member's record
//!   still carries its uid (and, from Acquiring, that generation), so a stale reconcile never
//!   acts on a newer lease.
//! - A bound lease whose VM is gone, or whose member no longer carries it, becomes `Lost`
//!   (Warning event `VmLost`): a lease never stays `Bound` on nothing.
//! - Before `Bound`: a fresh token is written into the guest (and recorded, 0600, in
//!   `$BOXERY_HOME/tokens/<vm>`), then `authorized_keys` is set to the control plane's key
//!   plus the holder's key only.
//! - Every end (delete = release, expiry, host reboot, lost, [`end_now`] from outside) puts
//!   the member in `Resetting`, which revokes the token first. An ended lease cannot be
//!   renewed. Deadlines are tied to the host's boot id: after a reboot every lease is void.
//! - Ending a lease from outside: set its status phase to an ended one (`Expired`, `Lost`)
//!   with a `Ready=False` condition saying why (`update_status`), or call [`end_now`], which
//!   does that and lets the member go at once. The next reconcile of an ended lease lets its
//!   member go if it still holds it ([`ended`]): token revoked, member reset (its VM reimaged
//!   from the clean image, which drops the holder's key).

use std::sync::Arc;
use std::time::Duration;

use boxery_api::conditions::{self, READY, reasons};
use boxery_api::lease::LeasePhase;
use boxery_api::pool::{MemberState, MemberStatus, PoolMember};
use boxery_api::{ConditionStatus, Conditions, EventType, Lease, Pool, Resource, Time, now};
use boxery_controller::{Action, FinalizerEvent, finalizer};
use boxery_store::StoreError;

use boxery_store::{ObjectRef, ObjectStoreExt};

use crate::context::Ctx;
use crate::error::ReconcileError;
use crate::pool::start_reset;

/// The Lease finalizer.
pub const FINALIZER: &str = boxery_api::meta::finalizers::LEASE;

type Result<T, E = ReconcileError> = std::result::Result<T, E>;

/// The host's boot id (`BOXERY_BOOT_ID` overrides it, for tests that simulate a reboot).
pub fn boot_id() -> String {
    boxery_store::boot_id()
}

/// The token store ([`boxery_home::tokens`]): `$BOXERY_HOME/tokens/<vm>` holds `<lease uid> <token>`
/// (0600) while a lease holds the VM. The proxy accepts only a token found here.
pub fn token_file(ctx: &Ctx, vm: &str) -> std::path::PathBuf {
    boxery_home::layout::token(&ctx.home, vm)
}

/// Whether `token` is the live token of `vm` (what the proxy checks; constant-time).
pub fn token_valid(home: &std::path::Path, vm: &str, token: &str) -> bool {
    boxery_home::tokens::matches(home, vm, token).is_some()
}

/// Revoke the token of the lease `lease_uid` on `vm` (no-op when another lease's token is there).
pub fn revoke_token(ctx: &Ctx, vm: &str, lease_uid: &str) {
    let _ = boxery_home::tokens::revoke(&ctx.home, vm, lease_uid);
}

fn write_token(ctx: &Ctx, vm: &str, lease_uid: &str, token: &str) -> std::io::Result<()> {
    boxery_home::tokens::write(&ctx.home, vm, lease_uid, token)
}

async fn save(ctx: &Ctx, l: &Lease) -> Result<Lease> {
    Ok(ctx.store.update_status_as(l).await?)
}

/// How long a lease lasts. `BOXERY_LEASE_SECOND_MS` (a test knob, default 1000) says how many
/// milliseconds a lease second lasts, so expiry tests need not wait minutes.
fn duration(l: &Lease) -> chrono::Duration {
    let ms: i64 = std::env::var("BOXERY_LEASE_SECOND_MS")
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|v| *v > 0)
        .unwrap_or(1000);
    chrono::Duration::milliseconds(l.spec.lease_duration_seconds as i64 * ms)
}

/// Change member `member`'s record with its resourceVersion as the precondition, if `check`
/// holds. Returns the member's new generation, or `None` when the check failed (fenced out)
/// or the member is gone.
async fn edit_member(
    ctx: &Ctx,
    member: &str,
    check: impl Fn(&MemberStatus) -> bool,
    change: impl Fn(&mut MemberStatus),
) -> Result<Option<u64>> {
    for _ in 0..50 {
        let Some(mut rec) = ctx.store.get_as::<PoolMember>(member).await? else {
            return Ok(None);
        };
        let mut row = MemberStatus::of(&rec);
        if !check(&row) {
            return Ok(None);
        }
        change(&mut row);
        let g = row.generation;
        rec.status = row.record();
        match ctx.store.update_status_as(&rec).await {
            Ok(_) => return Ok(Some(g)),
            Err(StoreError::Conflict { .. }) => continue,
            Err(StoreError::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(e.into()),
        }
    }
    Err(StoreError::Conflict {
        kind: "PoolMember".into(),
        name: member.into(),
        expected: "?".into(),
        actual: "?".into(),
    }
    .into())
}

/// The member lease `uid` claimed in pool `pool`, if any (a claim made by a batch, or before a
/// crash): found in the member cache (or the store), confirmed against the store.
async fn find_claim(ctx: &Ctx, pool: &str, uid: &str) -> Result<Option<PoolMember>> {
    let name = match ctx.pool_caches().filter(|c| c.members.is_ready()) {
        // Only the records whose text names the uid are parsed: this runs on every
        // reconcile of a pending lease, against every member of every pool.
        Some(c) => c
            .members
            .list_containing(uid)
            .iter()
            .find(|o| {
                o.status()["leaseUid"].as_str() == Some(uid)
                    && o.spec()["pool"].as_str() == Some(pool)
            })
            .map(|o| o.metadata.name.clone()),
        None => crate::pool::records(ctx, pool)
            .await?
            .into_iter()
            .find(|m| m.status.lease_uid.as_deref() == Some(uid))
            .map(|m| m.metadata.name),
    };
    let Some(name) = name else { return Ok(None) };
    Ok(ctx
        .store
        .get_as::<PoolMember>(&name)
        .await?
        .filter(|m| m.status.lease_uid.as_deref() == Some(uid) && m.spec.pool == pool))
}

/// End a lease's hold on its member: revoke its token and reset the member, if the member is
/// still this lease's (fenced: its record carries the lease's uid and is held).
async fn let_go(ctx: &Ctx, l: &Lease, why: &str) -> Result<()> {
    let Some(uid) = &l.metadata.uid else {
        return Ok(());
    };
    let vm = match &l.status.vm {
        Some(vm) => vm.clone(),
        None => match find_claim(ctx, &l.spec.pool, uid).await? {
            Some(m) => m.metadata.name,
            None => return Ok(()),
        },
    };
    revoke_token(ctx, &vm, uid);
    // Its grants' entries go before the reset starts (the Grant reconciler then marks them
    // Revoked).
    crate::grant::revoke_lease(ctx, &vm, uid).await?;
    let mine = |m: &MemberStatus| {
        m.lease_uid.as_deref() == Some(uid.as_str())
            && matches!(m.state, MemberState::Acquiring | MemberState::Leased)
    };
    edit_member(ctx, &vm, mine, |m| start_reset(m, why)).await?;
    Ok(())
}

/// Reconcile one Lease, under its finalizer (the controller's [`finalizer`] helper): a
/// deleted lease lets its member go before it is removed.
pub async fn reconcile(lease: Arc<Lease>, ctx: Arc<Ctx>) -> Result<Action> {
    let done = finalizer(
        ctx.store.as_ref(),
        FINALIZER,
        lease,
        async |event| match event {
            FinalizerEvent::Apply(l) => step((*l).clone(), &ctx).await,
            FinalizerEvent::Cleanup(l) => release(&l, &ctx).await,
        },
    )
    .await;
    Ok(done?)
}

/// A released (deleted) lease: it says `Released` first, then its member is reset and goes
/// back to the pool (so no one reads it `Bound` while its VM is another's).
async fn release(l: &Lease, ctx: &Ctx) -> Result<Action> {
    if l.status.phase == LeasePhase::Bound {
        let msg = format!(
            "its lease was released: {} goes back to the pool after a reset",
            l.status.vm.clone().unwrap_or_default()
        );
        return finish(
            l.clone(),
            ctx,
            LeasePhase::Released,
            EventType::Normal,
            reasons::RELEASED,
            &msg,
        )
        .await;
    }
    let_go(ctx, l, "its lease was released").await?;
    Ok(Action::await_change())
}

/// One step, by phase: claim a member, keep a bound lease (renewals, expiry, reboots, a VM
/// gone), or finish an ended one.
async fn step(l: Lease, ctx: &Ctx) -> Result<Action> {
    match l.status.phase {
        LeasePhase::Pending => {
            let uid = l.metadata.uid.clone().unwrap_or_default();
            acquire(l, ctx, &uid).await
        }
        LeasePhase::Bound => bound(l, ctx).await,
        LeasePhase::Expired | LeasePhase::Released | LeasePhase::Lost => ended(l, ctx).await,
    }
}

/// Bound: void after a host reboot; lost when its VM or member is gone; renewals extend it;
/// it ends when it runs out.
async fn bound(mut l: Lease, ctx: &Ctx) -> Result<Action> {
    let generation = l.metadata.generation;
    if l.status.boot_id.as_deref().is_some_and(|b| b != boot_id()) {
        return end(
            l,
            ctx,
            reasons::HOST_REBOOTED,
            "the host rebooted: every lease is void after a reboot",
        )
        .await;
    }
    if let Some(why) = gone(ctx, &l).await? {
        return lost(l, ctx, &why).await;
    }
    // Renewals extend it; an expired lease cannot be renewed (below).
    if let Some(r) = l.spec.renew_time
        && l.status.renewed.is_none_or(|done| r > done)
        && l.status.expire_time.is_some_and(|e| r <= e)
    {
        l.status.renewed = Some(r);
        l.status.expire_time = Some(r.max(now()) + duration(&l));
        l.status.observed_generation = generation;
        l = save(ctx, &l).await?;
    }
    let left = l.status.expire_time.unwrap_or_else(now) - now();
    if left <= chrono::Duration::zero() {
        return end(
            l,
            ctx,
            reasons::LEASE_EXPIRED,
            "the lease ran out without renewal",
        )
        .await;
    }
    // what it used, and its budgets (crate::budget)
    let (changed, check) = crate::budget::lease(ctx, &mut l).await;
    if changed {
        save(ctx, &l).await?;
    }
    Ok(Action::requeue(
        left.to_std().unwrap_or(Duration::from_secs(1)).min(check),
    ))
}

/// Why a bound lease holds nothing any more, if it does not: its VM is gone, or its member no
/// longer carries it (it left the pool, or was taken back). A pool whose member table is
/// still being moved to records is not judged.
async fn gone(ctx: &Ctx, l: &Lease) -> Result<Option<String>> {
    let (Some(vm), Some(uid)) = (&l.status.vm, &l.metadata.uid) else {
        return Ok(Some("the lease records no VM".into()));
    };
    let rec = ctx.store.get_as::<PoolMember>(vm).await?;
    let mine = rec.as_ref().is_some_and(|m| {
        m.status.lease_uid.as_deref() == Some(uid.as_str())
            && matches!(m.status.state, MemberState::Acquiring | MemberState::Leased)
    });
    if !mine {
        if rec.is_none()
            && ctx
                .store
                .get_as::<Pool>(&l.spec.pool)
                .await?
                .is_some_and(|p| !p.status.members.is_empty())
        {
            return Ok(None);
        }
        return Ok(Some(format!(
            "{vm} is no longer held by this lease (it left pool {})",
            l.spec.pool
        )));
    }
    if ctx
        .store
        .get(&ObjectRef::of::<boxery_api::Vm>(vm.as_str()))
        .await?
        .is_none()
    {
        return Ok(Some(format!("VM {vm} is gone")));
    }
    Ok(None)
}

/// Ended (expired, released, lost): the member is let go (again: a no-op once it is), and a
/// renewal asked for after the end is refused, once. A lease ended from outside (its status
/// set to `Expired` or `Lost` by another part of boxery) ends here: token revoked, member
/// reset.
async fn ended(mut l: Lease, ctx: &Ctx) -> Result<Action> {
    let generation = l.metadata.generation;
    let why = l
        .status
        .conditions
        .get_condition(READY)
        .map(|c| c.message.clone())
        .filter(|m| !m.is_empty())
        .unwrap_or_else(|| "its lease ended".into());
    let_go(ctx, &l, &why).await?;
    if let (Some(r), Some(e)) = (l.spec.renew_time, l.status.expire_time)
        && r > e
    {
        let msg = format!(
            "the lease expired at {e}; an expired lease cannot be renewed: `boxery lease release {}` and acquire a new one",
            l.name()
        );
        if l.status.conditions.set_condition(
            conditions::RENEWED,
            ConditionStatus::False,
            reasons::RENEW_REFUSED,
            &msg,
            generation,
        ) {
            save(ctx, &l).await?;
        }
    }
    Ok(Action::await_change())
}

async fn end(l: Lease, ctx: &Ctx, reason: &str, msg: &str) -> Result<Action> {
    finish(l, ctx, LeasePhase::Expired, EventType::Normal, reason, msg).await
}

/// A bound lease whose VM or member is gone: `Lost`, with a Warning event.
async fn lost(l: Lease, ctx: &Ctx, msg: &str) -> Result<Action> {
    let msg = format!("{msg}: the lease holds nothing; release it and acquire a new one");
    finish(
        l,
        ctx,
        LeasePhase::Lost,
        EventType::Warning,
        reasons::VM_LOST,
        &msg,
    )
    .await
}

async fn finish(
    mut l: Lease,
    ctx: &Ctx,
    phase: LeasePhase,
    type_: EventType,
    reason: &str,
    msg: &str,
) -> Result<Action> {
    let generation = l.metadata.generation;
    // Ended first, then its member let go: no one reads it `Bound` while its VM is another's.
    // A let-go that fails is done again by `ended`.
    crate::budget::lease_final(ctx, &mut l).await;
    l.status.phase = phase;
    l.status
        .conditions
        .set_condition(READY, ConditionStatus::False, reason, msg, generation);
    let l = save(ctx, &l).await?;
    let_go(ctx, &l, msg).await?;
    ctx.event(&l, type_, reason, msg).await;
    Ok(Action::await_change())
}

/// End lease `name` now, from outside the lease controller (`delete --force` of its VM or
/// pool; a caller that decided the lease is void): its status becomes `phase` (an ended one)
/// with `Ready=False` `reason`/`message` (resourceVersion precondition, re-read on a
/// conflict), its token is revoked and its member moved to Resetting (fenced), and an event
/// says why. A lease already ended is left as it is. Works with no controller running; the
/// Lease reconciler finishes the same way if it runs first (see [`ended`]).
pub async fn end_now(
    store: &dyn boxery_store::ObjectStore,
    home: &std::path::Path,
    recorder: &boxery_controller::Recorder,
    name: &str,
    phase: LeasePhase,
    reason: &str,
    message: &str,
) -> Result<bool> {
    debug_assert!(phase.ended());
    for _ in 0..20 {
        let Some(mut l) = store.get_as::<Lease>(name).await? else {
            return Ok(false);
        };
        if l.status.phase.ended() {
            return Ok(false);
        }
        let generation = l.metadata.generation;
        l.status.phase = phase;
        l.status.conditions.set_condition(
            READY,
            ConditionStatus::False,
            reason,
            message,
            generation,
        );
        let l = match store.update_status_as(&l).await {
            Ok(l) => l,
            Err(StoreError::Conflict { .. }) => continue,
            Err(e) => return Err(e.into()),
        };
        if let (Some(vm), Some(uid)) = (&l.status.vm, &l.metadata.uid) {
            let _ = boxery_home::tokens::revoke(home, vm, uid);
            // Its grants' entries too, before the member's reset.
            boxery_home::grants::remove_entries(home, vm, |e| e.lease_uid.as_deref() == Some(uid))
                .map_err(|e| {
                    ReconcileError::backend(
                        "grant-state",
                        format!("Lease/{name}"),
                        boxery_backends::BackendError::io("revoking the lease's grants", e),
                    )
                })?;
            for _ in 0..20 {
                let Some(mut rec) = store.get_as::<PoolMember>(vm).await? else {
                    break;
                };
                let mut row = MemberStatus::of(&rec);
                if row.lease_uid.as_deref() != Some(uid.as_str())
                    || !matches!(row.state, MemberState::Acquiring | MemberState::Leased)
                {
                    break;
                }
                start_reset(&mut row, message);
                rec.status = row.record();
                match store.update_status_as(&rec).await {
                    Ok(_) | Err(StoreError::NotFound { .. }) => break,
                    Err(StoreError::Conflict { .. }) => continue,
                    Err(e) => return Err(e.into()),
                }
            }
        }
        recorder
            .publish(
                &boxery_controller::events::involved(&l),
                EventType::Warning,
                reason,
                message,
            )
            .await;
        return Ok(true);
    }
    Err(StoreError::Conflict {
        kind: "Lease".into(),
        name: name.into(),
        expected: "?".into(),
        actual: "?".into(),
    }
    .into())
}

async fn waiting(
    mut l: Lease,
    ctx: &Ctx,
    reason: &str,
    msg: &str,
    again: Option<Duration>,
) -> Result<Action> {
    let generation = l.metadata.generation;
    if l.status
        .conditions
        .set_condition(READY, ConditionStatus::False, reason, msg, generation)
    {
        l.status.observed_generation = generation;
        save(ctx, &l).await?;
    }
    Ok(again
        .map(Action::requeue)
        .unwrap_or_else(Action::await_change))
}

fn token_error(l: &Lease, e: std::io::Error) -> ReconcileError {
    ReconcileError::backend(
        "token",
        format!("Lease/{}", l.name()),
        boxery_backends::BackendError::io("writing the token store", e),
    )
}

async fn acquire(mut l: Lease, ctx: &Ctx, uid: &str) -> Result<Action> {
    let pool_name = l.spec.pool.clone();
    let Some(pool) = ctx.store.get_as::<Pool>(&pool_name).await? else {
        return waiting(
            l,
            ctx,
            reasons::POOL_NOT_FOUND,
            &format!("pool {pool_name} does not exist: `boxery get pools` lists them"),
            Some(Duration::from_secs(5)),
        )
        .await;
    };
    if !pool.status.members.is_empty() {
        return waiting(
            l,
            ctx,
            reasons::POOL_UPGRADING,
            &format!("pool {pool_name}'s member table is being moved to PoolMember records"),
            Some(Duration::from_secs(1)),
        )
        .await;
    }
    if l.spec.lease_duration_seconds > pool.spec.lease.max_ttl_seconds {
        let msg = format!(
            "leaseDurationSeconds {} is over pool {pool_name}'s maximum of {}: ask for less",
            l.spec.lease_duration_seconds, pool.spec.lease.max_ttl_seconds
        );
        return waiting(l, ctx, reasons::DURATION_TOO_LONG, &msg, None).await;
    }
    // A member already claimed for this lease (by a batch, or before a crash) is resumed.
    let member = match find_claim(ctx, &pool_name, uid).await? {
        Some(m) => m,
        None => {
            // Claims on one pool are made one batch at a time (a lock per pool in this
            // process; each member's precondition still fences any other writer): whoever
            // takes the lock assigns free members to the waiting leases, oldest first.
            let lock = ctx.vm_lock(&format!("pool:{pool_name}"));
            let _held = lock.lock().await;
            match claim_batch(ctx, &pool, &l, uid).await? {
                Some(m) => m,
                None => {
                    let s = pool.status;
                    return waiting(
                        l,
                        ctx,
                        reasons::NO_FREE_MEMBER,
                        &format!(
                            "waiting for a free member of pool {pool_name} ({} leased, {} resetting, {} broken of {})",
                            s.leased, s.resetting, s.broken, s.replicas
                        ),
                        Some(Duration::from_secs(5)),
                    ).await;
                }
            }
        }
    };
    let vm = member.metadata.name.clone();
    l.status.vm = Some(vm.clone());
    l.status.member_generation = Some(member.status.generation);
    l.status.pool_epoch = Some(pool.status.epoch);
    match member.status.state {
        MemberState::Acquiring => {
            // Recorded first, so `lease get` shows which VM is being prepared.
            l = save(ctx, &l).await?;
            // Token first, then keys: the holder never has the VM without its own token.
            let token = boxery_backends::identity::proxy_token();
            write_token(ctx, &vm, uid, &token).map_err(|e| token_error(&l, e))?;
            install(ctx, &vm, &token, &l.spec.public_key)
                .await
                .map_err(|e| {
                    ReconcileError::backend("install", format!("Lease/{}", l.name()), e)
                })?;
            let g = member.status.generation;
            let luid = uid.to_string();
            let moved = edit_member(
                ctx,
                &vm,
                |m| {
                    m.lease_uid.as_deref() == Some(luid.as_str())
                        && m.generation == g
                        && m.state == MemberState::Acquiring
                },
                |m| {
                    m.state = MemberState::Leased;
                    m.generation += 1;
                },
            )
            .await?;
            let Some(g) = moved else {
                // Fenced out (the member was reset or removed meanwhile): start over.
                l.status.vm = None;
                l.status.member_generation = None;
                save(ctx, &l).await?;
                return Ok(Action::requeue(Duration::ZERO));
            };
            l.status.member_generation = Some(g);
        }
        MemberState::Leased => {
            if boxery_home::tokens::read(&ctx.home, &vm).is_none_or(|(owner, _)| owner != uid) {
                let token = boxery_backends::identity::proxy_token();
                write_token(ctx, &vm, uid, &token).map_err(|e| token_error(&l, e))?;
            }
        }
        _ => return Ok(Action::requeue(Duration::ZERO)),
    }
    let t: Time = now();
    let generation = l.metadata.generation;
    l.status.phase = LeasePhase::Bound;
    l.status.acquire_time = Some(t);
    l.status.expire_time = Some(t + duration(&l));
    l.status.renewed = l.spec.renew_time;
    l.status.boot_id = Some(boot_id());
    l.status.lease_transitions += 1;
    l.status.observed_generation = generation;
    l.status.conditions.set_condition(
        READY,
        ConditionStatus::True,
        reasons::BOUND,
        &format!("holding {vm}: `boxery ssh {vm}`"),
        generation,
    );
    let l = save(ctx, &l).await?;
    ctx.event(
        &l,
        EventType::Normal,
        "Bound",
        &format!(
            "{} holds {vm} until {}",
            l.spec.holder_identity,
            l.status
                .expire_time
                .map(|e| e.to_string())
                .unwrap_or_default()
        ),
    )
    .await;
    let exp = l.status.expire_time.unwrap_or_else(now) - now();
    Ok(Action::requeue(
        exp.to_std()
            .unwrap_or(Duration::from_secs(1))
            .min(Duration::from_secs(300)),
    ))
}

/// The leases of pool `pool` waiting for a member, oldest first (the lease cache when kept).
async fn waiting_leases(ctx: &Ctx, pool: &Pool) -> Result<Vec<Lease>> {
    let name = pool.name();
    let max = pool.spec.lease.max_ttl_seconds;
    let all: Vec<Lease> = match ctx.pool_caches().filter(|c| c.leases.is_ready()) {
        Some(c) => c
            .leases
            .list_containing(&crate::pool::pool_needle(name))
            .iter()
            .filter(|o| {
                o.spec()["pool"].as_str() == Some(name)
                    && o.status()["phase"].as_str().is_none_or(|p| p == "Pending")
                    && !o.metadata.is_deleting()
            })
            .filter_map(|o| o.to_typed().ok())
            .collect(),
        None => ctx.store.list_as::<Lease>(&Default::default()).await?,
    };
    let mut waiting: Vec<Lease> = all
        .into_iter()
        .filter(|w| {
            w.spec.pool == name
                && w.status.phase == LeasePhase::Pending
                && !w.metadata.is_deleting()
                && w.spec.lease_duration_seconds <= max
        })
        .collect();
    waiting.sort_by(|a, b| {
        a.metadata
            .creation_timestamp
            .cmp(&b.metadata.creation_timestamp)
            .then(a.metadata.name.cmp(&b.metadata.name))
    });
    Ok(waiting)
}

/// Assign free members of `pool` to its waiting leases, oldest first, one small record
/// update each (its resourceVersion the precondition: a member taken meanwhile is skipped);
/// returns the member given to lease `uid` (if any). Backends without sshd have nothing to
/// install, so their members go straight to Leased.
async fn claim_batch(
    ctx: &Ctx,
    pool: &Pool,
    this: &Lease,
    uid: &str,
) -> Result<Option<PoolMember>> {
    if let Some(m) = find_claim(ctx, pool.name(), uid).await? {
        return Ok(Some(m));
    }
    let direct = ctx.ssh.is_none();
    let records = crate::pool::records(ctx, pool.name()).await?;
    let mut free: Vec<PoolMember> = records
        .iter()
        .filter(|m| m.status.state == MemberState::Free && !m.metadata.is_deleting())
        .cloned()
        .collect();
    if free.is_empty() {
        return Ok(None);
    }
    free.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    let claimed: std::collections::HashSet<&str> = records
        .iter()
        .filter_map(|m| m.status.lease_uid.as_deref())
        .collect();
    let mut waiting: Vec<Lease> = waiting_leases(ctx, pool)
        .await?
        .into_iter()
        .filter(|w| {
            w.metadata
                .uid
                .as_deref()
                .is_some_and(|u| !claimed.contains(u))
        })
        .collect();
    // The lease being reconciled waits, whether or not the lease cache has seen it yet (a
    // lease just written is reconciled before the cache of every lease may hold it): left
    // out, it would find no member and wait for its next look.
    if !waiting
        .iter()
        .any(|w| w.metadata.uid.as_deref() == Some(uid))
    {
        waiting.push(this.clone());
        waiting.sort_by(|a, b| {
            a.metadata
                .creation_timestamp
                .cmp(&b.metadata.creation_timestamp)
                .then(a.metadata.name.cmp(&b.metadata.name))
        });
    }
    let mut mine = None;
    let mut free = free.into_iter();
    'leases: for w in &waiting {
        for mut m in free.by_ref() {
            let mut row = MemberStatus::of(&m);
            row.state = if direct {
                MemberState::Leased
            } else {
                MemberState::Acquiring
            };
            row.generation += 1;
            row.lease = Some(w.metadata.name.clone());
            row.lease_uid = w.metadata.uid.clone();
            row.message = String::new();
            m.status = row.record();
            match ctx.store.update_status_as(&m).await {
                Ok(m) => {
                    if w.metadata.uid.as_deref() == Some(uid) {
                        mine = Some(m);
                    }
                    continue 'leases;
                }
                // Taken or changed meanwhile: try the next free member for this lease.
                Err(StoreError::Conflict { .. } | StoreError::NotFound { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        break;
    }
    Ok(mine)
}

/// Write the token, then `authorized_keys` = the control plane's lines (its key and user
/// certificate authority) + the holder's key, in the
/// guest (over ssh with the pinned key). Backends without sshd (fake) have nothing to install.
async fn install(
    ctx: &Ctx,
    vm: &str,
    token: &str,
    holder_key: &str,
) -> Result<(), boxery_backends::BackendError> {
    let Some(ssh) = &ctx.ssh else { return Ok(()) };
    let fail = |m: String| boxery_backends::BackendError::failed("install", m);
    let cp_lines = ssh.authorized_lines().map_err(|e| fail(e.to_string()))?;
    // This VM's ssh files only (one read, O(1) in the number of VMs).
    let v = ctx.store.get_as::<boxery_api::Vm>(vm).await.ok().flatten();
    let target = v.as_ref().and_then(crate::ssh::Target::of);
    let target = target.ok_or_else(|| fail(format!("VM {vm} has no ssh endpoint yet")))?;
    ssh.write(&target).map_err(|e| fail(e.to_string()))?;
    let q = |s: &str| format!("'{}'", s.replace('\'', "'\\''"));
    let script = format!(
        "set -e; umask 077; mkdir -p ~/.boxery ~/.ssh; printf '%s\\n' {} > ~/.boxery/token.tmp; mv -f ~/.boxery/token.tmp ~/.boxery/token; \
         printf '%s\\n' {} {} > ~/.ssh/authorized_keys.tmp; mv -f ~/.ssh/authorized_keys.tmp ~/.ssh/authorized_keys",
        q(token),
        cp_lines
            .iter()
            .map(|l| q(l.trim()))
            .collect::<Vec<_>>()
            .join(" "),
        q(holder_key.trim())
    );
    let out = ssh
        .command(vm)
        .args(["-T", "-o", "BatchMode=yes", "--", &script])
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|e| fail(format!("cannot run ssh: {e}")))?;
    if !out.status.success() {
        return Err(fail(format!(
            "installing the holder's key in {vm} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    // The proxy's address, the lease's token and the lease's grants, before `Bound`.
    if let Some(v) = &v {
        crate::guest::sync(ctx, v)
            .await
            .map_err(|e| fail(format!("pushing the lease's grants to {vm} failed: {e}")))?;
    }
    Ok(())
}

/// Map a Pool change to its pending leases: every one waiting on the pool itself (for it to
/// exist, to finish moving its member table, or to allow its duration), and the four oldest
/// waiting for a free member. Not every waiting lease: the pool's status changes with every
/// claim, and waking a thousand waiting leases for each made claims quadratic. The oldest
/// waiters' batch ([`claim_batch`]) assigns every free member to every waiting lease, oldest
/// first; a member turning Free wakes the oldest too ([`crate::pool::follow_members`]); and
/// each waiting lease looks again within 5 s.
pub fn leases_for_pool(
    leases: &boxery_controller::Cache,
    pool: &boxery_api::DynObject,
) -> Vec<String> {
    let on_the_pool = [
        reasons::POOL_NOT_FOUND,
        reasons::POOL_UPGRADING,
        reasons::DURATION_TOO_LONG,
    ];
    let mut pending: Vec<Arc<boxery_api::DynObject>> = leases
        .list_containing(&crate::pool::pool_needle(&pool.metadata.name))
        .into_iter()
        .filter(|l| {
            l.spec()["pool"].as_str() == Some(pool.metadata.name.as_str())
                && l.status()["phase"].as_str().is_none_or(|p| p == "Pending")
        })
        .collect();
    pending.sort_by(|a, b| {
        (a.metadata.creation_timestamp, &a.metadata.name)
            .cmp(&(b.metadata.creation_timestamp, &b.metadata.name))
    });
    let mut oldest = 0;
    pending
        .iter()
        .filter(|l| {
            let on_pool = l.status()["conditions"]
                .as_array()
                .and_then(|cs| cs.iter().find(|c| c["type"] == READY))
                .is_some_and(|c| {
                    c["reason"]
                        .as_str()
                        .is_some_and(|r| on_the_pool.contains(&r))
                });
            on_pool || {
                oldest += 1;
                oldest <= 4
            }
        })
        .map(|l| l.metadata.name.clone())
        .collect()
}

/// Map a Vm change to the lease its member record names: the lease looks at its VM again (a
/// VM gone makes it `Lost`). A removal is seen as a change of the last copy, so every change
/// of a held member's VM is mapped (they are rare: a leased VM is steady).
pub fn lease_of_vm(members: &boxery_controller::Cache, vm: &boxery_api::DynObject) -> Vec<String> {
    members
        .get(&vm.metadata.name)
        .and_then(|m| m.status()["lease"].as_str().map(str::to_string))
        .into_iter()
        .collect()
}

/// The kind's name, for wiring.
pub const KIND: &str = Lease::INFO.kind;
