//! Suspend and resume on the qemu backend against real QEMU (TCG) and the tiny guest: the
//! same processes after a resume, nothing lost when a suspend or resume is cut short, a state
//! that no longer matches kept and refused. These tests FAIL when QEMU is missing.
//!
//! Run: `cargo nextest run -p boxery-backends --features qemu --test qemu_memory`

mod qemu_support;

use std::time::{Duration, Instant};

use boxery_backends::qemu::qmp::Qmp;
use boxery_backends::{Backend, BackendError, PowerState};
use qemu_support::Env;

const BOOT: Duration = Duration::from_secs(180);

/// A counter the guest runs in the background (one line a tenth of a second into
/// ~/count); its PID.
async fn start_counter(env: &Env, vm: &str) -> String {
    env.run(
        vm,
        "setsid sh -c 'i=0; while true; do i=$((i+1)); echo $i > $HOME/count; sleep 0.1; done' \
         </dev/null >/dev/null 2>&1 & echo $!; sleep 1",
    )
    .await
}

async fn count(env: &Env, vm: &str) -> u64 {
    env.run(vm, "cat $HOME/count").await.parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suspend_keeps_processes_and_frees_qemu() {
    let env = Env::new().await;
    env.tiny_image("tiny").await;
    env.backend.create(&env.vm("m1", "tiny")).await.unwrap();
    env.wait_ssh("m1", BOOT).await;
    let boot_id = env.run("m1", "cat /proc/sys/kernel/random/boot_id").await;
    let pid = start_counter(&env, "m1").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = count(&env, "m1").await;
    assert!(before > 0);

    let t = Instant::now();
    env.backend.suspend("m1").await.unwrap();
    eprintln!("suspend: {:?}", t.elapsed());
    let info = env.backend.get("m1").await.unwrap().unwrap();
    assert_eq!(info.state, PowerState::Suspended);
    assert_eq!(info.ssh, None);
    let mem = info
        .memory
        .expect("a suspended VM reports its saved memory");
    assert!(mem.bytes > 1 << 20, "the state holds the guest's memory");
    assert_eq!(mem.stale, None);
    assert!(env.qemu_pids().is_empty(), "no QEMU runs while suspended");
    // suspending again is a no-op
    env.backend.suspend("m1").await.unwrap();

    let t = Instant::now();
    env.backend.start("m1").await.unwrap();
    eprintln!("resume (QEMU running the guest): {:?}", t.elapsed());
    let info = env.backend.get("m1").await.unwrap().unwrap();
    assert_eq!(info.state, PowerState::Running);
    assert_eq!(info.memory, None);
    assert_eq!(info.degraded, None);
    env.wait_ssh("m1", Duration::from_secs(30)).await;
    eprintln!("resume to ssh: {:?}", t.elapsed());
    assert_eq!(
        env.run("m1", "cat /proc/sys/kernel/random/boot_id").await,
        boot_id,
        "the same boot, not a new one"
    );
    assert_eq!(
        env.run("m1", &format!("kill -0 {pid} && echo alive")).await,
        "alive",
        "the counter started before the suspend still runs"
    );
    let after = count(&env, "m1").await;
    assert!(
        after >= before,
        "the counter went on from {before}: {after}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(count(&env, "m1").await > after, "and keeps counting");
    assert!(
        !env.backend.layout().vm_memory("m1").exists(),
        "the state is gone once the guest runs on"
    );

    // a stopped VM has no memory to suspend; stopping a suspended one discards its memory
    env.backend.suspend("m1").await.unwrap();
    env.backend.stop("m1").await.unwrap();
    let info = env.backend.get("m1").await.unwrap().unwrap();
    assert_eq!(info.state, PowerState::Stopped);
    assert_eq!(info.memory, None);
    assert!(!env.backend.layout().vm_memory("m1").exists());
    let err = env.backend.suspend("m1").await.unwrap_err();
    assert!(matches!(err, BackendError::Invalid(_)), "{err}");
    // and it boots cold
    env.backend.start("m1").await.unwrap();
    env.wait_ssh("m1", BOOT).await;
    assert_ne!(
        env.run("m1", "cat /proc/sys/kernel/random/boot_id").await,
        boot_id
    );
    env.backend.remove("m1").await.unwrap();
    assert!(env.qemu_pids().is_empty());
}

/// A state whose QEMU command line no longer matches (boxery changed how it starts the VM) is
/// kept and refused with what to do; a truncated state fails the resume and is kept; a
/// suspend that its control plane left half way is finished by `repair`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_or_mismatched_states_are_kept_and_interrupted_suspends_settle() {
    let env = Env::new().await;
    env.tiny_image("tiny").await;
    env.backend.create(&env.vm("m2", "tiny")).await.unwrap();
    env.wait_ssh("m2", BOOT).await;
    let pid = start_counter(&env, "m2").await;

    // killed mid-suspend: QEMU was told to migrate, nothing committed; repair finishes it
    let layout = env.backend.layout().clone();
    let part = layout.vm_memory_part("m2");
    {
        let mut q = Qmp::connect(&layout.vm_qmp("m2"), Duration::from_secs(10))
            .await
            .unwrap();
        q.stop().await.unwrap();
        q.migrate_set_capabilities(&[("mapped-ram", true), ("multifd", true)])
            .await
            .unwrap();
        q.migrate(&format!("file:{}", part.display()))
            .await
            .unwrap();
    }
    let info = env.backend.get("m2").await.unwrap().unwrap();
    assert_eq!(info.state, PowerState::Running);
    assert!(info.degraded.is_some(), "the half-done suspend shows");
    env.backend.repair("m2").await.unwrap();
    let info = env.backend.get("m2").await.unwrap().unwrap();
    assert_eq!(info.state, PowerState::Suspended, "{info:?}");
    assert!(!part.exists());
    assert!(env.qemu_pids().is_empty());

    // a state saved under another command line: kept, refused, reported stale
    let record = layout.vm_memory_record("m2");
    let saved = std::fs::read_to_string(&record).unwrap();
    let mut rec: serde_json::Value = serde_json::from_str(&saved).unwrap();
    rec["args"][0] = "-name-of-another-time".into();
    std::fs::write(&record, rec.to_string()).unwrap();
    let err = env.backend.start("m2").await.unwrap_err();
    assert!(matches!(err, BackendError::Invalid(_)), "{err}");
    assert!(err.to_string().contains("boxery stop m2"), "{err}");
    let info = env.backend.get("m2").await.unwrap().unwrap();
    assert_eq!(info.state, PowerState::Suspended);
    assert!(info.memory.unwrap().stale.is_some());
    assert!(env.qemu_pids().is_empty());
    // (a state saved before VMs had a screen is restored without one: qemu::memory's unit
    // test `a_spec_follows_a_saved_states_screen` checks the command line it is held to)
    std::fs::write(&record, &saved).unwrap();

    // a truncated state: the resume fails, nothing runs, the state is still there
    let state = layout.vm_memory("m2");
    let whole = std::fs::read(&state).unwrap();
    std::fs::write(&state, &whole[..4096]).unwrap();
    let err = env.backend.start("m2").await.unwrap_err();
    eprintln!("truncated: {}", err.chain());
    assert!(env.qemu_pids().is_empty(), "no half-made QEMU is left");
    assert_eq!(
        env.backend.get("m2").await.unwrap().unwrap().state,
        PowerState::Suspended
    );
    // the whole state resumes
    std::fs::write(&state, &whole).unwrap();
    env.backend.start("m2").await.unwrap();
    env.wait_ssh("m2", Duration::from_secs(30)).await;
    assert_eq!(
        env.run("m2", &format!("kill -0 {pid} && echo alive")).await,
        "alive"
    );

    // killed mid-resume, before the guest ran: the paused QEMU goes, the state stays
    env.backend.suspend("m2").await.unwrap();
    let rec = std::fs::read_to_string(&record).unwrap();
    let whole = std::fs::read(&state).unwrap();
    env.backend.start("m2").await.unwrap();
    // what a kill between load and `cont` leaves: a paused QEMU beside a whole state
    Qmp::connect(&layout.vm_qmp("m2"), Duration::from_secs(10))
        .await
        .unwrap()
        .stop()
        .await
        .unwrap();
    std::fs::write(&record, &rec).unwrap();
    std::fs::write(&state, &whole).unwrap();
    let info = env.backend.get("m2").await.unwrap().unwrap();
    assert!(info.degraded.is_some());
    env.backend.repair("m2").await.unwrap();
    assert_eq!(
        env.backend.get("m2").await.unwrap().unwrap().state,
        PowerState::Suspended
    );
    env.backend.remove("m2").await.unwrap();
    assert!(env.qemu_pids().is_empty());
}

/// A memory snapshot of a running VM, and a revert to it: the VM comes back running where it
/// was (same boot, the counter from the snapshot's instant, the disk as it was then); the
/// VM ran on after the snapshot. A stopped VM's memory cannot be taken, a disk-only image's
/// memory cannot be restored, and deleting the image deletes its memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_snapshot_and_revert_come_back_running() {
    let env = Env::new().await;
    env.tiny_image("tiny").await;
    let req = env.vm("m3", "tiny");
    env.backend.create(&req).await.unwrap();
    env.wait_ssh("m3", BOOT).await;
    let boot_id = env.run("m3", "cat /proc/sys/kernel/random/boot_id").await;
    let pid = start_counter(&env, "m3").await;
    env.run("m3", "echo before > ~/marker && sync").await;

    let t = Instant::now();
    env.backend
        .capture_memory("m3", "m3.s1", "uid-s1")
        .await
        .unwrap();
    eprintln!("memory snapshot: {:?}", t.elapsed());
    let img = env
        .backend
        .images()
        .await
        .unwrap()
        .into_iter()
        .find(|i| i.name == "m3.s1")
        .expect("the image is listed");
    assert!(img.memory_bytes.unwrap() > 1 << 20, "{img:?}");
    assert_eq!(
        env.backend.get("m3").await.unwrap().unwrap().state,
        PowerState::Running,
        "the VM runs on"
    );
    // the VM goes on after the snapshot
    tokio::time::sleep(Duration::from_secs(3)).await;
    env.run("m3", "echo after > ~/marker && sync").await;
    let later = count(&env, "m3").await;

    let t = Instant::now();
    env.backend
        .reimage_memory("m3", "m3.s1", &req.identity)
        .await
        .unwrap();
    env.wait_ssh("m3", Duration::from_secs(60)).await;
    eprintln!("revert with memory → ssh: {:?}", t.elapsed());
    assert_eq!(
        env.run("m3", "cat /proc/sys/kernel/random/boot_id").await,
        boot_id,
        "the snapshot's boot, running"
    );
    assert_eq!(env.run("m3", "cat ~/marker").await, "before");
    assert_eq!(
        env.run("m3", &format!("kill -0 {pid} && echo alive")).await,
        "alive"
    );
    let back = count(&env, "m3").await;
    assert!(
        back < later,
        "the counter is back near the snapshot's instant: {back} (was {later})"
    );

    // refusals
    env.backend
        .capture("m3", "m3.disk", "uid-disk")
        .await
        .unwrap();
    let err = env
        .backend
        .reimage_memory("m3", "m3.disk", &req.identity)
        .await
        .unwrap_err();
    assert!(matches!(err, BackendError::Unchanged(_)), "{err}");
    env.backend.stop("m3").await.unwrap();
    let err = env
        .backend
        .capture_memory("m3", "m3.s2", "uid-s2")
        .await
        .unwrap_err();
    assert!(matches!(err, BackendError::Invalid(_)), "{err}");
    assert!(
        env.backend
            .images()
            .await
            .unwrap()
            .iter()
            .all(|i| i.name != "m3.s2"),
        "no partial image"
    );
    let layout = env.backend.layout().clone();
    env.backend.remove_image("m3.s1").await.unwrap();
    assert!(!layout.image_memory("m3.s1").exists());
    assert!(!layout.image_memory_record("m3.s1").exists());
    env.backend.remove("m3").await.unwrap();
    assert!(env.qemu_pids().is_empty());
}

