//! The fake backend against its contract (seed 001), its fault injection and its journal.
//!
//! The cross-process tests re-run this test binary as a child (`child_entry`), so a real
//! process exits or is killed inside a step.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use boxery_backends::fake::{FakeBackend, FaultAction, FaultConfig, FaultRule, JournalOp};
use boxery_backends::{
    Backend, BackendError, DiskSource, Identity, NewVm, PowerState, Progress, Stability, Stock,
    VmSize,
};

const STOCK: &str = "stock";
const STOCK_UID: &str = "uid-stock";
/// The stock image the tests build, as `STOCK` for `STOCK_UID`.
const DEBIAN: Stock<'static> = Stock {
    layers: &[],
    name: "debian-12",
    image: STOCK,
    uid: STOCK_UID,
};

fn fake() -> (tempfile::TempDir, FakeBackend) {
    let home = tempfile::tempdir().unwrap();
    let b = FakeBackend::new(home.path().join("fake"));
    (home, b)
}

fn no_progress() -> Progress {
    Arc::new(|_: &str| {})
}

fn new_vm(name: &str, uid: &str, image: &str) -> NewVm {
    NewVm {
        name: name.into(),
        uid: uid.into(),
        source: DiskSource::Image(image.into()),
        cpus: 2,
        memory_mib: 2048,
        disk_gib: 10,
        start: true,
        identity: Identity {
            hostname: name.into(),
            machine_id: format!("{:0>32}", name.len()),
            host_key: None,
            authorized_keys: vec!["ssh-ed25519 AAAA test".into()],
            proxy_token: Some(format!("token-{name}")),
            display: None,
        },
        egress: boxery_api::network::EgressPolicy::Public,
        memory: false,
    }
}

/// An initialised fake with the stock image built as `stock`.
async fn with_stock() -> (tempfile::TempDir, FakeBackend) {
    let (home, b) = fake();
    b.init().await.unwrap();
    b.build_image(DEBIAN, no_progress()).await.unwrap();
    (home, b)
}

fn ops(b: &FakeBackend) -> Vec<(JournalOp, String)> {
    b.journal()
        .unwrap()
        .into_iter()
        .map(|e| (e.op, e.name))
        .collect()
}

fn count(b: &FakeBackend, op: JournalOp) -> usize {
    b.journal().unwrap().iter().filter(|e| e.op == op).count()
}

fn rule(step: &str, action: FaultAction) -> FaultRule {
    FaultRule::new(step, action)
}

#[tokio::test]
async fn capabilities_and_by_name() {
    let home = tempfile::tempdir().unwrap();
    let b = boxery_backends::by_name("fake", home.path()).unwrap();
    let caps = b.capabilities();
    assert_eq!(caps.name, "fake");
    assert_eq!(b.name(), "fake");
    assert_eq!(caps.stability, Stability::TestOnly);
    assert!(caps.resize && caps.live_capture && caps.build_stock_image && !caps.host_key);
    b.check().await.unwrap();
    b.init().await.unwrap();
    b.init().await.unwrap();
    assert!(home.path().join("fake/vms").is_dir());
    assert!(b.host_key("x").await.unwrap().is_none());
}

#[tokio::test]
async fn build_reports_progress_and_makes_a_marked_image() {
    let (_home, b) = fake();
    let seen = Arc::new(AtomicUsize::new(0));
    let s = seen.clone();
    let progress: Progress = Arc::new(move |_: &str| {
        s.fetch_add(1, Ordering::SeqCst);
    });
    b.build_image(DEBIAN, progress.clone()).await.unwrap();
    assert!(seen.load(Ordering::SeqCst) >= 1);
    assert_eq!(b.read_image_disk(STOCK).unwrap(), b"debian-12\n");
    let images = b.images().await.unwrap();
    assert_eq!(images.len(), 1);
    assert_eq!(images[0].name, STOCK);
    assert_eq!(images[0].mark.as_deref(), Some(STOCK_UID));
    assert!(images[0].created.is_some());
    assert_eq!(images[0].size_bytes, Some(10));
    // Idempotent for the same uid, refused for another, unknown stock images invalid.
    b.build_image(DEBIAN, progress).await.unwrap();
    assert_eq!(count(&b, JournalOp::Build), 1);
    assert!(matches!(
        b.build_image(
            Stock {
                uid: "other",
                ..DEBIAN
            },
            no_progress()
        )
        .await,
        Err(BackendError::Failed { .. })
    ));
    assert!(matches!(
        b.build_image(
            Stock {
                layers: &[],
                name: "windows-95",
                image: "w",
                uid: "u"
            },
            no_progress()
        )
        .await,
        Err(BackendError::Invalid(_))
    ));
}

