//! The `ObjectStore` conformance suite: every guarantee of docs/store.md, checked through the
//! trait (`Arc<dyn ObjectStore>`, async), so any implementation runs it unchanged.
//!
//! An implementation provides an [`Implementation`] (a fresh empty store, and a way to open a
//! second, independent handle on it from its address, as another process would) and one line
//! in its own test file:
//!
//! ```ignore
//! mod common;
//! #[macro_use]
//! mod conformance;
//! conformance::suite!(MyStore);
//! ```
//!
//! which makes one test per check (on a multi-thread runtime, so work an implementation moves
//! off the async workers is exercised; a few also on a current-thread runtime), plus the
//! `conformance_child` entry point the cross-process check runs in a second OS process. A store
//! no other process can reach (one in memory) says so: `conformance::suite!(MyStore,
//! in_one_process)` makes every check but the cross-process one.
//!
//! Checks assume nothing an implementation may do differently: revisions are compared with
//! each other, never with fixed numbers, and leader epochs only grow.

#![allow(dead_code)] // each check is used through the `suite!` macro

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use boxery_api::{DynObject, Selector, Vm};
use boxery_store::{
    ApplyAction, ApplyOptions, Candidate, DeleteOutcome, LAST_APPLIED, Leadership, ObjectRef,
    ObjectStore, ObjectStoreExt, StoreError, WatchEvent, WatchStream,
};
use futures::StreamExt;
use serde_json::json;

use crate::common::{ChildGuard, Fixture, image, vm};

/// A store under test.
pub struct Subject {
    /// The handle the checks use.
    pub store: Arc<dyn ObjectStore>,
    /// What [`Implementation::open`] needs to reach the same store (a path, a URL).
    pub address: String,
    /// The handle with the control plane's rights (status writes, adoption, leadership,
    /// compaction): `store` itself for a store the control plane opens; for a client of a
    /// guarded surface (a context through the API, which refuses those calls:
    /// `store::guard`), the store behind it. Checks make the control plane's writes here and
    /// observe them through `store`.
    pub control: Arc<dyn ObjectStore>,
    /// Whatever keeps the store alive (a temp dir, a server); dropped after `store`.
    pub keep: Box<dyn std::any::Any + Send + Sync>,
}

/// An implementation under test.
pub trait Implementation: Send + Sync + 'static {
    /// A new, empty store, without background compaction (the checks compact when they mean
    /// to).
    fn fresh(&self) -> Subject;
    /// A second, independent handle on the store at `address`: its own connections, as
    /// another process opens it. Also called in a child process.
    fn open(&self, address: &str) -> Arc<dyn ObjectStore>;
    /// A second handle with the control plane's rights (see [`Subject::control`]).
    fn open_control(&self, address: &str) -> Arc<dyn ObjectStore> {
        self.open(address)
    }
}

/// Generate the tests: one per check, for the implementation `$imp` (an expression of a type
/// that implements [`Implementation`]).
macro_rules! suite {
    ($imp:expr) => {
        /// Not a test on its own: the child process of `watch_sees_writes_from_another_process`.
        #[test]
        fn conformance_child() {
            $crate::conformance::child(&$imp);
        }
        $crate::conformance::suite!(@each $imp, "multi_thread";
            watch_sees_writes_from_another_process,
        );
        $crate::conformance::suite!($imp, in_one_process);
    };
    ($imp:expr, in_one_process) => {
        $crate::conformance::suite!(@each $imp, "multi_thread";
            create_sets_server_fields_and_refuses_a_taken_name,
            get_is_none_for_absent_objects_and_impossible_names,
            list_is_sorted_filtered_and_returns_its_revision,
            list_named_prefix_returns_exactly_the_names_that_start_with_it,
            list_at_reads_the_past_or_says_it_cannot,
            generation_grows_with_spec_changes_only,
            fields_fixed_at_creation_are_refused_by_update_and_apply,
            a_stale_resource_version_conflicts_and_writes_nothing,
            an_update_without_resource_version_is_unconditional,
            concurrent_conditional_updates_never_lose_one,
            writes_that_change_nothing_write_nothing,
            update_status_never_bumps_generation_and_is_refused_for_events,
            finalizers_mark_then_the_last_one_removes,
            removal_cascades_by_owner_uid,
            an_owner_reference_must_name_a_current_uid,
            apply_creates_configures_and_records_last_applied,
            apply_is_all_or_nothing,
            apply_refuses_objects_being_deleted,
            apply_sets_its_fields_and_leaves_other_managers_fields,
            two_appliers_conflict_on_a_field_and_share_an_equal_one,
            a_forced_apply_takes_a_field_over,
            prune_of_an_apply_set_reaches_kinds_it_no_longer_holds,
            prune_deletes_only_applied_objects_of_the_sets_kinds,
            dry_run_reports_and_writes_nothing,
            an_update_dry_run_checks_everything_and_writes_nothing,
            watch_is_ordered_exactly_once_and_resumable,
            a_dropped_watch_resumes_without_loss_or_repeat,
            a_kind_filtered_watch_is_not_held_back_by_other_kinds,
            list_then_watch_misses_nothing_under_concurrent_writers,
            compaction_makes_old_watches_too_old_and_a_relist_recovers,
            watch_sees_writes_from_another_handle,
            leader_lock_follows_expires_resigns_and_fences_by_epoch,
            removed_uids_are_remembered_and_the_identity_is_stable,
            adopt_recreates_an_object_with_its_uid,
        );
        mod current_thread {
            use super::*;
            $crate::conformance::suite!(@each $imp, "current_thread";
                create_sets_server_fields_and_refuses_a_taken_name,
                watch_is_ordered_exactly_once_and_resumable,
                watch_sees_writes_from_another_handle,
            );
        }
    };
    (@each $imp:expr, $flavor:tt; $($check:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = $flavor)]
            async fn $check() {
                $crate::conformance::$check(&$imp).await
            }
        )*
    };
}
pub(crate) use suite;

/// How long a check waits for an event that must come.
const PATIENCE: Duration = Duration::from_secs(10);
/// The name of the child entry point [`suite!`] generates.
const CHILD_TEST: &str = "conformance_child";
/// Set in the child process: the store's address.
const CHILD_ENV: &str = "BOXERY_STORE_CONFORMANCE_CHILD";
/// Objects the child process writes.
const CHILD_WRITES: usize = 10;

type Item = boxery_store::Result<(u64, WatchEvent)>;

fn key(kind: &str, name: &str) -> ObjectRef {
    ObjectRef::new(kind, name)
}

async fn get(s: &Arc<dyn ObjectStore>, kind: &str, name: &str) -> Option<DynObject> {
    s.get(&key(kind, name)).await.expect("get")
}

async fn rev(s: &Arc<dyn ObjectStore>) -> u64 {
    s.revision().await.expect("revision")
}

async fn names(s: &Arc<dyn ObjectStore>, kind: &str, selector: &str) -> Vec<String> {
    let sel: Selector = selector.parse().expect("selector");
    let (objs, _) = s.list(kind, &sel).await.expect("list");
    objs.into_iter().map(|o| o.metadata.name).collect()
}

/// Every object of the kinds the checks write, as JSON: a picture of the store's contents.
async fn contents(s: &Arc<dyn ObjectStore>) -> String {
    let mut out = String::new();
    for kind in ["Vm", "Image", "Event"] {
        let (objs, _) = s.list(kind, &Selector::default()).await.expect("list");
        out.push_str(&serde_json::to_string(&objs).expect("json"));
        out.push('\n');
    }
    out
}

async fn next(w: &mut WatchStream) -> Item {
    tokio::time::timeout(PATIENCE, w.next())
        .await
        .expect("a watch event in time")
        .expect("the stream is open")
}

/// Nothing arrives for a while.
async fn quiet(w: &mut WatchStream, what: &str) {
    if let Ok(got) = tokio::time::timeout(Duration::from_millis(150), w.next()).await {
        panic!("{what}: want no event, got {got:?}");
    }
}

fn summary(item: &(u64, WatchEvent)) -> (u64, &'static str, String) {
    let (rev, ev) = item;
    let ty = match ev {
        WatchEvent::Added(_) => "Added",
        WatchEvent::Modified(_) => "Modified",
        WatchEvent::Deleted(_) => "Deleted",
    };
    (*rev, ty, ev.object().metadata.name.clone())
}

fn event(name: &str) -> DynObject {
    serde_json::from_value(json!({
        "apiVersion": boxery_api::API_VERSION, "kind": "Event",
        "metadata": {"name": name},
        "involvedObject": {"kind": "Vm", "name": "dev1"},
        "type": "Normal", "reason": "Created", "message": "created",
        "firstTimestamp": "2026-11-30T10:00:00Z", "lastTimestamp": "2026-11-30T10:00:00Z"
    }))
    .expect("fixture")
}

fn with_status(mut o: DynObject, status: serde_json::Value) -> DynObject {
    o.rest.insert("status".into(), status);
    o
}

