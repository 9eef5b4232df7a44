//! `status.usage` and budgets (docs/pools.md, "Budgets"; docs/observability.md, "Usage").
//!
//! - Each Vm, Lease and Pool carries what it used in `status.usage`, read from the usage
//!   ledger (`boxery_home::usage`) by its own controller: a Vm since it was made, a Lease over
//!   its life, a Pool this UTC month. Written when it changed by what a person reads and at most
//!   every [`REFRESH_EVERY`], so usage does not flood the store or its watchers.
//! - A Lease's budget (`spec.budget`, else its pool's `spec.lease.budget`) and a Pool's
//!   monthly budget (`spec.budget`) are checked every [`CHECK_EVERY`] while they can be spent.
//!   Past 80 % of a limit a Warning `BudgetNear` is said once; at 100 % the object gets
//!   `BudgetExhausted=True` with a Warning of the same name, and a pool's exhaustion is passed
//!   to each of its bound leases. The Vm reconciler holds a leased VM whose lease says
//!   `BudgetExhausted=True` suspended (stopped where the backend keeps no memory) and says so
//!   in its own condition; once the budget is raised, the month ends or the lease ends, the
//!   condition turns `False` and the VM runs again (a resume: its processes carry on).
//!
//! # Caveats
//! - Compute is sampled every 10 s and a budget checked every [`CHECK_EVERY`]: a VM can pass
//!   its budget by what it uses in that time. Tokens are counted when each request ends.
//! - A pool's budget counts what its leases used: a free member running between leases is
//!   charged to itself, not to the pool.

use std::time::Duration;

use boxery_api::conditions::{BUDGET_EXHAUSTED, reasons};
use boxery_api::meta::{Condition, ConditionStatus, Conditions, Time};
use boxery_api::usage::{Budget, Limit, LlmUsage, Usage, exhausted};
use boxery_api::{EventType, Lease, Pool, Resource, Vm};
use boxery_home::usage::{HOUR, Scope, hour_of, next_month, periods};
use boxery_store::ObjectStoreExt;

use crate::context::Ctx;

/// How often an object's `status.usage` is written at most (sooner when a budget's state
/// changes).
pub const REFRESH_EVERY: Duration = Duration::from_secs(60);

/// How often a running VM's `status.usage` is refreshed.
pub const VM_REFRESH_EVERY: Duration = Duration::from_secs(300);

/// How often a budget that can be spent is checked.
pub const CHECK_EVERY: Duration = Duration::from_secs(15);

/// The share of a limit past which `BudgetNear` is said.
pub const NEAR: f64 = 0.8;

/// What `scope` used from `since` (an instant: counted from its hour) on, from the ledger;
/// `None` when there is no ledger or it cannot be read (said in the log).
async fn read(ctx: &Ctx, scope: Scope, since: Time) -> Option<Usage> {
    let ledger = ctx.ledger()?;
    let from = hour_of(since.timestamp());
    let read = tokio::task::spawn_blocking(move || ledger.totals(&scope, from))
        .await
        .map_err(std::io::Error::other)
        .and_then(|r| r);
    let t = match read {
        Ok(t) => t,
        Err(e) => {
            tracing::warn!(error = %e, "reading usage failed");
            return None;
        }
    };
    let hours = |s: f64| s / HOUR as f64;
    Some(Usage {
        since: chrono::DateTime::from_timestamp(from * HOUR, 0).unwrap_or(since),
        update_time: boxery_api::meta::now(),
        vcpu_hours: hours(t.vcpu_seconds),
        gib_hours: hours(t.gib_seconds),
        cpu_seconds: t.cpu_seconds,
        llm: t
            .llm
            .into_iter()
            .map(
                |(provider, requests, input_tokens, output_tokens)| LlmUsage {
                    provider,
                    requests,
                    input_tokens,
                    output_tokens,
                },
            )
            .collect(),
    })
}

