//! The Vm reconciler's decisions, one reconcile at a time, on a store in memory and the fake
//! backend (`boxery_reconcilers::testing`): no controller runs, so each test says exactly
//! which reconcile made which decision.

use std::time::Duration;

use boxery_api::conditions::{self, READY, reasons};
use boxery_api::vm::{InstanceType, OperationType};
use boxery_api::{ConditionStatus, Conditions, Image, ImagePhase, Vm, VmPhase, now};
use boxery_backends::fake::JournalOp;
use boxery_backends::{Backend, PowerState};
use boxery_reconcilers::testing::{self, Harness, Part, interrupted};
use boxery_reconcilers::vm::{self, FINALIZER};

fn condition(vm: &Vm, type_: &str) -> (ConditionStatus, String) {
    let c = vm
        .status
        .conditions
        .get_condition(type_)
        .unwrap_or_else(|| panic!("no {type_} condition in {:?}", vm.status.conditions));
    (c.status, c.reason.clone())
}

/// VM `a`, which a crashed control plane left in the middle of its create from `base`.
async fn interrupted_create(h: &Harness) -> Vm {
    h.ready_image("base");
    let a = h.put(&testing::vm("a", "base"));
    h.reconcile(vm::reconcile, "a").await.unwrap();
    h.edit::<Vm>("a", Part::Status, |a| {
        a.status.operation = Some(interrupted(OperationType::Create, "base"))
    });
    a
}

/// A VM made from image `base` and settled: running, Ready.
async fn running(h: &Harness, name: &str) -> Vm {
    h.ready_image("base");
    h.put(&testing::vm(name, "base"));
    let next = h.settle(vm::reconcile, name).await.unwrap();
    assert!(next.is_await_change(), "{next:?}");
    h.get(name)
}

#[tokio::test]
async fn the_first_reconcile_adds_the_finalizer_and_nothing_else() {
    let h = Harness::new();
    h.put(&testing::vm("a", "base"));
    let next = h.reconcile(vm::reconcile, "a").await.unwrap();
    assert!(next.is_await_change(), "the write wakes it: {next:?}");
    let a: Vm = h.get("a");
    assert_eq!(a.metadata.finalizers, [FINALIZER]);
    assert!(a.status.conditions.is_empty(), "no step yet");
    assert!(h.calls().is_empty());
}

#[tokio::test]
async fn a_stock_image_is_made_on_first_use_and_the_vm_waits_for_it() {
    let h = Harness::new();
    h.put(&testing::vm("a", "tiny"));
    let next = h.settle(vm::reconcile, "a").await.unwrap();
    assert_eq!(next.requeue_after(), Some(Duration::from_secs(5)));
    let a: Vm = h.get("a");
    assert_eq!(a.status.phase, VmPhase::Pending);
    assert_eq!(
        condition(&a, conditions::IMAGE_AVAILABLE),
        (ConditionStatus::False, reasons::IMAGE_NOT_READY.into())
    );
    assert!(
        h.find::<Image>("tiny").is_some(),
        "the stock image's object"
    );
    assert_eq!(h.reasons::<Vm>("a"), ["BuildingImage"]);
    assert!(h.calls().is_empty(), "no backend call before the image");
}

#[tokio::test]
async fn a_missing_image_is_said_once_and_nothing_is_made() {
    let h = Harness::new();
    h.put(&testing::vm("a", "nosuch"));
    h.settle(vm::reconcile, "a").await.unwrap();
    h.settle(vm::reconcile, "a").await.unwrap();
    let a: Vm = h.get("a");
    assert_eq!(
        condition(&a, READY),
        (ConditionStatus::False, reasons::IMAGE_NOT_FOUND.into())
    );
    assert_eq!(h.warnings::<Vm>("a"), ["ImageNotFound"]);
    assert!(h.find::<Image>("nosuch").is_none());
    assert!(h.calls().is_empty());
}

