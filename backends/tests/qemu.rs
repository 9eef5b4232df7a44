//! The qemu backend against real QEMU (TCG here) and the tiny guest (image/build-tiny.sh).
//! These tests FAIL when qemu-system-x86_64 is missing; they never pass without booting.
//! Every QEMU they start is killed by PID when the test ends, failed or not.
//!
//! Run: `cargo test -p boxery-backends --features qemu --test qemu`

mod qemu_support;
mod screen_support;

use std::time::Duration;

use boxery_backends::{Backend, PowerState};
use qemu_support::Env;

const BOOT: Duration = Duration::from_secs(180);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smoke_create_ssh_remove() {
    let env = Env::new().await;
    env.tiny_image("tiny").await;
    env.backend.create(&env.vm("dev1", "tiny")).await.unwrap();
    let info = env.backend.get("dev1").await.unwrap().unwrap();
    assert_eq!(info.state, PowerState::Running);
    let took = env.wait_ssh("dev1", BOOT).await;
    eprintln!("boot to ssh: {took:?}");
    assert_eq!(env.run("dev1", "hostname").await, "dev1");

    // What the guest can reach (docs/egress.md): slirp runs with `restrict=on`, so a service
    // listening only on the host's 127.0.0.1 is out of the guest's reach through 10.0.2.2
    // (slirp's gateway, which maps to the host's loopback); the control: the same listener
    // answers the host.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let accept = tokio::spawn(async move { listener.accept().await.map(|(_, peer)| peer) });
    let out = env
        .run(
            "dev1",
            &format!("echo from-guest | nc -w 3 10.0.2.2 {port} 2>&1; echo rc=$?"),
        )
        .await;
    assert!(!out.ends_with("rc=0"), "the guest's nc failed: {out}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !accept.is_finished(),
        "the guest reached the host's loopback through 10.0.2.2: {out}"
    );
    let control = tokio::net::TcpStream::connect(("127.0.0.1", port)).await;
    assert!(control.is_ok(), "the host reaches its own listener");
    let peer = tokio::time::timeout(Duration::from_secs(5), accept)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(peer.ip().is_loopback(), "the control's connection: {peer}");

    env.backend.remove("dev1").await.unwrap();
    assert!(env.qemu_pids().is_empty());
}

/// Whether QEMU `pid` holds `path`'s inode open for writing.
fn qemu_writes(pid: i32, path: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).unwrap();
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .any(|fd| {
            let Ok(t) = std::fs::metadata(fd.path()) else {
                return false;
            };
            if (t.dev(), t.ino()) != (m.dev(), m.ino()) {
                return false;
            }
            let info = std::fs::read_to_string(format!(
                "/proc/{pid}/fdinfo/{}",
                fd.file_name().to_string_lossy()
            ))
            .unwrap();
            let flags = info
                .lines()
                .find_map(|l| l.strip_prefix("flags:"))
                .unwrap()
                .trim();
            u32::from_str_radix(flags, 8).unwrap() & 3 != 0
        })
}