fn unconditional(mut o: DynObject) -> DynObject {
    o.metadata.resource_version = None;
    o
}

fn apply_opts() -> ApplyOptions {
    ApplyOptions::default()
}

fn actions(out: &[(ApplyAction, DynObject)]) -> Vec<(ApplyAction, String)> {
    out.iter()
        .map(|(a, o)| (*a, o.metadata.name.clone()))
        .collect()
}

// --- objects -----------------------------------------------------------------------------

/// `create` sets the server fields (ignoring the client's), `get` returns the object as
/// created, a taken name is `AlreadyExists`, an invalid object `Invalid`, and a failed write
/// writes nothing.
pub async fn create_sets_server_fields_and_refuses_a_taken_name(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    let r0 = rev(s).await;
    let mut input = vm("dev1");
    input.metadata.uid = Some("forged".into());
    input.metadata.generation = Some(7);
    input.metadata.resource_version = Some("77".into());
    input.metadata.creation_timestamp = Some("2000-01-01T00:00:00Z".parse().unwrap());
    input.metadata.deletion_timestamp = Some(boxery_api::now());
    let created = s.create(input).await.unwrap();
    let m = &created.metadata;
    let uid = m.uid.as_deref().expect("a uid");
    assert!(
        !uid.is_empty() && uid != "forged",
        "the server's uid: {uid}"
    );
    assert_eq!(m.generation, Some(1));
    assert!(m.rv() > r0, "a new revision: {m:?}");
    assert_eq!(
        rev(s).await,
        m.rv(),
        "resourceVersion is the change's revision"
    );
    let ts = m.creation_timestamp.expect("creationTimestamp");
    assert!(
        ts.timestamp() > 946_684_800,
        "the server's creationTimestamp"
    );
    assert!(m.deletion_timestamp.is_none(), "not settable by create");
    assert_eq!(created.spec()["runStrategy"], "Running", "defaults written");
    assert_eq!(get(s, "Vm", "dev1").await, Some(created.clone()));

    let at = rev(s).await;
    let err = s.create(vm("dev1")).await.unwrap_err();
    assert!(matches!(err, StoreError::AlreadyExists { .. }), "{err}");
    let err = s.create(vm("Bad_Name")).await.unwrap_err();
    assert!(matches!(err, StoreError::Invalid(_)), "{err}");
    let err = s.create(vm("big").cpus(1000)).await.unwrap_err();
    assert!(matches!(err, StoreError::Invalid(_)), "{err}");
    assert_eq!(rev(s).await, at, "failed writes write nothing");
    assert_eq!(get(s, "Vm", "big").await, None);

    // Another object gets another uid; the typed helper reads the same object.
    let other = s.create(vm("dev2")).await.unwrap();
    assert_ne!(other.metadata.uid, created.metadata.uid);
    assert!(other.metadata.rv() > created.metadata.rv());
    let typed: Vm = s.get_as("dev1").await.unwrap().unwrap();
    assert_eq!(typed.metadata.uid, created.metadata.uid);
}

/// `get` answers `None` for an absent object, an unknown kind and a name no object can have.
pub async fn get_is_none_for_absent_objects_and_impossible_names(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    s.create(vm("dev1")).await.unwrap();
    assert_eq!(get(s, "Vm", "nope").await, None);
    assert_eq!(get(s, "Image", "dev1").await, None, "keys include the kind");
    for name in ["../x", "", "Bad_Name", "a/b", &"x".repeat(300)] {
        assert_eq!(get(s, "Vm", name).await, None, "{name:?}");
    }
    assert_eq!(get(s, "NoSuchKind", "dev1").await, None);
}

/// `list` filters by label selector, sorts by name, and returns the revision it read at.
pub async fn list_is_sorted_filtered_and_returns_its_revision(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    s.create(vm("c").label("team", "web")).await.unwrap();
    s.create(vm("a").label("team", "web").label("tier", "fe"))
        .await
        .unwrap();
    s.create(vm("b").label("team", "db")).await.unwrap();
    s.create(image("a-img").label("team", "web")).await.unwrap();
    assert_eq!(names(s, "Vm", "").await, ["a", "b", "c"]);
    assert_eq!(names(s, "Vm", "team=web").await, ["a", "c"]);
    assert_eq!(names(s, "Vm", "team!=web").await, ["b"]);
    assert_eq!(names(s, "Vm", "tier").await, ["a"]);
    assert_eq!(names(s, "Vm", "team in (db,x),!tier").await, ["b"]);
    assert_eq!(names(s, "Image", "team=web").await, ["a-img"]);
    assert!(names(s, "Pool", "").await.is_empty());
    let (_, at) = s.list("Vm", &Selector::default()).await.unwrap();
    assert_eq!(at, rev(s).await, "the revision the list was read at");
    let typed: Vec<Vm> = s.list_as(&"team=web".parse().unwrap()).await.unwrap();
    assert_eq!(typed.len(), 2);
}

/// A name prefix selects exactly the names that start with it, of that kind only, sorted.
pub async fn list_named_prefix_returns_exactly_the_names_that_start_with_it(
    imp: &dyn Implementation,
) {
    let sub = imp.fresh();
    let s = &sub.store;
    for n in ["web", "web-a", "web-b", "web-2", "webz", "we", "x-web"] {
        s.create(vm(n)).await.unwrap();
    }
    s.create(image("web-img")).await.unwrap();
    let named = |p: &'static str| async move {
        s.list_named_prefix("Vm", p)
            .await
            .unwrap()
            .into_iter()
            .map(|o| o.metadata.name)
            .collect::<Vec<_>>()
    };
    assert_eq!(named("web-").await, ["web-2", "web-a", "web-b"]);
    assert_eq!(
        named("web").await,
        ["web", "web-2", "web-a", "web-b", "webz"]
    );
    assert_eq!(named("").await.len(), 7);
    assert!(named("nothing").await.is_empty());
    let imgs = s.list_named_prefix("Image", "web-").await.unwrap();
    assert_eq!(imgs.len(), 1);
}

/// `generation` grows by one on a spec change only; labels, annotations and status do not
/// bump it; the server fields cannot be changed through `update`.
pub async fn generation_grows_with_spec_changes_only(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    let v = s.create(vm("dev1")).await.unwrap();
    let v2 = s.update(v.clone().label("team", "web")).await.unwrap();
    assert_eq!(v2.metadata.generation, Some(1), "labels");
    assert!(v2.metadata.rv() > v.metadata.rv(), "a new revision");
    assert_eq!(v2.metadata.labels["team"], "web");
    let mut a = v2.clone();
    a.metadata.annotations.insert("note".into(), "x".into());
    let v3 = s.update(a).await.unwrap();
    assert_eq!(v3.metadata.generation, Some(1), "annotations");
    let v4 = s.update(v3.clone().cpus(4)).await.unwrap();
    assert_eq!(v4.metadata.generation, Some(2), "spec");
    assert_eq!(v4.spec()["resources"]["cpus"], 4);
    let v5 = sub
        .control
        .update_status(with_status(v4.clone(), json!({"phase": "Running"})))
        .await
        .unwrap();
    assert_eq!(v5.metadata.generation, Some(2), "status");
    let v6 = s.update(v5.clone().cpus(2)).await.unwrap();
    assert_eq!(v6.metadata.generation, Some(3));

    let mut forged = v6.clone();
    forged.metadata.uid = Some("forged".into());
    forged.metadata.generation = Some(99);
    forged.metadata.creation_timestamp = Some("2000-01-01T00:00:00Z".parse().unwrap());
    forged.metadata.deletion_timestamp = Some(boxery_api::now());
    let at = rev(s).await;
    let v7 = s.update(forged).await.unwrap();
    assert_eq!(
        v7, v6,
        "uid, generation and the timestamps are the server's"
    );
    assert_eq!(rev(s).await, at);
    assert_eq!(get(s, "Vm", "dev1").await, Some(v6));
}