#[tokio::test]
async fn a_vm_is_created_from_a_ready_image_and_reported_running() {
    let h = Harness::new();
    let a = running(&h, "a").await;
    assert_eq!(h.calls(), [(JournalOp::Create, "a".to_string())]);
    assert_eq!(a.status.phase, VmPhase::Running);
    assert_eq!(
        condition(&a, READY),
        (ConditionStatus::True, reasons::RUNNING.into())
    );
    assert_eq!(a.status.operation, None, "the intent is cleared");
    assert_eq!(a.status.source_image.as_deref(), Some("base"));
    assert_eq!(a.status.instance_type, Some(InstanceType::VirtualMachine));
    assert_eq!(a.status.observed_generation, a.metadata.generation);
    assert_eq!(h.reasons::<Vm>("a"), ["Created"]);
    let rec = h.backend.vm_record("a").unwrap().unwrap();
    assert_eq!(rec.state, PowerState::Running);
    assert_eq!(rec.mark.as_deref(), Some(h.ctx.mark(&a.metadata).as_str()));
    // Settled: another reconcile changes nothing and calls nothing.
    let rv = a.metadata.resource_version.clone();
    assert!(
        h.reconcile(vm::reconcile, "a")
            .await
            .unwrap()
            .is_await_change()
    );
    assert_eq!(h.get::<Vm>("a").metadata.resource_version, rv);
    assert_eq!(h.calls().len(), 1);
}

/// A VM that asks for a kind of instance its backend does not make is refused before
/// anything is made or built for it, saying what the backend makes; one that asks for the
/// backend's own kind is made as it.
#[tokio::test]
async fn an_instance_type_the_backend_does_not_make_is_refused_before_anything_is_made() {
    let h = Harness::new();
    let mut c = testing::vm("c", "tiny");
    c.spec.instance_type = Some(InstanceType::Container);
    h.put(&c);
    h.settle(vm::reconcile, "c").await.unwrap();
    let c: Vm = h.get("c");
    let ready = c.status.conditions.get_condition(READY).unwrap();
    assert_eq!(
        (ready.status, ready.reason.as_str()),
        (ConditionStatus::False, reasons::INVALID_REQUEST)
    );
    assert!(
        ready.message.contains("spec.instanceType is container")
            && ready
                .message
                .contains("the fake backend makes virtual-machine only"),
        "{}",
        ready.message
    );
    assert_eq!(c.status.instance_type, None);
    assert!(h.calls().is_empty(), "nothing made");
    assert!(h.find::<Image>("tiny").is_none(), "nor built");

    h.ready_image("base");
    let mut v = testing::vm("v", "base");
    v.spec.instance_type = Some(InstanceType::VirtualMachine);
    h.put(&v);
    h.settle(vm::reconcile, "v").await.unwrap();
    let v: Vm = h.get("v");
    assert_eq!(v.status.instance_type, Some(InstanceType::VirtualMachine));
    assert_eq!(v.status.phase, VmPhase::Running);
}

#[tokio::test]
async fn a_vm_gone_from_the_backend_is_lost_and_never_made_again() {
    let h = Harness::new();
    running(&h, "a").await;
    std::fs::remove_dir_all(h.backend.dir().join("vms/a")).unwrap();
    let next = h.settle(vm::reconcile, "a").await.unwrap();
    assert!(next.is_await_change());
    let a: Vm = h.get("a");
    assert_eq!(a.status.phase, VmPhase::Lost);
    assert_eq!(
        condition(&a, conditions::LOST),
        (ConditionStatus::True, reasons::NOT_IN_BACKEND.into())
    );
    assert_eq!(h.warnings::<Vm>("a"), ["Lost"]);
    assert_eq!(h.calls(), [(JournalOp::Create, "a".to_string())]);
}

#[tokio::test]
async fn a_vm_that_stopped_on_its_own_is_started_with_a_warning() {
    let h = Harness::new();
    running(&h, "a").await;
    h.backend.stop("a").await.unwrap();
    let next = h.reconcile(vm::reconcile, "a").await.unwrap();
    assert_eq!(next.requeue_after(), Some(Duration::ZERO));
    let a: Vm = h.get("a");
    assert_eq!(
        condition(&a, READY),
        (ConditionStatus::False, reasons::BOOTING.into()),
        "the old Ready is gone with the old guest"
    );
    assert_eq!(h.warnings::<Vm>("a"), ["Restarted"]);
    assert_eq!(h.calls().last().unwrap().0, JournalOp::Start);
    h.settle(vm::reconcile, "a").await.unwrap();
    assert!(vm::is_ready(&h.get("a")));
}