#[tokio::test]
async fn vm_lifecycle() {
    let (_home, b) = with_stock().await;
    assert!(b.list().await.unwrap().is_empty());
    assert!(b.get("a").await.unwrap().is_none());

    b.create(&new_vm("a", "uid-a", STOCK)).await.unwrap();
    let a = b.get("a").await.unwrap().unwrap();
    assert_eq!(a.mark.as_deref(), Some("uid-a"));
    assert_eq!(a.state, PowerState::Running);
    assert_eq!(
        a.size,
        VmSize {
            cpus: 2,
            memory_mib: 2048,
            disk_gib: 10
        }
    );
    assert_eq!(a.ssh.as_deref(), Some("fake:a"));
    assert_eq!(a.disk_used_bytes, Some(10));
    assert_eq!(b.read_disk("a").unwrap(), b"debian-12\n");
    assert_eq!(
        b.ssh_endpoint("a").await.unwrap().as_deref(),
        Some("fake:a")
    );
    let rec = b.vm_record("a").unwrap().unwrap();
    assert_eq!(rec.identity.hostname, "a");
    assert_eq!(rec.source.as_deref(), Some(STOCK));

    let mut stopped = new_vm("s", "uid-s", STOCK);
    stopped.start = false;
    b.create(&stopped).await.unwrap();
    assert_eq!(
        b.get("s").await.unwrap().unwrap().state,
        PowerState::Stopped
    );
    assert_eq!(b.ssh_endpoint("s").await.unwrap(), None);
    let names: Vec<String> = b
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|v| v.name)
        .collect();
    assert_eq!(names, ["a", "s"]);

    b.stop("a").await.unwrap();
    b.stop("a").await.unwrap();
    let a = b.get("a").await.unwrap().unwrap();
    assert_eq!((a.state, a.ssh), (PowerState::Stopped, None));
    b.start("a").await.unwrap();
    b.start("a").await.unwrap();
    assert_eq!(
        b.get("a").await.unwrap().unwrap().state,
        PowerState::Running
    );

    // Resize keeps the power state; disks only grow.
    let bigger = VmSize {
        cpus: 4,
        memory_mib: 4096,
        disk_gib: 20,
    };
    b.resize("a", bigger).await.unwrap();
    let a = b.get("a").await.unwrap().unwrap();
    assert_eq!((a.size, a.state), (bigger, PowerState::Running));
    b.resize("s", bigger).await.unwrap();
    assert_eq!(
        b.get("s").await.unwrap().unwrap().state,
        PowerState::Stopped
    );
    let shrink = VmSize {
        disk_gib: 19,
        ..bigger
    };
    assert!(matches!(
        b.resize("a", shrink).await,
        Err(BackendError::Invalid(_))
    ));
    assert!(matches!(
        b.resize("a", VmSize { cpus: 65, ..bigger }).await,
        Err(BackendError::Invalid(_))
    ));
    assert_eq!(b.get("a").await.unwrap().unwrap().size, bigger);

    // Absent VMs.
    for r in [
        b.start("nope").await,
        b.stop("nope").await,
        b.resize("nope", bigger).await,
    ] {
        assert!(matches!(r, Err(BackendError::NotFound { .. })), "{r:?}");
    }
    assert!(matches!(
        b.ssh_endpoint("nope").await,
        Err(BackendError::NotFound { .. })
    ));

    b.remove("a").await.unwrap();
    b.remove("a").await.unwrap();
    assert!(b.get("a").await.unwrap().is_none());
    assert!(b.leftovers().unwrap().is_empty(), "{:?}", b.leftovers());
    assert_eq!(
        ops(&b),
        [
            (JournalOp::Build, STOCK.to_string()),
            (JournalOp::Create, "a".into()),
            (JournalOp::Create, "s".into()),
            (JournalOp::Stop, "a".into()),
            (JournalOp::Start, "a".into()),
            (JournalOp::Resize, "a".into()),
            (JournalOp::Resize, "s".into()),
            (JournalOp::Remove, "a".into()),
        ]
    );
    let e = &b.journal().unwrap()[1];
    assert_eq!(
        (e.uid.as_deref(), e.source.as_deref(), e.pid),
        (Some("uid-a"), Some(STOCK), std::process::id())
    );
}

#[tokio::test]
async fn create_refuses_impossible_requests() {
    let (_home, b) = with_stock().await;
    let cases = [
        NewVm {
            cpus: 65,
            ..new_vm("a", "u", STOCK)
        },
        NewVm {
            cpus: 0,
            ..new_vm("a", "u", STOCK)
        },
        NewVm {
            memory_mib: 1 << 30,
            ..new_vm("a", "u", STOCK)
        },
        NewVm {
            disk_gib: 1 << 30,
            ..new_vm("a", "u", STOCK)
        },
        new_vm("../escape", "u", STOCK),
        new_vm(".hidden", "u", STOCK),
    ];
    for vm in cases {
        let r = b.create(&vm).await;
        assert!(matches!(r, Err(BackendError::Invalid(_))), "{vm:?}: {r:?}");
        assert!(r.unwrap_err().is_terminal());
    }
    let r = b.create(&new_vm("a", "u", "no-such-image")).await;
    assert!(matches!(r, Err(BackendError::NotFound { .. })), "{r:?}");
    // A disk smaller than the image's source.
    b.create(&NewVm {
        disk_gib: 30,
        ..new_vm("big", "u-big", STOCK)
    })
    .await
    .unwrap();
    b.capture("big", "big@snap", "u-snap").await.unwrap();
    let r = b
        .create(&NewVm {
            disk_gib: 20,
            ..new_vm("small", "u-small", "big@snap")
        })
        .await;
    assert!(
        matches!(r, Err(BackendError::Invalid(ref m)) if m.contains("at least 30")),
        "{r:?}"
    );
    assert!(b.leftovers().unwrap().is_empty(), "{:?}", b.leftovers());
    assert_eq!(count(&b, JournalOp::Create), 1);
}