/// A field fixed once the object exists (a Vm's `spec.source`, `spec.instanceType`) is
/// refused when an update or an apply would set, unset or change it, saying what it is and
/// what to do, and nothing is written; the same value again, and other fields, go through.
pub async fn fields_fixed_at_creation_are_refused_by_update_and_apply(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    let typed = with_spec(vm("c1"), "instanceType", json!("container"));
    let v = s.create(typed).await.unwrap();
    let at = rev(s).await;
    for (field, value) in [
        ("instanceType", json!("virtual-machine")),
        ("instanceType", serde_json::Value::Null),
        ("source", json!({"image": "tiny"})),
    ] {
        let mut changed = with_spec(v.clone(), field, value.clone());
        if value.is_null() {
            changed
                .rest
                .get_mut("spec")
                .unwrap()
                .as_object_mut()
                .unwrap()
                .remove(field);
        }
        let e = s.update(changed.clone()).await.unwrap_err().to_string();
        assert!(
            e.contains(&format!("spec.{field}"))
                && e.contains("fixed once the Vm exists")
                && e.contains("delete the Vm and make it again"),
            "update of {field}: {e}"
        );
        if value.is_null() {
            // an apply that leaves out a field it never set leaves it as it is
            continue;
        }
        changed.metadata.resource_version = None;
        let e = s
            .apply_all(vec![changed], &apply_opts())
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("spec.{field}")),
            "apply of {field}: {e}"
        );
    }
    let e = s
        .update(with_spec(v.clone(), "source", json!({"image": "tiny"})))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains(r#"it is {"image":"debian-12"}"#), "{e}");
    assert_eq!(rev(s).await, at, "nothing written");
    let same = s
        .update(with_spec(v.clone(), "instanceType", json!("container")).cpus(3))
        .await
        .unwrap();
    assert_eq!(
        same.metadata.generation,
        Some(2),
        "the rest of the spec changes"
    );
    // set where it was not: refused too (what was made was made without it)
    let plain = s.create(vm("p1")).await.unwrap();
    let e = s
        .update(with_spec(plain, "instanceType", json!("virtual-machine")))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("it was not set"), "{e}");
}

/// A write carrying a stale `resourceVersion` is `Conflict` (saying both versions) and writes
/// nothing; writes to an absent object are `NotFound`.
pub async fn a_stale_resource_version_conflicts_and_writes_nothing(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    let v = s.create(vm("dev1")).await.unwrap();
    let v2 = s.update(v.clone().label("a", "1")).await.unwrap();
    let at = rev(s).await;
    let err = s.update(v.clone().label("b", "2")).await.unwrap_err();
    match &err {
        StoreError::Conflict {
            expected, actual, ..
        } => {
            assert_eq!(expected, &v.metadata.rv().to_string());
            assert_eq!(actual, &v2.metadata.rv().to_string());
        }
        other => panic!("want Conflict, got {other}"),
    }
    assert!(err.to_string().contains("read it again"), "{err}");
    let err = sub
        .control
        .update_status(with_status(v.clone(), json!({"phase": "Running"})))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Conflict { .. }), "{err}");
    assert_eq!(rev(s).await, at, "a refused write writes nothing");
    assert_eq!(get(s, "Vm", "dev1").await, Some(v2.clone()));
    // The current version passes.
    s.update(v2.label("b", "2")).await.unwrap();

    let err = s.update(vm("ghost")).await.unwrap_err();
    assert!(matches!(err, StoreError::NotFound { .. }), "{err}");
    let err = sub.control.update_status(vm("ghost")).await.unwrap_err();
    assert!(matches!(err, StoreError::NotFound { .. }), "{err}");
    let err = s.delete(&key("Vm", "ghost")).await.unwrap_err();
    assert!(matches!(err, StoreError::NotFound { .. }), "{err}");
}

/// `update_dry_run` returns what `update` would store (validated, defaulted, the generation
/// bumped for a spec change, the precondition checked) and writes nothing: no object, no
/// revision, no watch event.
pub async fn an_update_dry_run_checks_everything_and_writes_nothing(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    let v = s.create(vm("dev1")).await.unwrap();
    let at = rev(s).await;
    let would = s.update_dry_run(v.clone().cpus(4)).await.unwrap();
    assert_eq!(would.spec()["resources"]["cpus"], 4);
    assert_eq!(
        would.metadata.generation,
        Some(2),
        "as update would bump it"
    );
    assert_eq!(rev(s).await, at, "no revision");
    assert_eq!(
        get(s, "Vm", "dev1").await,
        Some(v.clone()),
        "nothing stored"
    );
    // the real update path's refusals
    let mut bad = v.clone().cpus(4);
    bad.rest.get_mut("spec").expect("spec")["resources"]["cpus"] = json!("many");
    assert!(matches!(
        s.update_dry_run(bad).await.unwrap_err(),
        StoreError::Invalid(_)
    ));
    let v2 = s.update(v.clone().label("a", "1")).await.unwrap();
    assert!(matches!(
        s.update_dry_run(v.clone().cpus(2)).await.unwrap_err(),
        StoreError::Conflict { .. }
    ));
    assert!(matches!(
        s.update_dry_run(vm("ghost")).await.unwrap_err(),
        StoreError::NotFound { .. }
    ));
    assert_eq!(get(s, "Vm", "dev1").await, Some(v2));
}

/// Without a `resourceVersion` an update is unconditional: it replaces what it replaces.
pub async fn an_update_without_resource_version_is_unconditional(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    let v = s.create(vm("dev1")).await.unwrap();
    s.update(v.clone().label("a", "1")).await.unwrap();
    let out = s.update(unconditional(v.label("b", "2"))).await.unwrap();
    assert_eq!(out.metadata.labels.get("a"), None, "labels replaced");
    assert_eq!(out.metadata.labels["b"], "2");
    let st = sub
        .control
        .update_status(unconditional(with_status(
            out.clone(),
            json!({"phase": "Running"}),
        )))
        .await
        .unwrap();
    assert_eq!(st.status()["phase"], "Running");
}