#[tokio::test]
async fn run_strategy_stopped_stops_the_vm() {
    let h = Harness::new();
    running(&h, "a").await;
    h.edit::<Vm>("a", Part::Spec, |a| {
        a.spec.run_strategy = boxery_api::RunStrategy::Stopped
    });
    h.settle(vm::reconcile, "a").await.unwrap();
    let a: Vm = h.get("a");
    assert_eq!(a.status.phase, VmPhase::Stopped);
    assert_eq!(
        condition(&a, READY),
        (ConditionStatus::False, reasons::STOPPED.into())
    );
    assert_eq!(h.calls().last().unwrap().0, JournalOp::Stop);
    assert!(h.reasons::<Vm>("a").contains(&"Stopped".to_string()));
}

#[tokio::test]
async fn a_degraded_vm_is_repaired_without_a_restart() {
    let h = Harness::new();
    running(&h, "a").await;
    h.backend.degrade("a", "its network helper exited").unwrap();
    let next = h.reconcile(vm::reconcile, "a").await.unwrap();
    assert_eq!(next.requeue_after(), Some(Duration::ZERO));
    let ops: Vec<JournalOp> = h.calls().into_iter().map(|c| c.0).collect();
    assert_eq!(ops, [JournalOp::Create, JournalOp::Repair]);
    assert!(h.reasons::<Vm>("a").contains(&"Repaired".to_string()));
    assert!(
        h.backend
            .vm_record("a")
            .unwrap()
            .unwrap()
            .degraded
            .is_none()
    );
}

#[tokio::test]
async fn a_bigger_spec_resizes_and_a_smaller_disk_is_refused() {
    let h = Harness::new();
    running(&h, "a").await;
    h.edit::<Vm>("a", Part::Spec, |a| a.spec.resources.cpus = Some(4));
    h.settle(vm::reconcile, "a").await.unwrap();
    assert_eq!(h.calls().last().unwrap().0, JournalOp::Resize);
    assert_eq!(h.backend.vm_record("a").unwrap().unwrap().size.cpus, 4);
    let disk = h.backend.vm_record("a").unwrap().unwrap().size.disk_gib;
    assert!(disk > 1, "a disk that can be asked smaller: {disk}Gi");
    h.edit::<Vm>("a", Part::Spec, |a| {
        a.spec.resources.disk = Some(boxery_api::Quantity::gib(disk - 1))
    });
    let calls = h.calls().len();
    h.settle(vm::reconcile, "a").await.unwrap();
    let a: Vm = h.get("a");
    assert_eq!(
        condition(&a, conditions::RESIZED),
        (ConditionStatus::False, reasons::DISK_SHRINK_REFUSED.into())
    );
    assert_eq!(
        condition(&a, READY).1,
        reasons::DISK_SHRINK_REFUSED,
        "not converged"
    );
    assert_ne!(a.status.observed_generation, a.metadata.generation);
    assert_eq!(h.warnings::<Vm>("a"), ["DiskShrinkRefused"]);
    assert_eq!(h.calls().len(), calls, "nothing shrinks");
    // Settled: a later reconcile writes nothing (Ready is not set True and back, which would
    // give it a new lastTransitionTime, and so a write, on every reconcile).
    tokio::time::sleep(Duration::from_millis(5)).await;
    h.reconcile(vm::reconcile, "a").await.unwrap();
    assert_eq!(
        h.get::<Vm>("a").metadata.resource_version,
        a.metadata.resource_version
    );
}

#[tokio::test]
async fn deletion_removes_the_backend_vm_then_the_finalizer() {
    let h = Harness::new();
    running(&h, "a").await;
    h.delete::<Vm>("a");
    assert_eq!(
        h.get::<Vm>("a").metadata.finalizers,
        [FINALIZER],
        "held by its finalizer"
    );
    let next = h.reconcile(vm::reconcile, "a").await.unwrap();
    assert!(next.is_await_change());
    assert!(h.find::<Vm>("a").is_none(), "the finalizer went");
    assert!(h.backend.vm_record("a").unwrap().is_none());
    assert_eq!(h.calls().last().unwrap(), &(JournalOp::Remove, "a".into()));
}

