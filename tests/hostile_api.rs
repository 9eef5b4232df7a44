//! The API's writers that are not the control plane, tried as an attacker holding a token
//! would (docs/security.md, "Who may write what"): a `full` token over the store calls and the
//! Kubernetes API, a `lease:` token, and a synced repository. Each was a working attack before
//! `boxery_store::guard`; the fake backend, a real `serve --api-listen`, kubectl and curl.

mod common;

use std::time::Duration;

use boxery_api::grant::GrantPhase;
use boxery_api::{Grant, Lease, Vm};
use common::api::Api;
use common::eventually;
use serde_json::json;

fn grant_manifest(name: &str, vm: &str, marker: &std::path::Path) -> serde_json::Value {
    json!({"apiVersion": "boxery.dev/v1alpha1", "kind": "Grant",
        "metadata": {"name": name},
        "spec": {"vm": vm, "type": "env", "target": "X",
                 "valueFrom": {"command": ["touch", marker.to_str().unwrap()]}},
        "status": {"phase": "Applied", "approvedBy": "root", "approvedGeneration": 1,
                   "approvedAt": "2026-12-04T00:00:00Z"}})
}

/// A grant the reconciler has seen, as stored.
fn settled_grant(api: &Api, name: &str) -> Grant {
    eventually(Duration::from_secs(30), || {
        let g: Grant = api.home.store().get_as(name).ok()??;
        (g.status.observed_generation.is_some()).then_some(g)
    })
    .unwrap_or_else(|| panic!("grant {name} was never reconciled"))
}

/// A grant sent with an approval in its status, through every writer a token or a repository
/// controls, is never approved: it waits for a person, its command never runs.
#[test]
fn no_token_and_no_repository_approves_a_grant() {
    let api = Api::start();
    let vm = api.home.write("a.yaml", &common::vm_yaml("a"));
    api.home.ok(&["apply", "-f", vm.to_str().unwrap()]);
    let marker = api.home.path().join("pwned");

    // the store calls (a context's), as createBy: the status it carries is dropped
    let call = json!({"op": "createBy", "manager": "x", "obj": grant_manifest("g1", "a", &marker)});
    let (code, body) = api.request(
        &api.kubeconfig,
        "POST",
        "/boxery/v1/store",
        Some(&call.to_string()),
    );
    assert_eq!(code, 200, "{body}");
    // adopt (an object with a uid of the caller's choosing) and a status write: 403
    for call in [
        json!({"op": "adopt", "uid": "0000-1", "obj": grant_manifest("g2", "a", &marker)}),
        json!({"op": "updateStatus", "obj": api.home.store().get("Grant", "g1").unwrap().unwrap()}),
    ] {
        let (code, body) = api.request(
            &api.kubeconfig,
            "POST",
            "/boxery/v1/store",
            Some(&call.to_string()),
        );
        assert_eq!(code, 403, "{call}: {body}");
    }

    // the Kubernetes API
    let (code, body) = api.request(
        &api.kubeconfig,
        "POST",
        "/apis/boxery.dev/v1alpha1/grants",
        Some(&grant_manifest("g3", "a", &marker).to_string()),
    );
    assert_eq!(code, 201, "{body}");

    // a synced directory
    let repo = api.home.path().join("repo");
    std::fs::create_dir(&repo).unwrap();
    let manifest = serde_json::to_string(&grant_manifest("g4", "a", &marker)).unwrap();
    std::fs::write(repo.join("grant.json"), manifest).unwrap();
    api.home.ok(&[
        "sync",
        repo.to_str().unwrap(),
        "--type",
        "directory",
        "--once",
    ]);

    for g in ["g1", "g3", "g4"] {
        let g = settled_grant(&api, g);
        assert_eq!(g.status.phase, GrantPhase::PendingApproval, "{g:?}");
        assert_eq!(g.status.approved_by, None, "{g:?}");
        assert_eq!(g.status.approved_generation, None, "{g:?}");
    }
    assert!(
        !marker.exists(),
        "a token's grant ran its command on the host"
    );
    let state = api.home.path().join("grants/a.json");
    let state = std::fs::read_to_string(state).unwrap_or_default();
    assert!(!state.contains("g1") && !state.contains("g3"), "{state}");
}