/// Tasks racing read-modify-write cycles with preconditions (retrying on `Conflict`) never
/// lose an update.
pub async fn concurrent_conditional_updates_never_lose_one(imp: &dyn Implementation) {
    const TASKS: usize = 4;
    const EACH: usize = 15;
    let sub = imp.fresh();
    let other = imp.open(&sub.address);
    sub.store.create(vm("counter")).await.unwrap();
    let conflicts = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let s = if t % 2 == 0 {
            sub.store.clone()
        } else {
            other.clone()
        };
        let conflicts = conflicts.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..EACH {
                loop {
                    let cur = get(&s, "Vm", "counter").await.unwrap();
                    let n: usize = cur
                        .metadata
                        .labels
                        .get("n")
                        .map_or(0, |n| n.parse().unwrap());
                    match s.update(cur.label("n", &(n + 1).to_string())).await {
                        Ok(_) => break,
                        Err(StoreError::Conflict { .. }) => {
                            conflicts.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => panic!("update: {e}"),
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let last = get(&sub.store, "Vm", "counter").await.unwrap();
    assert_eq!(
        last.metadata.labels["n"],
        (TASKS * EACH).to_string(),
        "{} conflicts",
        conflicts.load(Ordering::Relaxed)
    );
}

/// An update, status update, apply or repeated delete that changes nothing returns the stored
/// object and writes nothing: no revision, no event.
pub async fn writes_that_change_nothing_write_nothing(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    s.apply_all(vec![vm("applied")], &apply_opts())
        .await
        .unwrap();
    let v = s.create(vm("dev1").label("a", "1")).await.unwrap();
    let v = sub
        .control
        .update_status(with_status(v, json!({"phase": "Running"})))
        .await
        .unwrap();
    let marked = s.create(image("img").finalizer("f")).await.unwrap();
    let DeleteOutcome::Marked(marked) = s.delete(&ObjectRef::to(&marked)).await.unwrap() else {
        panic!("want Marked")
    };
    let at = rev(s).await;
    let mut w = s.watch(None, at);

    assert_eq!(s.update(v.clone()).await.unwrap(), v);
    assert_eq!(s.update(unconditional(v.clone())).await.unwrap(), v);
    assert_eq!(sub.control.update_status(v.clone()).await.unwrap(), v);
    let out = s
        .apply_all(vec![vm("applied")], &apply_opts())
        .await
        .unwrap();
    assert_eq!(actions(&out), [(ApplyAction::Unchanged, "applied".into())]);
    let DeleteOutcome::Marked(again) = s.delete(&ObjectRef::to(&marked)).await.unwrap() else {
        panic!("want Marked")
    };
    assert_eq!(again, marked, "deleting again changes nothing");
    assert_eq!(rev(s).await, at, "no revision");
    quiet(&mut w, "no-op writes").await;

    // The next real change is the next event.
    let changed = s.update(v.label("a", "2")).await.unwrap();
    let (r, ev) = next(&mut w).await.unwrap();
    assert_eq!(r, changed.metadata.rv());
    assert_eq!(ev, WatchEvent::Modified(changed));
}

/// `update_status` replaces only status and never bumps generation; `update` keeps the stored
/// status; an invalid status is `Invalid`; an `Event` has no status (`Invalid`).
pub async fn update_status_never_bumps_generation_and_is_refused_for_events(
    imp: &dyn Implementation,
) {
    let sub = imp.fresh();
    let s = &sub.control;
    let v = s.create(vm("dev1")).await.unwrap();
    let w = with_status(
        v.clone().cpus(8).label("x", "y"),
        json!({"phase": "Running", "observedGeneration": 1}),
    );
    let out = sub.control.update_status(w).await.unwrap();
    assert_eq!(out.status()["phase"], "Running");
    assert_eq!(out.metadata.generation, Some(1));
    assert!(out.metadata.rv() > v.metadata.rv());
    assert_eq!(out.spec(), v.spec(), "spec untouched");
    assert!(out.metadata.labels.is_empty(), "labels untouched");

    let u = with_status(out.clone().cpus(2), json!({"phase": "Failed"}));
    let out2 = s.update(u).await.unwrap();
    assert_eq!(out2.status()["phase"], "Running", "update keeps status");
    assert_eq!(out2.metadata.generation, Some(2));

    let at = rev(s).await;
    let bad = with_status(out2.clone(), json!({"phase": "Dancing"}));
    let err = sub.control.update_status(bad).await.unwrap_err();
    assert!(matches!(err, StoreError::Invalid(_)), "{err}");
    assert_eq!(rev(s).await, at);

    let mut typed: Vm = out2.to_typed().unwrap();
    typed.status.observed_generation = Some(2);
    let t2 = sub.control.update_status_as(&typed).await.unwrap();
    assert_eq!(t2.status.observed_generation, Some(2));
    assert_eq!(t2.metadata.generation, Some(2));

    let e = s.create(event("dev1.abc")).await.unwrap();
    let mut e2 = e.clone();
    e2.rest.insert("count".into(), 2.into());
    let e2 = s.update(e2).await.unwrap();
    assert_eq!(
        e2.rest["count"], 2,
        "an Event's fields change through update"
    );
    let at = rev(s).await;
    let err = sub.control.update_status(e2).await.unwrap_err();
    assert!(matches!(err, StoreError::Invalid(_)), "{err}");
    assert_eq!(rev(s).await, at);
}

/// `delete` marks an object with finalizers (once); no finalizer can be added to it; update
/// cannot clear `deletionTimestamp`; the update removing the last finalizer removes it.
pub async fn finalizers_mark_then_the_last_one_removes(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    s.create(
        vm("dev1")
            .finalizer("boxery.dev/vm")
            .finalizer("boxery.dev/other"),
    )
    .await
    .unwrap();
    let k = key("Vm", "dev1");
    let DeleteOutcome::Marked(m) = s.delete(&k).await.unwrap() else {
        panic!("want Marked")
    };
    let ts = m.metadata.deletion_timestamp;
    assert!(ts.is_some());
    assert_eq!(rev(s).await, m.metadata.rv(), "marking is a change");
    let DeleteOutcome::Marked(m2) = s.delete(&k).await.unwrap() else {
        panic!("want Marked")
    };
    assert_eq!(m2.metadata.deletion_timestamp, ts);

    let err = s
        .update(m2.clone().finalizer("boxery.dev/late"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("finalizer"), "{err}");
    let mut cleared = m2.clone();
    cleared.metadata.deletion_timestamp = None;
    let cleared = s.update(cleared).await.unwrap();
    assert_eq!(cleared.metadata.deletion_timestamp, ts, "cannot be cleared");

    let mut one = cleared.clone();
    one.metadata.finalizers.retain(|f| f != "boxery.dev/other");
    let one = s.update(one).await.unwrap();
    assert_eq!(one.metadata.deletion_timestamp, ts);
    assert!(get(s, "Vm", "dev1").await.is_some(), "a finalizer remains");

    let mut w = s.watch(Some("Vm"), rev(s).await);
    let mut none = one.clone();
    none.metadata.finalizers.clear();
    let gone = s.update(none).await.unwrap();
    assert!(
        gone.metadata.finalizers.is_empty(),
        "returned as it was last"
    );
    assert_eq!(get(s, "Vm", "dev1").await, None);
    let (_, ev) = next(&mut w).await.unwrap();
    assert!(matches!(ev, WatchEvent::Deleted(_)), "{ev:?}");
    let err = s.delete(&k).await.unwrap_err();
    assert!(matches!(err, StoreError::NotFound { .. }), "{err}");

    s.create(vm("dev2")).await.unwrap();
    let out = s.delete(&key("Vm", "dev2")).await.unwrap();
    assert!(matches!(out, DeleteOutcome::Removed(_)), "no finalizers");
    assert_eq!(get(s, "Vm", "dev2").await, None);
}

/// Removing an object removes (or marks, with finalizers) every object naming its uid among
/// its ownerReferences, recursively; a reference by name alone, or to an older object of the
/// same name, is not ownership; an owner only marked does not cascade yet.
pub async fn removal_cascades_by_owner_uid(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    let owner = s.create(vm("owner")).await.unwrap();
    let child = s.create(vm("child").owned_by(&owner)).await.unwrap();
    s.create(image("grandchild").owned_by(&child))
        .await
        .unwrap();
    s.create(
        image("guarded")
            .owned_by(&child)
            .finalizer("boxery.dev/image"),
    )
    .await
    .unwrap();
    let unrelated = s.create(vm("unrelated")).await.unwrap();
    let mut by_name = vm("by-name").owned_by(&unrelated);
    by_name.metadata.owner_references[0].name = "owner".into();
    s.create(by_name).await.unwrap();

    let out = s.delete(&key("Vm", "owner")).await.unwrap();
    assert!(matches!(out, DeleteOutcome::Removed(_)));
    assert_eq!(get(s, "Vm", "child").await, None);
    assert_eq!(get(s, "Image", "grandchild").await, None);
    let g = get(s, "Image", "guarded")
        .await
        .expect("finalizers keep it");
    assert!(g.metadata.is_deleting(), "marked for deletion");
    assert!(get(s, "Vm", "unrelated").await.is_some());
    assert!(get(s, "Vm", "by-name").await.is_some(), "not owned by uid");

    // A new object with the old owner's name is not the owner of what names the old uid.
    let again = s.create(vm("owner")).await.unwrap();
    assert_ne!(again.metadata.uid, owner.metadata.uid);
    s.create(vm("new-child").owned_by(&again)).await.unwrap();
    s.delete(&key("Vm", "owner")).await.unwrap();
    assert_eq!(get(s, "Vm", "new-child").await, None);
    assert!(get(s, "Vm", "by-name").await.is_some(), "still not owned");

    // An owner that is only marked does not cascade until its last finalizer goes.
    let owner2 = s.create(vm("owner2").finalizer("f")).await.unwrap();
    s.create(vm("child2").owned_by(&owner2)).await.unwrap();
    let out = s.delete(&key("Vm", "owner2")).await.unwrap();
    assert!(matches!(out, DeleteOutcome::Marked(_)));
    assert!(get(s, "Vm", "child2").await.is_some());
    let mut o = get(s, "Vm", "owner2").await.unwrap();
    o.metadata.finalizers.clear();
    s.update(o).await.unwrap();
    assert_eq!(get(s, "Vm", "child2").await, None, "cascade on removal");

    // A dependent naming several owners goes with any of them.
    let a = s.create(vm("a")).await.unwrap();
    let b = s.create(vm("b")).await.unwrap();
    s.create(vm("both").owned_by(&a).owned_by(&b))
        .await
        .unwrap();
    s.delete(&key("Vm", "a")).await.unwrap();
    assert_eq!(get(s, "Vm", "both").await, None);
}

/// A new ownerReference must name the uid of a current object (`OwnerGone`): not a removed
/// owner's uid, even when an object of its name exists again.
pub async fn an_owner_reference_must_name_a_current_uid(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    let owner = s.create(vm("owner")).await.unwrap();
    s.delete(&key("Vm", "owner")).await.unwrap();
    let err = s.create(vm("orphan").owned_by(&owner)).await.unwrap_err();
    assert!(matches!(err, StoreError::OwnerGone { .. }), "{err}");
    assert!(err.to_string().contains("Vm/owner"), "{err}");
    let again = s.create(vm("owner")).await.unwrap();
    let err = s.create(vm("orphan").owned_by(&owner)).await.unwrap_err();
    assert!(
        matches!(err, StoreError::OwnerGone { .. }),
        "same name, old uid: {err}"
    );
    let x = s.create(vm("x")).await.unwrap();
    let err = s.update(x.clone().owned_by(&owner)).await.unwrap_err();
    assert!(matches!(err, StoreError::OwnerGone { .. }), "{err}");
    assert_eq!(get(s, "Vm", "orphan").await, None);
    assert!(
        get(s, "Vm", "x")
            .await
            .unwrap()
            .metadata
            .owner_references
            .is_empty()
    );
    let x = s.update(x.owned_by(&again)).await.unwrap();
    assert_eq!(
        x.metadata.owner_references[0].uid,
        again.metadata.uid.unwrap()
    );
}

// --- apply -------------------------------------------------------------------------------

/// `apply_all` creates absent objects with a last-applied record, configures present ones
/// (keeping status, finalizers and system annotations; generation only on a spec change),
/// and leaves unchanged ones alone.
pub async fn apply_creates_configures_and_records_last_applied(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    let out = s
        .apply_all(vec![vm("a"), vm("b").label("team", "web")], &apply_opts())
        .await
        .unwrap();
    assert_eq!(
        actions(&out),
        [
            (ApplyAction::Created, "a".into()),
            (ApplyAction::Created, "b".into())
        ]
    );
    assert_eq!(
        out[0].1,
        get(s, "Vm", "a").await.unwrap(),
        "returns what it stored"
    );
    let a = get(s, "Vm", "a").await.unwrap();
    assert_eq!(a.metadata.generation, Some(1));
    let record: serde_json::Value =
        serde_json::from_str(&a.metadata.annotations[LAST_APPLIED]).unwrap();
    assert_eq!(
        record,
        serde_json::to_value(vm("a")).unwrap(),
        "the manifest as given"
    );

    // The controller writes status, a finalizer, a system annotation; a user one more.
    let a = sub
        .control
        .update_status(with_status(a, json!({"phase": "Running"})))
        .await
        .unwrap();
    let mut a2 = a.finalizer("boxery.dev/vm");
    a2.metadata
        .annotations
        .insert("boxery.dev/printed".into(), "x".into());
    a2.metadata
        .annotations
        .insert("note".into(), "by hand".into());
    s.update(a2).await.unwrap();

    let mut manifest = with_status(vm("a").cpus(2), json!({"phase": "Failed"}));
    manifest
        .metadata
        .annotations
        .insert("owner".into(), "me".into());
    let out = s
        .apply_all(vec![manifest, vm("b").label("team", "web")], &apply_opts())
        .await
        .unwrap();
    assert_eq!(
        actions(&out),
        [
            (ApplyAction::Configured, "a".into()),
            (ApplyAction::Unchanged, "b".into())
        ]
    );
    let a = get(s, "Vm", "a").await.unwrap();
    assert_eq!(a.metadata.generation, Some(2));
    assert_eq!(
        a.status()["phase"],
        "Running",
        "status is observed, not applied"
    );
    assert_eq!(a.metadata.finalizers, ["boxery.dev/vm"]);
    assert_eq!(a.metadata.annotations["boxery.dev/printed"], "x");
    // Set by another manager (the update above), so the manifest, which never named it,
    // leaves it alone (field ownership).
    assert_eq!(
        a.metadata.annotations.get("note").map(String::as_str),
        Some("by hand")
    );
    assert_eq!(a.metadata.annotations["owner"], "me");
    let record = &a.metadata.annotations[LAST_APPLIED];
    assert!(record.contains("\"cpus\":2"), "{record}");
    assert!(!record.contains("status"), "{record}");

    let out = s
        .apply_all(vec![vm("b").label("team", "db")], &apply_opts())
        .await
        .unwrap();
    assert_eq!(actions(&out), [(ApplyAction::Configured, "b".into())]);
    assert_eq!(
        get(s, "Vm", "b").await.unwrap().metadata.generation,
        Some(1)
    );
}

/// One invalid object, or a key twice in a set, and nothing of the set is written: no
/// object, no revision, no event.
fn with_spec(mut o: DynObject, field: &str, value: serde_json::Value) -> DynObject {
    o.rest.get_mut("spec").unwrap()[field] = value;
    o
}

fn by(manager: &str) -> ApplyOptions {
    ApplyOptions {
        field_manager: Some(manager.into()),
        ..Default::default()
    }
}

/// The fields `manager` owns on `o`, dotted (`spec.runStrategy`).
fn owned(o: &DynObject, manager: &str) -> Vec<String> {
    fn go(v: &serde_json::Value, path: &mut Vec<String>, out: &mut Vec<String>) {
        let m = v.as_object().unwrap();
        if m.is_empty() {
            out.push(path.join("."));
        }
        for (k, c) in m {
            path.push(k.trim_start_matches("f:").to_string());
            go(c, path, out);
            path.pop();
        }
    }
    let mut out = Vec::new();
    for e in o
        .metadata
        .managed_fields
        .iter()
        .filter(|e| e.manager == manager)
    {
        go(&e.fields_v1, &mut Vec::new(), &mut out);
    }
    out.sort();
    out
}

/// Field ownership: an apply sets what its manifest names, removes what it named before and
/// no longer does, and leaves what another manager set (`stop`'s runStrategy, a hand-made
/// label); setting such a field to another value is a conflict naming the other manager.
pub async fn apply_sets_its_fields_and_leaves_other_managers_fields(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    let first = vm("a").cpus(2).label("team", "web");
    s.apply_all(vec![first.clone()], &apply_opts())
        .await
        .unwrap();
    let a = get(s, "Vm", "a").await.unwrap();
    assert_eq!(
        owned(&a, "boxery-apply"),
        [
            "metadata.labels.team",
            "spec.resources.cpus",
            "spec.source.image"
        ],
        "the applier owns what the manifest names, not the defaults"
    );
    // Another manager stops it and labels it.
    let mut stopped = with_spec(a.clone(), "runStrategy", json!("Stopped"));
    stopped.metadata.labels.insert("owner".into(), "me".into());
    let stopped = s.update_by(stopped, "boxery-stop").await.unwrap();
    assert_eq!(
        owned(&stopped, "boxery-stop"),
        ["metadata.labels.owner", "spec.runStrategy"]
    );
    // The same manifest again: nothing to do, nothing written.
    let at = rev(s).await;
    let out = s
        .apply_all(vec![first.clone()], &apply_opts())
        .await
        .unwrap();
    assert_eq!(actions(&out), [(ApplyAction::Unchanged, "a".into())]);
    assert_eq!(rev(s).await, at);
    // The manifest drops cpus: the applier's field is removed (its default comes back), the
    // stop and the hand-made label stay.
    let out = s
        .apply_all(vec![vm("a").label("team", "web")], &apply_opts())
        .await
        .unwrap();
    assert_eq!(actions(&out), [(ApplyAction::Configured, "a".into())]);
    let a = get(s, "Vm", "a").await.unwrap();
    assert_eq!(a.rest["spec"]["runStrategy"], "Stopped");
    assert_eq!(a.metadata.labels["owner"], "me");
    assert_eq!(a.rest["spec"]["resources"]["cpus"], 1, "the default again");
    assert_eq!(a.metadata.generation, Some(3));
    // Setting the stopped field to another value: a conflict, nothing written.
    let at = rev(s).await;
    let err = s
        .apply_all(
            vec![with_spec(vm("a"), "runStrategy", json!("Running")), vm("b")],
            &apply_opts(),
        )
        .await
        .unwrap_err();
    match &err {
        StoreError::FieldConflicts {
            object,
            applier,
            conflicts,
        } => {
            assert_eq!(
                (object.as_str(), applier.as_str()),
                ("Vm/a", "boxery-apply")
            );
            assert_eq!(conflicts.len(), 1);
            assert_eq!(conflicts[0].field, "spec.runStrategy");
            assert_eq!(conflicts[0].manager, "boxery-stop");
        }
        other => panic!("expected FieldConflicts, got {other:?}"),
    }
    let text = err.to_string();
    assert!(
        text.contains("boxery-stop") && text.contains("--force-conflicts"),
        "{text}"
    );
    assert_eq!(rev(s).await, at, "a conflict writes nothing");
    assert!(get(s, "Vm", "b").await.is_none());
}

/// Two appliers: a field both set to one value is shared; another value is a conflict.
pub async fn two_appliers_conflict_on_a_field_and_share_an_equal_one(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    s.apply_all(vec![vm("a").cpus(2)], &by("git-one"))
        .await
        .unwrap();
    s.apply_all(vec![vm("a").cpus(2)], &by("git-two"))
        .await
        .unwrap();
    let a = get(s, "Vm", "a").await.unwrap();
    assert_eq!(owned(&a, "git-one"), owned(&a, "git-two"));
    let err = s
        .apply_all(vec![vm("a").cpus(4)], &by("git-two"))
        .await
        .unwrap_err();
    let StoreError::FieldConflicts { conflicts, .. } = err else {
        panic!("expected a conflict, got {err:?}")
    };
    assert_eq!(
        (conflicts[0].field.as_str(), conflicts[0].manager.as_str()),
        ("spec.resources.cpus", "git-one")
    );
    // git-one drops the field: git-two still names it, so it stays.
    s.apply_all(vec![vm("a")], &by("git-one")).await.unwrap();
    let a = get(s, "Vm", "a").await.unwrap();
    assert_eq!(a.rest["spec"]["resources"]["cpus"], 2);
    assert!(
        owned(&a, "git-one")
            .iter()
            .all(|f| f != "spec.resources.cpus")
    );
}

/// `force_conflicts`: the applier takes the field; the other manager loses it.
pub async fn a_forced_apply_takes_a_field_over(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    s.apply_all(vec![vm("a")], &apply_opts()).await.unwrap();
    let a = get(s, "Vm", "a").await.unwrap();
    s.update_by(with_spec(a, "runStrategy", json!("Stopped")), "boxery-stop")
        .await
        .unwrap();
    let opts = ApplyOptions {
        force_conflicts: true,
        ..Default::default()
    };
    s.apply_all(
        vec![with_spec(vm("a"), "runStrategy", json!("Running"))],
        &opts,
    )
    .await
    .unwrap();
    let a = get(s, "Vm", "a").await.unwrap();
    assert_eq!(a.rest["spec"]["runStrategy"], "Running");
    assert!(owned(&a, "boxery-stop").is_empty());
    assert!(owned(&a, "boxery-apply").contains(&"spec.runStrategy".to_string()));
}

/// An apply set's prune (`prune_all_kinds`) reaches a kind the set no longer holds at all,
/// and never an object outside the set.
pub async fn prune_of_an_apply_set_reaches_kinds_it_no_longer_holds(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    let set = "boxery.dev/applyset";
    s.apply_all(
        vec![vm("a").label(set, "one"), image("img").label(set, "one")],
        &apply_opts(),
    )
    .await
    .unwrap();
    s.apply_all(vec![image("mine")], &apply_opts())
        .await
        .unwrap();
    let opts = ApplyOptions {
        prune: Some(format!("{set}=one").parse().unwrap()),
        prune_all_kinds: true,
        ..Default::default()
    };
    let out = s
        .apply_all(vec![vm("a").label(set, "one")], &opts)
        .await
        .unwrap();
    assert_eq!(
        actions(&out),
        [
            (ApplyAction::Unchanged, "a".into()),
            (ApplyAction::Pruned, "img".into())
        ]
    );
    assert!(get(s, "Image", "mine").await.is_some());
}

pub async fn apply_is_all_or_nothing(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    s.apply_all(vec![vm("a"), vm("b")], &apply_opts())
        .await
        .unwrap();
    let before = contents(s).await;
    let at = rev(s).await;
    let mut w = s.watch(None, at);
    let err = s
        .apply_all(
            vec![vm("a").cpus(3), vm("c"), image("i"), vm("d").cpus(1000)],
            &apply_opts(),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Invalid(_)), "{err}");
    assert!(err.to_string().contains("spec.resources.cpus"), "{err}");
    let err = s
        .apply_all(vec![vm("x"), image("x"), vm("x").cpus(2)], &apply_opts())
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Invalid(_)), "{err}");
    assert!(
        err.to_string().contains("Vm/x appears more than once"),
        "{err}"
    );
    assert_eq!(contents(s).await, before);
    assert_eq!(rev(s).await, at);
    quiet(&mut w, "a refused apply").await;
    // The same kind and name in two kinds is two objects.
    s.apply_all(vec![vm("x"), image("x")], &apply_opts())
        .await
        .unwrap();
}

/// Applying an object being deleted is `BeingDeleted`, and writes nothing of the set.
pub async fn apply_refuses_objects_being_deleted(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    s.create(vm("a").finalizer("f")).await.unwrap();
    s.delete(&key("Vm", "a")).await.unwrap();
    let at = rev(s).await;
    let err = s
        .apply_all(vec![vm("new"), vm("a")], &apply_opts())
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::BeingDeleted { .. }), "{err}");
    assert!(err.to_string().contains("being deleted"), "{err}");
    assert_eq!(rev(s).await, at);
    assert_eq!(get(s, "Vm", "new").await, None);
}

