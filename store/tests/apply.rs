//! apply_all: create / configure / unchanged, all-or-nothing, duplicates, prune, dry run.

mod common;

use boxery_api::Selector;
use boxery_store::{ApplyAction, ApplyOptions, LAST_APPLIED, StoreError};
use common::{Fixture, dump, image, store, vm};

fn actions(out: &[(ApplyAction, boxery_api::DynObject)]) -> Vec<(ApplyAction, String)> {
    out.iter()
        .map(|(a, o)| (*a, o.metadata.name.clone()))
        .collect()
}

fn apply(s: &boxery_store::Store, objs: Vec<boxery_api::DynObject>) -> Vec<(ApplyAction, String)> {
    actions(&s.apply_all(objs, &ApplyOptions::default()).unwrap())
}

#[test]
fn creates_configures_and_leaves_unchanged() {
    let (_d, s) = store();
    let out = apply(&s, vec![vm("a"), vm("b").label("team", "web")]);
    assert_eq!(
        out,
        [
            (ApplyAction::Created, "a".into()),
            (ApplyAction::Created, "b".into())
        ]
    );
    let a = s.get("Vm", "a").unwrap().unwrap();
    let record: serde_json::Value =
        serde_json::from_str(&a.metadata.annotations[LAST_APPLIED]).unwrap();
    assert_eq!(
        record,
        serde_json::to_value(vm("a")).unwrap(),
        "the manifest as given"
    );
    let rev = s.revision().unwrap();

    // Same set again: nothing written.
    let out = apply(&s, vec![vm("a"), vm("b").label("team", "web")]);
    assert_eq!(
        out,
        [
            (ApplyAction::Unchanged, "a".into()),
            (ApplyAction::Unchanged, "b".into())
        ]
    );
    assert_eq!(s.revision().unwrap(), rev);

    // The controller writes status, a finalizer and a system annotation; a user adds one.
    let mut a = s.get("Vm", "a").unwrap().unwrap();
    a.rest
        .insert("status".into(), serde_json::json!({"phase": "Running"}));
    let a = s.update_status(a).unwrap();
    let mut a2 = a.clone().finalizer("boxery.dev/vm");
    a2.metadata
        .annotations
        .insert("boxery.dev/printed".into(), "x".into());
    a2.metadata
        .annotations
        .insert("note".into(), "by hand".into());
    s.update(a2).unwrap();

    // Spec change: Configured, generation bumps, status/finalizers/system annotations kept,
    // the manifest's annotations set, another manager's kept.
    let mut manifest = vm("a").cpus(2);
    manifest
        .metadata
        .annotations
        .insert("owner".into(), "me".into());
    manifest
        .rest
        .insert("status".into(), serde_json::json!({"phase": "Failed"}));
    let out = apply(&s, vec![manifest, vm("b").label("team", "web")]);
    assert_eq!(
        out,
        [
            (ApplyAction::Configured, "a".into()),
            (ApplyAction::Unchanged, "b".into())
        ]
    );
    let a = s.get("Vm", "a").unwrap().unwrap();
    assert_eq!(a.metadata.generation, Some(2));
    assert_eq!(a.status()["phase"], "Running");
    assert_eq!(a.metadata.finalizers, ["boxery.dev/vm"]);
    assert_eq!(
        a.metadata
            .annotations
            .get("boxery.dev/printed")
            .map(String::as_str),
        Some("x")
    );
    // Set by another manager (the update above), so the manifest, which never named it,
    // leaves it alone (field ownership).
    assert_eq!(
        a.metadata.annotations.get("note").map(String::as_str),
        Some("by hand")
    );
    assert_eq!(a.metadata.annotations["owner"], "me");
    assert!(a.metadata.annotations[LAST_APPLIED].contains("\"cpus\":2"));
    assert!(!a.metadata.annotations[LAST_APPLIED].contains("status"));

    // Labels only: Configured, generation stays.
    let out = apply(&s, vec![vm("b").label("team", "db")]);
    assert_eq!(out, [(ApplyAction::Configured, "b".into())]);
    assert_eq!(
        s.get("Vm", "b").unwrap().unwrap().metadata.generation,
        Some(1)
    );
}

