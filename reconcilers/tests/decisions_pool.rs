//! The Pool and Lease reconcilers' decisions on a store in memory and the fake backend
//! (`boxery_reconcilers::testing`): members made, captured and freed, scale-down, claims,
//! expiry, release and the reset that follows. A pool's members need the Vm and Image
//! reconcilers too: [`rounds`] runs each once per round, in a fixed order, as a manager would.

use std::time::Duration;

use boxery_api::conditions::{READY, reasons};
use boxery_api::lease::LeasePhase;
use boxery_api::pool::{MemberState, PoolMember};
use boxery_api::{Conditions, Image, ImagePhase, Lease, Pool, Vm, now};
use boxery_reconcilers::pool::{self, TEMPLATE_ANNOTATION, clean_image};
use boxery_reconcilers::testing::{Harness, Part};
use boxery_reconcilers::{image, lease, vm};
use serde_json::json;

/// Pool `p` of `replicas` members made from image `base` (ready in the store and backend).
fn pool_of(h: &Harness, replicas: u32) {
    h.ready_image("base");
    let p: Pool = serde_json::from_value(json!({
        "apiVersion": "boxery.dev/v1alpha1", "kind": "Pool", "metadata": {"name": "p"},
        "spec": {"template": {"spec": {"source": {"image": "base"}}}, "replicas": replicas},
    }))
    .unwrap();
    h.put(&p);
}