/// A full token over the store calls writes no VM's status (its ssh endpoint is what
/// `connect` dials), takes no leadership, compacts nothing, and writes no PoolMember or Event.
#[test]
fn a_full_token_writes_no_status_and_makes_no_host_call() {
    let api = Api::start();
    let vm = api.home.write("a.yaml", &common::vm_yaml("a"));
    api.home
        .ok(&["apply", "-f", vm.to_str().unwrap(), "--wait"]);
    let mut a = api.home.store().get("Vm", "a").unwrap().unwrap();
    a.rest.get_mut("status").unwrap()["ssh"]["endpoint"] = json!("127.0.0.1:1");
    let calls = [
        json!({"op": "updateStatus", "obj": a}),
        json!({"op": "tryLead", "lock": boxery_verbs::control::LOCK, "ttl_ms": 60000,
               "me": {"id": "intruder", "pid": 1, "bootId": "x"}}),
        json!({"op": "compact", "keep_revisions": 1}),
        json!({"op": "createBy", "manager": "x", "obj": {"apiVersion": "boxery.dev/v1alpha1",
               "kind": "PoolMember", "metadata": {"name": "a"}, "spec": {"pool": "p"}}}),
    ];
    for call in calls {
        let (code, body) = api.request(
            &api.kubeconfig,
            "POST",
            "/boxery/v1/store",
            Some(&call.to_string()),
        );
        assert_eq!(code, 403, "{call}: {body}");
        assert_eq!(body["error"]["reason"], "forbidden", "{body}");
        let why = body["error"]["why"].as_str().unwrap_or_default();
        assert!(
            why.contains("only") || why.contains("controllers"),
            "{body}"
        );
    }
    let a: Vm = api.home.store().get_as("a").unwrap().unwrap();
    let endpoint = a.status.ssh.and_then(|s| s.endpoint).unwrap_or_default();
    assert_ne!(endpoint, "127.0.0.1:1");
    let leader = api
        .home
        .store()
        .leader(boxery_verbs::control::LOCK)
        .unwrap();
    assert!(
        leader.is_some_and(|l| !l.contains("intruder")),
        "serve lost its leadership"
    );
}

