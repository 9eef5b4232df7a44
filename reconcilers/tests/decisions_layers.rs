//! Issue 33: layers on a Vm (`spec.layers`) and build records, decided one reconcile at a
//! time on a store in memory and the fake backend (`boxery_reconcilers::testing`). The fake has
//! no guest: a layer added in place is recorded from the layered build's record, without the
//! copy (`tests/real_vms/layers.rs` makes it in a real guest).

use std::time::Duration;

use boxery_api::conditions::{self, READY, reasons};
use boxery_api::image::LAYERED_LABEL;
use boxery_api::{ConditionStatus, Conditions, Image, ImagePhase, ImageSource, Vm, VmPhase};
use boxery_backends::fake::JournalOp;
use boxery_reconcilers::testing::{self, Harness, Part};
use boxery_reconcilers::{Settings, image, vm};

const RECORD: &str = "built_at=2026-12-05T19:27:08Z\nimage=debian-12-agents\nlayers=plumbing devtools agents\nlayers_hash=92915ac4c1be9e2d53f219988ffce54232da6d3cdade80578e9e726c0a07a838\nkernel=6.1.0-57-cloud-amd64\n";

/// A control plane whose builders' output directory (removed with the second value) holds
/// `files` (name, content).
fn harness(files: &[(&str, &[u8])]) -> (Harness, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    for (name, content) in files {
        std::fs::write(dir.path().join(name), content).unwrap();
    }
    let h = Harness::with_settings(Settings {
        build_outputs: Some(dir.path().to_path_buf()),
        ..Settings::default()
    });
    (h, dir)
}

fn layered_vm(name: &str, layers: &[&str]) -> Vm {
    serde_json::from_value(serde_json::json!({
        "apiVersion": boxery_api::API_VERSION, "kind": "Vm", "metadata": {"name": name},
        "spec": {"source": {"image": "debian-12"}, "layers": layers},
    }))
    .unwrap()
}

/// VM `name` with `spec.layers: [agents]`, made: its layered image built, then the VM.
async fn made_with_agents(h: &Harness, name: &str) {
    h.put(&layered_vm(name, &["agents"]));
    h.settle(vm::reconcile, name).await.unwrap();
    h.settle(image::reconcile, "debian-12-agents")
        .await
        .unwrap();
    h.settle(vm::reconcile, name).await.unwrap();
}

/// `LayersApplied`'s status and reason, which must be these; returns its message.
fn layers_applied(vm: &Vm, status: ConditionStatus, reason: &str) -> String {
    let (s, r, msg) = condition(vm, conditions::LAYERS_APPLIED).expect("LayersApplied");
    assert_eq!((s, r.as_str()), (status, reason), "{msg}");
    msg
}

fn condition(vm: &Vm, type_: &str) -> Option<(ConditionStatus, String, String)> {
    vm.status
        .conditions
        .get_condition(type_)
        .map(|c| (c.status, c.reason.clone(), c.message.clone()))
}