#[tokio::test]
async fn deletion_leaves_a_backend_vm_made_for_another_object() {
    let h = Harness::new();
    running(&h, "a").await;
    std::fs::remove_dir_all(h.backend.dir().join("vms/a")).unwrap();
    h.backend
        .add_vm("a", Some("someone-else"), PowerState::Running)
        .unwrap();
    h.remove(vm::reconcile, "a").await;
    assert!(
        h.backend.vm_record("a").unwrap().is_some(),
        "not ours: kept"
    );
    assert_eq!(h.calls().len(), 1, "no remove");
}

#[tokio::test]
async fn a_failed_create_is_recorded_and_backs_off() {
    let h = Harness::new();
    h.ready_image("base");
    h.put(&testing::vm("a", "base"));
    h.fail("create");
    let next = h.settle(vm::reconcile, "a").await.unwrap();
    let wait = next.requeue_after().expect("a requeue");
    assert!(
        wait > Duration::ZERO && wait <= boxery_reconcilers::backoff::BASE,
        "what is left of the first backoff: {wait:?}"
    );
    let a: Vm = h.get("a");
    assert_eq!(a.status.failures, 1);
    assert_eq!(a.status.phase, VmPhase::Failed);
    assert_eq!(
        a.status.operation, None,
        "nothing half made is left recorded"
    );
    assert_eq!(
        condition(&a, READY),
        (ConditionStatus::False, reasons::STEP_FAILED.into())
    );
    assert_eq!(h.warnings::<Vm>("a"), ["StepFailed"]);
    // Within the backoff, a reconcile (the wake-up of the status write) waits and calls
    // nothing.
    let next = h.reconcile(vm::reconcile, "a").await.unwrap();
    let left = next.requeue_after().expect("a requeue");
    assert!(left > Duration::ZERO && left <= boxery_reconcilers::backoff::BASE);
    assert_eq!(h.backend.fault_counts().unwrap()["create"], 1);
    assert_eq!(h.get::<Vm>("a").status.failures, 1);
    // A new generation goes ahead at once, and success clears the failures.
    h.heal();
    h.edit::<Vm>("a", Part::Spec, |a| a.spec.resources.cpus = Some(2));
    h.settle(vm::reconcile, "a").await.unwrap();
    let a: Vm = h.get("a");
    assert_eq!((a.status.failures, a.status.phase), (0, VmPhase::Running));
    assert_eq!(h.calls(), [(JournalOp::Create, "a".to_string())]);
}

#[tokio::test]
async fn an_interrupted_create_is_adopted_when_the_backend_finished_it() {
    let h = Harness::new();
    let a = interrupted_create(&h).await;
    h.backend
        .add_vm("a", Some(&h.ctx.mark(&a.metadata)), PowerState::Running)
        .unwrap();
    h.settle(vm::reconcile, "a").await.unwrap();
    let a: Vm = h.get("a");
    assert_eq!(a.status.operation, None);
    assert!(a.status.created_at.is_some());
    assert_eq!(a.status.phase, VmPhase::Running);
    assert_eq!(h.reasons::<Vm>("a")[0], "Recovered");
    assert!(
        !h.calls().iter().any(|c| c.0 == JournalOp::Create),
        "adopted, not made again: {:?}",
        h.calls()
    );
}

#[tokio::test]
async fn an_interrupted_create_is_cleaned_up_and_made_again() {
    let h = Harness::new();
    let a = interrupted_create(&h).await;
    h.backend
        .add_partial_vm("a", &h.ctx.mark(&a.metadata))
        .unwrap();
    h.settle(vm::reconcile, "a").await.unwrap();
    let ops: Vec<JournalOp> = h.calls().into_iter().map(|c| c.0).collect();
    assert_eq!(ops, [JournalOp::CleanupNew, JournalOp::Create]);
    assert_eq!(h.reasons::<Vm>("a"), ["Recovered", "Created"]);
    assert!(h.backend.leftovers().unwrap().is_empty());
}