/// Put `fresh` in `slot` when it says something new and the last was written at least
/// [`REFRESH_EVERY`] ago (or `now` is set); whether it changed.
fn keep(slot: &mut Option<Usage>, fresh: Option<Usage>, now: bool) -> bool {
    let Some(fresh) = fresh else { return false };
    if slot.is_none()
        && fresh.same_as(&Usage {
            since: fresh.since,
            ..Usage::default()
        })
    {
        // nothing used yet: no usage to show
        return false;
    }
    let due = slot.as_ref().is_none_or(|old| {
        !old.same_as(&fresh)
            && (now
                || (fresh.update_time - old.update_time)
                    .to_std()
                    .is_ok_and(|d| d >= REFRESH_EVERY))
    });
    if due {
        *slot = Some(fresh);
    }
    due
}

/// Refresh a Vm's `status.usage` (a VM that exists in the backend); whether it changed.
pub(crate) async fn vm(ctx: &Ctx, vm: &mut Vm) -> bool {
    let Some(made) = vm.metadata.creation_timestamp else {
        return false;
    };
    let fresh_enough = vm.status.usage.as_ref().is_some_and(|u| {
        (boxery_api::meta::now() - u.update_time)
            .to_std()
            .is_ok_and(|d| d < REFRESH_EVERY)
    });
    if fresh_enough {
        return false;
    }
    let fresh = read(ctx, Scope::Vm(vm.name().to_string()), made).await;
    keep(&mut vm.status.usage, fresh, false)
}

/// The first limit reached, and those past [`NEAR`].
fn judge(limits: &[Limit]) -> (Option<Limit>, Vec<Limit>) {
    let reached = limits.iter().find(|l| l.share() >= 1.0).copied();
    let near = limits
        .iter()
        .filter(|l| l.share() >= NEAR && l.share() < 1.0)
        .copied()
        .collect();
    (reached, near)
}

/// Set `BudgetExhausted` in `conds` for the object's `generation`: `True` with `reason` and
/// `msg` when `reached` (the message of the moment it was first reached is kept), `False` once
/// it was there (absent until a budget is first reached). Returns whether the conditions
/// changed at all, and whether it turned (`Some(true)`: now exhausted).
fn turn(
    conds: &mut Vec<Condition>,
    generation: Option<i64>,
    reached: bool,
    reason: &str,
    msg: &str,
) -> (bool, Option<bool>) {
    let old = conds.get_condition(BUDGET_EXHAUSTED).cloned();
    let was = exhausted(conds).is_some();
    if reached {
        let msg = match &old {
            Some(c) if was && c.reason == reason => c.message.clone(),
            _ => msg.to_string(),
        };
        let changed = conds.set_condition(
            BUDGET_EXHAUSTED,
            ConditionStatus::True,
            reason,
            &msg,
            generation,
        );
        (changed, (!was).then_some(true))
    } else if old.is_some() {
        let changed = conds.set_condition(
            BUDGET_EXHAUSTED,
            ConditionStatus::False,
            reasons::WITHIN_BUDGET,
            msg,
            generation,
        );
        (changed, was.then_some(false))
    } else {
        (false, None)
    }
}

/// Say a turn of `BudgetExhausted` in an event on `obj`.
async fn announce<R: Resource>(ctx: &Ctx, obj: &R, turned: Option<bool>, msg: &str) {
    match turned {
        Some(true) => {
            ctx.event(obj, EventType::Warning, "BudgetExhausted", msg)
                .await
        }
        Some(false) => ctx.event(obj, EventType::Normal, "WithinBudget", msg).await,
        None => {}
    }
}

/// A Warning `BudgetNear` on `obj` for each limit in `near`, once per `key` and limit.
async fn warn_near<R: Resource>(
    ctx: &Ctx,
    obj: &R,
    key: &str,
    near: &[Limit],
    say: impl Fn(&Limit) -> String,
) {
    for n in near {
        if ctx.first_report(&format!("{key}:{}:near", n.field)) {
            ctx.event(obj, EventType::Warning, "BudgetNear", &say(n))
                .await;
        }
    }
}