#[tokio::test]
async fn a_vm_with_layers_is_made_from_the_layered_build_which_it_makes_and_waits_for() {
    let (h, _outputs) = harness(&[("debian-12-agents.build-info", RECORD.as_bytes())]);
    h.put(&layered_vm("a", &["agents"]));
    let next = h.settle(vm::reconcile, "a").await.unwrap();
    assert_eq!(
        next.requeue_after(),
        Some(Duration::from_secs(5)),
        "it waits"
    );
    let a: Vm = h.get("a");
    assert_eq!(a.status.phase, VmPhase::Pending);
    let img: Image = h.get("debian-12-agents");
    match &img.spec.source {
        ImageSource::Build(b) => assert_eq!(
            (b.base.as_str(), b.layers.clone()),
            ("debian-12", vec!["agents".to_string()])
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        img.metadata.labels.get(LAYERED_LABEL).map(String::as_str),
        Some("agents")
    );
    assert!(
        img.metadata.owner_references.is_empty(),
        "shared: owned by no VM"
    );
    assert_eq!(h.reasons::<Vm>("a"), ["BuildingImage"]);
    // a second VM asking for the same reuses it
    h.put(&layered_vm("b", &["agents"]));
    h.settle(vm::reconcile, "b").await.unwrap();
    assert_eq!(
        h.reasons::<Vm>("b"),
        Vec::<String>::new(),
        "no second image"
    );

    // the build: Ready with the builder's record
    h.settle(image::reconcile, "debian-12-agents")
        .await
        .unwrap();
    let img: Image = h.get("debian-12-agents");
    assert_eq!(img.status.phase, ImagePhase::Ready);
    let info = img.status.build_info.clone().expect("the build record");
    assert_eq!(info.layers, ["plumbing", "devtools", "agents"]);
    assert_eq!(info.kernel.as_deref(), Some("6.1.0-57-cloud-amd64"));

    // the VM: made from it, with its layers and record
    let next = h.settle(vm::reconcile, "a").await.unwrap();
    assert!(next.is_await_change(), "{next:?}");
    let a: Vm = h.get("a");
    assert_eq!(a.status.phase, VmPhase::Running);
    assert_eq!(a.status.source_image.as_deref(), Some("debian-12-agents"));
    assert_eq!(a.status.layers, ["agents"]);
    assert_eq!(a.status.build_info, Some(info));
    assert!(h.calls().contains(&(JournalOp::Create, "a".to_string())));
}

#[tokio::test]
async fn an_image_of_the_layered_name_that_is_something_else_is_said_not_used() {
    let (h, _outputs) = harness(&[]);
    let other: Image = serde_json::from_value(serde_json::json!({
        "apiVersion": boxery_api::API_VERSION, "kind": "Image", "metadata": {"name": "debian-12-agents"},
        "spec": {"source": {"build": {"base": "tiny"}}}, "status": {"phase": "Ready"},
    }))
    .unwrap();
    h.put(&other);
    h.put(&layered_vm("a", &["agents"]));
    h.settle(vm::reconcile, "a").await.unwrap();
    let a: Vm = h.get("a");
    let (status, reason, msg) = condition(&a, conditions::IMAGE_AVAILABLE).unwrap();
    assert_eq!(
        (status, reason.as_str()),
        (ConditionStatus::False, reasons::IMAGE_NOT_FOUND)
    );
    assert!(msg.contains("something else: delete or rename it"), "{msg}");
    assert!(h.calls().is_empty(), "nothing made");
}

#[tokio::test]
async fn a_layer_added_to_a_running_vm_waits_for_the_layered_build_then_is_recorded() {
    let (h, _outputs) = harness(&[("debian-12-agents.build-info", RECORD.as_bytes())]);
    h.ready_image("debian-12");
    h.put(&layered_vm("a", &[]));
    h.settle(vm::reconcile, "a").await.unwrap();
    assert!(vm::is_ready(&h.get("a")));
    h.edit::<Vm>("a", Part::Spec, |a| a.spec.layers = vec!["agents".into()]);

    let next = h.settle(vm::reconcile, "a").await.unwrap();
    assert_eq!(next.requeue_after(), Some(Duration::from_secs(5)));
    let a: Vm = h.get("a");
    let msg = layers_applied(&a, ConditionStatus::False, reasons::LAYERED_IMAGE_NOT_READY);
    assert!(
        msg.starts_with("adding agents in place: waiting for image debian-12-agents"),
        "{msg}"
    );
    assert!(a.status.layers.is_empty());
    assert_eq!(a.status.phase, VmPhase::Running, "it runs on meanwhile");

    h.settle(image::reconcile, "debian-12-agents")
        .await
        .unwrap();
    let next = h.settle(vm::reconcile, "a").await.unwrap();
    assert!(next.is_await_change(), "{next:?}");
    let a: Vm = h.get("a");
    assert_eq!(a.status.layers, ["agents"]);
    let msg = layers_applied(&a, ConditionStatus::True, reasons::LAYERS_APPLIED);
    assert!(
        msg.starts_with("added agents in place from image debian-12-agents in "),
        "{msg}"
    );
    assert_eq!(
        a.status.build_info.as_ref().map(|b| b.layers.len()),
        Some(3)
    );
    assert!(vm::is_ready(&a), "Ready for the new generation");
    let reasons = h.reasons::<Vm>("a");
    assert!(
        reasons.ends_with(&["AddingLayers".to_string(), "LayersAdded".to_string()]),
        "{reasons:?}"
    );
    // the VM was not made again
    let creates = h
        .calls()
        .iter()
        .filter(|(op, n)| *op == JournalOp::Create && n == "a")
        .count();
    assert_eq!(creates, 1);
}

#[tokio::test]
async fn a_layer_removed_from_a_vm_is_refused_once_and_the_vm_runs_on() {
    let (h, _outputs) = harness(&[]);
    made_with_agents(&h, "a").await;
    h.edit::<Vm>("a", Part::Spec, |a| a.spec.layers.clear());
    let next = h.settle(vm::reconcile, "a").await.unwrap();
    assert!(next.is_await_change(), "{next:?}");
    h.reconcile(vm::reconcile, "a").await.unwrap();
    let a: Vm = h.get("a");
    let msg = layers_applied(&a, ConditionStatus::False, reasons::LAYER_REMOVAL_REFUSED);
    assert!(
        msg.contains("agents cannot be removed") && msg.contains("put it back in spec.layers"),
        "{msg}"
    );
    assert_eq!(a.status.layers, ["agents"], "it still has it");
    assert_eq!(h.warnings::<Vm>("a"), ["LayerRemovalRefused"], "said once");
    assert_eq!(
        condition(&a, READY).unwrap().0,
        ConditionStatus::True,
        "it runs on"
    );
    // put back: nothing refused any more
    h.edit::<Vm>("a", Part::Spec, |a| a.spec.layers = vec!["agents".into()]);
    h.settle(vm::reconcile, "a").await.unwrap();
    let a: Vm = h.get("a");
    assert_eq!(
        condition(&a, conditions::LAYERS_APPLIED).unwrap().0,
        ConditionStatus::True
    );
}

/// `docker` (packages and services) is not copied into a running VM: refused once, saying how
/// to get it; the VM runs on, and no layered image is made for it.
#[tokio::test]
async fn a_layer_that_cannot_be_added_in_place_is_refused_once_and_the_vm_runs_on() {
    let (h, _outputs) = harness(&[]);
    h.ready_image("debian-12");
    h.put(&layered_vm("a", &[]));
    h.settle(vm::reconcile, "a").await.unwrap();
    h.edit::<Vm>("a", Part::Spec, |a| a.spec.layers = vec!["docker".into()]);
    let next = h.settle(vm::reconcile, "a").await.unwrap();
    assert!(next.is_await_change(), "{next:?}");
    h.reconcile(vm::reconcile, "a").await.unwrap();
    let a: Vm = h.get("a");
    let msg = layers_applied(&a, ConditionStatus::False, reasons::LAYER_NOT_IN_PLACE);
    assert!(
        msg.contains("docker cannot be added to a running VM")
            && msg.contains("make a new VM with it (`boxery rm a`"),
        "{msg}"
    );
    assert!(a.status.layers.is_empty());
    assert_eq!(
        h.warnings::<Vm>("a"),
        ["LayerNotAddableInPlace"],
        "said once"
    );
    assert!(vm::is_ready(&a), "it runs on");
    assert!(
        h.find::<Image>("debian-12-docker").is_none(),
        "no image is made for it"
    );
}

#[tokio::test]
async fn a_hostile_build_record_is_left_out_with_a_warning() {
    let (h, _outputs) = harness(&[("tiny.build-info", b"kernel=6.1\x1b]0;pwned\x07\n")]);
    h.put(&testing::vm("a", "tiny"));
    h.settle(vm::reconcile, "a").await.unwrap();
    h.settle(image::reconcile, "tiny").await.unwrap();
    let img: Image = h.get("tiny");
    assert_eq!(img.status.phase, ImagePhase::Ready, "the image is fine");
    assert_eq!(img.status.build_info, None);
    assert_eq!(h.warnings::<Image>("tiny"), ["BuildInfoRefused"]);
    let e = h.events::<Image>("tiny");
    let msg = &e
        .iter()
        .find(|e| e.reason == "BuildInfoRefused")
        .unwrap()
        .message;
    assert!(msg.contains("control character"), "{msg}");
}

#[tokio::test]
async fn a_capture_carries_its_source_vms_record() {
    let (h, _outputs) = harness(&[("debian-12-agents.build-info", RECORD.as_bytes())]);
    made_with_agents(&h, "a").await;
    let snap: Image = serde_json::from_value(serde_json::json!({
        "apiVersion": boxery_api::API_VERSION, "kind": "Image", "metadata": {"name": "a.snap"},
        "spec": {"source": {"vm": "a"}},
    }))
    .unwrap();
    h.put(&snap);
    h.settle(image::reconcile, "a.snap").await.unwrap();
    let snap: Image = h.get("a.snap");
    assert_eq!(snap.status.phase, ImagePhase::Ready);
    let a: Vm = h.get("a");
    assert!(a.status.build_info.is_some());
    assert_eq!(snap.status.build_info, a.status.build_info);
}

#[tokio::test]
async fn a_build_made_before_records_were_kept_gets_its_record() {
    let (h, _outputs) = harness(&[("debian-12-agents.build-info", RECORD.as_bytes())]);
    let old: Image = serde_json::from_value(serde_json::json!({
        "apiVersion": boxery_api::API_VERSION, "kind": "Image",
        "metadata": {"name": "agents", "finalizers": ["boxery.dev/image"]},
        "spec": {"source": {"build": {"base": "debian-12", "layers": ["agents"]}}},
        "status": {"phase": "Ready"},
    }))
    .unwrap();
    h.put(&old);
    h.settle(image::reconcile, "agents").await.unwrap();
    let img: Image = h.get("agents");
    assert_eq!(img.status.phase, ImagePhase::Ready);
    assert_eq!(
        img.status.build_info.map(|b| b.layers),
        Some(vec!["plumbing".into(), "devtools".into(), "agents".into()])
    );
    assert!(h.calls().is_empty(), "nothing built again");
}