/// Prune deletes objects of the set's kinds that match the selector, carry a last-applied
/// record and are not in the set; finalizers are respected, and a marked object is not
/// pruned twice.
pub async fn prune_deletes_only_applied_objects_of_the_sets_kinds(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    let apply = |objs: Vec<DynObject>| async move {
        s.apply_all(objs, &apply_opts()).await.unwrap();
    };
    apply(vec![
        vm("keep").label("app", "x"),
        vm("old").label("app", "x"),
        vm("other").label("app", "y"),
    ])
    .await;
    apply(vec![image("img-old").label("app", "x")]).await;
    s.create(vm("by-hand").label("app", "x")).await.unwrap();
    apply(vec![
        vm("guarded").label("app", "x").finalizer("boxery.dev/vm"),
    ])
    .await;
    let prune = ApplyOptions {
        prune: Some("app=x".parse().unwrap()),
        ..Default::default()
    };
    let out = s
        .apply_all(vec![vm("keep").label("app", "x")], &prune)
        .await
        .unwrap();
    assert_eq!(
        actions(&out),
        [
            (ApplyAction::Unchanged, "keep".into()),
            (ApplyAction::Pruned, "guarded".into()),
            (ApplyAction::Pruned, "old".into()),
        ]
    );
    assert_eq!(get(s, "Vm", "old").await, None);
    let g = get(s, "Vm", "guarded").await.unwrap();
    assert!(g.metadata.is_deleting(), "finalizers respected");
    assert!(get(s, "Vm", "other").await.is_some(), "selector");
    assert!(get(s, "Vm", "by-hand").await.is_some(), "never applied");
    assert!(
        get(s, "Image", "img-old").await.is_some(),
        "kind not in the set"
    );
    let at = rev(s).await;
    let out = s
        .apply_all(vec![vm("keep").label("app", "x")], &prune)
        .await
        .unwrap();
    assert_eq!(actions(&out), [(ApplyAction::Unchanged, "keep".into())]);
    assert_eq!(rev(s).await, at);
}