/// A lease token renews or releases its own lease, changes its VM within what the lease allows
/// and never reimages it from another VM's disk; what it changed ends with the lease.
#[test]
fn a_lease_token_stays_within_its_lease() {
    let api = Api::start();
    let pool = api.home.write(
        "pool.yaml",
        "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {name: p}\nspec:\n  replicas: 1\n  template:\n    spec:\n      source: {image: tiny}\n",
    );
    api.home.ok(&["apply", "-f", pool.to_str().unwrap()]);
    api.home
        .ok(&["lease", "acquire", "p", "--name", "mine", "--wait"]);
    let held = eventually(Duration::from_secs(60), || {
        let l: Lease = api.home.store().get_as("mine").ok()??;
        l.status.vm.clone()
    })
    .expect("lease mine holds a VM");
    let template: Vm = api.home.store().get_as(&held).unwrap().unwrap();
    let kc = api.kubeconfig("lease:mine", "agent");
    let as_agent = |args: &[&str]| api.kubectl_with(&kc, args, &[]);
    let refused = |args: &[&str]| {
        let o = as_agent(args);
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && e.contains("Forbidden"),
            "{args:?}: {e}"
        );
        e.into_owned()
    };
    let patched =
        |kind: &str, name: &str, p: &str| as_agent(&["patch", kind, name, "--type=merge", "-p", p]);
    // its Lease: no longer, no other holder, key or pool
    for p in [
        r#"{"spec":{"leaseDurationSeconds":28800}}"#,
        r#"{"spec":{"holderIdentity":"mallory"}}"#,
        r#"{"spec":{"pool":"q"}}"#,
    ] {
        let e = refused(&["patch", "lease", "mine", "--type=merge", "-p", p]);
        // (the pool: refused first as an agent's move out of its pool's budgets)
        assert!(
            e.contains("renew") || e.contains("cannot move lease mine"),
            "{e}"
        );
    }
    // a renewal, at the server's time whatever it sends
    let o = patched(
        "lease",
        "mine",
        r#"{"spec":{"renewTime":"2999-01-01T00:00:00Z"}}"#,
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let l: Lease = api.home.store().get_as("mine").unwrap().unwrap();
    let renewed = l.spec.renew_time.expect("renewed");
    assert!(
        renewed < chrono::Utc::now() + chrono::Duration::minutes(1),
        "{renewed}"
    );
    // its VM: never from another disk (the stock image is the home's, not this VM's)
    let e = refused(&[
        "patch",
        "vm",
        &held,
        "--type=merge",
        "-p",
        r#"{"spec":{"restore":{"image":"tiny","requestedAt":"2026-12-04T00:00:00Z"}}}"#,
    ]);
    assert!(e.contains("own images"), "{e}");
    // nor boxery's labels (refused by the verbs' own check before the guard's)
    let o = as_agent(&["label", "vm", &held, "boxery.dev/pool-"]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && e.contains("boxery's own"), "{e}");
    // within the lease: more CPUs, a tighter egress
    let o = patched(
        "vm",
        &held,
        r#"{"spec":{"resources":{"cpus":2},"network":{"egress":{"policy":"Deny"}}}}"#,
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // released by its own token: the member is its template's again
    // (kubectl waits until it reads the lease gone: a 404 and an empty list, not a 403)
    let o = as_agent(&["delete", "lease", "mine", "--timeout=30s"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = as_agent(&["get", "lease", "mine"]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("NotFound") || e.contains("not found"), "{e}");
    let e = refused(&["get", "vm", &held]);
    assert!(e.contains("does not exist"), "{e}");
    let back = eventually(Duration::from_secs(60), || {
        let v: Vm = api.home.store().get_as(&held).ok()??;
        (v.spec.resources == template.spec.resources && v.spec.network == template.spec.network)
            .then_some(v)
    });
    assert!(
        back.is_some(),
        "the holder's changes outlived the lease: {:?}",
        api.home.store().get_as::<Vm>(&held).unwrap()
    );
}

/// kubectl with a full token keeps boxery's own labels: it cannot remove the label that puts
/// a VM in its pool or in a Source's apply set.
#[test]
fn kubectl_keeps_boxerys_labels() {
    let api = Api::start();
    let pool = api.home.write(
        "pool.yaml",
        "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {name: p}\nspec:\n  replicas: 1\n  template:\n    spec:\n      source: {image: tiny}\n",
    );
    api.home.ok(&["apply", "-f", pool.to_str().unwrap()]);
    let member = eventually(Duration::from_secs(60), || {
        let vms: Vec<Vm> = api.home.store().list_as(&Default::default()).ok()?;
        vms.first().map(|v| v.metadata.name.clone())
    })
    .expect("a member");
    let e = api.k_err(&["label", "vm", &member, "boxery.dev/pool-"]);
    assert!(e.contains("boxery.dev/"), "{e}");
    let e = api.k_err(&["label", "vm", &member, "boxery.dev/applyset=other"]);
    assert!(e.contains("boxery.dev/"), "{e}");
    api.k(&["label", "vm", &member, "team=a"]);
    let v: Vm = api.home.store().get_as(&member).unwrap().unwrap();
    assert_eq!(
        v.metadata.labels.get("boxery.dev/pool").map(String::as_str),
        Some("p")
    );
}