/// Pin `public` as VM `vm`'s host key in the backend's known_hosts (a VM started from another
/// VM's memory answers with that VM's key until it is given its own).
async fn pin(env: &Env, vm: &str, public: &str) {
    let port = env.port(vm).await;
    let line = boxery_backends::identity::known_hosts_line(&format!("[127.0.0.1]:{port}"), public);
    std::fs::write(env.backend.layout().vm_known_hosts(vm), format!("{line}\n")).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_vms_start_from_another_vms_memory() {
    let env = Env::new().await;
    env.tiny_image("tiny").await;
    let parent = env.vm("p1", "tiny");
    let parent_key = parent.identity.host_key.clone().unwrap().1;
    env.backend.create(&parent).await.unwrap();
    env.wait_ssh("p1", BOOT).await;
    let boot_id = env.run("p1", "cat /proc/sys/kernel/random/boot_id").await;
    let pid = start_counter(&env, "p1").await;
    env.backend
        .capture_memory("p1", "p1.f", "uid-f")
        .await
        .unwrap();
    env.backend.capture("p1", "p1.disk", "uid-d").await.unwrap();
    // the memory image is in its shared form: a raw RAM file and the device state
    let layout = env.backend.layout().clone();
    assert!(layout.image_memory_ram("p1.f").exists());
    assert!(layout.image_memory_dev("p1.f").exists());
    assert!(
        !layout.image_memory("p1.f").exists(),
        "the first form is gone"
    );

    // what can start from it, asked before anything is made
    let b = &env.backend;
    assert_eq!(b.memory_start_refusal("p1.f", 1, 256).await.unwrap(), None);
    let other_size = b
        .memory_start_refusal("p1.f", 2, 256)
        .await
        .unwrap()
        .unwrap();
    assert!(other_size.contains("1 CPUs and 256 MiB"), "{other_size}");
    let disk_only = b
        .memory_start_refusal("p1.disk", 1, 256)
        .await
        .unwrap()
        .unwrap();
    assert!(disk_only.contains("carries no memory"), "{disk_only}");
    let mut big = env.vm("c3", "p1.f");
    big.memory = true;
    big.cpus = 2;
    let err = b.create(&big).await.unwrap_err();
    assert!(matches!(err, BackendError::Invalid(_)), "{err}");
    b.cleanup_new("c3").await.unwrap();
    assert!(
        b.get("c3").await.unwrap().is_none(),
        "nothing is left of a refused start"
    );

    let mut children = Vec::new();
    for name in ["c1", "c2"] {
        let mut req = env.vm(name, "p1.f");
        req.memory = true;
        let t = Instant::now();
        b.create(&req).await.unwrap();
        let info = b.get(name).await.unwrap().unwrap();
        assert_eq!(info.state, PowerState::Running);
        assert!(info.inherited, "it runs with its source's identity for now");
        let inh = b.inherited(name).await.unwrap().expect("inherited");
        assert_eq!(inh.answers_with.trim(), parent_key.trim());
        assert_eq!(
            inh.identity, req.identity,
            "the identity it takes is its seed's"
        );
        let mac = inh.mac.clone().unwrap();
        pin(&env, name, &parent_key).await;
        env.wait_ssh(name, Duration::from_secs(60)).await;
        eprintln!("{name}: start from memory → ssh: {:?}", t.elapsed());
        // its RAM is the image's RAM file, mapped privately (the link in the VM's directory
        // is gone once it runs; the mapping keeps the file)
        let pid = b.pid(name).unwrap();
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
        assert!(
            maps.lines().any(|l| l.contains("memory.ram")),
            "{name}'s RAM is mapped from the image's file"
        );
        assert!(!layout.vm_memory_ram(name).exists());
        children.push((name, mac));
    }
    for (name, _) in &children {
        assert_eq!(
            env.run(name, "cat /proc/sys/kernel/random/boot_id").await,
            boot_id,
            "{name} continues the source's boot"
        );
        assert_eq!(
            env.run(name, &format!("kill -0 {pid} && echo alive")).await,
            "alive",
            "{name} runs the source's counter"
        );
    }
    // the source runs on, and the children are independent of it and of each other
    assert_eq!(
        env.run("p1", &format!("kill -0 {pid} && echo alive")).await,
        "alive"
    );
    env.run("c1", "echo c1 > ~/mine && sync").await;
    assert_eq!(
        env.run("c2", "cat ~/mine 2>/dev/null || echo none").await,
        "none"
    );
    assert_eq!(
        env.run("p1", "cat ~/mine 2>/dev/null || echo none").await,
        "none"
    );
    assert_ne!(children[0].1, children[1].1, "each child has its own MAC");

    b.identity_taken("c1").await.unwrap();
    assert!(b.inherited("c1").await.unwrap().is_none());
    assert!(!b.get("c1").await.unwrap().unwrap().inherited);
    // a cold boot gives the guest its seed's identity: nothing is inherited after it
    b.stop("c2").await.unwrap();
    b.start("c2").await.unwrap();
    assert!(b.inherited("c2").await.unwrap().is_none());

    for vm in ["c1", "c2", "p1"] {
        b.remove(vm).await.unwrap();
    }
    for img in ["p1.f", "p1.disk"] {
        b.remove_image(img).await.unwrap();
    }
    assert!(env.qemu_pids().is_empty());
}

/// A conversion cut short by a killed control plane (its scratch directory, a staging file in
/// /dev/shm whose control plane is gone) is cleaned up when the backend starts again.
#[tokio::test]
async fn conversions_cut_short_are_cleaned_up_at_init() {
    let env = Env::new().await;
    let layout = env.backend.layout().clone();
    let scratch = layout.image_memory_scratch("gone");
    std::fs::create_dir_all(&scratch).unwrap();
    std::fs::write(scratch.join("ram"), b"x").unwrap();
    let mut dead = std::process::Command::new("true").spawn().unwrap();
    let pid = dead.id();
    dead.wait().unwrap();
    std::fs::write(scratch.join("qemu.pid"), pid.to_string()).unwrap();
    let staged = std::path::PathBuf::from(format!("/dev/shm/boxery-{pid}-00000000000000aa.ram"));
    std::fs::write(&staged, b"x").unwrap();
    env.backend.init().await.unwrap();
    assert!(!scratch.exists(), "the scratch directory is gone");
    assert!(
        !staged.exists(),
        "the staging file of a gone control plane is gone"
    );
}