#[tokio::test]
async fn create_is_idempotent_per_uid() {
    let (_home, b) = with_stock().await;
    b.create(&new_vm("a", "uid-a", STOCK)).await.unwrap();
    b.write_disk("a", b"guest data").unwrap();
    b.create(&new_vm("a", "uid-a", STOCK)).await.unwrap();
    assert_eq!(
        b.read_disk("a").unwrap(),
        b"guest data",
        "a repeated create must not touch the VM"
    );
    assert_eq!(count(&b, JournalOp::Create), 1);
    let r = b.create(&new_vm("a", "uid-other", STOCK)).await;
    assert!(matches!(r, Err(BackendError::Failed { .. })), "{r:?}");
}

#[tokio::test]
async fn capture_of_a_running_vm_leaves_it_running_and_holds_the_disk_at_capture_time() {
    let (_home, b) = with_stock().await;
    b.create(&new_vm("a", "uid-a", STOCK)).await.unwrap();
    b.write_disk("a", b"v1").unwrap();
    b.capture("a", "a@snap", "uid-snap").await.unwrap();
    assert_eq!(
        b.get("a").await.unwrap().unwrap().state,
        PowerState::Running
    );
    b.write_disk("a", b"v2").unwrap();
    assert_eq!(b.read_image_disk("a@snap").unwrap(), b"v1");
    b.create(&new_vm("b", "uid-b", "a@snap")).await.unwrap();
    assert_eq!(b.read_disk("b").unwrap(), b"v1");
    let img = b
        .images()
        .await
        .unwrap()
        .into_iter()
        .find(|i| i.name == "a@snap")
        .unwrap();
    assert_eq!(img.mark.as_deref(), Some("uid-snap"));
    assert_eq!(img.size_bytes, Some(2));

    // Idempotent for the same uid (no new copy), refused for another.
    b.capture("a", "a@snap", "uid-snap").await.unwrap();
    assert_eq!(b.read_image_disk("a@snap").unwrap(), b"v1");
    assert_eq!(count(&b, JournalOp::Capture), 1);
    assert!(matches!(
        b.capture("a", "a@snap", "uid-x").await,
        Err(BackendError::Failed { .. })
    ));

    // A stopped VM stays stopped; a missing one fails and leaves nothing.
    b.stop("a").await.unwrap();
    b.capture("a", "a@stopped", "uid-2").await.unwrap();
    assert_eq!(
        b.get("a").await.unwrap().unwrap().state,
        PowerState::Stopped
    );
    let r = b.capture("ghost", "ghost@snap", "uid-3").await;
    assert!(matches!(r, Err(BackendError::NotFound { .. })), "{r:?}");
    assert!(b.image_record("ghost@snap").unwrap().is_none());
    assert!(b.leftovers().unwrap().is_empty(), "{:?}", b.leftovers());
}

#[tokio::test]
async fn images_are_independent_of_their_source() {
    let (_home, b) = with_stock().await;
    b.create(&new_vm("a", "uid-a", STOCK)).await.unwrap();
    b.write_disk("a", b"a-data").unwrap();
    b.capture("a", "a@fork", "uid-fork").await.unwrap();
    b.create(&new_vm("b", "uid-b", "a@fork")).await.unwrap();
    // Writes to the fork touch neither the image nor the source.
    b.write_disk("b", b"b-data").unwrap();
    assert_eq!(b.read_image_disk("a@fork").unwrap(), b"a-data");
    assert_eq!(b.read_disk("a").unwrap(), b"a-data");
    // An image of the fork, then delete everything upstream, in any order.
    b.capture("b", "b@snap", "uid-bsnap").await.unwrap();
    b.remove("a").await.unwrap();
    b.remove_image("a@fork").await.unwrap();
    b.remove_image("a@fork").await.unwrap();
    b.remove_image(STOCK).await.unwrap();
    assert_eq!(b.read_disk("b").unwrap(), b"b-data");
    b.create(&new_vm("c", "uid-c", "b@snap")).await.unwrap();
    b.remove("b").await.unwrap();
    assert_eq!(b.read_disk("c").unwrap(), b"b-data");
    assert_eq!(b.read_image_disk("b@snap").unwrap(), b"b-data");
    let names: Vec<String> = b
        .images()
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.name)
        .collect();
    assert_eq!(names, ["b@snap"]);
    assert_eq!(
        count(&b, JournalOp::RemoveImage),
        2,
        "a repeated remove_image is not journaled"
    );
}