#[test]
fn one_invalid_object_leaves_the_store_byte_for_byte_unchanged() {
    let (d, s) = store();
    apply(&s, vec![vm("a"), vm("b")]);
    let before = dump(&d.path().join("store.db"));
    let rev = s.revision().unwrap();
    let err = s
        .apply_all(
            vec![vm("a").cpus(3), vm("c"), vm("d").cpus(1000)],
            &ApplyOptions::default(),
        )
        .unwrap_err();
    assert!(matches!(err, StoreError::Invalid(_)), "{err}");
    assert!(err.to_string().contains("spec.resources.cpus"), "{err}");
    assert_eq!(dump(&d.path().join("store.db")), before);
    assert_eq!(s.revision().unwrap(), rev);
}

#[test]
fn duplicates_in_one_set_are_refused() {
    let (d, s) = store();
    let before = dump(&d.path().join("store.db"));
    let err = s
        .apply_all(
            vec![vm("a"), image("a"), vm("a").cpus(2)],
            &ApplyOptions::default(),
        )
        .unwrap_err();
    assert!(
        err.to_string().contains("Vm/a appears more than once"),
        "{err}"
    );
    assert_eq!(dump(&d.path().join("store.db")), before);
}

#[test]
fn objects_being_deleted_are_refused() {
    let (_d, s) = store();
    s.create(vm("a").finalizer("f")).unwrap();
    s.delete("Vm", "a").unwrap();
    let err = s
        .apply_all(vec![vm("a")], &ApplyOptions::default())
        .unwrap_err();
    assert!(matches!(err, StoreError::BeingDeleted { .. }), "{err}");
    assert!(err.to_string().contains("being deleted"), "{err}");
}

#[test]
fn prune_deletes_only_applied_objects_that_match_and_are_not_in_the_set() {
    let (_d, s) = store();
    apply(
        &s,
        vec![
            vm("keep").label("app", "x"),
            vm("old").label("app", "x"),
            vm("other").label("app", "y"),
        ],
    );
    apply(&s, vec![image("img-old").label("app", "x")]);
    s.create(vm("by-hand").label("app", "x")).unwrap(); // no last-applied record
    apply(
        &s,
        vec![vm("guarded").label("app", "x").finalizer("boxery.dev/vm")],
    );
    let prune = ApplyOptions {
        prune: Some("app=x".parse::<Selector>().unwrap()),
        ..Default::default()
    };
    let out = actions(
        &s.apply_all(vec![vm("keep").label("app", "x")], &prune)
            .unwrap(),
    );
    assert_eq!(
        out,
        [
            (ApplyAction::Unchanged, "keep".into()),
            (ApplyAction::Pruned, "guarded".into()),
            (ApplyAction::Pruned, "old".into()),
        ]
    );
    assert_eq!(s.get("Vm", "old").unwrap(), None);
    assert!(
        s.get("Vm", "guarded")
            .unwrap()
            .unwrap()
            .metadata
            .is_deleting(),
        "finalizers respected"
    );
    assert!(
        s.get("Vm", "other").unwrap().is_some(),
        "selector does not match"
    );
    assert!(s.get("Vm", "by-hand").unwrap().is_some(), "never applied");
    assert!(
        s.get("Image", "img-old").unwrap().is_some(),
        "kind not in the set"
    );
    // Pruning again: the marked object is not reported twice.
    let out = actions(
        &s.apply_all(vec![vm("keep").label("app", "x")], &prune)
            .unwrap(),
    );
    assert_eq!(out, [(ApplyAction::Unchanged, "keep".into())]);
}

#[test]
fn dry_run_reports_and_writes_nothing() {
    let (d, s) = store();
    apply(&s, vec![vm("a"), vm("b").label("app", "x")]);
    let before = dump(&d.path().join("store.db"));
    let opts = ApplyOptions {
        dry_run: true,
        prune: Some("app=x".parse().unwrap()),
        ..Default::default()
    };
    let out = actions(&s.apply_all(vec![vm("a").cpus(2), vm("c")], &opts).unwrap());
    assert_eq!(
        out,
        [
            (ApplyAction::Configured, "a".into()),
            (ApplyAction::Created, "c".into()),
            (ApplyAction::Pruned, "b".into())
        ]
    );
    assert_eq!(dump(&d.path().join("store.db")), before);
}
