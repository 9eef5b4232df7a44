//! create / get / list / update / update_status / delete against a real SQLite file.

mod common;

use boxery_api::{Selector, Vm};
use boxery_store::{DeleteOutcome, StoreError};
use common::{Fixture, image, store, vm};

fn sel(s: &str) -> Selector {
    s.parse().expect("selector")
}

#[test]
fn create_sets_server_fields_and_get_returns_the_object() {
    let (_d, s) = store();
    assert_eq!(s.revision().unwrap(), 0);
    let mut input = vm("dev1");
    input.metadata.resource_version = Some("77".into());
    input.metadata.deletion_timestamp = Some(boxery_api::now());
    let created = s.create(input).unwrap();
    let m = &created.metadata;
    assert!(m.uid.as_deref().is_some_and(|u| u.len() == 36), "{m:?}");
    assert_eq!(m.generation, Some(1));
    assert_eq!(m.resource_version.as_deref(), Some("1"));
    assert!(m.creation_timestamp.is_some());
    assert!(
        m.deletion_timestamp.is_none(),
        "deletionTimestamp cannot be set by create"
    );
    // Defaults were written by validation.
    assert_eq!(created.spec()["runStrategy"], "Running");
    assert_eq!(s.get("Vm", "dev1").unwrap(), Some(created.clone()));
    assert_eq!(s.get("Vm", "nope").unwrap(), None);
    assert_eq!(s.revision().unwrap(), 1);

    let err = s.create(vm("dev1")).unwrap_err();
    assert!(matches!(err, StoreError::AlreadyExists { .. }), "{err}");
    let err = s.create(vm("Bad_Name")).unwrap_err();
    assert!(matches!(err, StoreError::Invalid(_)), "{err}");
    assert_eq!(s.revision().unwrap(), 1, "failed writes write nothing");

    let typed: Vm = s.get_as("dev1").unwrap().unwrap();
    assert_eq!(typed.metadata.uid, created.metadata.uid);
}

#[test]
fn list_filters_by_selector_sorts_by_name_and_returns_the_revision() {
    let (_d, s) = store();
    s.create(vm("c").label("team", "web")).unwrap();
    s.create(vm("a").label("team", "web").label("tier", "fe"))
        .unwrap();
    s.create(vm("b").label("team", "db")).unwrap();
    s.create(image("a-img").label("team", "web")).unwrap();
    let names = |sel_: &str| -> Vec<String> {
        s.list("Vm", &sel(sel_))
            .unwrap()
            .0
            .into_iter()
            .map(|o| o.metadata.name)
            .collect()
    };
    assert_eq!(names(""), ["a", "b", "c"]);
    assert_eq!(names("team=web"), ["a", "c"]);
    assert_eq!(names("team!=web"), ["b"]);
    assert_eq!(names("tier"), ["a"]);
    assert_eq!(names("team in (db,x),!tier"), ["b"]);
    let (_, rev) = s.list("Vm", &sel("")).unwrap();
    assert_eq!(rev, 4);
    let typed: Vec<Vm> = s.list_as(&sel("team=web")).unwrap();
    assert_eq!(typed.len(), 2);
}

#[test]
fn generation_grows_on_spec_changes_only() {
    let (_d, s) = store();
    let v = s.create(vm("dev1")).unwrap();
    // Labels only: new revision, same generation.
    let v2 = s.update(v.clone().label("team", "web")).unwrap();
    assert_eq!(v2.metadata.generation, Some(1));
    assert_eq!(v2.metadata.resource_version.as_deref(), Some("2"));
    assert_eq!(v2.metadata.labels["team"], "web");
    // Spec change: generation 2.
    let v3 = s.update(v2.clone().cpus(4)).unwrap();
    assert_eq!(v3.metadata.generation, Some(2));
    assert_eq!(v3.spec()["resources"]["cpus"], 4);
    // Same object again: nothing written.
    let v4 = s.update(v3.clone()).unwrap();
    assert_eq!(v4, v3);
    assert_eq!(s.revision().unwrap(), 3);
    // Server fields cannot be changed through update.
    let mut forged = v3.clone();
    forged.metadata.uid = Some("forged".into());
    forged.metadata.generation = Some(99);
    forged.metadata.deletion_timestamp = Some(boxery_api::now());
    let v5 = s.update(forged).unwrap();
    assert_eq!(
        v5, v3,
        "uid, generation and deletionTimestamp are the server's"
    );
}