/// A dry run reports what would happen and writes nothing: no object, no revision, no event.
pub async fn dry_run_reports_and_writes_nothing(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    s.apply_all(vec![vm("a"), vm("b").label("app", "x")], &apply_opts())
        .await
        .unwrap();
    let before = contents(s).await;
    let at = rev(s).await;
    let mut w = s.watch(None, at);
    let opts = ApplyOptions {
        dry_run: true,
        prune: Some("app=x".parse().unwrap()),
        ..Default::default()
    };
    let out = s
        .apply_all(vec![vm("a").cpus(2), vm("c")], &opts)
        .await
        .unwrap();
    assert_eq!(
        actions(&out),
        [
            (ApplyAction::Configured, "a".into()),
            (ApplyAction::Created, "c".into()),
            (ApplyAction::Pruned, "b".into())
        ]
    );
    assert_eq!(
        out[0].1.spec()["resources"]["cpus"],
        2,
        "what would be stored"
    );
    assert_eq!(out[0].1.metadata.generation, Some(2));
    assert_eq!(contents(s).await, before);
    assert_eq!(rev(s).await, at);
    assert_eq!(get(s, "Vm", "c").await, None);
    quiet(&mut w, "a dry run").await;
    // A dry run that fails is the same error as the real one.
    let err = s
        .apply_all(vec![vm("d").cpus(1000)], &opts)
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Invalid(_)), "{err}");
}

// --- watch -------------------------------------------------------------------------------

/// A watch yields every change after its start revision, of one kind or all, in order,
/// exactly once, history first then live; `Deleted` carries the object as it was last with
/// the deletion's revision.
pub async fn watch_is_ordered_exactly_once_and_resumable(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    let r0 = rev(s).await;
    let a = s.create(vm("a")).await.unwrap();
    let img = s.create(image("img")).await.unwrap();
    let a2 = s.update(a.clone().label("x", "y")).await.unwrap();
    let DeleteOutcome::Removed(_) = s.delete(&key("Vm", "a")).await.unwrap() else {
        panic!("want Removed")
    };
    let r_del = rev(s).await;
    let (r1, r2, r3) = (a.metadata.rv(), img.metadata.rv(), a2.metadata.rv());
    assert!(r0 < r1 && r1 < r2 && r2 < r3 && r3 < r_del);

    let mut vms = s.watch(Some("Vm"), r0);
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(summary(&next(&mut vms).await.unwrap()));
    }
    assert_eq!(
        got,
        [
            (r1, "Added", "a".into()),
            (r3, "Modified", "a".into()),
            (r_del, "Deleted", "a".into())
        ]
    );

    let mut all = s.watch(None, r2);
    let (r, ev) = next(&mut all).await.unwrap();
    assert_eq!((r, ev), (r3, WatchEvent::Modified(a2.clone())));
    let (r, ev) = next(&mut all).await.unwrap();
    assert_eq!(r, r_del);
    let WatchEvent::Deleted(gone) = ev else {
        panic!("want Deleted, got {ev:?}")
    };
    assert_eq!(gone.metadata.rv(), r_del, "the deletion's revision");
    assert_eq!(gone.metadata.labels["x"], "y", "as it was last");
    assert_eq!(gone.metadata.uid, a.metadata.uid);

    let mut from_head = s.watch(None, r_del);
    let i2 = s.create(image("img2")).await.unwrap();
    let b = s.create(vm("b")).await.unwrap();
    assert_eq!(
        summary(&next(&mut vms).await.unwrap()),
        (b.metadata.rv(), "Added", "b".into())
    );
    for w in [&mut all, &mut from_head] {
        assert_eq!(
            next(w).await.unwrap(),
            (i2.metadata.rv(), WatchEvent::Added(i2.clone()))
        );
        assert_eq!(
            next(w).await.unwrap(),
            (b.metadata.rv(), WatchEvent::Added(b.clone()))
        );
    }
    quiet(&mut vms, "nothing more").await;
    quiet(&mut all, "nothing more").await;
}