#[tokio::test]
async fn recovery_hooks_succeed_on_nothing_and_twice() {
    let (_home, b) = with_stock().await;
    for _ in 0..2 {
        b.cleanup_new("nothing").await.unwrap();
        b.cleanup_image("nothing").await.unwrap();
        b.recover_capture("nothing", "nothing@x", Some(PowerState::Running))
            .await
            .unwrap();
    }

    // cleanup_new: a partial VM goes, a complete one stays.
    b.add_partial_vm("p", "uid-p").unwrap();
    assert!(b.get("p").await.unwrap().is_none());
    assert!(b.list().await.unwrap().is_empty());
    b.cleanup_new("p").await.unwrap();
    b.cleanup_new("p").await.unwrap();
    b.create(&new_vm("a", "uid-a", STOCK)).await.unwrap();
    b.cleanup_new("a").await.unwrap();
    assert!(b.get("a").await.unwrap().is_some());

    // cleanup_image: a partial image and a complete one.
    b.add_partial_image("a@partial").unwrap();
    b.cleanup_image("a@partial").await.unwrap();
    b.cleanup_image("a@partial").await.unwrap();
    b.capture("a", "a@done", "uid-done").await.unwrap();
    b.cleanup_image("a@done").await.unwrap();
    b.cleanup_image("a@done").await.unwrap();
    assert!(b.image_record("a@done").unwrap().is_none());

    // recover_capture after a capture that failed before its commit.
    b.set_faults(&FaultConfig::rules([rule(
        "capture.commit",
        FaultAction::Fail,
    )]))
    .unwrap();
    assert!(matches!(
        b.capture("a", "a@snap", "uid-snap").await,
        Err(BackendError::Failed { .. })
    ));
    b.clear_faults().unwrap();
    assert_eq!(
        b.leftovers().unwrap(),
        [PathBuf::from("staging/images/a@snap")]
    );
    assert!(b.images().await.unwrap().iter().all(|i| i.name != "a@snap"));
    b.recover_capture("a", "a@snap", Some(PowerState::Running))
        .await
        .unwrap();
    b.recover_capture("a", "a@snap", Some(PowerState::Running))
        .await
        .unwrap();
    assert_eq!(
        b.get("a").await.unwrap().unwrap().state,
        PowerState::Running,
        "never touches the source"
    );
    // A complete image is not partial: recover_capture leaves it.
    b.capture("a", "a@snap", "uid-snap").await.unwrap();
    b.recover_capture("a", "a@snap", None).await.unwrap();
    assert!(b.image_record("a@snap").unwrap().is_some());

    assert!(b.leftovers().unwrap().is_empty(), "{:?}", b.leftovers());
    let journal = ops(&b);
    for op in [
        JournalOp::CleanupNew,
        JournalOp::CleanupImage,
        JournalOp::RecoverCapture,
    ] {
        assert!(
            journal.iter().any(|(o, _)| *o == op),
            "{op:?} not journaled: {journal:?}"
        );
    }
    assert_eq!(
        count(&b, JournalOp::CleanupNew),
        1,
        "a cleanup that removed nothing is not journaled"
    );
}

#[tokio::test]
async fn cleanup_new_removes_a_failed_create() {
    let (_home, b) = with_stock().await;
    b.set_faults(&FaultConfig::rules([rule(
        "create.disk",
        FaultAction::Fail,
    )]))
    .unwrap();
    let r = b.create(&new_vm("a", "uid-a", STOCK)).await;
    assert!(
        matches!(r, Err(BackendError::Failed { ref step, .. }) if step == "create.disk"),
        "{r:?}"
    );
    b.clear_faults().unwrap();
    assert!(b.get("a").await.unwrap().is_none());
    assert!(b.list().await.unwrap().is_empty());
    assert_eq!(b.leftovers().unwrap(), [PathBuf::from("vms/a")]);
    assert_eq!(count(&b, JournalOp::Create), 0);
    b.cleanup_new("a").await.unwrap();
    b.cleanup_new("a").await.unwrap();
    assert!(b.leftovers().unwrap().is_empty());
    let e = b
        .journal()
        .unwrap()
        .into_iter()
        .find(|e| e.op == JournalOp::CleanupNew)
        .unwrap();
    assert_eq!(
        e.uid.as_deref(),
        Some("uid-a"),
        "a partial VM knows its mark"
    );
    b.create(&new_vm("a", "uid-a", STOCK)).await.unwrap();
    assert_eq!(b.read_disk("a").unwrap(), b"debian-12\n");
}

#[tokio::test]
async fn create_retried_after_a_failure_completes_once() {
    let (_home, b) = with_stock().await;
    // Fails before the commit: the retry reuses the partial dir.
    b.set_faults(&FaultConfig::rules([rule(
        "create.commit",
        FaultAction::Fail,
    )
    .nth(1)]))
        .unwrap();
    assert!(b.create(&new_vm("a", "uid-a", STOCK)).await.is_err());
    b.create(&new_vm("a", "uid-a", STOCK)).await.unwrap();
    // Fails after the commit (a crash before the caller heard back): the retry is a no-op.
    b.set_faults(&FaultConfig::rules([rule(
        "create.done",
        FaultAction::Fail,
    )
    .nth(1)]))
        .unwrap();
    assert!(b.create(&new_vm("b", "uid-b", STOCK)).await.is_err());
    assert!(b.get("b").await.unwrap().is_some());
    b.create(&new_vm("b", "uid-b", STOCK)).await.unwrap();
    let mut per_uid: HashMap<String, usize> = HashMap::new();
    for e in b
        .journal()
        .unwrap()
        .into_iter()
        .filter(|e| e.op == JournalOp::Create)
    {
        *per_uid.entry(e.uid.unwrap()).or_default() += 1;
    }
    assert_eq!(
        per_uid,
        HashMap::from([("uid-a".into(), 1), ("uid-b".into(), 1)])
    );
    assert!(b.leftovers().unwrap().is_empty(), "{:?}", b.leftovers());
}