/// A bound lease: refresh its `status.usage` and judge its budget and its pool's. Returns
/// whether the lease changed, and when to look again.
pub(crate) async fn lease(ctx: &Ctx, l: &mut Lease) -> (bool, Duration) {
    let pool = match ctx.store.get_as::<Pool>(&l.spec.pool).await {
        Ok(p) => p,
        // not judged on what could not be read: the condition stays as it is
        Err(e) => {
            tracing::warn!(error = %e, lease = l.name(), "reading the lease's pool failed");
            return (false, CHECK_EVERY);
        }
    };
    let budget = boxery_api::usage::LeaseBudget::tighter(
        l.spec.budget.as_ref(),
        pool.as_ref().and_then(|p| p.spec.lease.budget.as_ref()),
    );
    let since = l.status.acquire_time.unwrap_or_else(boxery_api::meta::now);
    let uid = l.metadata.uid.clone().unwrap_or_default();
    let fresh = read(ctx, Scope::Owner(uid.clone()), since).await;
    if fresh.is_none() && budget.is_some() {
        // the ledger could not be read: not judged, the condition stays as it is
        return (false, CHECK_EVERY);
    }
    let name = l.name().to_string();
    let vm = l.status.vm.clone().unwrap_or_default();
    let (reached, near) = match (&budget, &fresh) {
        (Some(b), Some(u)) => judge(&b.limits(u)),
        _ => (None, Vec::new()),
    };
    warn_near(ctx, l, &format!("budget:{uid}"), &near, |n| {
        format!(
            "lease {name} has used over {:.0} % of its {} budget ({}): at the limit its VM {vm} is suspended",
            NEAR * 100.0,
            n.field,
            n.shown()
        )
    })
    .await;
    // the pool's monthly budget, passed on
    let pool_out = pool
        .as_ref()
        .and_then(|p| exhausted(&p.status.conditions))
        .map(|c| c.message.clone());
    let (now_reached, reason, msg) = match (reached, pool_out) {
        (Some(r), _) => (
            true,
            reasons::LEASE_BUDGET,
            format!(
                "lease {name} used its {} budget ({}): its VM {vm} is held suspended (stopped where the backend keeps no memory) until spec.budget is raised or the lease ends",
                r.field,
                r.shown()
            ),
        ),
        (None, Some(why)) => (true, reasons::POOL_BUDGET, why),
        (None, None) => (
            false,
            reasons::WITHIN_BUDGET,
            format!("lease {name} is within its budgets: its VM {vm} runs"),
        ),
    };
    let generation = l.metadata.generation;
    let (changed, turned) = turn(
        &mut l.status.conditions,
        generation,
        now_reached,
        reason,
        &msg,
    );
    announce(ctx, l, turned, &msg).await;
    let wrote = keep(&mut l.status.usage, fresh, changed);
    let next = if budget.is_some() || pool.as_ref().is_some_and(|p| p.spec.budget.is_some()) {
        CHECK_EVERY
    } else {
        REFRESH_EVERY
    };
    (wrote || changed, next)
}

/// An ending lease: what it used, to the last sample.
pub(crate) async fn lease_final(ctx: &Ctx, l: &mut Lease) {
    if l.status.phase != boxery_api::lease::LeasePhase::Bound {
        return;
    }
    let since = l.status.acquire_time.unwrap_or_else(boxery_api::meta::now);
    let uid = l.metadata.uid.clone().unwrap_or_default();
    let fresh = read(ctx, Scope::Owner(uid), since).await;
    keep(&mut l.status.usage, fresh, true);
    // it holds no VM any more: nothing is held for it
    let generation = l.metadata.generation;
    turn(
        &mut l.status.conditions,
        generation,
        false,
        reasons::WITHIN_BUDGET,
        "the lease ended: its VM is no longer held for a budget",
    );
}