#[tokio::test]
async fn a_revert_reimages_from_a_ready_image_and_waits_for_one_that_is_not() {
    let h = Harness::new();
    running(&h, "a").await;
    let revert = |image: &str| {
        let image = image.to_string();
        move |a: &mut Vm| {
            a.spec.restore = Some(boxery_api::vm::Restore {
                image,
                requested_at: now(),
                memory: false,
            })
        }
    };
    h.edit::<Vm>("a", Part::Spec, revert("nosuch"));
    let next = h.reconcile(vm::reconcile, "a").await.unwrap();
    assert_eq!(next.requeue_after(), Some(Duration::from_secs(5)));
    assert_eq!(
        condition(&h.get("a"), conditions::REVERTED),
        (ConditionStatus::False, reasons::IMAGE_NOT_READY.into())
    );
    assert_eq!(h.warnings::<Vm>("a"), ["RevertWaiting"]);
    h.edit::<Vm>("a", Part::Spec, revert("base"));
    h.settle(vm::reconcile, "a").await.unwrap();
    let a: Vm = h.get("a");
    assert_eq!(
        condition(&a, conditions::REVERTED),
        (ConditionStatus::True, reasons::REVERTED.into())
    );
    assert_eq!(a.status.last_restore, a.spec.restore);
    assert_eq!(h.calls().last().unwrap(), &(JournalOp::Reimage, "a".into()));
    assert_eq!(
        h.find::<Image>("base").unwrap().status.phase,
        ImagePhase::Ready
    );
}

/// The owner's quota on memory files (`memory.quota`): a suspend that could take the total
/// past it is refused before anything is saved, saying what takes the room; the VM runs on.
#[tokio::test]
async fn a_suspend_past_the_memory_quota_is_refused_and_the_vm_runs_on() {
    use boxery_api::RunStrategy;
    let probe = Harness::new();
    let need = running(&probe, "x")
        .await
        .spec
        .resources
        .effective()
        .memory
        .bytes();
    // room for one whole VM's memory, not for a second beside the first's saved quarter
    let h = Harness::with_settings(boxery_reconcilers::Settings {
        memory_quota: Some(need + need / 8),
        ..Default::default()
    });
    running(&h, "a").await;
    h.put(&testing::vm("b", "base"));
    h.settle(vm::reconcile, "b").await.unwrap();
    for vm in ["a", "b"] {
        h.edit::<Vm>(vm, Part::Spec, |v| {
            v.spec.run_strategy = RunStrategy::Suspended
        });
    }
    h.settle(vm::reconcile, "a").await.unwrap();
    assert_eq!(h.get::<Vm>("a").status.phase, VmPhase::Suspended);
    h.settle(vm::reconcile, "b").await.unwrap();
    let b: Vm = h.get("b");
    let err = b
        .status
        .last_failure
        .clone()
        .expect("the suspend failed")
        .message;
    assert_eq!(b.status.phase, VmPhase::Running);
    assert!(err.contains("memory.quota in config.yaml"), "{err}");
    assert!(err.contains("by suspended VMs"), "{err}");
    assert!(err.contains("the VM runs on"), "{err}");
    assert_eq!(
        h.backend.get("b").await.unwrap().unwrap().state,
        boxery_backends::PowerState::Running
    );
    // room made (a runs again, its memory gone): b suspends at its next try (after the
    // first failure's 200 ms backoff)
    h.edit::<Vm>("a", Part::Spec, |v| {
        v.spec.run_strategy = RunStrategy::Running
    });
    h.settle(vm::reconcile, "a").await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    h.settle(vm::reconcile, "b").await.unwrap();
    assert_eq!(h.get::<Vm>("b").status.phase, VmPhase::Suspended);
}