/// A consumer that drops its stream (also while the stream is reading) and watches again from
/// the last revision it saw gets every later change once.
pub async fn a_dropped_watch_resumes_without_loss_or_repeat(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    let r0 = rev(s).await;
    let mut revs = Vec::new();
    for i in 0..40 {
        revs.push(s.create(vm(&format!("v{i}"))).await.unwrap().metadata.rv());
    }
    // Dropped after polling once: whatever that started is abandoned.
    for _ in 0..20 {
        let mut w = s.watch(Some("Vm"), r0);
        let _ = futures::FutureExt::now_or_never(w.next());
        drop(w);
    }
    let mut seen = r0;
    let mut got = Vec::new();
    for take in [5, 1, 20] {
        let mut w = s.watch(Some("Vm"), seen);
        for _ in 0..take {
            seen = next(&mut w).await.unwrap().0;
            got.push(seen);
        }
        let _ = futures::FutureExt::now_or_never(w.next());
    }
    let mut w = s.watch(Some("Vm"), seen);
    let late = s.create(vm("late")).await.unwrap();
    revs.push(late.metadata.rv());
    while got.len() < revs.len() {
        got.push(next(&mut w).await.unwrap().0);
    }
    assert_eq!(got, revs);
    // The store still reads and writes.
    assert!(get(s, "Vm", "late").await.is_some());
    s.create(vm("later")).await.unwrap();
    assert_eq!(next(&mut w).await.unwrap().0, rev(s).await);
}

/// A kind-filtered watch moves past other kinds' changes: their churn and a compaction of it
/// neither delay it nor make it too old.
pub async fn a_kind_filtered_watch_is_not_held_back_by_other_kinds(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    s.create(vm("first")).await.unwrap();
    let mut vms = s.watch(Some("Vm"), rev(s).await);
    let waiting = tokio::spawn(async move { next(&mut vms).await.map(|(r, _)| r) });
    tokio::time::sleep(Duration::from_millis(30)).await;
    for i in 0..600 {
        s.create(image(&format!("j{i}"))).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(sub.control.compact(10).await.unwrap() > 0);
    let v = s.create(vm("after")).await.unwrap();
    let got = tokio::time::timeout(PATIENCE, waiting)
        .await
        .expect("in time")
        .unwrap();
    assert_eq!(got.unwrap(), v.metadata.rv());
}

/// Lists taken while several tasks write, each followed by a watch from the list's revision,
/// rebuild exactly the final state: nothing falls between a list and its watch.
pub async fn list_then_watch_misses_nothing_under_concurrent_writers(imp: &dyn Implementation) {
    const WRITERS: usize = 3;
    const OPS: usize = 60;
    let sub = imp.fresh();
    let s = sub.store.clone();
    let other = imp.open(&sub.address);
    let mut writers = Vec::new();
    for t in 0..WRITERS {
        let w = if t == 0 { other.clone() } else { s.clone() };
        writers.push(tokio::spawn(async move {
            for i in 0..OPS {
                let name = format!("w{t}-{}", i % 20);
                match get(&w, "Vm", &name).await {
                    None => {
                        w.create(vm(&name)).await.unwrap();
                    }
                    Some(o) if i % 3 == 0 => {
                        w.delete(&ObjectRef::to(&o)).await.unwrap();
                    }
                    Some(o) => {
                        w.update(o.label("i", &i.to_string())).await.unwrap();
                    }
                }
            }
        }));
    }
    let mut views = Vec::new();
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(15)).await;
        let (objs, at) = s.list("Vm", &Selector::default()).await.unwrap();
        let view: BTreeMap<String, DynObject> = objs
            .into_iter()
            .map(|o| (o.metadata.name.clone(), o))
            .collect();
        views.push((view, at, s.watch(Some("Vm"), at)));
    }
    for w in writers {
        w.await.unwrap();
    }
    let (last, head) = s.list("Vm", &Selector::default()).await.unwrap();
    let want: BTreeMap<String, DynObject> = last
        .into_iter()
        .map(|o| (o.metadata.name.clone(), o))
        .collect();
    for (mut view, mut at, mut w) in views {
        while at < head {
            let (r, ev) = next(&mut w).await.unwrap();
            assert!(r > at, "in order, once each: {r} after {at}");
            at = r;
            let o = ev.object().clone();
            assert_eq!(o.metadata.rv(), r, "the event's object is at its revision");
            match ev {
                WatchEvent::Deleted(_) => {
                    assert!(
                        view.remove(&o.metadata.name).is_some(),
                        "deleted what existed"
                    )
                }
                WatchEvent::Added(_) => {
                    assert!(
                        view.insert(o.metadata.name.clone(), o).is_none(),
                        "added anew"
                    )
                }
                WatchEvent::Modified(_) => {
                    assert!(
                        view.insert(o.metadata.name.clone(), o).is_some(),
                        "modified what existed"
                    )
                }
            }
        }
        assert_eq!(at, head);
        assert_eq!(view, want, "list + watch = the final state");
    }
}

/// Compaction trims history: a watch from below the floor gets `TooOld` (first and alone;
/// the stream then ends), a lagging watcher gets what it can in order and then `TooOld` (or
/// everything), objects are untouched, and a relist then watch recovers.
/// `list_at` (a paged list's later pages): when a store answers, it is the list as it was at
/// the revision, whatever changed since (a change, a delete, a create); a store may say it
/// cannot (`None`); below the compaction floor it is `TooOld` or `None`, never a wrong list.
pub async fn list_at_reads_the_past_or_says_it_cannot(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    for n in ["a", "b", "c"] {
        s.create(image(n)).await.unwrap();
    }
    let all = Selector::default();
    let (before, r) = s.list("Image", &all).await.unwrap();
    let mut b = get(s, "Image", "b").await.unwrap();
    b.metadata.labels.insert("changed".into(), "yes".into());
    s.update(b).await.unwrap();
    s.delete(&key("Image", "c")).await.unwrap();
    s.create(image("d")).await.unwrap();
    let then = |objs: Vec<DynObject>| -> Vec<(String, Option<String>)> {
        objs.into_iter()
            .map(|o| (o.metadata.name, o.metadata.resource_version))
            .collect()
    };
    if let Some(at) = s.list_at("Image", &all, r).await.unwrap() {
        assert_eq!(then(at), then(before.clone()), "the list at {r}");
        let team: Selector = "changed=yes".parse().unwrap();
        assert_eq!(s.list_at("Image", &team, r).await.unwrap(), Some(vec![]));
    }
    // (a store a client may not compact, a remote one, refuses to)
    if sub.control.compact(0).await.is_ok() {
        match s.list_at("Image", &all, r).await {
            Err(StoreError::TooOld { .. }) | Ok(None) => {}
            other => panic!("below the floor: {other:?}"),
        }
    }
}

pub async fn compaction_makes_old_watches_too_old_and_a_relist_recovers(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    let r0 = rev(s).await;
    for i in 0..1500 {
        s.create(image(&format!("i{i}"))).await.unwrap();
    }
    let head = rev(s).await;
    let mut lagging = s.watch(None, r0);
    let (first, _) = next(&mut lagging).await.unwrap();
    let removed = sub.control.compact(100).await.unwrap();
    assert!(removed >= 1300, "{removed} entries removed");
    let floor = s.compacted().await.unwrap();
    assert_eq!(floor, head - 100, "history keeps the newest 100 revisions");
    assert_eq!(
        sub.control.compact(100).await.unwrap(),
        0,
        "nothing left to trim"
    );

    let mut old = s.watch(None, floor - 1);
    match next(&mut old).await {
        Err(StoreError::TooOld {
            requested,
            floor: f,
        }) => {
            assert_eq!((requested, f), (floor - 1, floor))
        }
        other => panic!("want TooOld, got {other:?}"),
    }
    assert!(old.next().await.is_none(), "TooOld ends the stream");
    assert!(old.next().await.is_none(), "and it stays ended");

    let mut last = first;
    loop {
        match tokio::time::timeout(PATIENCE, lagging.next())
            .await
            .expect("in time")
        {
            Some(Ok((r, _))) => {
                assert_eq!(r, last + 1, "in order, nothing skipped");
                last = r;
                if r == head {
                    break;
                }
            }
            Some(Err(e)) => {
                assert!(matches!(e, StoreError::TooOld { .. }), "{e}");
                assert!(e.to_string().contains("list again"), "{e}");
                assert!(lagging.next().await.is_none());
                break;
            }
            None => panic!("ended without an error"),
        }
    }

    let mut ok = s.watch(None, floor);
    assert_eq!(
        next(&mut ok).await.unwrap().0,
        floor + 1,
        "from the floor: fine"
    );
    let (objs, at) = s.list("Image", &Selector::default()).await.unwrap();
    assert_eq!(objs.len(), 1500, "objects are untouched");
    let mut relisted = s.watch(Some("Image"), at);
    let n = s.create(image("new")).await.unwrap();
    assert_eq!(
        next(&mut relisted).await.unwrap(),
        (n.metadata.rv(), WatchEvent::Added(n))
    );
}