/// A pool: refresh its `status.usage` (this UTC month, its leases') and judge its monthly
/// budget. Returns whether it changed, and when to look again (`None`: nothing can grow, no
/// lease holds a member and no budget is set).
pub(crate) async fn pool(ctx: &Ctx, p: &mut Pool) -> (bool, Option<Duration>) {
    let (_, month) = periods(chrono::Utc::now().timestamp());
    let start = chrono::DateTime::from_timestamp(month * HOUR, 0).unwrap_or_default();
    let fresh = read(ctx, Scope::Pool(p.name().to_string()), start).await;
    if fresh.is_none() && p.spec.budget.is_some() {
        // the ledger could not be read: not judged, the condition stays as it is
        return (false, Some(CHECK_EVERY));
    }
    let name = p.name().to_string();
    let (reached, near) = match (&p.spec.budget, &fresh) {
        (Some(b), Some(u)) => judge(&b.limits(u)),
        _ => (None, Vec::new()),
    };
    let resets = next_month(month).to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let period = start.format("%Y-%m");
    let key = format!(
        "budget:{}:{period}",
        p.metadata.uid.as_deref().unwrap_or(&name)
    );
    warn_near(ctx, p, &key, &near, |n| {
        format!(
            "pool {name} has used over {:.0} % of its {} budget in {period} (UTC) ({}): at the limit its leased VMs are suspended until {resets}",
            NEAR * 100.0,
            n.field,
            n.shown()
        )
    })
    .await;
    let msg = match reached {
        Some(r) => format!(
            "pool {name} used its {} budget in {period} (UTC) ({}): its leased VMs are held suspended (stopped where the backend keeps no memory) until {resets} or until spec.budget is raised",
            r.field,
            r.shown()
        ),
        None => format!("pool {name} is within its budgets in {period} (UTC)"),
    };
    let generation = p.metadata.generation;
    let (changed, turned) = turn(
        &mut p.status.conditions,
        generation,
        reached.is_some(),
        reasons::POOL_BUDGET,
        &msg,
    );
    announce(ctx, p, turned, &msg).await;
    let wrote = keep(&mut p.status.usage, fresh, changed);
    let next = if p.spec.budget.is_some() {
        Some(CHECK_EVERY)
    } else {
        (p.status.leased > 0).then_some(REFRESH_EVERY)
    };
    (wrote || changed, next)
}

/// Why a VM is held for a budget: its lease (through its pool member record) says
/// `BudgetExhausted=True`. Read from the caches: no store read.
pub(crate) fn held(ctx: &Ctx, vm: &Vm) -> Option<(String, String)> {
    vm.metadata.labels.get(boxery_api::pool::POOL_LABEL)?;
    let caches = ctx.pool_caches()?;
    if !caches.members.is_ready() || !caches.leases.is_ready() {
        // not known yet (a restart): what was held stays held
        return exhausted(&vm.status.conditions).map(|c| (c.reason.clone(), c.message.clone()));
    }
    let member = caches
        .members
        .get_as::<boxery_api::PoolMember>(vm.name())?
        .1
        .ok()?;
    let lease = member.status.lease.as_deref()?;
    let l = caches.leases.get_as::<Lease>(lease)?.1.ok()?;
    if l.status.vm.as_deref() != Some(vm.name()) || l.status.phase.ended() {
        return None;
    }
    exhausted(&l.status.conditions).map(|c| (c.reason.clone(), c.message.clone()))
}

/// Map a Lease change to its VM when the VM's hold may change: the lease has a
/// `BudgetExhausted` condition (either way), or has ended. (Not at every renewal.)
pub fn vm_of_lease(lease: &boxery_api::DynObject) -> Vec<String> {
    let status = lease.status();
    let ended = matches!(
        status["phase"].as_str(),
        Some("Expired" | "Released" | "Lost")
    ) || lease.metadata.is_deleting();
    let budget = status["conditions"]
        .as_array()
        .is_some_and(|cs| cs.iter().any(|c| c["type"] == BUDGET_EXHAUSTED));
    if !(ended || budget) {
        return Vec::new();
    }
    status["vm"]
        .as_str()
        .map(str::to_string)
        .into_iter()
        .collect()
}