#[tokio::test]
async fn suspend_resume_and_stop_follow_run_strategy() {
    use boxery_api::RunStrategy;
    let h = Harness::new();
    running(&h, "a").await;
    h.edit::<Vm>("a", Part::Spec, |a| {
        a.spec.run_strategy = RunStrategy::Suspended
    });
    h.settle(vm::reconcile, "a").await.unwrap();
    let a: Vm = h.get("a");
    assert_eq!(a.status.phase, VmPhase::Suspended);
    assert_eq!(
        condition(&a, READY),
        (ConditionStatus::False, reasons::SUSPENDED.into())
    );
    assert_eq!(
        condition(&a, conditions::MEMORY_RESTORABLE),
        (ConditionStatus::True, reasons::MEMORY_SAVED.into())
    );
    let saved = a
        .status
        .memory
        .clone()
        .expect("status.memory while suspended");
    assert!(saved.bytes > 0);
    assert_eq!(vm::printable(&a), "Suspended");
    assert_eq!(h.calls().last().unwrap().0, JournalOp::Suspend);
    assert!(h.reasons::<Vm>("a").contains(&"Suspended".to_string()));

    // a size change waits for the resume (the saved memory holds the size)
    h.edit::<Vm>("a", Part::Spec, |a| a.spec.resources.cpus = Some(2));
    h.settle(vm::reconcile, "a").await.unwrap();
    assert_eq!(h.calls().last().unwrap().0, JournalOp::Suspend);

    // Running resumes it: Ready again, no memory in status, no `Restarted` warning
    h.edit::<Vm>("a", Part::Spec, |a| {
        a.spec.run_strategy = RunStrategy::Running
    });
    h.settle(vm::reconcile, "a").await.unwrap();
    let a: Vm = h.get("a");
    assert_eq!(a.status.phase, VmPhase::Running);
    assert!(vm::is_ready(&a));
    assert_eq!(a.status.memory, None);
    assert!(
        a.status
            .conditions
            .get_condition(conditions::MEMORY_RESTORABLE)
            .is_none()
    );
    assert!(h.reasons::<Vm>("a").contains(&"Resumed".to_string()));
    assert!(
        h.warnings::<Vm>("a").is_empty(),
        "{:?}",
        h.warnings::<Vm>("a")
    );
    let ops: Vec<JournalOp> = h.calls().into_iter().map(|c| c.0).collect();
    assert_eq!(
        &ops[ops.len() - 2..],
        [JournalOp::Start, JournalOp::Resize],
        "resumed, then resized: {ops:?}"
    );

    // Stopped discards a suspended VM's memory
    h.edit::<Vm>("a", Part::Spec, |a| {
        a.spec.run_strategy = RunStrategy::Suspended
    });
    h.settle(vm::reconcile, "a").await.unwrap();
    h.edit::<Vm>("a", Part::Spec, |a| {
        a.spec.run_strategy = RunStrategy::Stopped
    });
    h.settle(vm::reconcile, "a").await.unwrap();
    let a: Vm = h.get("a");
    assert_eq!(a.status.phase, VmPhase::Stopped);
    assert_eq!(a.status.memory, None);
    assert_eq!(
        h.backend.get("a").await.unwrap().unwrap().state,
        PowerState::Stopped
    );
}

#[tokio::test]
async fn a_stale_memory_is_kept_and_said_not_booted_over() {
    use boxery_api::RunStrategy;
    let h = Harness::new();
    running(&h, "a").await;
    h.edit::<Vm>("a", Part::Spec, |a| {
        a.spec.run_strategy = RunStrategy::Suspended
    });
    h.settle(vm::reconcile, "a").await.unwrap();
    h.backend
        .stale_memory("a", "it was saved by QEMU 9 and this host runs QEMU 10")
        .unwrap();
    h.edit::<Vm>("a", Part::Spec, |a| {
        a.spec.run_strategy = RunStrategy::Running
    });
    let _ = h.reconcile(vm::reconcile, "a").await;
    let a: Vm = h.get("a");
    let failure = a.status.last_failure.clone().expect("the resume failed");
    assert!(failure.terminal, "retrying cannot help: {failure:?}");
    assert!(
        failure.message.contains("boxery stop a"),
        "{}",
        failure.message
    );
    assert_eq!(
        h.backend.get("a").await.unwrap().unwrap().state,
        PowerState::Suspended,
        "the memory is kept"
    );
    // what the owner reads while suspended: the condition and the one word
    h.edit::<Vm>("a", Part::Spec, |a| {
        a.spec.run_strategy = RunStrategy::Suspended
    });
    h.settle(vm::reconcile, "a").await.unwrap();
    let a: Vm = h.get("a");
    assert_eq!(
        condition(&a, conditions::MEMORY_RESTORABLE),
        (ConditionStatus::False, reasons::STALE_MEMORY.into())
    );
    assert_eq!(vm::printable(&a), reasons::STALE_MEMORY);
    // the owner says so: stop discards, start boots cold
    h.edit::<Vm>("a", Part::Spec, |a| {
        a.spec.run_strategy = RunStrategy::Stopped
    });
    h.settle(vm::reconcile, "a").await.unwrap();
    h.edit::<Vm>("a", Part::Spec, |a| {
        a.spec.run_strategy = RunStrategy::Running
    });
    h.settle(vm::reconcile, "a").await.unwrap();
    assert!(vm::is_ready(&h.get("a")));
}

