//! The Grant reconciler against a real SQLite store and the fake backend, with every
//! controller running (`runtime::run`): phases and events, a spec change re-pends, deleting
//! the VM, the lease or the grant revokes (the state file entry goes), a state file that
//! disagrees with the store is rebuilt, and no value ever reaches the store.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use boxery_api::grant::{GrantPhase, GrantSpec, GrantType, ValueFrom};
use boxery_api::lease::LeasePhase;
use boxery_api::{Grant, Lease, Vm, now};
use boxery_controller::CancellationToken;
use boxery_reconcilers::{Ctx, grant};
use boxery_store::Store;
use serde_json::json;

struct Plane {
    dir: tempfile::TempDir,
    store: Store,
    ctx: Arc<Ctx>,
    stop: CancellationToken,
}

impl Plane {
    /// `$BOXERY_HOME`: a folder of the test's directory, whose other folders are outside it.
    fn home(&self) -> &Path {
        self.ctx.home.as_path()
    }
}

impl Drop for Plane {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn plane() -> Plane {
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    let store = Store::open(&home.join("store.db")).unwrap();
    let backend = Arc::new(boxery_backends::fake::FakeBackend::new(home.join("fake")));
    let settings = boxery_reconcilers::Settings {
        inventory_every: Duration::from_secs(1),
        ..Default::default()
    };
    let ctx = Arc::new(Ctx::new(
        Arc::new(store.clone()),
        home,
        backend,
        "test".into(),
        settings,
    ));
    let stop = CancellationToken::new();
    tokio::spawn(boxery_reconcilers::runtime::run(ctx.clone(), stop.clone()));
    Plane {
        dir,
        store,
        ctx,
        stop,
    }
}

async fn until<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn vm(p: &Plane, name: &str) {
    let v: Vm = serde_json::from_value(json!({
        "apiVersion": "boxery.dev/v1alpha1", "kind": "Vm", "metadata": {"name": name},
        "spec": {"source": {"image": "tiny"}},
    }))
    .unwrap();
    p.store.create_as(&v).unwrap();
    until("the VM to run", || {
        let v: Vm = p.store.get_as(name).unwrap()?;
        (v.status.phase == boxery_api::VmPhase::Running).then_some(())
    })
    .await;
}

fn grant_for(name: &str, vm: Option<&str>, lease: Option<&str>, value_from: ValueFrom) -> Grant {
    Grant::new(
        name,
        GrantSpec {
            limits: None,
            vm: vm.map(str::to_string),
            lease: lease.map(str::to_string),
            type_: GrantType::Llm,
            target: "anthropic".into(),
            header: None,
            value_from,
        },
    )
}

fn get(p: &Plane, name: &str) -> Option<Grant> {
    p.store.get_as(name).unwrap()
}

async fn phase(p: &Plane, name: &str, want: GrantPhase) -> Grant {
    until(&format!("grant {name} {want:?}"), || {
        get(p, name).filter(|g| {
            g.status.phase == want && g.status.observed_generation == g.metadata.generation
        })
    })
    .await
}

/// What the approval path writes (`boxery_verbs::grants::approve`, minus the prompt).
fn approve(p: &Plane, name: &str) {
    for _ in 0..20 {
        let mut g = get(p, name).unwrap();
        g.status.approved_by = Some("tester".into());
        g.status.approved_at = Some(now());
        g.status.approved_generation = g.metadata.generation;
        g.status.denied_generation = None;
        match p.store.update_status_as(&g) {
            Ok(_) => return,
            Err(boxery_store::StoreError::Conflict { .. }) => continue,
            Err(e) => panic!("{e}"),
        }
    }
    panic!("approval kept conflicting");
}

fn deny(p: &Plane, name: &str) {
    for _ in 0..20 {
        let mut g = get(p, name).unwrap();
        g.status.denied_by = Some("tester".into());
        g.status.denied_generation = g.metadata.generation;
        g.status.approved_generation = None;
        g.status.approved_by = None;
        match p.store.update_status_as(&g) {
            Ok(_) => return,
            Err(boxery_store::StoreError::Conflict { .. }) => continue,
            Err(e) => panic!("{e}"),
        }
    }
    panic!("denial kept conflicting");
}

fn reasons(p: &Plane, name: &str) -> Vec<String> {
    let (evs, _) = p.store.list("Event", &Default::default()).unwrap();
    evs.iter()
        .filter(|e| {
            e.rest["involvedObject"]["kind"] == "Grant" && e.rest["involvedObject"]["name"] == name
        })
        .filter_map(|e| e.rest["reason"].as_str().map(str::to_string))
        .collect()
}

fn entries(p: &Plane, vm: &str) -> Vec<String> {
    boxery_home::grants::read_state(p.home(), vm)
        .into_iter()
        .map(|e| e.name)
        .collect()
}

/// A file outside boxery's home holding `value`.
fn secret_file(p: &Plane, value: &str) -> String {
    let f = p.dir.path().join("secret");
    std::fs::write(&f, value).unwrap();
    f.to_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn phases_events_and_spec_changes() {
    let p = plane().await;
    vm(&p, "dev1").await;
    p.store
        .create_as(&grant_for(
            "g1",
            Some("dev1"),
            None,
            ValueFrom::Env("PATH".into()),
        ))
        .unwrap();
    let g = phase(&p, "g1", GrantPhase::PendingApproval).await;
    let ready = g
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .unwrap();
    assert_eq!(ready.reason, "PendingApproval");
    assert!(
        ready.message.contains("boxery grant approve g1"),
        "{}",
        ready.message
    );
    assert!(
        entries(&p, "dev1").is_empty(),
        "nothing in force before approval"
    );
    until("ApprovalNeeded", || {
        reasons(&p, "g1")
            .contains(&"ApprovalNeeded".into())
            .then_some(())
    })
    .await;

    approve(&p, "g1");
    let g = phase(&p, "g1", GrantPhase::Applied).await;
    assert_eq!(g.status.vm.as_deref(), Some("dev1"));
    until("the entry", || {
        (entries(&p, "dev1") == ["g1"]).then_some(())
    })
    .await;
    let file = boxery_home::layout::grant_state(p.home(), "dev1");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&file).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let e = &boxery_home::grants::read_state(p.home(), "dev1")[0];
    assert_eq!(e.spec.value_from, ValueFrom::Env("PATH".into()));
    assert_eq!(e.generation, 1);
    until("Applied event", || {
        reasons(&p, "g1").contains(&"Applied".into()).then_some(())
    })
    .await;

    // A spec change voids the approval: pending again, the entry gone, an event.
    let mut g = get(&p, "g1").unwrap();
    g.spec.target = "openai".into();
    p.store.update_as(&g).unwrap();
    let g = phase(&p, "g1", GrantPhase::PendingApproval).await;
    assert_eq!(g.metadata.generation, Some(2));
    assert!(
        entries(&p, "dev1").is_empty(),
        "re-pended grants leave the state"
    );
    until("SpecChanged", || {
        reasons(&p, "g1")
            .contains(&"SpecChanged".into())
            .then_some(())
    })
    .await;

    approve(&p, "g1");
    phase(&p, "g1", GrantPhase::Applied).await;
    until("the entry again", || {
        boxery_home::grants::read_state(p.home(), "dev1")
            .first()
            .is_some_and(|e| e.generation == 2 && e.spec.target == "openai")
            .then_some(())
    })
    .await;

    // Denied: out of force.
    deny(&p, "g1");
    phase(&p, "g1", GrantPhase::Denied).await;
    assert!(entries(&p, "dev1").is_empty());
    until("Denied event", || {
        reasons(&p, "g1").contains(&"Denied".into()).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_the_vm_or_the_grant_revokes() {
    let p = plane().await;
    vm(&p, "dev1").await;
    vm(&p, "dev2").await;
    for (g, v) in [("a", "dev1"), ("b", "dev2")] {
        p.store
            .create_as(&grant_for(g, Some(v), None, ValueFrom::Env("PATH".into())))
            .unwrap();
        phase(&p, g, GrantPhase::PendingApproval).await;
        approve(&p, g);
        phase(&p, g, GrantPhase::Applied).await;
    }
    assert_eq!(entries(&p, "dev1"), ["a"]);
    // The VM goes: its grant is revoked (final) and its file is gone.
    p.store.delete("Vm", "dev1").unwrap();
    let g = phase(&p, "a", GrantPhase::Revoked).await;
    let ready = g
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .unwrap();
    assert_eq!(ready.reason, "VmGone");
    assert!(!boxery_home::layout::grant_state(p.home(), "dev1").exists());
    // A new VM of the same name does not inherit it.
    vm(&p, "dev1").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(get(&p, "a").unwrap().status.phase, GrantPhase::Revoked);
    assert!(entries(&p, "dev1").is_empty());
    // Deleting a grant revokes it before it goes.
    p.store.delete("Grant", "b").unwrap();
    until("grant b gone", || get(&p, "b").is_none().then_some(())).await;
    assert!(entries(&p, "dev2").is_empty());
    assert!(!boxery_home::layout::grant_state(p.home(), "dev2").exists());
}

/// Approve `name` once the reconciler has seen it.
async fn approve_when_pending(p: &Plane, name: &str) {
    until("the grant to be seen", || {
        get(p, name).and_then(|g| g.status.conditions.first().map(|_| ()))
    })
    .await;
    approve(p, name);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_grant_dies_with_its_lease() {
    let p = plane().await;
    let pool = serde_json::from_value(json!({
        "apiVersion": "boxery.dev/v1alpha1", "kind": "Pool", "metadata": {"name": "pool"},
        "spec": {"replicas": 1, "template": {"spec": {"source": {"image": "tiny"}}}},
    }))
    .unwrap();
    p.store.create(pool).unwrap();
    until("a free member", || {
        let pl: boxery_api::Pool = p.store.get_as("pool").unwrap()?;
        (pl.status.free == 1).then_some(())
    })
    .await;
    let lease: Lease = serde_json::from_value(json!({
        "apiVersion": "boxery.dev/v1alpha1", "kind": "Lease", "metadata": {"name": "l1"},
        "spec": {"pool": "pool", "holderIdentity": "me",
                 "publicKey": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIC3dGVzdHRlc3R0ZXN0dGVzdHRlc3R0ZXN0dGVzdA me"},
    }))
    .unwrap();
    p.store.create_as(&lease).unwrap();
    let vm = until("the lease to bind", || {
        let l: Lease = p.store.get_as("l1").unwrap()?;
        (l.status.phase == LeasePhase::Bound).then(|| l.status.vm.clone().unwrap())
    })
    .await;
    p.store
        .create_as(&grant_for(
            "lg",
            None,
            Some("l1"),
            ValueFrom::Env("PATH".into()),
        ))
        .unwrap();
    phase(&p, "lg", GrantPhase::PendingApproval).await;
    approve(&p, "lg");
    let g = phase(&p, "lg", GrantPhase::Applied).await;
    assert_eq!(g.status.vm.as_deref(), Some(vm.as_str()));
    // A VM grant on the member stays out of force, saying to grant the lease.
    p.store
        .create_as(&grant_for(
            "vg",
            Some(&vm),
            None,
            ValueFrom::Env("PATH".into()),
        ))
        .unwrap();
    approve_when_pending(&p, "vg").await;
    let why = until("the member's VM grant to say why it waits", || {
        let g = get(&p, "vg")?;
        let c = g.status.conditions.iter().find(|c| c.type_ == "Ready")?;
        (c.reason == "PoolMember").then(|| c.message.clone())
    })
    .await;
    assert!(why.contains("--lease"), "{why}");
    assert_eq!(
        get(&p, "vg").unwrap().status.phase,
        GrantPhase::PendingApproval
    );
    p.store.delete("Grant", "vg").unwrap();
    until("grant vg gone", || get(&p, "vg").is_none().then_some(())).await;
    let e = boxery_home::grants::read_state(p.home(), &vm);
    assert_eq!(e.len(), 1);
    assert_eq!(e[0].spec.lease.as_deref(), Some("l1"));
    // Release: the entry goes (before the reset), the grant turns Revoked.
    p.store.delete("Lease", "l1").unwrap();
    let g = phase(&p, "lg", GrantPhase::Revoked).await;
    let ready = g
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .unwrap();
    assert_eq!(ready.reason, "LeaseEnded");
    assert!(entries(&p, &vm).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_file_that_disagrees_with_the_store_is_rebuilt() {
    let p = plane().await;
    vm(&p, "dev1").await;
    p.store
        .create_as(&grant_for(
            "g1",
            Some("dev1"),
            None,
            ValueFrom::Env("PATH".into()),
        ))
        .unwrap();
    phase(&p, "g1", GrantPhase::PendingApproval).await;
    approve(&p, "g1");
    phase(&p, "g1", GrantPhase::Applied).await;
    let good = std::fs::read(boxery_home::layout::grant_state(p.home(), "dev1")).unwrap();
    // As a crash could leave it (or a hand): the real entry missing, a stranger in its place,
    // and a file for a VM that has no grant at all.
    let mut forged: serde_json::Value = serde_json::from_slice(&good).unwrap();
    forged["grants"][0]["name"] = json!("forged");
    forged["grants"][0]["uid"] = json!("00000000-0000-0000-0000-000000000000");
    std::fs::write(
        boxery_home::layout::grant_state(p.home(), "dev1"),
        forged.to_string(),
    )
    .unwrap();
    std::fs::write(
        boxery_home::layout::grant_state(p.home(), "ghost"),
        forged.to_string(),
    )
    .unwrap();
    let fixed = grant::sweep(&p.ctx).await.unwrap();
    assert_eq!(fixed, ["dev1", "ghost"]);
    assert_eq!(entries(&p, "dev1"), ["g1"]);
    assert!(!boxery_home::layout::grant_state(p.home(), "ghost").exists());
    // A file lost entirely comes back.
    std::fs::remove_file(boxery_home::layout::grant_state(p.home(), "dev1")).unwrap();
    grant::sweep(&p.ctx).await.unwrap();
    assert_eq!(entries(&p, "dev1"), ["g1"]);
    assert!(
        grant::sweep(&p.ctx).await.unwrap().is_empty(),
        "a second pass changes nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_value_reaches_the_store_and_unreadable_values_wait() {
    let p = plane().await;
    vm(&p, "dev1").await;
    const CANARY: &str = "sekrit-canary-4242-do-not-store";
    let file = secret_file(&p, CANARY);
    p.store
        .create_as(&grant_for(
            "g1",
            Some("dev1"),
            None,
            ValueFrom::File(file.clone()),
        ))
        .unwrap();
    phase(&p, "g1", GrantPhase::PendingApproval).await;
    approve(&p, "g1");
    phase(&p, "g1", GrantPhase::Applied).await;
    for f in ["store.db", "store.db-wal"] {
        // Read by another process: closing a descriptor of store.db here would drop the
        // SQLite locks this process's open store holds on it (docs/store.md).
        let bytes = std::process::Command::new("cat")
            .arg(p.home().join(f))
            .output()
            .map(|o| o.stdout)
            .unwrap_or_default();
        let hit = bytes.windows(CANARY.len()).any(|w| w == CANARY.as_bytes());
        assert!(!hit, "the value is in {f}");
    }
    let state =
        std::fs::read_to_string(boxery_home::layout::grant_state(p.home(), "dev1")).unwrap();
    assert!(!state.contains(CANARY) && state.contains(&file), "{state}");

    // Approved, but the value cannot be read here: not in force, says why.
    p.store
        .create_as(&grant_for(
            "g2",
            Some("dev1"),
            None,
            ValueFrom::Env("BOXERY_TEST_SURELY_UNSET_VARIABLE".into()),
        ))
        .unwrap();
    phase(&p, "g2", GrantPhase::PendingApproval).await;
    approve(&p, "g2");
    until("ValueUnavailable", || {
        let g = get(&p, "g2")?;
        let c = g.status.conditions.iter().find(|c| c.type_ == "Ready")?;
        (c.reason == "ValueUnavailable").then_some(())
    })
    .await;
    assert_eq!(entries(&p, "dev1"), ["g1"]);
    // A grant file under boxery's home is never readable as a value.
    assert!(
        boxery_home::values::available(
            &ValueFrom::File(p.home().join("store.db").to_str().unwrap().into()),
            p.home()
        )
        .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_waits_for_a_vm_that_does_not_exist_yet() {
    let p = plane().await;
    p.store
        .create_as(&grant_for(
            "early",
            Some("later"),
            None,
            ValueFrom::Env("PATH".into()),
        ))
        .unwrap();
    let g = phase(&p, "early", GrantPhase::PendingApproval).await;
    let ready = g
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .unwrap();
    assert_eq!(ready.reason, "VmNotFound");
    approve(&p, "early");
    vm(&p, "later").await;
    let g = phase(&p, "early", GrantPhase::Applied).await;
    assert!(g.status.vm_uid.is_some());
    assert_eq!(entries(&p, "later"), ["early"]);
}

/// The token store the proxy checks: a VM outside a pool has its own token from creation
/// (owned by its uid) until it is deleted; a free pool member has none; a lease's token is
/// owned by the lease and gone when the lease ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_follow_vms_and_leases() {
    use boxery_home::tokens;
    let p = plane().await;
    vm(&p, "dev1").await;
    let uid = p
        .store
        .get_as::<Vm>("dev1")
        .unwrap()
        .unwrap()
        .metadata
        .uid
        .unwrap();
    let (owner, token) = tokens::read(p.home(), "dev1").expect("a VM has a token from creation");
    assert_eq!(owner, uid);
    assert!(token.starts_with("bxt_") && token.len() == 68);
    assert_eq!(
        tokens::matches(p.home(), "dev1", &token).as_deref(),
        Some(uid.as_str())
    );
    // A lost token file is minted again (a new token) on the next reconcile.
    std::fs::remove_file(boxery_home::layout::token(p.home(), "dev1")).unwrap();
    let mut v: Vm = p.store.get_as("dev1").unwrap().unwrap();
    v.metadata.labels.insert("touch".into(), "1".into());
    p.store.update_as(&v).unwrap();
    let (_, again) = until("a new token", || tokens::read(p.home(), "dev1")).await;
    assert_ne!(again, token);
    p.store.delete("Vm", "dev1").unwrap();
    until("dev1 gone", || {
        p.store
            .get_as::<Vm>("dev1")
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    assert!(
        tokens::read(p.home(), "dev1").is_none(),
        "rm revokes the token"
    );

    let pool = serde_json::from_value(json!({
        "apiVersion": "boxery.dev/v1alpha1", "kind": "Pool", "metadata": {"name": "pool"},
        "spec": {"replicas": 1, "template": {"spec": {"source": {"image": "tiny"}}}},
    }))
    .unwrap();
    p.store.create(pool).unwrap();
    until("a free member", || {
        let pl: boxery_api::Pool = p.store.get_as("pool").unwrap()?;
        (pl.status.free == 1).then_some(())
    })
    .await;
    assert!(
        tokens::read(p.home(), "pool-0").is_none(),
        "a free member has no token"
    );
    let lease: Lease = serde_json::from_value(json!({
        "apiVersion": "boxery.dev/v1alpha1", "kind": "Lease", "metadata": {"name": "l1"},
        "spec": {"pool": "pool", "holderIdentity": "me",
                 "publicKey": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIC3dGVzdHRlc3R0ZXN0dGVzdHRlc3R0ZXN0dGVzdA me"},
    }))
    .unwrap();
    p.store.create_as(&lease).unwrap();
    let (vm, luid) = until("the lease to bind", || {
        let l: Lease = p.store.get_as("l1").unwrap()?;
        (l.status.phase == LeasePhase::Bound).then(|| {
            (
                l.status.vm.clone().unwrap(),
                l.metadata.uid.clone().unwrap(),
            )
        })
    })
    .await;
    let (owner, _) = tokens::read(p.home(), &vm).expect("a bound lease has a token");
    assert_eq!(owner, luid);
    p.store.delete("Lease", "l1").unwrap();
    until("the lease's token gone", || {
        tokens::read(p.home(), &vm).is_none().then_some(())
    })
    .await;
}