#[test]
fn stale_resource_version_conflicts_and_none_is_unconditional() {
    let (_d, s) = store();
    let v = s.create(vm("dev1")).unwrap();
    s.update(v.clone().label("a", "1")).unwrap();
    let err = s.update(v.clone().label("b", "2")).unwrap_err();
    match &err {
        StoreError::Conflict {
            expected, actual, ..
        } => assert_eq!((expected.as_str(), actual.as_str()), ("1", "2")),
        other => panic!("want Conflict, got {other}"),
    }
    assert!(err.to_string().contains("read it again"), "{err}");
    let err = s.update_status(v.clone()).unwrap_err();
    assert!(matches!(err, StoreError::Conflict { .. }), "{err}");
    let mut blind = v.label("b", "2");
    blind.metadata.resource_version = None;
    let out = s.update(blind).unwrap();
    assert_eq!(
        out.metadata.labels.get("a"),
        None,
        "an unconditional update replaces labels"
    );
    assert_eq!(out.metadata.labels["b"], "2");
    let err = s.update(vm("ghost")).unwrap_err();
    assert!(matches!(err, StoreError::NotFound { .. }), "{err}");
    assert!(err.to_string().contains("boxery get vms"), "{err}");
}

#[test]
fn update_status_replaces_status_only_and_keeps_generation() {
    let (_d, s) = store();
    let v = s.create(vm("dev1")).unwrap();
    let mut w = v.clone().cpus(8).label("x", "y");
    w.rest.insert(
        "status".into(),
        serde_json::json!({"phase": "Running", "observedGeneration": 1}),
    );
    let out = s.update_status(w).unwrap();
    assert_eq!(out.status()["phase"], "Running");
    assert_eq!(out.metadata.generation, Some(1));
    assert_eq!(out.spec(), v.spec(), "spec untouched by update_status");
    assert!(
        out.metadata.labels.is_empty(),
        "labels untouched by update_status"
    );
    // update keeps the stored status.
    let mut u = out.clone().cpus(2);
    u.rest
        .insert("status".into(), serde_json::json!({"phase": "Failed"}));
    let out2 = s.update(u).unwrap();
    assert_eq!(out2.status()["phase"], "Running");
    assert_eq!(out2.metadata.generation, Some(2));
    // Invalid status is refused.
    let mut bad = out2.clone();
    bad.rest
        .insert("status".into(), serde_json::json!({"phase": "Dancing"}));
    assert!(matches!(
        s.update_status(bad).unwrap_err(),
        StoreError::Invalid(_)
    ));
    // Typed.
    let mut typed: Vm = out2.to_typed().unwrap();
    typed.status.observed_generation = Some(2);
    let t2 = s.update_status_as(&typed).unwrap();
    assert_eq!(t2.status.observed_generation, Some(2));
    assert_eq!(t2.metadata.generation, Some(2));
}

