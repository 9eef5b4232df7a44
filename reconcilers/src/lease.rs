//! The `Lease` reconciler: claims a free pool member, installs the holder's key and a fresh
//! token, expires, renews, and hands the member back for a reset when the lease ends.
//!
//! # Guarantees
//! - A claim is one update of the Pool's status with a resourceVersion precondition: of
//!   concurrent claims on one member exactly one wins; the others retry on another member.
//! - Fencing: the lease records the member's generation and the pool's epoch when it claims.
//!   It moves the member on (Acquiring → Leased, → Resetting) only while the member still
//!   carries its uid and that generation, so a stale reconcile never acts on a newer lease.
//! - Before `Bound`: a fresh token is written into the guest (and recorded, 0600, in
//!   `$BOXERY_HOME/tokens/<vm>`), then `authorized_keys` is set to the control plane's key
//!   plus the holder's key only.
//! - Every end (delete = release, expiry, host reboot) puts the member in `Resetting`, which
//!   revokes the token first. An expired lease cannot be renewed. Deadlines are tied to the
//!   host's boot id: after a reboot every lease is void.

use std::sync::Arc;
use std::time::Duration;

use boxery_api::conditions::{self, READY, reasons};
use boxery_api::lease::LeasePhase;
use boxery_api::pool::MemberState;
use boxery_api::{ConditionStatus, Conditions, EventType, Lease, Pool, Resource, Time, now};
use boxery_controller::{Action, FinalizerEvent, finalizer};
use boxery_store::StoreError;

use boxery_store::ObjectStoreExt;

use crate::context::Ctx;
use crate::error::ReconcileError;
use crate::pool::start_reset;

/// The Lease finalizer.
pub const FINALIZER: &str = boxery_api::meta::finalizers::LEASE;

type Result<T, E = ReconcileError> = std::result::Result<T, E>;

/// The host's boot id (`BOXERY_BOOT_ID` overrides it, for tests that simulate a reboot).
pub fn boot_id() -> String {
    std::env::var("BOXERY_BOOT_ID")
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok())
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// The token store: `$BOXERY_HOME/tokens/<vm>` holds `<lease uid> <token>` (0600) while a
/// lease holds the VM. The proxy (a later issue) accepts only a token found here.
pub fn token_file(ctx: &Ctx, vm: &str) -> std::path::PathBuf {
    ctx.home.join("tokens").join(vm)
}

/// Whether `token` is the live token of `vm` (what the proxy will check).
pub fn token_valid(home: &std::path::Path, vm: &str, token: &str) -> bool {
    std::fs::read_to_string(home.join("tokens").join(vm))
        .is_ok_and(|s| s.split_whitespace().nth(1) == Some(token))
}

/// Revoke the token of the lease `lease_uid` on `vm` (no-op when another lease's token is there).
pub fn revoke_token(ctx: &Ctx, vm: &str, lease_uid: &str) {
    let f = token_file(ctx, vm);
    if std::fs::read_to_string(&f).is_ok_and(|s| s.split_whitespace().next() == Some(lease_uid)) {
        let _ = std::fs::remove_file(&f);
    }
}

