//! The runtime against a real store in a temp dir: controller, finalizers, events, leader.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use boxery_api::{DynObject, Event, EventType, OwnerReference, Resource, Vm};
use boxery_controller::events::{MAX_EVENTS_PER_OBJECT, involved};
use boxery_controller::finalizer::FinalizerError;
use boxery_controller::leader::this_process;
use boxery_controller::{
    Action, CancellationToken, Controller, FinalizerEvent, LeaderElector, ReconcileError, Recorder,
    default_error_policy, ensure_finalizer, finalizer, remove_finalizer,
};
use boxery_store::{DeleteOutcome, Store, StoreError};
use serde_json::json;

fn store() -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("store.db")).unwrap();
    (dir, store)
}

fn vm(name: &str) -> DynObject {
    boxery_api::normalize(json!({
        "apiVersion": boxery_api::API_VERSION, "kind": "Vm",
        "metadata": {"name": name}, "spec": {"source": {"image": "debian-12"}}
    }))
    .unwrap()
}

fn image_owned_by(name: &str, owner: &DynObject) -> DynObject {
    let mut o = boxery_api::normalize(json!({
        "apiVersion": boxery_api::API_VERSION, "kind": "Image",
        "metadata": {"name": name}, "spec": {"source": {"vm": owner.metadata.name}}
    }))
    .unwrap();
    o.metadata.owner_references.push(OwnerReference {
        api_version: boxery_api::API_VERSION.into(),
        kind: owner.kind.clone(),
        name: owner.metadata.name.clone(),
        uid: owner.metadata.uid.clone().unwrap(),
        controller: Some(true),
    });
    o
}