/// Wait for the VM's streams, then check it has one disk file, one overlay on a base, and
/// return that base.
async fn one_overlay_on_base(env: &Env, vm: &str) -> std::path::PathBuf {
    env.backend
        .wait_settled(vm, Duration::from_secs(120))
        .await
        .unwrap();
    let dir = env.backend.layout().vm_dir(vm);
    let disks: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| (n.starts_with("disk-") || n.starts_with("layer-")) && n.ends_with(".qcow2"))
        .collect();
    assert_eq!(disks.len(), 1, "VM {vm} has disks {disks:?}");
    let out = std::process::Command::new("qemu-img")
        .args(["info", "-U", "--output=json"])
        .arg(dir.join(&disks[0]))
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let backing = std::path::PathBuf::from(v["full-backing-filename"].as_str().unwrap());
    assert!(
        backing.starts_with(env.backend.layout().bases()),
        "VM {vm} is backed by {}",
        backing.display()
    );
    backing
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_capture_reimage_fork_resize_remove() {
    let env = Env::new().await;
    let b = &env.backend;
    env.tiny_image("tiny").await;

    // create -> running -> ssh with the pinned key
    let dev1 = env.vm("dev1", "tiny");
    b.create(&dev1).await.unwrap();
    env.wait_ssh("dev1", BOOT).await;
    assert_eq!(env.run("dev1", "hostname").await, "dev1");
    let pinned = dev1.identity.host_key.clone().unwrap().1;
    assert_eq!(
        b.host_key("dev1").await.unwrap().as_deref(),
        Some(pinned.trim())
    );
    env.run("dev1", "echo hello > /home/agent/f && sync").await;

    // capture while running: the VM keeps running, the image appears, the disk goes back to
    // one overlay on the base
    b.capture("dev1", "dev1.snap1", "uid-snap1").await.unwrap();
    assert_eq!(
        b.get("dev1").await.unwrap().unwrap().state,
        PowerState::Running
    );
    assert!(
        !qemu_writes(b.pid("dev1").unwrap(), &b.layout().image_disk("dev1.snap1")),
        "QEMU must not write the image"
    );
    assert!(
        b.images()
            .await
            .unwrap()
            .iter()
            .any(|i| i.name == "dev1.snap1" && i.mark.as_deref() == Some("uid-snap1"))
    );
    env.run("dev1", "echo changed > /home/agent/f && sync")
        .await;
    b.wait_settled("dev1", Duration::from_secs(120))
        .await
        .unwrap();
    one_overlay_on_base(&env, "dev1").await;
    assert_eq!(env.run("dev1", "cat /home/agent/f").await, "changed");
    // a capture is idempotent for the same object, refused for another
    b.capture("dev1", "dev1.snap1", "uid-snap1").await.unwrap();
    assert!(b.capture("dev1", "dev1.snap1", "uid-other").await.is_err());

    // reimage: the file is back, same endpoint and host key
    let port = env.port("dev1").await;
    b.reimage("dev1", "dev1.snap1", &dev1.identity)
        .await
        .unwrap();
    env.wait_ssh("dev1", BOOT).await;
    assert_eq!(env.port("dev1").await, port);
    assert_eq!(env.run("dev1", "cat /home/agent/f").await, "hello");
    // reimage from an image that does not exist changes nothing
    let err = b.reimage("dev1", "nope", &dev1.identity).await.unwrap_err();
    assert!(
        matches!(err, boxery_backends::BackendError::Unchanged(_)),
        "{err}"
    );

    // two VMs from the image: each its own identity
    b.create(&env.vm("a", "dev1.snap1")).await.unwrap();
    b.create(&env.vm("b", "dev1.snap1")).await.unwrap();
    assert!(
        !qemu_writes(b.pid("a").unwrap(), &b.layout().image_disk("dev1.snap1")),
        "QEMU must not write the image"
    );
    env.wait_ssh("a", BOOT).await;
    env.wait_ssh("b", BOOT).await;
    let id = |vm: &'static str| {
        let env = &env;
        async move {
            env.run(
                vm,
                "hostname; cat /etc/machine-id; cat /sys/class/net/eth0/address; cat /home/agent/f",
            )
            .await
        }
    };
    let (ia, ib, i1) = (id("a").await, id("b").await, id("dev1").await);
    let la: Vec<_> = ia.lines().collect();
    let lb: Vec<_> = ib.lines().collect();
    let l1: Vec<_> = i1.lines().collect();
    assert_eq!((la[0], lb[0]), ("a", "b"));
    assert_eq!(
        (la[3], lb[3]),
        ("hello", "hello"),
        "the forks carry the image's data"
    );
    for i in 1..3 {
        assert_ne!(
            la[i], lb[i],
            "line {i} must differ between forks: {la:?} {lb:?}"
        );
        assert_ne!(
            la[i], l1[i],
            "line {i} must differ from the source: {la:?} {l1:?}"
        );
    }
    let ka = std::fs::read_to_string(b.layout().vm_known_hosts("a")).unwrap();
    let kb = std::fs::read_to_string(b.layout().vm_known_hosts("b")).unwrap();
    assert_ne!(
        ka.split_whitespace().nth(2),
        kb.split_whitespace().nth(2),
        "host keys differ"
    );
    // a's sshd does not present b's key: ssh to a pinned to b's key fails
    let wrong = qemu_support::ssh_cmd(
        &env.key,
        &b.layout().vm_known_hosts("b"),
        env.port("a").await,
        "true",
    )
    .await;
    assert!(
        !wrong.status.success(),
        "a's host key must not match b's pin"
    );

    // images are independent: delete the image and its source, the forks keep working (also
    // across a cold boot, which reads every block of the disk chain afresh)
    b.remove_image("dev1.snap1").await.unwrap();
    b.remove("dev1").await.unwrap();
    assert!(b.get("dev1").await.unwrap().is_none());
    b.stop("a").await.unwrap();
    assert_eq!(
        b.get("a").await.unwrap().unwrap().state,
        PowerState::Stopped
    );
    assert!(b.ssh_endpoint("a").await.unwrap().is_none());
    b.start("a").await.unwrap();
    env.wait_ssh("a", BOOT).await;
    assert_eq!(env.run("a", "cat /home/agent/f").await, "hello");
    one_overlay_on_base(&env, "a").await;

    // capture of a stopped VM, and a VM from that image
    b.stop("b").await.unwrap();
    b.capture("b", "b.cold", "uid-cold").await.unwrap();
    assert_eq!(
        b.get("b").await.unwrap().unwrap().state,
        PowerState::Stopped
    );
    b.create(&env.vm("c", "b.cold")).await.unwrap();
    env.wait_ssh("c", BOOT).await;
    assert_eq!(
        env.run("c", "cat /home/agent/f; hostname").await,
        "hello\nc"
    );

    // resize while stopped: CPUs, memory, disk
    b.stop("a").await.unwrap();
    let size = boxery_backends::VmSize {
        cpus: 2,
        memory_mib: 320,
        disk_gib: 2,
    };
    b.resize("a", size).await.unwrap();
    assert_eq!(
        b.get("a").await.unwrap().unwrap().state,
        PowerState::Stopped,
        "resize leaves a stopped VM stopped"
    );
    b.start("a").await.unwrap();
    env.wait_ssh("a", BOOT).await;
    let out = env
        .run(
            "a",
            "nproc; awk '/MemTotal/{print $2}' /proc/meminfo; df -k /home | awk 'NR==2{print $2}'",
        )
        .await;
    let v: Vec<u64> = out.lines().map(|l| l.trim().parse().unwrap()).collect();
    assert_eq!(v[0], 2, "{out}");
    assert!(v[1] > 260_000, "memory {out}");
    assert!(v[2] > 1800 * 1024, "disk {out}");
    assert_eq!(b.get("a").await.unwrap().unwrap().size, size);
    // resize while running: left running
    b.resize(
        "a",
        boxery_backends::VmSize {
            cpus: 1,
            memory_mib: 256,
            disk_gib: 2,
        },
    )
    .await
    .unwrap();
    assert_eq!(
        b.get("a").await.unwrap().unwrap().state,
        PowerState::Running
    );
    env.wait_ssh("a", BOOT).await;
    assert_eq!(env.run("a", "nproc").await, "1");

    // remove everything: nothing is left
    for vm in ["a", "b", "c"] {
        b.remove(vm).await.unwrap();
        b.remove(vm).await.unwrap(); // already gone: fine
    }
    for img in ["b.cold", "tiny"] {
        b.remove_image(img).await.unwrap();
    }
    assert!(env.qemu_pids().is_empty(), "QEMU processes left");
    assert!(b.list().await.unwrap().is_empty());
    assert!(b.images().await.unwrap().is_empty());
    let left = |d: std::path::PathBuf| std::fs::read_dir(d).unwrap().count();
    assert_eq!(left(b.layout().vms()), 0, "VM dirs left");
    assert_eq!(left(b.layout().images()), 0, "image files left");
    assert_eq!(left(b.layout().ports()), 0, "ports left reserved");
}

