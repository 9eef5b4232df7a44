//! The Image reconciler's decisions, one reconcile at a time, on a store in memory and the
//! fake backend (`boxery_reconcilers::testing`).

use std::time::Duration;

use boxery_api::conditions::{READY, reasons};
use boxery_api::vm::OperationType;
use boxery_api::{ConditionStatus, Conditions, Image, ImagePhase};
use boxery_backends::fake::{FaultAction, FaultConfig, FaultRule, JournalOp};
use boxery_reconcilers::testing::{self, Harness, Part, interrupted};
use boxery_reconcilers::{image, vm};
use serde_json::json;

fn image_of(name: &str, source: serde_json::Value) -> Image {
    serde_json::from_value(json!({
        "apiVersion": "boxery.dev/v1alpha1", "kind": "Image", "metadata": {"name": name},
        "spec": {"source": source},
    }))
    .unwrap()
}

/// The stock image `tiny`, to build.
fn tiny() -> Image {
    image_of("tiny", json!({"build": {"base": "tiny"}}))
}

/// `tiny`, built: ready.
async fn built_tiny(h: &Harness) {
    h.put(&tiny());
    h.settle(image::reconcile, "tiny").await.unwrap();
}

fn ready(img: &Image) -> (ConditionStatus, String) {
    let c = img.status.conditions.get_condition(READY).unwrap();
    (c.status, c.reason.clone())
}

#[tokio::test]
async fn a_stock_image_is_built_and_ready() {
    let h = Harness::new();
    h.put(&tiny());
    let next = h.settle(image::reconcile, "tiny").await.unwrap();
    assert!(next.is_await_change());
    let img: Image = h.get("tiny");
    assert_eq!(img.status.phase, ImagePhase::Ready);
    assert_eq!(ready(&img), (ConditionStatus::True, reasons::READY.into()));
    assert_eq!(img.status.operation, None);
    assert_eq!(h.calls(), [(JournalOp::Build, "tiny".to_string())]);
    assert_eq!(h.reasons::<Image>("tiny"), ["Building", "Ready"]);
}

#[tokio::test]
async fn a_capture_waits_for_its_source_vm() {
    let h = Harness::new();
    h.put(&image_of("snap", json!({"vm": "dev1"})));
    let next = h.settle(image::reconcile, "snap").await.unwrap();
    assert_eq!(next.requeue_after(), Some(Duration::from_secs(2)));
    assert_eq!(
        ready(&h.get("snap")),
        (ConditionStatus::False, reasons::SOURCE_VM_NOT_FOUND.into())
    );
    assert!(h.calls().is_empty());
}

#[tokio::test]
async fn a_capture_of_a_made_vm_copies_its_disk() {
    let h = Harness::new();
    built_tiny(&h).await;
    h.put(&testing::vm("dev1", "tiny"));
    h.settle(vm::reconcile, "dev1").await.unwrap();
    h.backend.write_disk("dev1", b"work\n").unwrap();
    h.put(&image_of("snap", json!({"vm": "dev1"})));
    h.settle(image::reconcile, "snap").await.unwrap();
    assert_eq!(h.get::<Image>("snap").status.phase, ImagePhase::Ready);
    assert_eq!(
        h.calls().last().unwrap(),
        &(JournalOp::Capture, "snap".into())
    );
    assert_eq!(h.backend.read_image_disk("snap").unwrap(), b"work\n");
}

#[tokio::test]
async fn a_ready_image_never_changes_and_says_so_once() {
    let h = Harness::new();
    built_tiny(&h).await;
    h.edit::<Image>("tiny", Part::Spec, |i| {
        i.spec.source = boxery_api::ImageSource::Vm("dev1".into())
    });
    h.settle(image::reconcile, "tiny").await.unwrap();
    h.settle(image::reconcile, "tiny").await.unwrap();
    let img: Image = h.get("tiny");
    assert_eq!(img.status.phase, ImagePhase::Ready);
    assert_eq!(img.status.observed_generation, img.metadata.generation);
    assert_eq!(h.warnings::<Image>("tiny"), ["Immutable"]);
    assert_eq!(h.calls().len(), 1, "nothing made again");
}