/// Set the VM's own `BudgetExhausted` (held: `Some((reason, message))`); whether its
/// conditions changed, and whether it turned (see [`turn`]).
pub(crate) fn mark_vm(vm: &mut Vm, held: Option<&(String, String)>) -> (bool, Option<bool>) {
    let generation = vm.metadata.generation;
    let (reached, reason, msg) = match held {
        Some((reason, msg)) => (true, reason.as_str(), msg.as_str()),
        None => (false, reasons::WITHIN_BUDGET, UNHELD),
    };
    turn(&mut vm.status.conditions, generation, reached, reason, msg)
}

/// What a VM let go from a budget hold says.
pub(crate) const UNHELD: &str =
    "no longer held for a budget (raised, a new month, or its lease ended): the VM runs";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_reached_limit_holds_and_near_ones_warn() {
        let l = |field, max, used| Limit { field, max, used };
        let (r, n) = judge(&[l("vcpuHours", 1.0, 0.85), l("tokens", 100.0, 100.0)]);
        assert_eq!(r.unwrap().field, "tokens");
        assert_eq!(n.len(), 1);
        assert_eq!(n[0].field, "vcpuHours");
        let (r, n) = judge(&[l("vcpuHours", 1.0, 0.5)]);
        assert!(r.is_none() && n.is_empty());
    }

    #[test]
    fn the_condition_turns_once_each_way_and_is_absent_until_needed() {
        let mut c: Vec<Condition> = Vec::new();
        let t =
            |c: &mut Vec<Condition>, reached, reason, msg| turn(c, Some(1), reached, reason, msg);
        assert_eq!(t(&mut c, false, "WithinBudget", "ok"), (false, None));
        assert!(c.is_empty());
        assert_eq!(t(&mut c, true, "LeaseBudget", "out"), (true, Some(true)));
        assert_eq!(t(&mut c, true, "LeaseBudget", "out, later"), (false, None));
        assert_eq!(
            c[0].message, "out",
            "the message of the moment it was reached stays"
        );
        assert_eq!(t(&mut c, true, "PoolBudget", "pool"), (true, None));
        assert_eq!(c[0].reason, "PoolBudget");
        assert_eq!(t(&mut c, false, "WithinBudget", "ok"), (true, Some(false)));
        assert_eq!(c[0].status, ConditionStatus::False);
        assert_eq!(t(&mut c, false, "WithinBudget", "ok"), (false, None));
        assert_eq!(c[0].observed_generation, Some(1));
        assert_eq!(
            turn(&mut c, Some(2), false, "WithinBudget", "ok"),
            (true, None),
            "a new generation is written, not turned"
        );
    }

    #[test]
    fn usage_is_written_when_it_changed_and_is_due() {
        let at = |s: i64| chrono::DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap();
        let u = |v: f64, t| Usage {
            vcpu_hours: v,
            update_time: at(t),
            ..Usage::default()
        };
        let mut slot = None;
        assert!(keep(&mut slot, Some(u(0.1, 0)), false), "the first");
        assert!(!keep(&mut slot, Some(u(0.2, 30)), false), "too soon");
        assert!(keep(&mut slot, Some(u(0.2, 30)), true), "asked now");
        assert!(!keep(&mut slot, Some(u(0.2, 200)), false), "the same");
        assert!(keep(&mut slot, Some(u(0.3, 200)), false));
        assert!(!keep(&mut slot, None, true), "no ledger");
        let mut empty = None;
        assert!(!keep(&mut empty, Some(u(0.0, 0)), true), "nothing used yet");
    }
}