#[tokio::test]
async fn reimage_replaces_the_disk_and_keeps_the_identity() {
    let (_home, b) = with_stock().await;
    b.create(&new_vm("a", "uid-a", STOCK)).await.unwrap();
    b.write_disk("a", b"clean").unwrap();
    b.capture("a", "a@clean", "uid-clean").await.unwrap();
    b.write_disk("a", b"dirty").unwrap();
    b.stop("a").await.unwrap();
    let before = b.vm_record("a").unwrap().unwrap();
    b.reimage("a", "a@clean", &before.identity).await.unwrap();
    let after = b.vm_record("a").unwrap().unwrap();
    assert_eq!(b.read_disk("a").unwrap(), b"clean");
    assert_eq!(after.state, PowerState::Running, "reimage ends running");
    assert_eq!(
        (&after.mac, &after.mark, &after.identity, after.size),
        (&before.mac, &before.mark, &before.identity, before.size)
    );
    assert_eq!(after.reimaged_from.as_deref(), Some("a@clean"));
    assert_eq!(count(&b, JournalOp::Reimage), 1);

    // No such image: Unchanged, and the VM is untouched.
    b.write_disk("a", b"dirty").unwrap();
    let r = b.reimage("a", "a@nope", &before.identity).await;
    assert!(matches!(r, Err(BackendError::Unchanged(_))), "{r:?}");
    assert_eq!(b.read_disk("a").unwrap(), b"dirty");
    // A failure while staging: Unchanged too.
    b.set_faults(&FaultConfig::rules([rule(
        "reimage.stage",
        FaultAction::Fail,
    )]))
    .unwrap();
    let r = b.reimage("a", "a@clean", &before.identity).await;
    assert!(matches!(r, Err(BackendError::Unchanged(_))), "{r:?}");
    assert_eq!(b.read_disk("a").unwrap(), b"dirty");
    b.clear_faults().unwrap();
    // No such VM.
    assert!(matches!(
        b.reimage("ghost", "a@clean", &before.identity).await,
        Err(BackendError::NotFound { .. })
    ));
    assert!(b.leftovers().unwrap().is_empty(), "{:?}", b.leftovers());
}

#[tokio::test]
async fn reimage_is_retryable_between_stage_and_swap() {
    let (_home, b) = with_stock().await;
    b.create(&new_vm("a", "uid-a", STOCK)).await.unwrap();
    b.write_disk("a", b"clean").unwrap();
    b.capture("a", "a@clean", "uid-clean").await.unwrap();
    b.write_disk("a", b"dirty").unwrap();
    let id = b.vm_record("a").unwrap().unwrap().identity;

    b.set_faults(&FaultConfig::rules([rule(
        "reimage.swap",
        FaultAction::Fail,
    )
    .nth(1)]))
        .unwrap();
    let r = b.reimage("a", "a@clean", &id).await;
    assert!(
        matches!(r, Err(BackendError::Failed { ref step, .. }) if step == "reimage.swap"),
        "{r:?}"
    );
    assert_eq!(b.read_disk("a").unwrap(), b"dirty");
    assert_eq!(
        b.leftovers().unwrap(),
        [
            PathBuf::from("vms/a/disk.new"),
            PathBuf::from("vms/a/reimage.json")
        ]
    );
    b.reimage("a", "a@clean", &id).await.unwrap();
    assert_eq!(b.read_disk("a").unwrap(), b"clean");
    assert!(b.leftovers().unwrap().is_empty(), "{:?}", b.leftovers());

    // Interrupted after staging, and the image deleted meanwhile: the retry finishes from the
    // staged copy.
    b.write_disk("a", b"dirty again").unwrap();
    b.set_faults(&FaultConfig::rules([rule(
        "reimage.swap",
        FaultAction::Fail,
    )
    .nth(1)]))
        .unwrap();
    assert!(b.reimage("a", "a@clean", &id).await.is_err());
    b.remove_image("a@clean").await.unwrap();
    b.reimage("a", "a@clean", &id).await.unwrap();
    assert_eq!(b.read_disk("a").unwrap(), b"clean");

    // Interrupted after the swap, before the record: the retry only finishes.
    b.capture("a", "a@v2", "uid-v2").await.unwrap();
    b.write_disk("a", b"dirty").unwrap();
    b.set_faults(&FaultConfig::rules([rule(
        "reimage.done",
        FaultAction::Fail,
    )
    .nth(1)]))
        .unwrap();
    assert!(matches!(
        b.reimage("a", "a@v2", &id).await,
        Err(BackendError::Failed { .. })
    ));
    assert_eq!(b.read_disk("a").unwrap(), b"clean");
    b.reimage("a", "a@v2", &id).await.unwrap();
    assert_eq!(b.read_disk("a").unwrap(), b"clean");
    b.clear_faults().unwrap();

    // A staged reimage to another image is abandoned by a reimage to this one.
    b.set_faults(&FaultConfig::rules([rule(
        "reimage.swap",
        FaultAction::Fail,
    )
    .nth(1)]))
        .unwrap();
    assert!(b.reimage("a", "a@v2", &id).await.is_err());
    b.reimage("a", STOCK, &id).await.unwrap();
    assert_eq!(b.read_disk("a").unwrap(), b"debian-12\n");
    assert!(b.leftovers().unwrap().is_empty(), "{:?}", b.leftovers());
}