#[test]
fn delete_with_finalizers_marks_and_removing_the_last_finalizer_removes() {
    let (_d, s) = store();
    s.create(
        vm("dev1")
            .finalizer("boxery.dev/vm")
            .finalizer("boxery.dev/other"),
    )
    .unwrap();
    let DeleteOutcome::Marked(m) = s.delete("Vm", "dev1").unwrap() else {
        panic!("want Marked")
    };
    let ts = m.metadata.deletion_timestamp;
    assert!(ts.is_some());
    // Deleting again changes nothing.
    let rev = s.revision().unwrap();
    let DeleteOutcome::Marked(m2) = s.delete("Vm", "dev1").unwrap() else {
        panic!("want Marked")
    };
    assert_eq!(m2.metadata.deletion_timestamp, ts);
    assert_eq!(s.revision().unwrap(), rev);
    // No new finalizers while deleting.
    let err = s
        .update(m2.clone().finalizer("boxery.dev/late"))
        .unwrap_err();
    assert!(err.to_string().contains("finalizer"), "{err}");
    // Drop one finalizer: still there.
    let mut one = m2.clone();
    one.metadata.finalizers.retain(|f| f != "boxery.dev/other");
    let one = s.update(one).unwrap();
    assert_eq!(
        one.metadata.deletion_timestamp, ts,
        "update cannot clear deletionTimestamp"
    );
    assert!(s.get("Vm", "dev1").unwrap().is_some());
    // Drop the last: gone.
    let mut none = one.clone();
    none.metadata.finalizers.clear();
    let gone = s.update(none).unwrap();
    assert!(gone.metadata.finalizers.is_empty());
    assert_eq!(s.get("Vm", "dev1").unwrap(), None);
    assert!(matches!(
        s.delete("Vm", "dev1").unwrap_err(),
        StoreError::NotFound { .. }
    ));
    // Without finalizers: removed at once.
    s.create(vm("dev2")).unwrap();
    assert!(matches!(
        s.delete("Vm", "dev2").unwrap(),
        DeleteOutcome::Removed(_)
    ));
    assert_eq!(s.get("Vm", "dev2").unwrap(), None);
}

#[test]
fn removal_cascades_through_owner_references_two_levels_deep() {
    let (_d, s) = store();
    let pool_vm = s.create(vm("owner")).unwrap();
    let child = s.create(vm("child").owned_by(&pool_vm)).unwrap();
    let grandchild = s.create(image("grandchild").owned_by(&child)).unwrap();
    let guarded = s
        .create(
            image("guarded")
                .owned_by(&child)
                .finalizer("boxery.dev/image"),
        )
        .unwrap();
    let unrelated = s.create(vm("unrelated")).unwrap();
    // An object owned by a *different* object of the same name is not touched.
    let mut fake_owner = vm("x").owned_by(&unrelated);
    fake_owner.metadata.owner_references[0].name = "owner".into();
    s.create(fake_owner).unwrap();

    assert!(matches!(
        s.delete("Vm", "owner").unwrap(),
        DeleteOutcome::Removed(_)
    ));
    assert_eq!(s.get("Vm", "child").unwrap(), None);
    assert_eq!(s.get("Image", "grandchild").unwrap(), None);
    let g = s
        .get("Image", "guarded")
        .unwrap()
        .expect("finalizers keep it");
    assert!(
        g.metadata.deletion_timestamp.is_some(),
        "marked for deletion"
    );
    assert!(s.get("Vm", "unrelated").unwrap().is_some());
    assert!(s.get("Vm", "x").unwrap().is_some());
    let _ = (grandchild, guarded);

    // An owner that is only marked does not cascade yet.
    let owner2 = s.create(vm("owner2").finalizer("f")).unwrap();
    s.create(vm("child2").owned_by(&owner2)).unwrap();
    assert!(matches!(
        s.delete("Vm", "owner2").unwrap(),
        DeleteOutcome::Marked(_)
    ));
    assert!(s.get("Vm", "child2").unwrap().is_some());
    let mut o = s.get("Vm", "owner2").unwrap().unwrap();
    o.metadata.finalizers.clear();
    s.update(o).unwrap();
    assert_eq!(
        s.get("Vm", "child2").unwrap(),
        None,
        "removing the owner's last finalizer cascades"
    );

    // A child of an owner that is gone would never be collected: refused.
    let err = s.create(vm("orphan").owned_by(&owner2)).unwrap_err();
    assert!(matches!(err, StoreError::OwnerGone { .. }), "{err}");
    assert!(err.to_string().contains("Vm/owner2"), "{err}");
    let adopted = s.create(vm("adoptee")).unwrap();
    let err = s.update(adopted.owned_by(&owner2)).unwrap_err();
    assert!(matches!(err, StoreError::OwnerGone { .. }), "{err}");
}

