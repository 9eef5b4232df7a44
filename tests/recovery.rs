//! Recovery paths that are not a crash: a step that fails N times then succeeds converges with
//! backoff; an unreachable backend deletes nothing; a VM deleted behind boxery's back turns
//! Lost; orphans are removed only when this store deleted their object (others are
//! quarantined, listed by `boxery orphans`, adopted or deleted on request) and foreign ones are
//! left alone; a crash exactly
//! inside a create converges with the VM created once.

mod common;

use std::time::Duration;

use boxery_backends::fake::{FaultAction, FaultConfig, FaultRule};
use boxery_backends::{Backend, PowerState};
use common::{Home, invariants};

fn converge(home: &Home) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut last = Vec::new();
    let ok = common::eventually(Duration::from_secs(60), || {
        last = rt.block_on(invariants::problems(home));
        last.is_empty().then_some(())
    });
    assert!(ok.is_some(), "did not converge:\n{}", last.join("\n"));
}

#[test]
fn failing_step_converges_with_backoff() {
    let home = Home::new();
    let fake = home.fake();
    fake.set_faults(&FaultConfig::rules([FaultRule::new(
        "create",
        FaultAction::Fail,
    )
    .times(3)]))
        .unwrap();
    let _serve = home.serve(&[]);
    home.ok(&["new", "f1"]);
    home.ok(&["wait", "vm", "f1", "--for=condition=Ready", "--timeout=60s"]);
    let d = home.ok(&["describe", "vm", "f1"]);
    assert!(
        d.contains("StepFailed"),
        "the failures are recorded as events: {d}"
    );
    assert_eq!(
        fake.fault_counts().unwrap().get("create").copied(),
        Some(4),
        "three failures, then success"
    );
    converge(&home);
}