/// Poll `f` every 10 ms until it holds, for at most `secs`.
async fn eventually(secs: u64, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[derive(Debug, thiserror::Error)]
#[error("reconcile failed")]
enum TestError {
    Finalizer(#[from] boxery_controller::finalizer::Error<StoreError>),
}
impl ReconcileError for TestError {}

struct Ctx {
    store: Store,
    seen: Mutex<Vec<(String, Option<String>)>>,
    cleaned: Mutex<Vec<String>>,
}

impl Ctx {
    fn count(&self, name: &str) -> usize {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|(n, _)| n == name)
            .count()
    }
}

async fn reconcile(vm: Arc<Vm>, ctx: Arc<Ctx>) -> Result<Action, TestError> {
    ctx.seen.lock().unwrap().push((
        vm.metadata.name.clone(),
        vm.metadata.resource_version.clone(),
    ));
    let store = ctx.store.clone();
    Ok(finalizer(&store, "boxery.dev/test", vm, |event| async {
        match event {
            FinalizerEvent::Apply(_) => Ok(Action::await_change()),
            FinalizerEvent::Cleanup(vm) => {
                // Cleanup writes status, as reconcilers do; the finalizer still comes off.
                let mut d = DynObject::from_typed(&*vm).unwrap();
                d.rest
                    .insert("status".into(), json!({"phase": "Terminating"}));
                store.update_status(d)?;
                ctx.cleaned.lock().unwrap().push(vm.metadata.name.clone());
                Ok(Action::await_change())
            }
        }
    })
    .await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_reconciles_fresh_objects_owned_children_and_cleans_up() {
    let (_dir, store) = store();
    store.create(vm("a")).unwrap();
    let ctx = Arc::new(Ctx {
        store: store.clone(),
        seen: Mutex::default(),
        cleaned: Mutex::default(),
    });
    let shutdown = CancellationToken::new();
    let ctl = Controller::<Vm>::new(Arc::new(store.clone())).owns::<boxery_api::Image>();
    let cache = ctl.cache();
    let run = tokio::spawn(ctl.run(
        reconcile,
        default_error_policy,
        ctx.clone(),
        shutdown.clone(),
    ));

    // First reconcile adds the finalizer; that write queues a second one, which sees it.
    eventually(10, "finalizer added", || {
        store
            .get("Vm", "a")
            .unwrap()
            .unwrap()
            .metadata
            .has_finalizer("boxery.dev/test")
    })
    .await;
    eventually(10, "reconcile after the finalizer write", || {
        ctx.count("a") >= 2
    })
    .await;
    let a = store.get("Vm", "a").unwrap().unwrap();
    let last = ctx.seen.lock().unwrap().last().cloned().unwrap();
    assert_eq!(
        last.1, a.metadata.resource_version,
        "reconcile reads the object as stored"
    );
    assert!(cache.get("a").is_some());

    // A child naming `a` as owner queues `a`.
    let before = ctx.count("a");
    store.create(image_owned_by("snap", &a)).unwrap();
    eventually(10, "owner reconciled on child change", || {
        ctx.count("a") > before
    })
    .await;

    // A write from another handle of the same file (as a CLI would) is seen too.
    let other = Store::open(store.path()).unwrap();
    other.create(vm("b")).unwrap();
    eventually(10, "b reconciled", || ctx.count("b") >= 1).await;

    // Delete: cleanup runs, writes status, the finalizer comes off, the object is gone.
    assert!(matches!(
        store.delete("Vm", "a").unwrap(),
        DeleteOutcome::Marked(_)
    ));
    eventually(10, "a removed after cleanup", || {
        store.get("Vm", "a").unwrap().is_none()
    })
    .await;
    assert_eq!(*ctx.cleaned.lock().unwrap(), ["a"]);
    assert!(
        store.get("Image", "snap").unwrap().is_none(),
        "cascade removed the child"
    );

    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(5), run)
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn finalizers_are_added_and_removed_with_preconditions() {
    let (_dir, store) = store();
    let created: Vm = store.create(vm("a")).unwrap().to_typed().unwrap();
    assert!(
        ensure_finalizer(&store, &created, "boxery.dev/x")
            .await
            .unwrap()
    );
    // The same (now stale) view again: Conflict, not a silent overwrite.
    let err = ensure_finalizer(&store, &created, "boxery.dev/y")
        .await
        .unwrap_err();
    assert!(
        matches!(err, FinalizerError::Add { .. }) && err.is_conflict(),
        "{err}"
    );
    let fresh: Vm = store.get("Vm", "a").unwrap().unwrap().to_typed().unwrap();
    assert!(
        !ensure_finalizer(&store, &fresh, "boxery.dev/x")
            .await
            .unwrap(),
        "already there"
    );
    // Deletion waits for the finalizer; none can be added now.
    assert!(matches!(
        store.delete("Vm", "a").unwrap(),
        DeleteOutcome::Marked(_)
    ));
    let deleting: Vm = store.get("Vm", "a").unwrap().unwrap().to_typed().unwrap();
    assert!(
        !ensure_finalizer(&store, &deleting, "boxery.dev/y")
            .await
            .unwrap()
    );
    let err = remove_finalizer(&store, &fresh, "boxery.dev/x")
        .await
        .unwrap_err();
    assert!(
        matches!(err, FinalizerError::Remove { .. }) && err.is_conflict(),
        "{err}"
    );
    assert!(
        remove_finalizer(&store, &deleting, "boxery.dev/x")
            .await
            .unwrap()
    );
    assert!(
        store.get("Vm", "a").unwrap().is_none(),
        "last finalizer gone: removed"
    );
}

#[tokio::test]
async fn recorder_dedups_repeats_and_caps_per_object() {
    let (_dir, store) = store();
    let a: Vm = store.create(vm("a")).unwrap().to_typed().unwrap();
    let b: Vm = store.create(vm("b")).unwrap().to_typed().unwrap();
    let rec = Recorder::new(Arc::new(store.clone()), "test-controller");
    for _ in 0..3 {
        rec.warning(
            &a,
            "BackendDown",
            "the backend did not answer: check `boxery backends`",
        )
        .await;
    }
    let evs = rec.events_of(&involved(&a)).await.unwrap();
    assert_eq!(evs.len(), 1);
    assert_eq!(evs[0].count, 3);
    assert_eq!(evs[0].type_, EventType::Warning);
    assert_eq!(evs[0].reporting_controller, "test-controller");
    assert!(evs[0].last_timestamp >= evs[0].first_timestamp);

    for i in 0..25 {
        rec.normal(&a, "Step", &format!("step {i}")).await;
        std::thread::sleep(Duration::from_millis(2));
    }
    rec.normal(&b, "Started", "b started").await;
    let evs = rec.events_of(&involved(&a)).await.unwrap();
    assert_eq!(evs.len(), MAX_EVENTS_PER_OBJECT);
    let messages: Vec<_> = evs.iter().map(|e| e.message.as_str()).collect();
    assert!(
        !messages.contains(&"step 0") && messages.contains(&"step 24"),
        "{messages:?}"
    );
    assert_eq!(rec.events_of(&involved(&b)).await.unwrap().len(), 1);

    // Events belong to their object: removing it removes them.
    store.delete("Vm", "a").unwrap();
    let (left, _) = store.list(Event::INFO.kind, &Default::default()).unwrap();
    assert_eq!(left.len(), 1, "only b's event is left");

    // A failure to record (no such kind) is logged, never a panic.
    rec.publish(
        &boxery_api::InvolvedObject {
            kind: "Vm".into(),
            name: "BAD NAME".into(),
            uid: None,
        },
        EventType::Normal,
        "X",
        "y",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_over_when_the_leader_stops_renewing() {
    let (_dir, store) = store();
    let ttl = Duration::from_millis(1500);
    let first = LeaderElector::new(Arc::new(store.clone()), "controllers", this_process(), ttl);
    let second = LeaderElector::new(Arc::new(store.clone()), "controllers", this_process(), ttl);
    let leader = first.acquire().await.unwrap();
    let standby = tokio::spawn(async move { second.acquire().await.unwrap() });
    tokio::time::sleep(ttl * 2).await;
    assert!(
        !standby.is_finished(),
        "renewed leases keep the standby waiting"
    );
    assert!(!leader.is_lost());

    // The leader stops renewing (as if it hung or was killed): the standby leads within 2 ttl.
    let stopped = Instant::now();
    drop(leader);
    let next = tokio::time::timeout(ttl * 2, standby)
        .await
        .expect("standby took over")
        .unwrap();
    assert!(stopped.elapsed() <= ttl * 2);
    assert!(next.epoch() >= 2);
    assert!(!next.token().is_cancelled());
}

/// A runtime whose only worker is stuck in a blocking call (a backend's synchronous libvirt
/// call) for three leases does not lose leadership: renewals run on their own thread.
#[tokio::test(flavor = "current_thread")]
async fn renewals_go_on_while_the_runtime_is_blocked() {
    let (_dir, store) = store();
    let ttl = Duration::from_millis(600);
    let leader = LeaderElector::new(Arc::new(store.clone()), "controllers", this_process(), ttl)
        .acquire()
        .await
        .unwrap();
    std::thread::sleep(ttl * 3); // blocks this runtime's one thread
    assert!(
        !leader.is_lost(),
        "still leading after the runtime was blocked"
    );
    let other = this_process();
    assert!(
        matches!(
            store.try_lead("controllers", &other, ttl).unwrap(),
            boxery_store::Leadership::Follower { .. }
        ),
        "nobody else could take the lock meanwhile"
    );
    leader.resign().await.unwrap();
    assert!(matches!(
        store.try_lead("controllers", &other, ttl).unwrap(),
        boxery_store::Leadership::Leader { .. }
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resigning_hands_over_at_once_and_the_old_leader_notices_loss() {
    let (_dir, store) = store();
    let ttl = Duration::from_millis(3000);
    let first = LeaderElector::new(Arc::new(store.clone()), "controllers", this_process(), ttl);
    let second = LeaderElector::new(Arc::new(store.clone()), "controllers", this_process(), ttl);
    let leader = first.acquire().await.unwrap();
    let standby = tokio::spawn(async move { second.acquire().await.unwrap() });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t = Instant::now();
    leader.resign().await.unwrap();
    let next = tokio::time::timeout(ttl, standby)
        .await
        .expect("standby took over")
        .unwrap();
    assert!(t.elapsed() < ttl / 2, "took {:?}", t.elapsed());

    // Steal the lock from `next` behind its back: its renewal sees a new holder and stops.
    store.resign("controllers", next_candidate(&next)).unwrap();
    let thief = LeaderElector::new(Arc::new(store.clone()), "controllers", this_process(), ttl)
        .acquire()
        .await
        .unwrap();
    tokio::time::timeout(ttl, next.lost())
        .await
        .expect("loss noticed within a renewal period");
    assert!(next.is_lost());
    assert!(!thief.is_lost());
}

fn next_candidate(l: &boxery_controller::Leader) -> &boxery_store::Candidate {
    l.candidate()
}

/// A child process killed and reaped on drop, even when the test fails.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_holder_on_this_host_is_replaced_at_once() {
    let (_dir, store) = store();
    let ttl = Duration::from_secs(30);
    let child = Child(
        std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap(),
    );
    // The lock is held on behalf of the child process (as `boxery serve` would hold it).
    let mut holder = this_process();
    holder.pid = child.0.id();
    let held = LeaderElector::new(Arc::new(store.clone()), "controllers", holder, ttl);
    drop(held.acquire().await.unwrap());
    let standby = LeaderElector::new(Arc::new(store.clone()), "controllers", this_process(), ttl);
    assert!(
        tokio::time::timeout(Duration::from_millis(500), standby.acquire())
            .await
            .is_err(),
        "a live holder keeps the lock"
    );
    drop(child);
    let t = Instant::now();
    let leader = tokio::time::timeout(Duration::from_secs(5), standby.acquire())
        .await
        .expect("a dead holder's lock is taken without waiting for the ttl")
        .unwrap();
    assert!(t.elapsed() < Duration::from_secs(2));
    assert!(leader.epoch() >= 2);
}