#[tokio::test]
async fn fault_nth_fires_on_one_call_only() {
    let (_home, b) = with_stock().await;
    b.set_faults(&FaultConfig::rules([
        rule("create", FaultAction::Fail).nth(2)
    ]))
    .unwrap();
    b.create(&new_vm("a", "ua", STOCK)).await.unwrap();
    let r = b.create(&new_vm("b", "ub", STOCK)).await;
    assert!(
        matches!(r, Err(BackendError::Failed { ref step, ref source }) if step == "create" && source.to_string().contains("injected")),
        "{r:?}"
    );
    b.create(&new_vm("b", "ub", STOCK)).await.unwrap();
    b.create(&new_vm("c", "uc", STOCK)).await.unwrap();
    assert_eq!(b.fault_counts().unwrap().get("create"), Some(&4));
    // A rule on the operation's entry fires before anything is made.
    assert!(b.leftovers().unwrap().is_empty());
}

#[tokio::test]
async fn fault_times_fails_then_converges() {
    let (_home, b) = with_stock().await;
    let mut vm = new_vm("a", "ua", STOCK);
    vm.start = false;
    b.create(&vm).await.unwrap();
    b.set_faults(&FaultConfig::rules([
        rule("start", FaultAction::Fail).times(2)
    ]))
    .unwrap();
    let mut attempts = 0;
    let mut delay = Duration::from_millis(1);
    loop {
        attempts += 1;
        match b.start("a").await {
            Ok(()) => break,
            Err(BackendError::Failed { .. }) if attempts < 10 => {
                tokio::time::sleep(delay).await;
                delay *= 2;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(attempts, 3);
    assert_eq!(
        b.get("a").await.unwrap().unwrap().state,
        PowerState::Running
    );
    // nth + times: a window.
    b.set_faults(&FaultConfig::rules([rule("get", FaultAction::Fail)
        .nth(2)
        .times(2)]))
        .unwrap();
    let results: Vec<bool> = get_results(&b, 5).await;
    assert_eq!(results, [true, false, false, true, true]);
}

async fn get_results(b: &FakeBackend, n: usize) -> Vec<bool> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(b.get("a").await.is_ok());
    }
    out
}

#[tokio::test]
async fn list_distinguishes_empty_from_unreachable() {
    let (home, b) = fake();
    // Never initialised: empty, not an error.
    assert_eq!(b.list().await.unwrap(), []);
    assert_eq!(b.images().await.unwrap(), []);
    b.init().await.unwrap();
    assert_eq!(b.list().await.unwrap(), []);

    // Injected.
    b.set_faults(&FaultConfig::rules([
        rule("list", FaultAction::Unreachable),
        rule("images", FaultAction::Unreachable),
    ]))
    .unwrap();
    assert!(matches!(
        b.list().await,
        Err(BackendError::Unreachable { .. })
    ));
    assert!(matches!(
        b.images().await,
        Err(BackendError::Unreachable { .. })
    ));
    b.clear_faults().unwrap();

    // A state dir that cannot be read.
    let vms = home.path().join("fake/vms");
    std::fs::remove_dir_all(&vms).unwrap();
    std::fs::write(&vms, b"not a dir").unwrap();
    assert!(matches!(
        b.list().await,
        Err(BackendError::Unreachable { .. })
    ));
}

#[tokio::test]
async fn hang_never_returns() {
    let (_home, b) = with_stock().await;
    b.create(&new_vm("a", "ua", STOCK)).await.unwrap();
    b.set_faults(&FaultConfig::rules([rule(
        "capture.copy",
        FaultAction::Hang,
    )
    .nth(1)]))
        .unwrap();
    let r = tokio::time::timeout(Duration::from_millis(300), b.capture("a", "a@x", "ux")).await;
    assert!(r.is_err(), "capture returned: {r:?}");
    // The dropped capture left a partial image only recovery sees; the next call proceeds.
    assert!(b.images().await.unwrap().iter().all(|i| i.name != "a@x"));
    b.recover_capture("a", "a@x", Some(PowerState::Running))
        .await
        .unwrap();
    b.capture("a", "a@x", "ux").await.unwrap();
    assert!(b.leftovers().unwrap().is_empty());
}

#[tokio::test]
async fn latency_and_sleep_delay_steps() {
    let (_home, b) = with_stock().await;
    b.create(&new_vm("a", "ua", STOCK)).await.unwrap();
    b.set_faults(&FaultConfig {
        latency_ms: 50,
        rules: vec![],
    })
    .unwrap();
    let t = Instant::now();
    b.get("a").await.unwrap();
    assert!(t.elapsed() >= Duration::from_millis(50));
    b.set_faults(&FaultConfig::rules([
        rule("stop", FaultAction::Sleep).ms(100)
    ]))
    .unwrap();
    let t = Instant::now();
    b.stop("a").await.unwrap();
    assert!(t.elapsed() >= Duration::from_millis(100));
    assert_eq!(
        b.get("a").await.unwrap().unwrap().state,
        PowerState::Stopped
    );
}

#[tokio::test]
async fn bad_fault_configurations_are_loud() {
    let (home, b) = with_stock().await;
    let r = b.set_faults(&FaultConfig::rules([rule(
        "create.copy",
        FaultAction::Fail,
    )]));
    assert!(
        matches!(r, Err(BackendError::Invalid(ref m)) if m.contains("unknown step `create.copy`")),
        "{r:?}"
    );
    // A hand-written faults.json with a typo fails every step, naming the file.
    std::fs::write(
        home.path().join("fake/faults.json"),
        r#"{"rules": [{"stp": "list", "action": "fail"}]}"#,
    )
    .unwrap();
    let r = b.list().await;
    assert!(
        matches!(r, Err(BackendError::Failed { ref source, .. }) if source.to_string().contains("faults.json")),
        "{r:?}"
    );
    b.clear_faults().unwrap();
    b.list().await.unwrap();
}

#[tokio::test]
async fn counters_persist_across_instances_and_reset_on_change() {
    let (home, b1) = with_stock().await;
    b1.set_faults(&FaultConfig::rules([
        rule("create", FaultAction::Fail).nth(2)
    ]))
    .unwrap();
    b1.create(&new_vm("a", "ua", STOCK)).await.unwrap();
    let b2 = FakeBackend::new(home.path().join("fake"));
    assert!(
        b2.create(&new_vm("b", "ub", STOCK)).await.is_err(),
        "the second call overall fails"
    );
    b2.create(&new_vm("b", "ub", STOCK)).await.unwrap();
    assert_eq!(b1.fault_counts().unwrap().get("create"), Some(&3));
    // Writing the file again (even unchanged) starts the count over.
    b2.set_faults(&FaultConfig::rules([
        rule("create", FaultAction::Fail).nth(2)
    ]))
    .unwrap();
    assert!(b1.fault_counts().unwrap().is_empty());
    b1.create(&new_vm("c", "uc", STOCK)).await.unwrap();
    assert!(b2.create(&new_vm("d", "ud", STOCK)).await.is_err());
}

#[tokio::test]
async fn unmarked_things_are_listed_but_never_got() {
    let (_home, b) = with_stock().await;
    b.add_vm("pet", None, PowerState::Running).unwrap();
    b.add_vm("orphan", Some("uid-gone"), PowerState::Stopped)
        .unwrap();
    b.add_image("foreign", None).unwrap();
    b.add_image("orphan@snap", Some("uid-gone-img")).unwrap();
    let vms: Vec<(String, Option<String>)> = b
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|v| (v.name, v.mark))
        .collect();
    assert_eq!(
        vms,
        [
            ("orphan".into(), Some("uid-gone".into())),
            ("pet".into(), None)
        ]
    );
    let images: Vec<(String, Option<String>)> = b
        .images()
        .await
        .unwrap()
        .into_iter()
        .map(|i| (i.name, i.mark))
        .collect();
    assert_eq!(
        images,
        [
            ("foreign".into(), None),
            ("orphan@snap".into(), Some("uid-gone-img".into())),
            (STOCK.into(), Some(STOCK_UID.into()))
        ]
    );
    assert!(
        b.get("pet").await.unwrap().is_none(),
        "get shows only marked VMs"
    );
    assert!(b.get("orphan").await.unwrap().is_some());
    assert_eq!(b.read_disk("pet").unwrap(), b"pet\n");
    assert_eq!(count(&b, JournalOp::Create), 0, "helpers are not journaled");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_operations_on_different_vms() {
    let (_home, b) = with_stock().await;
    let b = Arc::new(b);
    let mut tasks = Vec::new();
    for i in 0..16 {
        let b = b.clone();
        tasks.push(tokio::spawn(async move {
            let name = format!("vm{i}");
            b.create(&new_vm(&name, &format!("uid-{i}"), STOCK))
                .await
                .unwrap();
            b.write_disk(&name, name.as_bytes()).unwrap();
            b.capture(&name, &format!("{name}@snap"), &format!("uid-snap-{i}"))
                .await
                .unwrap();
            b.stop(&name).await.unwrap();
            b.reimage(&name, STOCK, &Identity::default()).await.unwrap();
            if i % 2 == 0 {
                b.remove(&name).await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(b.list().await.unwrap().len(), 8);
    assert_eq!(b.images().await.unwrap().len(), 17);
    let journal = b.journal().unwrap();
    assert_eq!(
        journal.iter().filter(|e| e.op == JournalOp::Create).count(),
        16
    );
    assert_eq!(
        journal
            .iter()
            .filter(|e| e.op == JournalOp::Reimage)
            .count(),
        16
    );
    assert_eq!(b.read_image_disk("vm3@snap").unwrap(), b"vm3");
    assert!(b.leftovers().unwrap().is_empty(), "{:?}", b.leftovers());
}

#[tokio::test]
async fn import_copies_a_disk_file() {
    let (home, b) = fake();
    let file = home.path().join("disk.img");
    std::fs::write(&file, b"imported").unwrap();
    b.import_image(&file, "imp", "uid-imp").await.unwrap();
    assert_eq!(b.read_image_disk("imp").unwrap(), b"imported");
    std::fs::remove_file(&file).unwrap();
    assert_eq!(b.read_image_disk("imp").unwrap(), b"imported");
    assert!(matches!(
        b.import_image(&file, "imp2", "u").await,
        Err(BackendError::Invalid(_))
    ));
}

// ----- across processes -----

/// A guard that SIGKILLs and reaps a child on drop (also when the test fails).
struct ChildGuard(std::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Run this test binary's `child_entry` with `scenario` against `dir`.
fn spawn_child(scenario: &str, dir: &Path, faults_env: Option<&str>) -> ChildGuard {
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args(["child_entry", "--exact", "--nocapture", "--test-threads=1"])
        .env("FAKE_TEST_CHILD", scenario)
        .env("FAKE_TEST_DIR", dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    match faults_env {
        Some(json) => cmd.env("BOXERY_FAKE_FAULTS", json),
        None => cmd.env_remove("BOXERY_FAKE_FAULTS"),
    };
    ChildGuard(cmd.spawn().unwrap())
}

fn wait_child(child: &mut ChildGuard) -> (Option<i32>, String) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = child.0.try_wait().unwrap() {
            let mut err = String::new();
            if let Some(mut e) = child.0.stderr.take() {
                use std::io::Read;
                let _ = e.read_to_string(&mut err);
            }
            return (status.code(), err);
        }
        assert!(Instant::now() < deadline, "child did not finish");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Not a test on its own: the body of the child processes the tests below start.
#[test]
fn child_entry() {
    let Ok(scenario) = std::env::var("FAKE_TEST_CHILD") else {
        return;
    };
    let dir = PathBuf::from(std::env::var("FAKE_TEST_DIR").unwrap());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let b = FakeBackend::new(dir);
        match scenario.as_str() {
            "create" => b.create(&new_vm("a", "uid-a", STOCK)).await.unwrap(),
            "capture" => b.capture("a", "a@snap", "uid-snap").await.unwrap(),
            other => panic!("unknown scenario {other}"),
        }
    });
}

#[tokio::test]
async fn exit_inside_a_step_leaves_a_partial_create_and_counters_survive() {
    let (home, b) = with_stock().await;
    let dir = home.path().join("fake");
    // From the environment: exit on the first create.commit only.
    let faults = r#"{"rules": [{"step": "create.commit", "nth": 1, "action": "exit"}]}"#;
    let mut child = spawn_child("create", &dir, Some(faults));
    let (code, err) = wait_child(&mut child);
    assert_eq!(code, Some(137), "{err}");
    assert!(err.contains("create.commit"), "{err}");
    assert!(b.get("a").await.unwrap().is_none());
    assert_eq!(b.leftovers().unwrap(), [PathBuf::from("vms/a")]);
    assert_eq!(count(&b, JournalOp::Create), 0);

    // A restarted process with the same configuration is on call 2: it completes (over the
    // partial dir), once.
    let mut child = spawn_child("create", &dir, Some(faults));
    let (code, err) = wait_child(&mut child);
    assert_eq!(code, Some(0), "{err}");
    assert!(b.get("a").await.unwrap().is_some());
    assert_eq!(count(&b, JournalOp::Create), 1);
    assert!(b.leftovers().unwrap().is_empty(), "{:?}", b.leftovers());
}

#[tokio::test]
async fn a_process_killed_while_hanging_in_capture_is_recovered() {
    let (home, b) = with_stock().await;
    let dir = home.path().join("fake");
    b.create(&new_vm("a", "uid-a", STOCK)).await.unwrap();
    b.set_faults(&FaultConfig::rules([rule(
        "capture.copy",
        FaultAction::Hang,
    )
    .nth(1)]))
        .unwrap();
    let mut child = spawn_child("capture", &dir, None);
    let deadline = Instant::now() + Duration::from_secs(30);
    while b.fault_counts().unwrap().get("capture.copy") != Some(&1) {
        assert!(
            Instant::now() < deadline,
            "the child never reached capture.copy"
        );
        assert!(child.0.try_wait().unwrap().is_none(), "the child exited");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    assert!(b.image_record("a@snap").unwrap().is_none());
    assert_eq!(
        b.leftovers().unwrap(),
        [PathBuf::from("staging/images/a@snap")]
    );
    b.recover_capture("a", "a@snap", Some(PowerState::Running))
        .await
        .unwrap();
    assert!(b.leftovers().unwrap().is_empty());
    // The next capture is call 2: it goes through.
    b.capture("a", "a@snap", "uid-snap").await.unwrap();
    assert_eq!(
        b.get("a").await.unwrap().unwrap().state,
        PowerState::Running
    );
}