/// Put VM `a`'s last use `ago` in the past: its Ready since then, its activity mark too.
fn used_ago(h: &Harness, ago: Duration) {
    let then = std::time::SystemTime::now() - ago;
    h.edit::<Vm>("a", Part::Status, |a| {
        for c in a.status.conditions.iter_mut() {
            if c.type_ == READY {
                c.last_transition_time = Some(then.into());
            }
        }
    });
    let home = h.dir().join("home");
    boxery_home::activity::touch(&home, "a").unwrap();
    std::fs::File::options()
        .write(true)
        .open(boxery_home::layout::activity_mark(&home, "a"))
        .unwrap()
        .set_modified(then)
        .unwrap();
}

#[tokio::test]
async fn an_idle_vm_is_suspended_and_its_next_use_resumes_it() {
    use boxery_api::RunStrategy;
    use boxery_api::vm::Idle;
    let h = Harness::new();
    let mut a = testing::vm("a", "base");
    a.spec.idle = Some(Idle {
        suspend_after: "1m".into(),
    });
    h.ready_image("base");
    h.put(&a);
    h.settle(vm::reconcile, "a").await.unwrap();
    assert!(vm::is_ready(&h.get("a")));

    // used 30 s ago: not due; the controller looks again when it would be
    used_ago(&h, Duration::from_secs(30));
    let next = h.reconcile(vm::reconcile, "a").await.unwrap();
    let left = next.requeue_after().expect("a look when it is due");
    assert!(
        left > Duration::from_secs(25) && left <= Duration::from_secs(31),
        "{left:?}"
    );
    assert_ne!(h.calls().last().unwrap().0, JournalOp::Suspend);

    // unused for more than a minute: suspended, runStrategy untouched
    used_ago(&h, Duration::from_secs(90));
    h.settle(vm::reconcile, "a").await.unwrap();
    let a: Vm = h.get("a");
    assert_eq!(a.status.phase, VmPhase::Suspended);
    assert_eq!(a.spec.run_strategy, RunStrategy::Running);
    assert!(a.status.idle_suspended_at.is_some());
    assert_eq!(h.calls().last().unwrap().0, JournalOp::Suspend);
    assert!(h.reasons::<Vm>("a").contains(&"IdleSuspended".to_string()));
    // it sleeps: more reconciles leave it suspended
    h.settle(vm::reconcile, "a").await.unwrap();
    assert_eq!(h.calls().last().unwrap().0, JournalOp::Suspend);

    // a use (the activity mark moves) wakes it
    boxery_home::activity::touch(&h.dir().join("home"), "a").unwrap();
    h.settle(vm::reconcile, "a").await.unwrap();
    let a: Vm = h.get("a");
    assert_eq!(a.status.phase, VmPhase::Running);
    assert!(vm::is_ready(&a));
    assert_eq!(a.status.idle_suspended_at, None);
    assert_eq!(h.calls().last().unwrap().0, JournalOp::Start);
    let resumed = h
        .events::<Vm>("a")
        .into_iter()
        .rev()
        .find(|e| e.reason == "Resumed")
        .expect("a Resumed event");
    assert!(resumed.message.contains("idle"), "{}", resumed.message);

    // so does the wake annotation a use through another machine writes
    used_ago(&h, Duration::from_secs(90));
    h.settle(vm::reconcile, "a").await.unwrap();
    assert_eq!(h.get::<Vm>("a").status.phase, VmPhase::Suspended);
    h.edit::<Vm>("a", Part::Spec, |a| {
        a.metadata.annotations.insert(
            boxery_api::vm::WOKEN_AT.into(),
            (now() + chrono::Duration::seconds(1)).to_rfc3339(),
        );
    });
    h.settle(vm::reconcile, "a").await.unwrap();
    assert_eq!(h.get::<Vm>("a").status.phase, VmPhase::Running);

    // an explicit suspend is not an idle one: runStrategy Running resumes it at once
    h.edit::<Vm>("a", Part::Spec, |a| {
        a.spec.run_strategy = RunStrategy::Suspended
    });
    h.settle(vm::reconcile, "a").await.unwrap();
    assert_eq!(h.get::<Vm>("a").status.idle_suspended_at, None);
}