#[test]
fn event_objects_have_no_status_subresource() {
    let (_d, s) = store();
    let ev: boxery_api::DynObject = serde_json::from_value(serde_json::json!({
        "apiVersion": boxery_api::API_VERSION, "kind": "Event",
        "metadata": {"name": "dev1.abc"},
        "involvedObject": {"kind": "Vm", "name": "dev1"},
        "type": "Normal", "reason": "Created", "message": "created",
        "firstTimestamp": "2026-11-30T10:00:00Z", "lastTimestamp": "2026-11-30T10:00:00Z"
    }))
    .unwrap();
    let e = s.create(ev).unwrap();
    assert_eq!(e.rest["count"], 1);
    let mut e2 = e.clone();
    e2.rest.insert("count".into(), 2.into());
    let e2 = s.update(e2).unwrap();
    assert_eq!(e2.rest["count"], 2);
    assert!(matches!(
        s.update_status(e2).unwrap_err(),
        StoreError::Invalid(_)
    ));
}

#[test]
fn open_creates_directories_and_reopens_with_data() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("a/b/store.db");
    {
        let s = common::open(&path);
        s.create(vm("dev1")).unwrap();
    }
    let s = common::open(&path);
    assert!(s.get("Vm", "dev1").unwrap().is_some());
    assert_eq!(s.revision().unwrap(), 1);
    let clone = s.clone();
    drop(s);
    assert!(
        clone.get("Vm", "dev1").unwrap().is_some(),
        "clones share the store"
    );
}

/// A field nothing implements yet is refused when a write sets it, but an object stored with
/// it by an older boxery keeps working: its status is written, its finalizers removed, it is
/// deleted; only setting such a field anew is refused (ratcheting).
#[test]
fn fields_nothing_implements_are_refused_only_when_set_anew() {
    // (a Pool's replicas without a template: nothing could make those members)
    let (_d, s) = common::store();
    let pool = |name: &str, replicas: u32| -> boxery_api::DynObject {
        serde_json::from_value(serde_json::json!({
            "apiVersion": boxery_api::API_VERSION, "kind": "Pool",
            "metadata": {"name": name},
            "spec": {"replicas": replicas}
        }))
        .unwrap()
    };
    let e = s.create(pool("old", 2)).unwrap_err();
    assert!(e.to_string().contains("spec.replicas"), "{e}");
    assert!(e.to_string().contains("no template"), "{e}");

    // An object an older boxery stored with the field, written into the file directly.
    let clean = s.create(pool("old", 0)).unwrap();
    let mut stored: serde_json::Value = serde_json::to_value(&clean).unwrap();
    stored["spec"]["replicas"] = serde_json::json!(2);
    let conn = rusqlite::Connection::open(s.path()).unwrap();
    conn.execute(
        "UPDATE objects SET json = ?1 WHERE kind = 'Pool' AND name = 'old'",
        [stored.to_string()],
    )
    .unwrap();
    drop(conn);

    // Status and labels are written; the spec is untouched.
    let mut o = s.get("Pool", "old").unwrap().unwrap();
    o.metadata.labels.insert("team".into(), "a".into());
    let o = s.update(o).unwrap();
    let mut st = o.clone();
    st.rest
        .insert("status".into(), serde_json::json!({"replicas": 0}));
    s.update_status(st).unwrap();
    // A spec change that keeps the field as it was is accepted; a new object setting it is not.
    let mut o = s.get("Pool", "old").unwrap().unwrap();
    o.rest["spec"]["lease"] = serde_json::json!({"defaultTtlSeconds": 600, "maxTtlSeconds": 3600});
    s.update(o).unwrap();
    let e = s.create(pool("new", 2)).unwrap_err();
    assert!(e.to_string().contains("spec.replicas"), "{e}");
    // It can be deleted.
    s.delete("Pool", "old").unwrap();
    assert!(s.get("Pool", "old").unwrap().is_none());
}