#[tokio::test]
async fn a_failed_build_is_recorded_cleaned_up_and_backs_off() {
    let h = Harness::new();
    h.put(&tiny());
    h.fail("build.commit");
    let next = h.settle(image::reconcile, "tiny").await.unwrap();
    let wait = next.requeue_after().expect("a requeue");
    assert!(wait > Duration::ZERO && wait <= boxery_reconcilers::backoff::BASE);
    let img: Image = h.get("tiny");
    assert_eq!(
        (img.status.phase, img.status.failures),
        (ImagePhase::Failed, 1)
    );
    assert_eq!(img.status.operation, None, "cleaned up");
    assert_eq!(
        ready(&img),
        (ConditionStatus::False, reasons::STEP_FAILED.into())
    );
    assert_eq!(h.warnings::<Image>("tiny"), ["StepFailed"]);
    assert!(h.backend.leftovers().unwrap().is_empty(), "nothing partial");
    // Within the backoff nothing is tried; after it, the build goes again and succeeds.
    let calls = h.backend.fault_counts().unwrap()["build.commit"];
    assert!(
        h.reconcile(image::reconcile, "tiny")
            .await
            .unwrap()
            .requeue_after()
            .is_some()
    );
    assert_eq!(h.backend.fault_counts().unwrap()["build.commit"], calls);
    h.heal();
    tokio::time::sleep(boxery_reconcilers::backoff::BASE).await;
    h.settle(image::reconcile, "tiny").await.unwrap();
    let img: Image = h.get("tiny");
    assert_eq!(
        (img.status.phase, img.status.failures),
        (ImagePhase::Ready, 0)
    );
}

#[tokio::test]
async fn an_interrupted_build_is_cleaned_up_and_retried() {
    let h = Harness::new();
    h.put(&tiny());
    h.reconcile(image::reconcile, "tiny").await.unwrap();
    h.edit::<Image>("tiny", Part::Status, |i| {
        i.status.phase = ImagePhase::Capturing;
        i.status.operation = Some(interrupted(OperationType::Build, "tiny"))
    });
    h.backend.add_partial_image("tiny").unwrap();
    h.settle(image::reconcile, "tiny").await.unwrap();
    let ops: Vec<JournalOp> = h.calls().into_iter().map(|c| c.0).collect();
    assert_eq!(ops, [JournalOp::CleanupImage, JournalOp::Build]);
    assert_eq!(h.reasons::<Image>("tiny")[0], "Recovered");
    assert_eq!(h.get::<Image>("tiny").status.phase, ImagePhase::Ready);
}

#[tokio::test]
async fn deletion_removes_the_image_from_the_backend_then_the_finalizer() {
    let h = Harness::new();
    built_tiny(&h).await;
    h.remove(image::reconcile, "tiny").await;
    assert!(h.backend.image_record("tiny").unwrap().is_none());
    assert!(
        h.calls()
            .contains(&(JournalOp::RemoveImage, "tiny".to_string()))
    );
}

/// A deletion asked for while a step runs, and that step then failing: the failure is told
/// but holds nothing back; the next reconcile is the cleanup, not a backoff.
#[tokio::test]
async fn a_deletion_during_a_failing_step_is_not_held_by_its_backoff() {
    let h = Harness::new();
    h.put(&tiny());
    h.backend
        .set_faults(&FaultConfig {
            latency_ms: 0,
            rules: vec![
                FaultRule::new("build", FaultAction::Sleep).ms(3_000),
                FaultRule::new("build.commit", FaultAction::Fail),
            ],
        })
        .unwrap();
    // the first reconcile puts the finalizer on; the next one builds
    h.reconcile(image::reconcile, "tiny").await.unwrap();
    assert_eq!(h.calls(), [], "nothing built yet");
    let step = tokio::spawn({
        let ctx = h.ctx.clone();
        let img: Image = h.get("tiny");
        async move { image::reconcile(std::sync::Arc::new(img), ctx).await }
    });
    // the deletion once the step is in the backend's build (its intent written before),
    // which holds it for 3 s
    let building = async {
        while !h.backend.fault_counts().unwrap().contains_key("build") {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), building)
        .await
        .expect("the step reaches the build");
    h.delete::<Image>("tiny");
    let next = step.await.unwrap().unwrap();
    let img: Image = h.get("tiny");
    assert!(img.metadata.is_deleting());
    assert_eq!(img.status.failures, 0, "not counted");
    assert_eq!(
        ready(&img),
        (ConditionStatus::False, reasons::STEP_FAILED.into()),
        "but told"
    );
    assert!(next.requeue_after().is_some());
    h.heal();
    h.reconcile(image::reconcile, "tiny").await.unwrap();
    assert!(h.find::<Image>("tiny").is_none(), "cleaned up at once");
}