/// A `--wait` that began while a `serve` led takes over when that `serve` dies, instead of
/// waiting out its timeout with no controller running.
#[test]
fn a_wait_outlives_the_serve_it_began_under() {
    let home = Home::new();
    let fake = home.fake();
    // the first create never returns: serve is stuck inside it when it is killed
    fake.set_faults(&FaultConfig::rules([FaultRule::new(
        "create",
        FaultAction::Hang,
    )
    .times(1)]))
        .unwrap();
    let mut serve = home.serve(&[]);
    serve.wait_leading();
    home.ok(&["new", "w1"]);
    let wait = home
        .cmd()
        .args(["wait", "vm", "w1", "--for=condition=Ready", "--timeout=60s"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    common::eventually(Duration::from_secs(20), || {
        (fake.fault_counts().unwrap().get("create").copied() >= Some(1)).then_some(())
    })
    .expect("serve is inside the create");
    std::thread::sleep(Duration::from_millis(500));
    serve.kill();
    let out = wait.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the wait finished the job: {stderr}");
    assert!(
        stderr.contains("no control plane leads the store any more"),
        "{stderr}"
    );
    converge(&home);
}

#[test]
fn unreachable_backend_deletes_nothing() {
    let home = Home::new();
    let fake = home.fake();
    let _serve = home.serve(&[]);
    for n in ["u1", "u2"] {
        home.ok(&["new", n]);
    }
    for n in ["u1", "u2"] {
        home.ok(&["wait", "vm", n, "--for=condition=Ready", "--timeout=30s"]);
    }
    fake.set_faults(&FaultConfig::rules([
        FaultRule::new("list", FaultAction::Unreachable),
        FaultRule::new("images", FaultAction::Unreachable),
        FaultRule::new("get", FaultAction::Unreachable),
    ]))
    .unwrap();
    home.ok(&[
        "wait",
        "vm",
        "u1",
        "--for=condition=BackendReachable=False",
        "--timeout=30s",
    ]);
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        fake.vm_record("u1").unwrap().is_some() && fake.vm_record("u2").unwrap().is_some(),
        "nothing deleted"
    );
    let store = home.store();
    for n in ["u1", "u2"] {
        let vm: boxery_api::Vm = store.get_as(n).unwrap().expect("object kept");
        assert!(
            vm.status.conditions.iter().all(|c| c.type_ != "Lost"),
            "{n} was not marked Lost"
        );
    }
    fake.clear_faults().unwrap();
    common::eventually(Duration::from_secs(30), || {
        let vm: boxery_api::Vm = store.get_as("u1").unwrap().unwrap();
        vm.status
            .conditions
            .iter()
            .all(|c| c.type_ != "BackendReachable")
            .then_some(())
    })
    .expect("BackendReachable cleared once the backend answers");
    converge(&home);
}

/// A VM that stops without being asked (guest power-off, hypervisor crash) is noticed by the
/// inventory pass, not the minute-long resync, shown as `Exited`, and started again.
#[test]
fn a_vm_that_stops_on_its_own_is_started_again() {
    let home = Home::new();
    let fake = home.fake();
    // serve leads from here on (no `--wait` runs the controllers in-process and hands over
    // later), so only its inventory pass, or the 60 s resync, can notice the stop
    let serve = home.serve(&[]);
    serve.wait_leading();
    home.ok(&["new", "e1"]);
    home.ok(&["wait", "vm", "e1", "--for=condition=Ready", "--timeout=30s"]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(fake.stop("e1")).unwrap();
    common::eventually(Duration::from_secs(15), || {
        home.ok(&["events", "vm", "e1"])
            .contains("Restarted")
            .then_some(())
    })
    .expect("a Restarted event within a few inventory passes");
    let state = rt.block_on(fake.get("e1")).unwrap().unwrap().state;
    assert_eq!(state, PowerState::Running);
    home.ok(&["wait", "vm", "e1", "--for=condition=Ready", "--timeout=30s"]);
    // Asked to stop, it stays stopped: no restart, no warning.
    home.ok(&["stop", "e1", "--wait", "--timeout=30s"]);
    std::thread::sleep(Duration::from_secs(3));
    let state = rt.block_on(fake.get("e1")).unwrap().unwrap().state;
    assert_eq!(state, PowerState::Stopped);
    let events = home.ok(&["events", "vm", "e1"]);
    assert_eq!(events.matches("Restarted").count(), 1, "{events}");
}

/// A running VM the backend reports degraded (as qemu does when a VM's network helper died):
/// the inventory pass marks it `Degraded` (`Ready=False`, a Warning event), its controller
/// repairs it without a restart, and it is Ready again. A failed repair is retried.
#[test]
fn a_degraded_vm_is_repaired_without_a_restart() {
    let home = Home::new();
    let fake = home.fake();
    let serve = home.serve(&[]);
    serve.wait_leading();
    home.ok(&["new", "d1"]);
    home.ok(&["wait", "vm", "d1", "--for=condition=Ready", "--timeout=30s"]);
    // The first repair fails (the retry is the controller's ordinary backoff).
    fake.set_faults(&FaultConfig::rules([FaultRule::new(
        "repair",
        FaultAction::Fail,
    )
    .times(1)]))
        .unwrap();
    fake.degrade("d1", "its network helper is not running")
        .unwrap();
    common::eventually(Duration::from_secs(20), || {
        home.ok(&["events", "vm", "d1"])
            .contains("Repaired")
            .then_some(())
    })
    .expect("a Repaired event within a few inventory passes");
    let events = home.ok(&["events", "vm", "d1"]);
    assert!(
        events.contains("Degraded") && events.contains("its network helper is not running"),
        "{events}"
    );
    assert!(
        !events.contains("Restarted"),
        "repaired, not restarted: {events}"
    );
    assert_eq!(
        fake.fault_counts().unwrap().get("repair").copied(),
        Some(2),
        "one failure, then the repair"
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let info = rt.block_on(fake.get("d1")).unwrap().unwrap();
    assert_eq!((info.state, info.degraded), (PowerState::Running, None));
    home.ok(&["wait", "vm", "d1", "--for=condition=Ready", "--timeout=30s"]);
    let ops: Vec<_> = fake
        .journal()
        .unwrap()
        .into_iter()
        .filter(|e| e.name == "d1")
        .map(|e| e.op)
        .collect();
    assert_eq!(
        ops.iter()
            .filter(|o| **o == boxery_backends::fake::JournalOp::Repair)
            .count(),
        1,
        "{ops:?}"
    );
    assert!(
        !ops.contains(&boxery_backends::fake::JournalOp::Stop),
        "never stopped: {ops:?}"
    );
}

#[test]
fn lost_vms_and_orphans() {
    let home = Home::new();
    let fake = home.fake();
    let _serve = home.serve(&[]);
    home.ok(&["new", "l1"]);
    home.ok(&["wait", "vm", "l1", "--for=condition=Ready", "--timeout=30s"]);
    // Deleted behind our back: Lost, with a warning event; never recreated silently.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(fake.remove("l1")).unwrap();
    home.ok(&["wait", "vm", "l1", "--for=condition=Lost", "--timeout=30s"]);
    assert_eq!(
        home.ok(&[
            "get",
            "vm",
            "l1",
            "-o",
            "jsonpath={.status.printableStatus}"
        ])
        .trim(),
        "Lost"
    );
    assert!(home.ok(&["events", "vm", "l1"]).contains("Lost"));
    // An orphan this store made for an object it deleted is removed; one it has no record of
    // (marked by another store, before stores had an identity, or for an object a restored
    // backup lacks) is quarantined: left alone and listed by `boxery orphans`; a foreign VM is
    // never touched.
    home.ok(&["new", "gone1"]);
    home.ok(&[
        "wait",
        "vm",
        "gone1",
        "--for=condition=Ready",
        "--timeout=30s",
    ]);
    let uid = home.ok(&["get", "vm", "gone1", "-o", "jsonpath={.metadata.uid}"]);
    home.ok(&["rm", "gone1", "--wait", "--timeout", "30s"]);
    let store_uid = home.store().uid().to_string();
    let mark = boxery_backends::mark::mark(uid.trim(), &store_uid);
    fake.add_vm("gone1", Some(&mark), PowerState::Running)
        .unwrap();
    fake.add_vm(
        "orphan",
        Some("00000000-dead-beef-0000-000000000000"),
        PowerState::Running,
    )
    .unwrap();
    let elsewhere =
        boxery_backends::mark::mark("00000000-dead-beef-0000-000000000002", "other-store");
    fake.add_vm("other", Some(&elsewhere), PowerState::Running)
        .unwrap();
    fake.add_vm("foreign", None, PowerState::Running).unwrap();
    fake.add_image("orphan-img", Some("00000000-dead-beef-0000-000000000001"))
        .unwrap();
    fake.add_image("foreign-img", None).unwrap();
    common::eventually(Duration::from_secs(30), || {
        fake.vm_record("gone1").unwrap().is_none().then_some(())
    })
    .expect("the orphan of an object this store deleted is removed");
    let listed = common::eventually(Duration::from_secs(30), || {
        let events = home.ok(&["events"]);
        (events.contains("Orphaned") && events.contains("orphan-img")).then_some(events)
    })
    .expect("quarantined orphans are reported as events");
    assert!(listed.contains("other"), "{listed}");
    for (name, gone) in [
        ("orphan", fake.vm_record("orphan").unwrap().is_none()),
        ("other", fake.vm_record("other").unwrap().is_none()),
        ("foreign", fake.vm_record("foreign").unwrap().is_none()),
        (
            "orphan-img",
            fake.image_record("orphan-img").unwrap().is_none(),
        ),
        (
            "foreign-img",
            fake.image_record("foreign-img").unwrap().is_none(),
        ),
    ] {
        assert!(!gone, "{name} must be left alone");
    }
    let table = home.ok(&["orphans"]);
    for line in [
        "Vm     orphan       Quarantined",
        "Vm     other        Quarantined",
        "Vm     foreign      Foreign",
        "Image  orphan-img   Quarantined",
    ] {
        let words: Vec<&str> = line.split_whitespace().collect();
        assert!(
            table
                .lines()
                .any(|l| l.split_whitespace().take(3).eq(words.iter().copied())),
            "`{line}` in:\n{table}"
        );
    }
    assert!(table.contains("another store (other-store)"), "{table}");
    // Settling them: delete needs --yes and never touches a foreign VM.
    let out = home.run(&["orphans", "delete", "vm", "orphan"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let out = home.run(&["orphans", "delete", "vm", "foreign", "--yes"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    home.ok(&["orphans", "delete", "vm", "orphan", "--yes"]);
    assert!(fake.vm_record("orphan").unwrap().is_none());
    assert!(fake.vm_record("foreign").unwrap().is_some());
    // Adopting: the object is written again with the uid it was made for, and is managed.
    home.ok(&["orphans", "adopt", "vm", "other"]);
    home.ok(&[
        "wait",
        "vm",
        "other",
        "--for=condition=Ready",
        "--timeout=30s",
    ]);
    assert_eq!(
        home.ok(&["get", "vm", "other", "-o", "jsonpath={.metadata.uid}"])
            .trim(),
        "00000000-dead-beef-0000-000000000002"
    );
    home.ok(&["rm", "other", "--wait", "--timeout", "30s"]);
    assert!(
        fake.vm_record("other").unwrap().is_none(),
        "an adopted VM is boxery's again"
    );
    // The Lost VM can be deleted.
    home.ok(&["rm", "l1", "--wait", "--timeout", "30s"]);
}

#[test]
fn crash_inside_create_and_capture() {
    for step in [
        "create.disk",
        "create.commit",
        "create.done",
        "capture.copy",
        "capture.commit",
        "reimage.swap",
    ] {
        let home = Home::new();
        let fake = home.fake();
        let mut serve = home.serve(&[]);
        home.ok(&["new", "c1"]);
        home.ok(&["wait", "vm", "c1", "--for=condition=Ready", "--timeout=30s"]);
        home.ok(&["snap", "c1", "base"]);
        home.ok(&[
            "wait",
            "image",
            "c1.base",
            "--for=condition=Ready",
            "--timeout=30s",
        ]);
        // The next call of `step` kills the control plane right inside the step.
        fake.set_faults(&FaultConfig::rules([FaultRule::new(
            step,
            FaultAction::Exit,
        )
        .nth(1)]))
            .unwrap();
        home.ok(&["new", "c2"]);
        home.ok(&["snap", "c1", "s2"]);
        home.ok(&["revert", "c1", "base"]);
        let died = common::eventually(Duration::from_secs(20), || (!serve.alive()).then_some(()));
        assert!(died.is_some(), "{step}: the injected crash never happened");
        fake.clear_faults().unwrap();
        serve = home.serve(&[]);
        converge(&home);
        drop(serve);
    }
}

/// A VM started again by its reconcile (not by the inventory pass) is not Ready until the new
/// guest answers: a Ready from before the stop must not let `wait --for=condition=Ready`
/// return while the guest still boots (the first command would meet a reset connection).
#[test]
fn a_restarted_vm_is_not_ready_until_it_answers() {
    let home = Home::new();
    let fake = home.fake();
    // No inventory pass in this test's time: only a reconcile can notice the stop.
    let serve = home.serve(&["--inventory-every", "1day"]);
    serve.wait_leading();
    home.ok(&["new", "r1"]);
    home.ok(&["wait", "vm", "r1", "--for=condition=Ready", "--timeout=30s"]);
    let store = home.store();
    let from = store.revision().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(fake.stop("r1")).unwrap();
    // A label change wakes the reconcile, which finds the VM stopped and starts it again.
    let mut o = store.get("Vm", "r1").unwrap().unwrap();
    o.metadata.labels.insert("poke".into(), "1".into());
    store.update(o).unwrap();
    common::eventually(Duration::from_secs(15), || {
        home.ok(&["events", "vm", "r1"])
            .contains("Restarted")
            .then_some(())
    })
    .expect("a Restarted event");
    home.ok(&["wait", "vm", "r1", "--for=condition=Ready", "--timeout=30s"]);
    // Between the stop and the new Ready, Ready was False at least once.
    let mut watch = store.watch(Some("Vm"), from);
    let mut not_ready = false;
    rt.block_on(async {
        use futures::StreamExt;
        while let Ok(Some(Ok(ev))) =
            tokio::time::timeout(Duration::from_millis(500), watch.next()).await
        {
            let vm: boxery_api::Vm = ev.1.object().to_typed().unwrap();
            if vm.metadata.name == "r1"
                && vm
                    .status
                    .conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == boxery_api::ConditionStatus::False)
            {
                not_ready = true;
            }
        }
    });
    assert!(not_ready, "r1 stayed Ready across its restart");
}
