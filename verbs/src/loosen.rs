//! What an agent may not loosen, only tighten: a person's limits on what agents do. Through the
//! tools (`Voice::Tool`: MCP, a lease's API token), a change of an existing object may not let
//! a guest reach more (its egress policy, [`crate::egress`]) nor let a lease or a pool use more
//! (a budget raised or removed: `Lease.spec.budget`, `Pool.spec.lease.budget`,
//! `Pool.spec.budget`, docs/pools.md "Budgets"). A person changes them with the CLI.

use boxery_api::DynObject;
use boxery_api::usage::{Budget, LeaseBudget, PoolBudget};
use boxery_hands::Voice;

use crate::{Result, VerbError, Verbs};

/// Whether `o`'s kind carries a limit an agent may not loosen.
pub fn guarded(o: &DynObject) -> bool {
    matches!(o.kind.as_str(), "Vm" | "Pool" | "Lease")
}

/// Refuse, in the tool voice, a change from `cur` to `new` that loosens a limit.
pub fn check(v: &Verbs, cur: &DynObject, new: &DynObject) -> Result<()> {
    if v.voice != Voice::Tool {
        return Ok(());
    }
    crate::egress::check(cur, new)?;
    // a lease is held by its pool's budgets: moved to another pool, it would leave them
    let pool = |o: &DynObject| o.rest.get("spec").and_then(|s| s.get("pool")).cloned();
    if new.kind == "Lease" && pool(cur) != pool(new) {
        let name = &new.metadata.name;
        return Err(VerbError::forbidden(format!(
            "an agent cannot move lease {name} to another pool (its pool's budgets hold it): \
             release it and acquire one from the other pool"
        )));
    }
    let Some(how) = looser_budget(cur, new) else {
        return Ok(());
    };
    let (kind, name) = (new.kind.to_ascii_lowercase(), &new.metadata.name);
    Err(VerbError::forbidden(format!(
        "an agent cannot raise or remove {} {name}'s budget ({how}): a person does, with \
         `boxery patch {kind} {name} …` or `boxery edit {kind} {name}`; lowering it is allowed",
        new.kind
    )))
}

/// Refuse, in the tool voice, deleting `cur` when that lifts a limit: a Pool with a budget
/// (made again without one, its leases would run unbounded).
pub fn may_delete(v: &Verbs, cur: &DynObject) -> Result<()> {
    if v.voice != Voice::Tool || cur.kind != "Pool" {
        return Ok(());
    }
    let spec = cur.rest.get("spec");
    let budgeted = spec.and_then(|s| s.get("budget")).is_some()
        || spec
            .and_then(|s| s.get("lease"))
            .and_then(|l| l.get("budget"))
            .is_some();
    if !budgeted {
        return Ok(());
    }
    let name = &cur.metadata.name;
    Err(VerbError::forbidden(format!(
        "an agent cannot delete pool {name}: it has a budget, which a person lifts \
         (`boxery delete pool {name}`)"
    )))
}

/// How `new`'s budgets allow more than `cur`'s, when they do.
fn looser_budget(cur: &DynObject, new: &DynObject) -> Option<String> {
    fn at<T: serde::de::DeserializeOwned>(o: &DynObject, path: &[&str]) -> Option<T> {
        let mut v = o.rest.get("spec")?;
        for k in path {
            v = v.get(k)?;
        }
        serde_json::from_value(v.clone()).ok()
    }
    let lease = |path: &[&str], what: &str| {
        let (old, now) = (at::<LeaseBudget>(cur, path), at::<LeaseBudget>(new, path));
        LeaseBudget::looser(now.as_ref(), old.as_ref()).map(|h| format!("{what}: {h}"))
    };
    match new.kind.as_str() {
        "Lease" => lease(&["budget"], "spec.budget"),
        "Pool" => {
            let (old, now) = (
                at::<PoolBudget>(cur, &["budget"]),
                at::<PoolBudget>(new, &["budget"]),
            );
            PoolBudget::looser(now.as_ref(), old.as_ref())
                .map(|h| format!("spec.budget: {h}"))
                .or_else(|| lease(&["lease", "budget"], "spec.lease.budget"))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(spec: serde_json::Value) -> DynObject {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "boxery.dev/v1alpha1", "kind": "Pool",
            "metadata": {"name": "p"}, "spec": spec
        }))
        .unwrap()
    }

    #[test]
    fn a_pools_budgets_may_be_lowered_not_raised_or_removed() {
        let cur = pool(serde_json::json!({"replicas": 1,
            "lease": {"defaultTtlSeconds": 1800, "maxTtlSeconds": 28800,
                      "budget": {"vcpuHours": 1.0}},
            "budget": {"tokensPerMonth": 1000}}));
        let lower = pool(serde_json::json!({"replicas": 1,
            "lease": {"defaultTtlSeconds": 1800, "maxTtlSeconds": 28800,
                      "budget": {"vcpuHours": 0.5}},
            "budget": {"tokensPerMonth": 10}}));
        assert_eq!(looser_budget(&cur, &lower), None);
        let raised = pool(serde_json::json!({"replicas": 1,
            "lease": {"defaultTtlSeconds": 1800, "maxTtlSeconds": 28800,
                      "budget": {"vcpuHours": 2.0}},
            "budget": {"tokensPerMonth": 1000}}));
        assert_eq!(
            looser_budget(&cur, &raised).as_deref(),
            Some("spec.lease.budget: vcpuHours 1 → 2")
        );
        let removed = pool(serde_json::json!({"replicas": 1}));
        assert_eq!(
            looser_budget(&cur, &removed).as_deref(),
            Some("spec.budget: tokensPerMonth 1000 removed")
        );
    }
}