fn write_token(ctx: &Ctx, vm: &str, lease_uid: &str, token: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let f = token_file(ctx, vm);
    std::fs::create_dir_all(f.parent().expect("a parent"))?;
    let tmp = f.with_extension("tmp");
    let mut w = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    w.write_all(format!("{lease_uid} {token}\n").as_bytes())?;
    std::fs::rename(tmp, f)
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

/// Change one member of `pool_name` with a resourceVersion precondition, if `check` holds.
/// Returns the member's new generation, or `None` when the check failed (fenced out).
async fn edit_member(
    ctx: &Ctx,
    pool_name: &str,
    member: &str,
    check: impl Fn(&boxery_api::pool::MemberStatus) -> bool,
    change: impl Fn(&mut boxery_api::pool::MemberStatus),
) -> Result<Option<u64>> {
    for _ in 0..50 {
        let Some(mut pool) = ctx.store.get_as::<Pool>(pool_name).await? else {
            return Ok(None);
        };
        let Some(m) = pool.status.members.iter_mut().find(|m| m.name == member) else {
            return Ok(None);
        };
        if !check(m) {
            return Ok(None);
        }
        change(m);
        let g = m.generation;
        match ctx.store.update_status_as(&pool).await {
            Ok(_) => return Ok(Some(g)),
            Err(StoreError::Conflict { .. }) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(StoreError::Conflict {
        kind: "Pool".into(),
        name: pool_name.into(),
        expected: "?".into(),
        actual: "?".into(),
    }
    .into())
}

/// End a lease's hold on its member: reset it, if the member is still this lease's.
async fn let_go(ctx: &Ctx, l: &Lease, why: &str) -> Result<()> {
    let (Some(vm), Some(uid)) = (&l.status.vm, &l.metadata.uid) else {
        return Ok(());
    };
    revoke_token(ctx, vm, uid);
    let mine = |m: &boxery_api::pool::MemberStatus| {
        m.lease_uid.as_deref() == Some(uid.as_str())
            && matches!(m.state, MemberState::Acquiring | MemberState::Leased)
    };
    edit_member(ctx, &l.spec.pool, vm, mine, |m| start_reset(m, why)).await?;
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

/// A released (deleted) lease: its member is reset and goes back to the pool.
async fn release(l: &Lease, ctx: &Ctx) -> Result<Action> {
    let_go(ctx, l, "its lease was released").await?;
    if l.status.phase == LeasePhase::Bound {
        ctx.event(
            l,
            EventType::Normal,
            "Released",
            &format!(
                "{} goes back to the pool after a reset",
                l.status.vm.clone().unwrap_or_default()
            ),
        )
        .await;
    }
    Ok(Action::await_change())
}

/// One step, by phase: claim a member, keep a bound lease (renewals, expiry, reboots), or
/// refuse to renew an ended one.
async fn step(l: Lease, ctx: &Ctx) -> Result<Action> {
    match l.status.phase {
        LeasePhase::Pending => {
            let uid = l.metadata.uid.clone().unwrap_or_default();
            acquire(l, ctx, &uid).await
        }
        LeasePhase::Bound => bound(l, ctx).await,
        LeasePhase::Expired | LeasePhase::Released => ended(l, ctx).await,
    }
}

/// Bound: void after a host reboot; renewals extend it; it ends when it runs out.
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
    Ok(Action::requeue(
        left.to_std()
            .unwrap_or(Duration::from_secs(1))
            .min(Duration::from_secs(300)),
    ))
}

/// Expired or released: a renewal asked for after the end is refused, once.
async fn ended(mut l: Lease, ctx: &Ctx) -> Result<Action> {
    let generation = l.metadata.generation;
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

async fn end(mut l: Lease, ctx: &Ctx, reason: &str, msg: &str) -> Result<Action> {
    let generation = l.metadata.generation;
    let_go(ctx, &l, msg).await?;
    l.status.phase = LeasePhase::Expired;
    l.status
        .conditions
        .set_condition(READY, ConditionStatus::False, reason, msg, generation);
    let l = save(ctx, &l).await?;
    ctx.event(&l, EventType::Normal, reason, msg).await;
    Ok(Action::await_change())
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
    if l.spec.lease_duration_seconds > pool.spec.lease.max_ttl_seconds {
        let msg = format!(
            "leaseDurationSeconds {} is over pool {pool_name}'s maximum of {}: ask for less",
            l.spec.lease_duration_seconds, pool.spec.lease.max_ttl_seconds
        );
        return waiting(l, ctx, reasons::DURATION_TOO_LONG, &msg, None).await;
    }
    // A member already claimed by this lease (a crash after the claim) is resumed.
    let mine = pool
        .status
        .members
        .iter()
        .find(|m| m.lease_uid.as_deref() == Some(uid))
        .cloned();
    let member = match mine {
        Some(m) => m,
        None => {
            // Claims on one pool are made one batch at a time (a lock per pool in this
            // process; the store's precondition still fences any other writer): whoever takes
            // the lock assigns free members to every waiting lease, oldest first, in one write.
            let lock = ctx.vm_lock(&format!("pool:{pool_name}"));
            let _held = lock.lock().await;
            match claim_batch(ctx, &pool_name, uid).await? {
                Some(m) => m,
                None => {
                    let s = ctx
                        .store
                        .get_as::<Pool>(&pool_name)
                        .await?
                        .map(|p| p.status)
                        .unwrap_or_default();
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
    let vm = member.name.clone();
    if l.status.vm.as_deref() != Some(&vm) {
        l.status.vm = Some(vm.clone());
        l.status.member_generation = Some(member.generation);
        l.status.pool_epoch = Some(pool.status.epoch);
        l = save(ctx, &l).await?;
    }
    if member.state == MemberState::Acquiring {
        // Token first, then keys: the holder never has the VM without its own token.
        let token = boxery_backends::identity::proxy_token();
        write_token(ctx, &vm, uid, &token).map_err(|e| {
            ReconcileError::backend(
                "token",
                format!("Lease/{}", l.name()),
                boxery_backends::BackendError::io("writing the token store", e),
            )
        })?;
        install(ctx, &vm, &token, &l.spec.public_key)
            .await
            .map_err(|e| ReconcileError::backend("install", format!("Lease/{}", l.name()), e))?;
        let g = member.generation;
        let luid = uid.to_string();
        let moved = edit_member(
            ctx,
            &pool_name,
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
    } else if member.state == MemberState::Leased {
        if !std::fs::read_to_string(token_file(ctx, &vm))
            .is_ok_and(|t| t.split_whitespace().next() == Some(uid))
        {
            let token = boxery_backends::identity::proxy_token();
            write_token(ctx, &vm, uid, &token).map_err(|e| {
                ReconcileError::backend(
                    "token",
                    format!("Lease/{}", l.name()),
                    boxery_backends::BackendError::io("writing the token store", e),
                )
            })?;
        }
    } else {
        l.status.vm = None;
        save(ctx, &l).await?;
        return Ok(Action::requeue(Duration::ZERO));
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

/// Assign free members of `pool_name` to its waiting leases, oldest first, in one status
/// update; returns the member given to lease `uid` (if any). Backends without sshd have
/// nothing to install, so their members go straight to Leased.
async fn claim_batch(
    ctx: &Ctx,
    pool_name: &str,
    uid: &str,
) -> Result<Option<boxery_api::pool::MemberStatus>> {
    let direct = ctx.ssh.is_none();
    for _ in 0..50 {
        let Some(mut pool) = ctx.store.get_as::<Pool>(pool_name).await? else {
            return Ok(None);
        };
        if let Some(m) = pool
            .status
            .members
            .iter()
            .find(|m| m.lease_uid.as_deref() == Some(uid))
        {
            return Ok(Some(m.clone()));
        }
        if crate::pool::free_member(&pool).is_none() {
            return Ok(None);
        }
        let claimed: std::collections::HashSet<String> = pool
            .status
            .members
            .iter()
            .filter_map(|m| m.lease_uid.clone())
            .collect();
        let mut waiting: Vec<Lease> = ctx
            .store
            .list_as::<Lease>(&Default::default())
            .await?
            .into_iter()
            .filter(|w| {
                w.spec.pool == pool_name
                    && w.status.phase == LeasePhase::Pending
                    && !w.metadata.is_deleting()
                    && w.metadata
                        .uid
                        .as_ref()
                        .is_some_and(|u| !claimed.contains(u))
                    && w.spec.lease_duration_seconds <= pool.spec.lease.max_ttl_seconds
            })
            .collect();
        waiting.sort_by(|a, b| {
            a.metadata
                .creation_timestamp
                .cmp(&b.metadata.creation_timestamp)
                .then(a.metadata.name.cmp(&b.metadata.name))
        });
        let mut mine = None;
        let mut next = waiting.iter();
        for m in pool
            .status
            .members
            .iter_mut()
            .filter(|m| m.state == MemberState::Free)
        {
            let Some(w) = next.next() else { break };
            m.state = if direct {
                MemberState::Leased
            } else {
                MemberState::Acquiring
            };
            m.generation += 1;
            m.lease = Some(w.metadata.name.clone());
            m.lease_uid = w.metadata.uid.clone();
            m.message = String::new();
            if w.metadata.uid.as_deref() == Some(uid) {
                mine = Some(m.clone());
            }
        }
        match ctx.store.update_status_as(&pool).await {
            Ok(_) => return Ok(mine),
            Err(StoreError::Conflict { .. }) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(None)
}

/// Write the token, then `authorized_keys` = the control plane's key + the holder's, in the
/// guest (over ssh with the pinned key). Backends without sshd (fake) have nothing to install.
async fn install(
    ctx: &Ctx,
    vm: &str,
    token: &str,
    holder_key: &str,
) -> Result<(), boxery_backends::BackendError> {
    let Some(ssh) = &ctx.ssh else { return Ok(()) };
    let fail = |m: String| boxery_backends::BackendError::failed("install", m);
    let cp_key = ssh.public_key().map_err(|e| fail(e.to_string()))?;
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
        q(cp_key.trim()),
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
    Ok(())
}

/// Map a Pool change to its pending leases.
pub fn leases_for_pool(
    leases: &boxery_controller::Cache,
    pool: &boxery_api::DynObject,
) -> Vec<String> {
    leases
        .list()
        .iter()
        .filter(|l| {
            l.spec()["pool"].as_str() == Some(pool.metadata.name.as_str())
                && l.status()["phase"].as_str().is_none_or(|p| p == "Pending")
        })
        .map(|l| l.metadata.name.clone())
        .collect()
}

/// The kind's name, for wiring.
pub const KIND: &str = Lease::INFO.kind;