fn lease_of(name: &str, seconds: u32) -> Lease {
    serde_json::from_value(json!({
        "apiVersion": "boxery.dev/v1alpha1", "kind": "Lease", "metadata": {"name": name},
        "spec": {"pool": "p", "holderIdentity": "alice", "leaseDurationSeconds": seconds,
                 "publicKey": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIO4xKVp2PnpcVp3iDyM9OUxaI3wD/3oXfDqJm+Ww1Cpm alice"}
    }))
    .unwrap()
}

/// Up to `n` rounds of: the pool, then every Vm, then every Image, each settled; stops early
/// once `done` holds after a round. Returns whether it held.
async fn rounds(h: &Harness, n: usize, done: impl Fn(&Harness) -> bool) -> bool {
    for _ in 0..n {
        if h.find::<Pool>("p").is_some() {
            h.settle(pool::reconcile, "p").await.unwrap();
        }
        let vms: Vec<Vm> = h.store.list_as(&Default::default()).unwrap();
        for v in vms {
            h.settle(vm::reconcile, v.metadata.name.as_str())
                .await
                .unwrap();
        }
        let images: Vec<Image> = h.store.list_as(&Default::default()).unwrap();
        for i in images {
            h.settle(image::reconcile, i.metadata.name.as_str())
                .await
                .unwrap();
        }
        if done(h) {
            return true;
        }
    }
    false
}

fn state(h: &Harness, member: &str) -> MemberState {
    h.get::<PoolMember>(member).status.state
}

fn free(n: u32) -> impl Fn(&Harness) -> bool {
    move |h| h.get::<Pool>("p").status.free == n
}

/// Pool `p` with `replicas` members, all free.
async fn free_pool(h: &Harness, replicas: u32) {
    pool_of(h, replicas);
    assert!(
        rounds(h, 12, free(replicas)).await,
        "{:?}",
        h.get::<Pool>("p").status
    );
}

/// Pool `p` with one member, held by lease `l1` (600 s).
async fn bound(h: &Harness) {
    free_pool(h, 1).await;
    h.put(&lease_of("l1", 600));
    h.settle(lease::reconcile, "l1").await.unwrap();
}

/// Lease `l1`'s time runs out (its expiry a second ago).
fn run_out(h: &Harness) {
    h.edit::<Lease>("l1", Part::Status, |l| {
        l.status.expire_time = Some(now() - chrono::Duration::seconds(1))
    });
}

#[tokio::test]
async fn the_first_reconcile_adds_the_finalizer_and_nothing_else() {
    let h = Harness::new();
    pool_of(&h, 2);
    let next = h.reconcile(pool::reconcile, "p").await.unwrap();
    assert!(next.is_await_change());
    assert_eq!(h.get::<Pool>("p").metadata.finalizers, [pool::FINALIZER]);
    assert!(h.find::<PoolMember>("p-0").is_none());
}

#[tokio::test]
async fn members_are_made_from_the_template_captured_and_freed() {
    let h = Harness::new();
    pool_of(&h, 2);
    h.settle(pool::reconcile, "p").await.unwrap();
    for m in ["p-0", "p-1"] {
        assert_eq!(state(&h, m), MemberState::Pending, "a record per member");
        let v: Vm = h.get(m);
        assert_eq!(v.metadata.labels["boxery.dev/pool"], "p");
        assert!(v.metadata.annotations.contains_key(TEMPLATE_ANNOTATION));
        assert_eq!(v.metadata.owner_references[0].kind, "Pool");
    }
    assert!(
        rounds(&h, 12, free(2)).await,
        "{:?}",
        h.get::<Pool>("p").status
    );
    for m in ["p-0", "p-1"] {
        assert_eq!(state(&h, m), MemberState::Free);
        assert_eq!(
            h.get::<Image>(&clean_image(m)).status.phase,
            ImagePhase::Ready,
            "its clean image"
        );
    }
    let p: Pool = h.get("p");
    assert_eq!((p.status.replicas, p.status.ready), (2, 2));
    assert_eq!(h.reasons::<Pool>("p"), ["MemberReady", "MemberReady"]);
}

#[tokio::test]
async fn scale_down_removes_the_last_member_its_vm_and_its_record() {
    let h = Harness::new();
    free_pool(&h, 2).await;
    h.edit::<Pool>("p", Part::Spec, |p| p.spec.replicas = 1);
    let gone = |h: &Harness| h.find::<PoolMember>("p-1").is_none() && h.find::<Vm>("p-1").is_none();
    assert!(rounds(&h, 10, gone).await);
    assert_eq!(state(&h, "p-0"), MemberState::Free, "the other stays");
    assert!(h.find::<Image>(&clean_image("p-1")).is_none());
    let reasons = h.reasons::<Pool>("p");
    assert!(
        reasons.ends_with(&["MemberRemoving".into(), "MemberRemoved".into()]),
        "{reasons:?}"
    );
    assert_eq!(h.get::<Pool>("p").status.replicas, 1);
}

#[tokio::test]
async fn a_deleted_pool_stays_until_every_member_left() {
    let h = Harness::new();
    free_pool(&h, 1).await;
    h.delete::<Pool>("p");
    h.reconcile(pool::reconcile, "p").await.unwrap();
    assert!(h.find::<Pool>("p").is_some(), "held by its finalizer");
    assert_eq!(state(&h, "p-0"), MemberState::Removing);
    assert!(rounds(&h, 10, |h| h.find::<Pool>("p").is_none()).await);
    assert!(h.find::<Vm>("p-0").is_none());
}

#[tokio::test]
async fn a_lease_claims_a_free_member_and_binds() {
    let h = Harness::new();
    bound(&h).await;
    let next = h.reconcile(lease::reconcile, "l1").await.unwrap();
    let l: Lease = h.get("l1");
    assert_eq!(l.status.phase, LeasePhase::Bound);
    assert_eq!(l.status.vm.as_deref(), Some("p-0"));
    // looked at again for its usage and budgets well before it expires
    let left = next.requeue_after().expect("a requeue");
    assert_eq!(left, boxery_reconcilers::budget::REFRESH_EVERY);
    let expires = l.status.expire_time.unwrap() - boxery_api::now();
    assert!(expires > chrono::Duration::seconds(60), "{expires}");
    let m: PoolMember = h.get("p-0");
    assert_eq!(m.status.state, MemberState::Leased, "no sshd: no Acquiring");
    assert_eq!(m.status.lease_uid, l.metadata.uid);
    assert!(lease::token_file(&h.ctx, "p-0").exists(), "its token");
    assert_eq!(h.reasons::<Lease>("l1"), ["Bound"]);
}

#[tokio::test]
async fn a_lease_waits_for_a_free_member_its_pool_or_a_shorter_duration() {
    let h = Harness::new();
    h.put(&lease_of("early", 600));
    let next = h.settle(lease::reconcile, "early").await.unwrap();
    assert_eq!(next.requeue_after(), Some(Duration::from_secs(5)));
    let ready = |name: &str| {
        h.get::<Lease>(name)
            .status
            .conditions
            .get_condition(READY)
            .unwrap()
            .reason
            .clone()
    };
    assert_eq!(ready("early"), reasons::POOL_NOT_FOUND);
    free_pool(&h, 1).await;
    h.edit::<Pool>("p", Part::Spec, |p| p.spec.lease.max_ttl_seconds = 3600);
    h.put(&lease_of("long", 7200));
    assert!(
        h.settle(lease::reconcile, "long")
            .await
            .unwrap()
            .is_await_change()
    );
    assert_eq!(ready("long"), reasons::DURATION_TOO_LONG);
    h.settle(lease::reconcile, "early").await.unwrap();
    h.put(&lease_of("late", 600));
    let next = h.settle(lease::reconcile, "late").await.unwrap();
    assert_eq!(next.requeue_after(), Some(Duration::from_secs(5)));
    assert_eq!(ready("late"), reasons::NO_FREE_MEMBER);
    assert_eq!(h.get::<Lease>("early").status.phase, LeasePhase::Bound);
    assert_eq!(h.get::<Lease>("late").status.phase, LeasePhase::Pending);
}

#[tokio::test]
async fn an_expired_lease_ends_revokes_its_token_and_its_member_is_reset() {
    let h = Harness::new();
    bound(&h).await;
    run_out(&h);
    let next = h.settle(lease::reconcile, "l1").await.unwrap();
    assert!(next.is_await_change());
    let l: Lease = h.get("l1");
    assert_eq!(l.status.phase, LeasePhase::Expired);
    assert_eq!(
        l.status.conditions.get_condition(READY).unwrap().reason,
        reasons::LEASE_EXPIRED
    );
    assert!(!lease::token_file(&h.ctx, "p-0").exists(), "revoked first");
    assert_eq!(state(&h, "p-0"), MemberState::Resetting);
    assert!(rounds(&h, 10, free(1)).await);
    assert!(h.reasons::<Pool>("p").contains(&"MemberReset".to_string()));
    assert_eq!(
        h.get::<Vm>("p-0").status.last_restore.unwrap().image,
        clean_image("p-0"),
        "reimaged from its clean image"
    );
}

#[tokio::test]
async fn a_renewal_extends_a_bound_lease_and_one_after_the_end_is_refused() {
    let h = Harness::new();
    bound(&h).await;
    let before = h.get::<Lease>("l1").status.expire_time.unwrap();
    h.edit::<Lease>("l1", Part::Spec, |l| l.spec.renew_time = Some(now()));
    h.settle(lease::reconcile, "l1").await.unwrap();
    let l: Lease = h.get("l1");
    assert!(l.status.expire_time.unwrap() > before, "extended");
    assert_eq!(l.status.renewed, l.spec.renew_time);
    run_out(&h);
    h.settle(lease::reconcile, "l1").await.unwrap();
    h.edit::<Lease>("l1", Part::Spec, |l| l.spec.renew_time = Some(now()));
    h.settle(lease::reconcile, "l1").await.unwrap();
    let l: Lease = h.get("l1");
    assert_eq!(l.status.phase, LeasePhase::Expired, "not brought back");
    assert_eq!(
        l.status
            .conditions
            .get_condition(boxery_api::conditions::RENEWED)
            .unwrap()
            .reason,
        reasons::RENEW_REFUSED
    );
}

#[tokio::test]
async fn a_released_lease_lets_its_member_go_before_it_is_removed() {
    let h = Harness::new();
    bound(&h).await;
    h.remove(lease::reconcile, "l1").await;
    assert!(!lease::token_file(&h.ctx, "p-0").exists());
    assert_eq!(state(&h, "p-0"), MemberState::Resetting);
}

/// A lease being deleted holds its member until its own cleanup: the pool, reconciled first,
/// leaves the member Leased (were it reset then, another lease could take it while the
/// deleted one still read `Bound`); the cleanup says `Released` before the member goes to
/// Resetting.
#[tokio::test]
async fn a_deleted_lease_holds_its_member_until_it_says_released() {
    let h = Harness::new();
    bound(&h).await;
    h.delete::<Lease>("l1");
    h.settle(pool::reconcile, "p").await.unwrap();
    assert_eq!(state(&h, "p-0"), MemberState::Leased, "the pool waits");
    // the cleanup's first write: Released, while the member is still this lease's
    use futures::StreamExt;
    let mut watch = h.store.watch(Some("Lease"), h.store.revision().unwrap());
    h.reconcile(lease::reconcile, "l1").await.unwrap();
    let (_, first) = tokio::time::timeout(std::time::Duration::from_secs(5), watch.next())
        .await
        .expect("the cleanup wrote the lease")
        .expect("an event")
        .expect("a change");
    let l: Lease = first.object().to_typed().unwrap();
    assert_eq!(l.status.phase, LeasePhase::Released, "said Released first");
    assert_eq!(state(&h, "p-0"), MemberState::Resetting);
}

#[tokio::test]
async fn a_leased_member_leaves_a_scaled_down_pool_only_after_its_lease() {
    let h = Harness::new();
    bound(&h).await;
    h.edit::<Pool>("p", Part::Spec, |p| p.spec.replicas = 0);
    rounds(&h, 3, |_| false).await;
    assert_eq!(state(&h, "p-0"), MemberState::Leased, "held while leased");
    assert!(h.find::<Vm>("p-0").is_some());
    h.remove(lease::reconcile, "l1").await;
    assert!(rounds(&h, 10, |h| h.find::<PoolMember>("p-0").is_none()).await);
    assert!(h.find::<Vm>("p-0").is_none());
}

/// `cleanState: Memory` on a backend without memory snapshots (the fake, as libvirt): the
/// members are still made and freed, their clean images hold the disk only, and the pool
/// says so with a Warning per member.
#[tokio::test]
async fn clean_state_in_memory_falls_back_to_the_disk_where_the_backend_cannot() {
    let h = Harness::new();
    h.ready_image("base");
    let p: Pool = serde_json::from_value(json!({
        "apiVersion": "boxery.dev/v1alpha1", "kind": "Pool", "metadata": {"name": "p"},
        "spec": {"template": {"spec": {"source": {"image": "base"}}}, "replicas": 1,
                 "cleanState": "Memory"},
    }))
    .unwrap();
    h.put(&p);
    assert!(
        rounds(&h, 12, free(1)).await,
        "{:?}",
        h.get::<Pool>("p").status
    );
    let vms: Vec<Vm> = h.store.list_as(&Default::default()).unwrap();
    let clean: Image = h.get(&clean_image(&vms[0].metadata.name));
    assert!(!clean.spec.memory, "the disk only");
    assert_eq!(clean.status.phase, ImagePhase::Ready);
    assert_eq!(h.warnings::<Pool>("p"), ["CleanStateOnDisk"]);
}

/// Charge `vcpu_seconds` and `tokens` to lease `l1` in the ledger (as the sampler and the proxy
/// do), with its pool noted.
fn charge(h: &Harness, vcpu_seconds: f64, tokens: u64) {
    use boxery_home::usage::{ComputeUse, Ledger, LlmUse, Owner, this_hour};
    let l: Lease = h.get("l1");
    let uid = l.metadata.uid.clone().unwrap();
    let ledger = Ledger::open(&h.dir().join("home")).unwrap();
    ledger
        .note_owners(&[Owner {
            uid: uid.clone(),
            kind: "Lease".into(),
            name: "l1".into(),
            holder: "alice".into(),
            pool: "p".into(),
        }])
        .unwrap();
    ledger
        .add_compute(&[ComputeUse {
            hour: this_hour(),
            vm: "p-0".into(),
            owner: uid.clone(),
            vcpu_seconds,
            gib_seconds: vcpu_seconds,
            cpu_seconds: vcpu_seconds / 2.0,
        }])
        .unwrap();
    ledger
        .add_llm(&[LlmUse {
            hour: this_hour(),
            vm: "p-0".into(),
            owner: uid,
            grant_uid: "g".into(),
            grant: "g".into(),
            provider: "anthropic".into(),
            model: "m".into(),
            requests: 1,
            input: tokens,
            output: 0,
        }])
        .unwrap();
}

fn budget_condition<R>(h: &Harness, name: &str) -> Option<(String, String)>
where
    R: boxery_api::Resource + serde::de::DeserializeOwned + HasConditions,
{
    let o: R = h.get(name);
    o.conditions()
        .get_condition(boxery_api::conditions::BUDGET_EXHAUSTED)
        .map(|c| (format!("{:?}", c.status), c.reason.clone()))
}

trait HasConditions {
    fn conditions(&self) -> &Vec<boxery_api::Condition>;
}
impl HasConditions for Lease {
    fn conditions(&self) -> &Vec<boxery_api::Condition> {
        &self.status.conditions
    }
}
impl HasConditions for Pool {
    fn conditions(&self) -> &Vec<boxery_api::Condition> {
        &self.status.conditions
    }
}

#[tokio::test]
async fn a_lease_past_its_budget_is_exhausted_and_the_tighter_budget_wins() {
    let h = Harness::new();
    bound(&h).await;
    // the pool allows 1 vCPU-hour; the lease asks for less tokens, and more hours than allowed
    h.edit::<Pool>("p", Part::Spec, |p| {
        p.spec.lease.budget = Some(boxery_api::usage::LeaseBudget {
            vcpu_hours: Some(1.0),
            tokens: None,
        })
    });
    h.edit::<Lease>("l1", Part::Spec, |l| {
        l.spec.budget = Some(boxery_api::usage::LeaseBudget {
            vcpu_hours: Some(100.0),
            tokens: Some(1000),
        })
    });
    // nothing used: no usage shown, no condition, checked again soon
    let next = h.reconcile(lease::reconcile, "l1").await.unwrap();
    assert_eq!(
        next.requeue_after(),
        Some(boxery_reconcilers::budget::CHECK_EVERY)
    );
    let l: Lease = h.get("l1");
    assert!(l.status.usage.is_none(), "{:?}", l.status.usage);
    assert_eq!(budget_condition::<Lease>(&h, "l1"), None);
    // 0.85 vCPU-hours: near the pool's 1, once
    charge(&h, 0.85 * 3600.0, 10);
    h.reconcile(lease::reconcile, "l1").await.unwrap();
    h.reconcile(lease::reconcile, "l1").await.unwrap();
    let near: Vec<String> = h
        .warnings::<Lease>("l1")
        .into_iter()
        .filter(|w| w == "BudgetNear")
        .collect();
    assert_eq!(near.len(), 1, "{:?}", h.warnings::<Lease>("l1"));
    let l: Lease = h.get("l1");
    let u = l.status.usage.expect("usage once something was used");
    assert!((u.vcpu_hours - 0.85).abs() < 1e-9, "{u:?}");
    assert_eq!(u.tokens(), 10);
    assert_eq!(budget_condition::<Lease>(&h, "l1"), None);
    // past the pool's hour (the lease's own 100 does not raise it)
    charge(&h, 0.2 * 3600.0, 0);
    h.reconcile(lease::reconcile, "l1").await.unwrap();
    assert_eq!(
        budget_condition::<Lease>(&h, "l1"),
        Some(("True".into(), "LeaseBudget".into()))
    );
    let l: Lease = h.get("l1");
    assert!(l.status.usage.unwrap().vcpu_hours > 1.0, "written at once");
    assert!(
        h.warnings::<Lease>("l1")
            .contains(&"BudgetExhausted".into())
    );
    // the owner raises the pool's budget: within it again
    h.edit::<Pool>("p", Part::Spec, |p| {
        p.spec.lease.budget.as_mut().unwrap().vcpu_hours = Some(2.0)
    });
    h.reconcile(lease::reconcile, "l1").await.unwrap();
    assert_eq!(
        budget_condition::<Lease>(&h, "l1"),
        Some(("False".into(), "WithinBudget".into()))
    );
    // the lease's own token budget, tighter than the pool's none
    charge(&h, 0.0, 2000);
    h.reconcile(lease::reconcile, "l1").await.unwrap();
    assert_eq!(
        budget_condition::<Lease>(&h, "l1"),
        Some(("True".into(), "LeaseBudget".into()))
    );
    // it runs out: it holds nothing, and nothing is held for it
    run_out(&h);
    h.reconcile(lease::reconcile, "l1").await.unwrap();
    let l: Lease = h.get("l1");
    assert_eq!(l.status.phase, LeasePhase::Expired);
    assert_eq!(
        budget_condition::<Lease>(&h, "l1"),
        Some(("False".into(), "WithinBudget".into()))
    );
    assert_eq!(
        l.status.usage.unwrap().tokens(),
        2010,
        "its last usage kept"
    );
}

#[tokio::test]
async fn a_pool_past_its_monthly_budget_holds_each_bound_lease() {
    let h = Harness::new();
    bound(&h).await;
    h.edit::<Pool>("p", Part::Spec, |p| {
        p.spec.budget = Some(boxery_api::usage::PoolBudget {
            vcpu_hours_per_month: None,
            tokens_per_month: Some(500),
        })
    });
    charge(&h, 60.0, 400);
    h.settle(pool::reconcile, "p").await.unwrap();
    let p: Pool = h.get("p");
    assert_eq!(
        p.status.usage.as_ref().unwrap().tokens(),
        400,
        "{:?}",
        p.status
    );
    assert_eq!(budget_condition::<Pool>(&h, "p"), None);
    assert!(h.warnings::<Pool>("p").contains(&"BudgetNear".into()));
    charge(&h, 0.0, 100);
    h.settle(pool::reconcile, "p").await.unwrap();
    assert_eq!(
        budget_condition::<Pool>(&h, "p"),
        Some(("True".into(), "PoolBudget".into()))
    );
    // passed on to its bound lease, with the pool's words
    h.reconcile(lease::reconcile, "l1").await.unwrap();
    assert_eq!(
        budget_condition::<Lease>(&h, "l1"),
        Some(("True".into(), "PoolBudget".into()))
    );
    let l: Lease = h.get("l1");
    let c = l
        .status
        .conditions
        .get_condition(boxery_api::conditions::BUDGET_EXHAUSTED)
        .unwrap();
    assert!(
        c.message.contains("pool p used its tokensPerMonth budget"),
        "{}",
        c.message
    );
}