/// Nothing of VM `vm` is left in the state dir.
fn nothing_left(env: &Env, vm: &str) {
    let l = env.backend.layout();
    assert!(!l.vm_dir(vm).exists(), "{} is left", l.vm_dir(vm).display());
    assert_eq!(
        std::fs::read_dir(l.ports()).unwrap().count(),
        0,
        "a port is left reserved"
    );
    assert!(env.qemu_pids().is_empty(), "a QEMU is left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_invalid_and_leave_nothing() {
    use boxery_backends::BackendError;
    let env = Env::new().await;
    let b = &env.backend;
    env.tiny_image("tiny").await;

    let mut vm = env.vm("bad", "tiny");
    vm.cpus = 4096;
    let e = b.create(&vm).await.unwrap_err();
    assert!(
        matches!(&e, BackendError::Invalid(m) if m.contains("CPUs")),
        "{e}"
    );
    let mut vm = env.vm("bad", "tiny");
    vm.memory_mib = 1 << 30;
    let e = b.create(&vm).await.unwrap_err();
    assert!(
        matches!(&e, BackendError::Invalid(m) if m.contains("memory")),
        "{e}"
    );
    let mut vm = env.vm("bad", "tiny");
    vm.disk_gib = 0;
    let e = b.create(&vm).await.unwrap_err();
    assert!(
        matches!(&e, BackendError::Invalid(m) if m.contains("smaller than image")),
        "{e}"
    );
    nothing_left(&env, "bad");
    let e = b.create(&env.vm("bad", "no-such-image")).await.unwrap_err();
    assert!(matches!(&e, BackendError::NotFound { .. }), "{e}");
    nothing_left(&env, "bad");

    // QEMU missing
    let mut cfg = b.config().clone();
    cfg.qemu = "/nonexistent/qemu-system-x86_64".into();
    let missing = boxery_backends::qemu::QemuBackend::with_config(
        b.layout().root().to_path_buf(),
        cfg.clone(),
    );
    let e = missing.create(&env.vm("bad", "tiny")).await.unwrap_err();
    assert!(
        matches!(&e, BackendError::Invalid(m) if m.contains("install-deps")),
        "{e}"
    );
    assert!(missing.check().await.is_err());
    nothing_left(&env, "bad");

    // QEMU failing to start: its stderr is in the error
    let fake = env.tmp.path().join("qemu-fails");
    std::fs::write(&fake, "#!/bin/sh\n[ \"$1\" = --version ] && exit 0\necho 'qemu-system-x86_64: -device virtio-blk-pci: boom, no such device' >&2\nexit 1\n").unwrap();
    std::process::Command::new("chmod")
        .arg("+x")
        .arg(&fake)
        .status()
        .unwrap();
    cfg.qemu = fake;
    let failing =
        boxery_backends::qemu::QemuBackend::with_config(b.layout().root().to_path_buf(), cfg);
    let e = failing.create(&env.vm("bad", "tiny")).await.unwrap_err();
    assert!(
        matches!(&e, BackendError::Invalid(m) if m.contains("boom, no such device")),
        "{e}"
    );
    nothing_left(&env, "bad");

    // a name taken by another object
    let mut vm = env.vm("taken", "tiny");
    vm.start = false;
    b.create(&vm).await.unwrap();
    b.create(&vm).await.unwrap(); // the same object again: fine
    let mut other = env.vm("taken", "tiny");
    other.uid = "someone-else".into();
    other.start = false;
    let e = b.create(&other).await.unwrap_err();
    assert!(
        matches!(&e, BackendError::Invalid(m) if m.contains("another object")),
        "{e}"
    );

    // its port taken by another process: start fails saying so, and works once it is free
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(b.layout().vm_config("taken")).unwrap()).unwrap();
    let port = cfg["port"].as_u64().unwrap() as u16;
    let squatter = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    let e = b.start("taken").await.unwrap_err();
    assert!(
        e.chain().contains(&format!("127.0.0.1:{port} is taken")),
        "{e}"
    );
    assert_eq!(
        b.get("taken").await.unwrap().unwrap().state,
        PowerState::Stopped
    );
    drop(squatter);
    b.start("taken").await.unwrap();
    env.wait_ssh("taken", BOOT).await;
    b.remove("taken").await.unwrap();
    nothing_left(&env, "taken");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_hooks_reattach_and_inventory_errors() {
    use boxery_backends::qemu::QemuBackend;
    let env = Env::new().await;
    let b = &env.backend;
    env.tiny_image("tiny").await;
    b.create(&env.vm("r1", "tiny")).await.unwrap();
    env.wait_ssh("r1", BOOT).await;

    // a control plane restart: a new backend on the same dir finds the running VM
    let again = QemuBackend::with_config(b.layout().root().to_path_buf(), b.config().clone());
    let info = again.get("r1").await.unwrap().unwrap();
    assert_eq!(info.state, PowerState::Running);
    assert_eq!(again.list().await.unwrap().len(), 1);

    // a QEMU killed behind our back is a stopped VM, and starts again
    let pid = b.pid("r1").unwrap();
    boxery_backends::qemu::process::kill_now(pid, &b.layout().vm_dir("r1"));
    assert!(boxery_backends::qemu::process::wait_gone(pid, Duration::from_secs(10)).await);
    assert_eq!(
        again.get("r1").await.unwrap().unwrap().state,
        PowerState::Stopped
    );
    again.start("r1").await.unwrap();
    env.wait_ssh("r1", BOOT).await;

    // a capture whose control plane died mid-way: the stream is still running in QEMU, a
    // restarted backend finishes it; then one that died between snapshot and publishing
    env.run("r1", "dd if=/dev/urandom of=/home/agent/big bs=1M count=150 2>/dev/null && md5sum /home/agent/big > /home/agent/big.md5 && sync").await;
    b.capture("r1", "r1.s1", "uid-s1").await.unwrap();
    again
        .wait_settled("r1", Duration::from_secs(120))
        .await
        .unwrap();
    one_overlay_on_base(&env, "r1").await;
    {
        use boxery_backends::qemu::qmp::Qmp;
        let l = b.layout();
        let mut q = Qmp::connect(&l.vm_qmp("r1"), Duration::from_secs(10))
            .await
            .unwrap();
        let disks: Vec<u64> = std::fs::read_dir(l.vm_dir("r1"))
            .unwrap()
            .flatten()
            .filter_map(|e| {
                e.file_name()
                    .to_string_lossy()
                    .strip_prefix("disk-")?
                    .strip_suffix(".qcow2")?
                    .parse()
                    .ok()
            })
            .collect();
        let g = disks[0];
        q.blockdev_snapshot_sync(
            &format!("ov{g}"),
            &l.vm_disk("r1", g + 1),
            &format!("ov{}", g + 1),
        )
        .await
        .unwrap();
        // and an overlay QEMU never switched to, as a kill between create and switch leaves
        std::process::Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
            .arg(l.vm_disk("r1", g + 1))
            .arg(l.vm_disk("r1", g + 2))
            .output()
            .unwrap();
        std::fs::write(l.images().join(".r1.s2.qcow2.part"), b"partial").unwrap();
    }
    for _ in 0..2 {
        again
            .recover_capture("r1", "r1.s2", Some(PowerState::Running))
            .await
            .unwrap();
    }
    assert!(!b.layout().images().join(".r1.s2.qcow2.part").exists());
    assert_eq!(
        b.get("r1").await.unwrap().unwrap().state,
        PowerState::Running
    );
    again
        .wait_settled("r1", Duration::from_secs(120))
        .await
        .unwrap();
    one_overlay_on_base(&env, "r1").await;
    assert_eq!(
        env.run("r1", "md5sum -c /home/agent/big.md5 >/dev/null && echo ok")
            .await,
        "ok"
    );

    // a stream cut short by a stop: the next start pulls the data offline
    b.capture("r1", "r1.s3", "uid-s3").await.unwrap();
    b.stop("r1").await.unwrap();
    b.start("r1").await.unwrap();
    one_overlay_on_base(&env, "r1").await;
    env.wait_ssh("r1", BOOT).await;
    assert_eq!(
        env.run("r1", "md5sum -c /home/agent/big.md5 >/dev/null && echo ok")
            .await,
        "ok"
    );

    // a create that died before its commit point: cleanup_new kills its QEMU and removes it
    std::fs::remove_file(b.layout().vm_config("r1")).unwrap();
    assert!(
        b.get("r1").await.unwrap().is_none(),
        "incomplete VMs are not listed"
    );
    for _ in 0..2 {
        again.cleanup_new("r1").await.unwrap();
    }
    nothing_left(&env, "r1");

    // a half-written image: cleanup_image removes it, twice
    std::fs::write(b.layout().image_disk("half"), b"x").unwrap();
    std::fs::write(b.layout().images().join(".half.qcow2.part"), b"x").unwrap();
    for _ in 0..2 {
        b.cleanup_image("half").await.unwrap();
    }
    assert!(!b.layout().image_disk("half").exists());
    // r1.s1 and r1.s3 are complete and independent: a VM from r1.s3 has the data
    b.remove_image("r1.s1").await.unwrap();
    b.create(&env.vm("r2", "r1.s3")).await.unwrap();
    env.wait_ssh("r2", BOOT).await;
    assert_eq!(
        env.run("r2", "md5sum -c /home/agent/big.md5 >/dev/null && echo ok")
            .await,
        "ok"
    );
    b.remove("r2").await.unwrap();

    // an unreadable state dir is an error, never an empty inventory
    let broken = env.tmp.path().join("broken");
    std::fs::create_dir_all(&broken).unwrap();
    std::fs::write(broken.join("vms"), b"not a dir").unwrap();
    std::fs::write(broken.join("images"), b"not a dir").unwrap();
    let bad = QemuBackend::with_config(broken, b.config().clone());
    assert!(matches!(
        bad.list().await,
        Err(boxery_backends::BackendError::Unreachable { .. })
    ));
    assert!(matches!(
        bad.images().await,
        Err(boxery_backends::BackendError::Unreachable { .. })
    ));
}

/// The full Debian 12 guest (image/build-debian.sh: ~2.5 min to build when not cached, 40–70 s
/// to boot under TCG): create, ssh as agent with sudo, a live capture with the guest agent
/// freezing the filesystems, a VM from that image, suspend and resume with the clock set
/// right, ACPI stop. Run with `--ignored`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "builds (or reuses) and boots the full Debian 12 image: minutes under TCG; run with --ignored"]
async fn debian_end_to_end() {
    let env = Env::new().await;
    let b = &env.backend;
    let progress: boxery_backends::Progress =
        std::sync::Arc::new(|line: &str| eprintln!("build: {line}"));
    b.build_image(
        boxery_backends::Stock {
            layers: &[],
            name: "debian-12",
            image: "debian-12",
            uid: "uid-debian",
        },
        progress,
    )
    .await
    .unwrap();
    let mut vm = env.vm("deb1", "debian-12");
    vm.cpus = 2;
    vm.memory_mib = 1024;
    vm.disk_gib = 4;
    let t = std::time::Instant::now();
    b.create(&vm).await.unwrap();
    env.wait_ssh("deb1", Duration::from_secs(400)).await;
    eprintln!("debian create -> ssh: {:?}", t.elapsed());
    assert_eq!(env.run("deb1", "hostname").await, "deb1");
    assert_eq!(env.run("deb1", "sudo -n whoami").await, "root");
    assert_eq!(
        env.run("deb1", "cat ~/.boxery/token").await,
        vm.identity.proxy_token.clone().unwrap()
    );
    env.run(
        "deb1",
        "cloud-init status --wait >/dev/null 2>&1 || true; echo data > ~/f && sync",
    )
    .await;
    // the guest agent is up: the capture freezes and thaws the filesystems
    let t = std::time::Instant::now();
    b.capture("deb1", "deb1.s1", "uid-deb-s1").await.unwrap();
    eprintln!("debian live capture: {:?}", t.elapsed());
    env.run("deb1", "echo after > ~/g && sync").await; // not left frozen
    let mut fork = env.vm("deb2", "deb1.s1");
    fork.memory_mib = 1024;
    fork.disk_gib = 4;
    b.create(&fork).await.unwrap();
    env.wait_ssh("deb2", Duration::from_secs(400)).await;
    assert_eq!(env.run("deb2", "hostname; cat ~/f").await, "deb2\ndata");
    let ids = env.run("deb1", "cat /etc/machine-id").await;
    assert_ne!(ids, env.run("deb2", "cat /etc/machine-id").await);
    // suspend and resume: the guest's clock stood still while suspended; its agent sets it
    // right after the resume (docs/live-memory.md)
    let t = std::time::Instant::now();
    b.suspend("deb2").await.unwrap();
    eprintln!("debian suspend (1 GiB): {:?}", t.elapsed());
    tokio::time::sleep(Duration::from_secs(20)).await;
    let t = std::time::Instant::now();
    b.start("deb2").await.unwrap();
    env.wait_ssh("deb2", Duration::from_secs(60)).await;
    eprintln!("debian resume -> ssh: {:?}", t.elapsed());
    let guest: i64 = env.run("deb2", "date +%s").await.parse().unwrap();
    let host = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    assert!(
        (guest - host).abs() <= 3,
        "the resumed guest's clock is {} s off the host's",
        guest - host
    );
    let t = std::time::Instant::now();
    b.stop("deb2").await.unwrap();
    eprintln!("debian ACPI stop: {:?}", t.elapsed());
    for v in ["deb1", "deb2"] {
        b.remove(v).await.unwrap();
    }
    b.remove_image("deb1.s1").await.unwrap();
    assert!(env.qemu_pids().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn import_registers_a_base_once_and_images_are_overlays() {
    use boxery_backends::BackendError;
    let env = Env::new().await;
    let b = &env.backend;
    env.tiny_image("tiny").await;
    let cache = b.config().storage.image_cache.clone();
    // a builder manifest imports as an image on the same (already registered) base
    b.import_image(&cache.join("tiny.json"), "imported", "uid-imp")
        .await
        .unwrap();
    b.import_image(&cache.join("tiny.qcow2"), "imported2", "uid-imp2")
        .await
        .unwrap();
    b.import_image(&cache.join("tiny.json"), "imported", "uid-imp")
        .await
        .unwrap(); // idempotent
    let e = b
        .import_image(&cache.join("tiny.json"), "imported", "uid-other")
        .await
        .unwrap_err();
    assert!(matches!(e, BackendError::Invalid(_)), "{e}");
    assert_eq!(
        std::fs::read_dir(b.layout().bases())
            .unwrap()
            .flatten()
            .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
            .count(),
        1
    );
    // a bare disk without a manifest says why it cannot be imported
    let bare = env.tmp.path().join("bare.qcow2");
    std::fs::copy(cache.join("tiny.qcow2"), &bare).unwrap();
    let e = b.import_image(&bare, "bare", "uid-bare").await.unwrap_err();
    assert!(
        matches!(&e, BackendError::Invalid(m) if m.contains("manifest")),
        "{e}"
    );
    let names: Vec<_> = b
        .images()
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.name)
        .collect();
    assert_eq!(names, ["imported", "imported2", "tiny"]);
    // every image is one overlay on the read-only base
    for n in &names {
        let out = std::process::Command::new("qemu-img")
            .args(["info", "-U", "--output=json"])
            .arg(b.layout().image_disk(n))
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let backing = v["full-backing-filename"].as_str().unwrap();
        assert!(
            backing.starts_with(&b.layout().bases().display().to_string()),
            "{n}: {backing}"
        );
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(backing).unwrap().permissions().mode() & 0o777,
            0o444
        );
    }
    // a VM made (not started) from an import, then removed with every image
    let mut vm = env.vm("imp1", "imported");
    vm.start = false;
    b.create(&vm).await.unwrap();
    assert_eq!(
        b.get("imp1").await.unwrap().unwrap().state,
        PowerState::Stopped
    );
    assert!(b.ssh_endpoint("imp1").await.unwrap().is_none());
    b.remove("imp1").await.unwrap();
    for n in &names {
        b.remove_image(n).await.unwrap();
    }
    assert!(b.images().await.unwrap().is_empty());
}

/// A build dropped mid-way (`serve` stopping, the Image deleted) ends the builder's whole
/// process group with TERM, so its trap runs (the real builder unmounts its chroot and removes
/// its work directory there): with KILL, neither happened.
#[tokio::test]
async fn a_dropped_build_ends_the_builder_with_term() {
    use boxery_backends::qemu::{QemuBackend, config::QemuConfig};
    qemu_support::need_qemu();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("image");
    let out = tmp.path().join("out");
    std::fs::create_dir_all(&dir).unwrap();
    // a builder whose foreground child runs long, as debootstrap does: bash runs its trap only
    // once that child is gone, so the TERM must reach the child too (the group)
    std::fs::write(
        dir.join("build-tiny.sh"),
        "#!/bin/bash\nmkdir -p \"$1\"\ntrap 'echo term > \"$1/term\"; exit 130' TERM\n\
         echo $$ > \"$1/started\"\nsleep 300\necho done > \"$1/done\"\n",
    )
    .unwrap();
    let mut config = QemuConfig::from_env();
    config.storage.image_dir = Some(dir);
    config.storage.image_cache = out.clone();
    let backend = QemuBackend::with_config(tmp.path().join("qemu"), config);
    backend.init().await.unwrap();
    let progress: boxery_backends::Progress = std::sync::Arc::new(|_: &str| {});
    let build = backend.build_image(
        boxery_backends::Stock {
            layers: &[],
            name: "tiny",
            image: "t1",
            uid: "uid-t1",
        },
        progress,
    );
    let started = out.join("started");
    let r = tokio::time::timeout(Duration::from_secs(20), async {
        tokio::pin!(build);
        loop {
            tokio::select! {
                r = &mut build => return Some(r),
                _ = tokio::time::sleep(Duration::from_millis(50)) => {
                    if started.exists() { return None; }
                }
            }
        }
    })
    .await
    .expect("the builder started");
    assert!(r.is_none(), "the build ended by itself: {r:?}");
    // the build future is dropped here
    let termed = (0..100).any(|_| {
        std::thread::sleep(Duration::from_millis(50));
        out.join("term").exists()
    });
    assert!(termed, "the builder's trap did not run");
    assert!(!out.join("done").exists());
}

/// The host path (a VM's screen): a running VM's screendump is a PNG of the size it reports,
/// showing the VGA text console (the firmware's lines: more than one colour). Keys typed reach
/// the guest's console, in order and none lost also in a batch QEMU takes in several
/// commands, and the echo changes the screen; pointer events inside the screen are taken (a
/// backend that has not seen the screen yet takes a screendump to learn its size), one outside
/// it and an unknown key are `Invalid`. A stopped VM has no screen (`Invalid`), a missing one
/// is `NotFound`, and no screendump file is left in the VM's directory.
///
/// The tiny guest runs no getty: the test puts a reader on tty1 over ssh
/// ([`screen_support::CONSOLE_READER`]), whose line discipline echoes what is typed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn screen_shows_the_console_and_takes_keys_and_a_pointer() {
    use boxery_backends::qemu::QemuBackend;
    use boxery_backends::{BackendError, InputEvent, PointerButton};
    use screen_support::{CONSOLE_READER, colours, differing, keys};
    let env = Env::new().await;
    env.tiny_image("tiny").await;
    let b = &env.backend;
    b.create(&env.vm("s1", "tiny")).await.unwrap();
    env.wait_ssh("s1", BOOT).await;

    let first = b.screendump("s1").await.unwrap();
    eprintln!(
        "screen: {}x{}, {} bytes of PNG, {} colours",
        first.width,
        first.height,
        first.png.len(),
        colours(&first)
    );
    assert!(first.width > 0 && first.height > 0);
    assert!(colours(&first) > 1, "the console shows text");

    assert_eq!(env.run("s1", CONSOLE_READER).await, "reading");
    let before = b.screendump("s1").await.unwrap();
    b.send_input("s1", &keys("abc\n")).await.unwrap();
    let typed = |want: &'static str| {
        let env = &env;
        async move {
            let t = std::time::Instant::now();
            loop {
                let got = env.run("s1", "cat /tmp/typed").await;
                if got == want || t.elapsed() > Duration::from_secs(30) {
                    return got;
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
    };
    assert_eq!(typed("abc").await, "abc", "the keys reached the console");
    let after = b.screendump("s1").await.unwrap();
    let changed = differing(&before, &after);
    eprintln!("typing `abc⏎` changed {changed} pixels");
    assert!(
        changed > 30,
        "the echo shows on the screen: {changed} pixels"
    );

    // a long text: QEMU gets it in several commands, the guest loses no key
    let long = "x".repeat(150);
    let batch = keys(&format!("{long}\n"));
    assert!(batch.len() > boxery_backends::screen::KEYS_PER_COMMAND * 10);
    b.send_input("s1", &batch).await.unwrap();
    let want: &'static str = Box::leak(format!("abc\n{long}").into_boxed_str());
    assert_eq!(typed(want).await, want, "every key of a long batch arrived");

    // the pointer: inside the screen taken, outside refused; a backend that has not seen
    // the screen learns its size first
    let (w, h) = (after.width, after.height);
    let fresh = QemuBackend::with_config(b.layout().root().to_path_buf(), b.config().clone());
    let pointer = [
        InputEvent::Move { x: 0, y: 0 },
        InputEvent::Move { x: w - 1, y: h - 1 },
        InputEvent::Button {
            button: PointerButton::Left,
            down: true,
        },
        InputEvent::Button {
            button: PointerButton::Left,
            down: false,
        },
        InputEvent::Button {
            button: PointerButton::WheelUp,
            down: true,
        },
        InputEvent::Button {
            button: PointerButton::WheelUp,
            down: false,
        },
        InputEvent::Button {
            button: PointerButton::WheelDown,
            down: true,
        },
        InputEvent::Button {
            button: PointerButton::WheelDown,
            down: false,
        },
    ];
    fresh.send_input("s1", &pointer).await.unwrap();
    b.send_input("s1", &pointer).await.unwrap();
    for backend in [b, &fresh] {
        let e = backend
            .send_input("s1", &[InputEvent::Move { x: w, y: 0 }])
            .await
            .unwrap_err();
        assert!(matches!(e, BackendError::Invalid(_)), "{e}");
    }
    let e = b
        .send_input(
            "s1",
            &[InputEvent::Key {
                qcode: "nosuchkey".into(),
                down: true,
            }],
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&e, BackendError::Invalid(m) if m.contains("nosuchkey")),
        "{e}"
    );
    b.send_input("s1", &[]).await.unwrap();

    let dir = b.layout().vm_dir("s1");
    let left: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|f| f.contains("screen"))
        .collect();
    assert!(left.is_empty(), "screendump files left: {left:?}");

    b.stop("s1").await.unwrap();
    let e = b.screendump("s1").await.unwrap_err();
    assert!(
        matches!(&e, BackendError::Invalid(m) if m.contains("stopped")),
        "{e}"
    );
    let e = b.send_input("s1", &keys("a")).await.unwrap_err();
    assert!(matches!(e, BackendError::Invalid(_)), "{e}");
    let e = b.screendump("nope").await.unwrap_err();
    assert!(matches!(e, BackendError::NotFound { .. }), "{e}");
    b.remove("s1").await.unwrap();
    assert!(env.qemu_pids().is_empty());
}
