//! The Grant reconciler's decisions, one reconcile at a time, on a store in memory and the
//! fake backend (`boxery_reconcilers::testing`): in force only while a person's approval of
//! the current generation stands and its VM lives; "in force" is an entry in the grant state
//! (`$BOXERY_HOME/grants/<vm>.json`), never the value.

use boxery_api::conditions::{READY, reasons};
use boxery_api::grant::GrantPhase;
use boxery_api::{Conditions, Grant, Vm};
use boxery_home::grants::read_state;
use boxery_reconcilers::testing::{self, Harness, Part};
use boxery_reconcilers::{grant, vm};
use serde_json::json;

/// Grant `g` of VM `dev1`'s LLM key, read from the control plane's `PATH` (always set).
fn grant_of_dev1() -> Grant {
    serde_json::from_value(json!({
        "apiVersion": "boxery.dev/v1alpha1", "kind": "Grant", "metadata": {"name": "g"},
        "spec": {"vm": "dev1", "type": "llm", "target": "anthropic",
                 "valueFrom": {"env": "PATH"}},
    }))
    .unwrap()
}

/// VM `dev1`, made and running (from image `base`, made Ready on first use).
async fn dev1(h: &Harness) {
    if h.find::<boxery_api::Image>("base").is_none() {
        h.ready_image("base");
    }
    h.put(&testing::vm("dev1", "base"));
    h.settle(vm::reconcile, "dev1").await.unwrap();
}

/// VM `dev1` and its grant `g`, approved: in force.
async fn applied(h: &Harness) {
    dev1(h).await;
    h.put(&grant_of_dev1());
    h.settle(grant::reconcile, "g").await.unwrap();
    approve(h);
    h.settle(grant::reconcile, "g").await.unwrap();
}

/// What `boxery grant approve g` writes: approval of the current generation.
fn approve(h: &Harness) {
    h.edit::<Grant>("g", Part::Status, |g| {
        g.status.approved_by = Some("root".into());
        g.status.approved_generation = g.metadata.generation;
    });
}

fn reason(h: &Harness) -> (GrantPhase, String) {
    let g: Grant = h.get("g");
    let ready = g.status.conditions.get_condition(READY).unwrap();
    (g.status.phase, ready.reason.clone())
}

#[tokio::test]
async fn a_grant_waits_for_its_vm_and_for_a_persons_approval() {
    let h = Harness::new();
    h.put(&grant_of_dev1());
    h.settle(grant::reconcile, "g").await.unwrap();
    assert_eq!(
        reason(&h),
        (GrantPhase::PendingApproval, reasons::VM_NOT_FOUND.into())
    );
    dev1(&h).await;
    h.settle(grant::reconcile, "g").await.unwrap();
    assert_eq!(
        reason(&h),
        (
            GrantPhase::PendingApproval,
            reasons::PENDING_APPROVAL.into()
        )
    );
    assert_eq!(h.reasons::<Grant>("g"), ["ApprovalNeeded"]);
    assert!(read_state(&h.ctx.home, "dev1").is_empty(), "not in force");
}

#[tokio::test]
async fn an_approved_grant_is_in_force_until_its_spec_changes() {
    let h = Harness::new();
    applied(&h).await;
    assert_eq!(reason(&h), (GrantPhase::Applied, reasons::APPLIED.into()));
    let g: Grant = h.get("g");
    let entries = read_state(&h.ctx.home, "dev1");
    assert_eq!(entries.len(), 1);
    assert_eq!(Some(&entries[0].uid), g.metadata.uid.as_ref());
    assert_eq!(g.status.vm_uid, h.get::<Vm>("dev1").metadata.uid, "bound");
    // A new generation voids the approval: pending again, its entry gone.
    h.edit::<Grant>("g", Part::Spec, |g| g.spec.target = "openai".into());
    h.settle(grant::reconcile, "g").await.unwrap();
    assert_eq!(
        reason(&h),
        (
            GrantPhase::PendingApproval,
            reasons::PENDING_APPROVAL.into()
        )
    );
    assert!(h.reasons::<Grant>("g").contains(&"SpecChanged".to_string()));
    assert!(read_state(&h.ctx.home, "dev1").is_empty());
}

#[tokio::test]
async fn a_grant_whose_vm_is_deleted_is_revoked_for_good() {
    let h = Harness::new();
    applied(&h).await;
    h.remove(vm::reconcile, "dev1").await;
    assert!(
        read_state(&h.ctx.home, "dev1").is_empty(),
        "the Vm reconciler took the entry out before the VM went"
    );
    h.settle(grant::reconcile, "g").await.unwrap();
    assert_eq!(reason(&h), (GrantPhase::Revoked, reasons::VM_GONE.into()));
    // A new VM of that name is another one: the grant stays revoked.
    dev1(&h).await;
    h.settle(grant::reconcile, "g").await.unwrap();
    assert_eq!(reason(&h).0, GrantPhase::Revoked);
    assert!(read_state(&h.ctx.home, "dev1").is_empty());
}

#[tokio::test]
async fn a_deleted_grant_leaves_the_state_before_it_goes() {
    let h = Harness::new();
    applied(&h).await;
    assert_eq!(read_state(&h.ctx.home, "dev1").len(), 1);
    h.remove(grant::reconcile, "g").await;
    assert!(read_state(&h.ctx.home, "dev1").is_empty());
}