/// Writes through a second handle (its own connections) are visible at once to reads through
/// the first and wake its watches; revisions are one sequence across handles.
pub async fn watch_sees_writes_from_another_handle(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    let other = imp.open(&sub.address);
    assert_eq!(other.uid(), s.uid(), "the same store");
    let mut here = s.watch(Some("Vm"), rev(s).await);
    let mut there = other.watch(Some("Vm"), rev(&other).await);
    let a = other.create(vm("a")).await.unwrap();
    assert_eq!(get(s, "Vm", "a").await, Some(a.clone()), "read after write");
    assert_eq!(rev(s).await, a.metadata.rv());
    let b = s.create(vm("b")).await.unwrap();
    assert!(b.metadata.rv() > a.metadata.rv());
    for w in [&mut here, &mut there] {
        assert_eq!(
            next(w).await.unwrap(),
            (a.metadata.rv(), WatchEvent::Added(a.clone()))
        );
        assert_eq!(
            next(w).await.unwrap(),
            (b.metadata.rv(), WatchEvent::Added(b.clone()))
        );
    }
    // A conflict is seen across handles too.
    s.update(a.clone().label("x", "1")).await.unwrap();
    let err = other.update(a.label("x", "2")).await.unwrap_err();
    assert!(matches!(err, StoreError::Conflict { .. }), "{err}");
}

/// The child process: writes [`CHILD_WRITES`] objects through the trait, a few ms apart.
pub fn child(imp: &dyn Implementation) {
    let Ok(address) = std::env::var(CHILD_ENV) else {
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let s = imp.open(&address);
        for i in 0..CHILD_WRITES {
            s.create(vm(&format!("p{i}"))).await.expect("child write");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
}

/// Writes by another OS process (this test binary run again as a child) reach a watcher, in
/// order, and reads.
pub async fn watch_sees_writes_from_another_process(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    let mut w = s.watch(Some("Vm"), rev(s).await);
    let mut child = ChildGuard::spawn(
        std::process::Command::new(std::env::current_exe().expect("own path"))
            .args([CHILD_TEST, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, &sub.address)
            .stdout(std::process::Stdio::null()),
    );
    let mut last = 0;
    for i in 0..CHILD_WRITES {
        let (r, ev) = next(&mut w).await.unwrap();
        assert!(r > last, "in order");
        last = r;
        assert!(matches!(ev, WatchEvent::Added(_)), "{ev:?}");
        assert_eq!(ev.object().metadata.name, format!("p{i}"));
    }
    let status = child.0.wait().expect("child exit");
    assert!(status.success(), "the child failed: {status}");
    assert_eq!(rev(s).await, last);
    assert_eq!(names(s, "Vm", "").await.len(), CHILD_WRITES);
}

// --- leader election, identity, adoption ---------------------------------------------

/// The leader lock: a second candidate follows until the lease runs out; renewing keeps the
/// epoch; a new holder gets a higher one; resign frees it at once (and by a non-holder does
/// nothing); locks are independent; none of it is a revision.
pub async fn leader_lock_follows_expires_resigns_and_fences_by_epoch(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.control;
    let other = imp.open_control(&sub.address);
    let a = Candidate::current("a");
    let b = Candidate::current("b");
    let ttl = Duration::from_millis(400);
    let at = rev(s).await;
    assert_eq!(
        other.leader("controllers").await.unwrap(),
        None,
        "never taken"
    );
    let Leadership::Leader { epoch: e1 } = s.try_lead("controllers", &a, ttl).await.unwrap() else {
        panic!("a leads a free lock")
    };
    assert_eq!(
        other.leader("controllers").await.unwrap().as_deref(),
        Some("a"),
        "every handle sees the holder"
    );
    match other.try_lead("controllers", &b, ttl).await.unwrap() {
        Leadership::Follower { holder, expires_in } => {
            assert_eq!(holder, "a");
            assert!(expires_in <= ttl && expires_in > ttl / 4, "{expires_in:?}");
        }
        l => panic!("want Follower, got {l:?}"),
    }
    assert_eq!(
        s.try_lead("controllers", &a, ttl).await.unwrap(),
        Leadership::Leader { epoch: e1 },
        "renewal keeps the epoch"
    );
    assert!(matches!(
        other.try_lead("other-lock", &b, ttl).await.unwrap(),
        Leadership::Leader { .. }
    ));
    // a is alive (same process as b) but stops renewing: b takes over after the ttl.
    tokio::time::sleep(ttl + Duration::from_millis(100)).await;
    assert_eq!(s.leader("controllers").await.unwrap(), None, "expired");
    let Leadership::Leader { epoch: e2 } = other.try_lead("controllers", &b, ttl).await.unwrap()
    else {
        panic!("b leads after the lease ran out")
    };
    assert!(e2 > e1, "a new holder, a higher epoch: {e2} > {e1}");
    assert!(matches!(
        s.try_lead("controllers", &a, ttl).await.unwrap(),
        Leadership::Follower { .. }
    ));
    s.resign("controllers", &a).await.unwrap();
    assert!(
        matches!(
            s.try_lead("controllers", &a, ttl).await.unwrap(),
            Leadership::Follower { .. }
        ),
        "a resign by a non-holder does nothing"
    );
    other.resign("controllers", &b).await.unwrap();
    assert_eq!(s.leader("controllers").await.unwrap(), None, "given up");
    let Leadership::Leader { epoch: e3 } = s.try_lead("controllers", &a, ttl).await.unwrap() else {
        panic!("a leads at once after b resigned")
    };
    assert!(e3 > e2, "{e3} > {e2}");
    assert_eq!(rev(s).await, at, "leader rows are not objects");
}

/// The store has an identity, the same through every handle; it remembers the uid of every
/// Vm and Image it removed (directly or by cascade), and only those.
pub async fn removed_uids_are_remembered_and_the_identity_is_stable(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.store;
    assert!(!s.uid().is_empty());
    assert_eq!(imp.open(&sub.address).uid(), s.uid());
    let another = imp.fresh();
    assert_ne!(another.store.uid(), s.uid(), "each store its own identity");

    let v = s.create(vm("dev1")).await.unwrap();
    let i = s.create(image("dev1.snap").owned_by(&v)).await.unwrap();
    let kept = s.create(vm("kept")).await.unwrap();
    let uid = |o: &DynObject| o.metadata.uid.clone().unwrap();
    assert!(!s.was_removed(&uid(&v)).await.unwrap());
    s.delete(&key("Vm", "dev1")).await.unwrap();
    assert!(s.was_removed(&uid(&v)).await.unwrap());
    assert!(s.was_removed(&uid(&i)).await.unwrap(), "removed by cascade");
    assert!(!s.was_removed(&uid(&kept)).await.unwrap());
    assert!(!s.was_removed("never-seen").await.unwrap());
    assert!(!another.store.was_removed(&uid(&v)).await.unwrap());
    let other = imp.open(&sub.address);
    assert!(
        other.was_removed(&uid(&v)).await.unwrap(),
        "through any handle"
    );
}

/// `adopt` creates an object again with a given uid; refused when a current object has the
/// uid or the store removed the object that had it, and `AlreadyExists` for a taken name.
pub async fn adopt_recreates_an_object_with_its_uid(imp: &dyn Implementation) {
    let sub = imp.fresh();
    let s = &sub.control;
    let uid = "0b8a3c1e-5d6f-4a7b-9c8d-1e2f3a4b5c6d";
    let at = rev(s).await;
    let a = s.adopt(vm("orphan"), uid).await.unwrap();
    assert_eq!(a.metadata.uid.as_deref(), Some(uid));
    assert_eq!(a.metadata.generation, Some(1));
    assert!(a.metadata.rv() > at);
    assert_eq!(get(s, "Vm", "orphan").await, Some(a.clone()));

    let err = s.adopt(vm("twin"), uid).await.unwrap_err();
    assert!(
        matches!(err, StoreError::Invalid(_)),
        "a current object has it: {err}"
    );
    let err = s
        .adopt(vm("orphan"), "1b8a3c1e-5d6f-4a7b-9c8d-1e2f3a4b5c6d")
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::AlreadyExists { .. }), "{err}");
    s.delete(&key("Vm", "orphan")).await.unwrap();
    let err = s.adopt(vm("orphan"), uid).await.unwrap_err();
    assert!(
        matches!(err, StoreError::Invalid(_)),
        "removed by this store: {err}"
    );
    assert!(err.to_string().contains("cannot be adopted"), "{err}");
    assert_eq!(get(s, "Vm", "orphan").await, None);
}
