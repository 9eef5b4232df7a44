//! The backend contract (seed 001: "VMs", "Images", "Identity", "Crash recovery contract";
//! `docs/backends.md`, "The contract"), one suite run unchanged against every backend this
//! build has: `fake` always, `qemu`, `libvirt` and `incus` with their cargo features. It sees a backend
//! only as `Arc<dyn Backend>`; what differs between backends is the fixture that makes one
//! (a [`Subject`]) and the capabilities the backend declares, which the suite honours.
//!
//! One VM (`a`) goes through the whole life: create → its screen → start/stop → resize →
//! capture (running, then stopped) → a clone from the capture (`b`, its own identity) →
//! reimage → remove; the
//! image is deleted while the clone still uses it. Real backends boot two tiny guests under
//! TCG for this. The real-VM tests FAIL with their reason (never skip) when QEMU or libvirt
//! is missing, and their fixtures kill every QEMU / undefine every domain they made, also when
//! a check fails.
//!
//! A new backend: its driver folder, a fixture making its `Subject`, and one line at the end of
//! this file (`contract!(name, "feature", fixture);`).
//!
//! `cargo nextest run -p boxery-backends --features qemu,libvirt,incus --test contract`

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use boxery_backends::{
    Backend, BackendError, DiskSource, Identity, InputEvent, NewVm, PowerState, Progress, VmSize,
};

mod screen_support;

/// One backend under test.
struct Subject {
    /// The backend, initialised, on a state directory of its own.
    backend: Arc<dyn Backend>,
    /// The same kind of backend, unable to reach its hypervisor or state (a daemon that is not
    /// there, a state directory that is not mounted, an injected fault).
    unreachable: Arc<dyn Backend>,
    /// The stock image it builds for the suite (`tiny` on real backends).
    stock: &'static str,
    /// Dropped last: kills what the backend left running, removes its files.
    _cleanup: Box<dyn std::any::Any>,
    /// A temporary directory for the suite's own files (the ssh client key).
    tmp: tempfile::TempDir,
}

/// How long a real guest may take to answer ssh (TCG on 2 shared cores).
const BOOT: Duration = Duration::from_secs(180);

fn progress() -> Progress {
    Arc::new(|_line: &str| {})
}

/// An ssh client key for the guests: (private key path, public line).
fn client_key(dir: &Path) -> (PathBuf, String) {
    let key = dir.join("id_ed25519");
    let out = std::process::Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", "contract", "-f"])
        .arg(&key)
        .output()
        .expect("ssh-keygen runs (openssh-client)");
    assert!(out.status.success(), "ssh-keygen failed");
    let public = std::fs::read_to_string(key.with_extension("pub"))
        .unwrap()
        .trim()
        .to_string();
    (key, public)
}

/// The guest side of a backend whose VMs run sshd: commands over ssh as `agent`, trusting
/// only the host key the backend pinned.
struct Guest<'a> {
    backend: &'a dyn Backend,
    key: PathBuf,
    dir: PathBuf,
}

impl Guest<'_> {
    /// Run `cmd` in VM `vm` once it answers (up to [`BOOT`]); its stdout, trimmed.
    async fn run(&self, vm: &str, cmd: &str) -> String {
        let t = Instant::now();
        let mut last = String::new();
        while t.elapsed() < BOOT {
            let Some(ep) = self.backend.ssh_endpoint(vm).await.unwrap() else {
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            };
            let (host, port) = ep.rsplit_once(':').expect("HOST:PORT");
            let pinned = self
                .backend
                .host_key(vm)
                .await
                .unwrap()
                .expect("a backend with host_key pins every VM's key");
            let kh = self.dir.join(format!("known_hosts-{vm}"));
            std::fs::write(&kh, format!("{vm}.boxery {pinned}\n")).unwrap();
            let out = tokio::process::Command::new("ssh")
                .arg("-i")
                .arg(&self.key)
                .args([
                    "-o",
                    "IdentitiesOnly=yes",
                    "-o",
                    "BatchMode=yes",
                    "-o",
                    "ConnectTimeout=5",
                    "-o",
                    "StrictHostKeyChecking=yes",
                    "-o",
                    "GlobalKnownHostsFile=/dev/null",
                    "-o",
                    "LogLevel=ERROR",
                ])
                .arg("-o")
                .arg(format!("UserKnownHostsFile={}", kh.display()))
                .arg("-o")
                .arg(format!("HostKeyAlias={vm}.boxery"))
                .args(["-p", port, &format!("agent@{host}"), cmd])
                .stdin(std::process::Stdio::null())
                .output()
                .await
                .unwrap();
            if out.status.success() {
                return String::from_utf8_lossy(&out.stdout).trim().to_string();
            }
            last = String::from_utf8_lossy(&out.stderr).into_owned();
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        panic!("ssh {vm} `{cmd}` did not succeed within {BOOT:?}: {last}");
    }
}

fn request(name: &str, image: &str, identity: Identity) -> NewVm {
    NewVm {
        name: name.into(),
        uid: format!("uid-{name}"),
        source: DiskSource::Image(image.into()),
        cpus: 1,
        memory_mib: 256,
        disk_gib: 1,
        start: true,
        identity,
        egress: boxery_api::network::EgressPolicy::Public,
        memory: false,
    }
}

async fn state(b: &dyn Backend, vm: &str) -> PowerState {
    b.get(vm)
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("VM {vm} is gone"))
        .state
}

/// The suite.
async fn contract(s: Subject) {
    let b = s.backend.as_ref();
    let caps = b.capabilities();
    let name = caps.name;
    let (key, public) = client_key(s.tmp.path());
    let guest = (caps.ssh && caps.host_key).then(|| Guest {
        backend: b,
        key: key.clone(),
        dir: s.tmp.path().to_path_buf(),
    });
    let identity = |vm: &str| {
        let mut id = boxery_backends::identity::generate(vm, std::slice::from_ref(&public))
            .expect("an identity (ssh-keygen)");
        id.proxy_token = Some(format!("token-{vm}"));
        id
    };
    let t0 = Instant::now();
    let step = |what: &str| eprintln!("[{name} {:>6.1}s] {what}", t0.elapsed().as_secs_f64());

    step("capabilities are declared once, and by_name makes the same backend");
    assert_eq!(b.name(), name);
    assert!(!caps.platforms.is_empty(), "{name}: platforms");
    let home = tempfile::tempdir().unwrap();
    let again = boxery_backends::by_name(name, home.path()).expect("by_name knows it");
    assert_eq!(again.capabilities(), caps);

    step("inventory: an empty host is Ok(empty), an unreachable one is Unreachable");
    assert_eq!(
        b.list().await.unwrap(),
        vec![],
        "{name}: a new host has no VMs"
    );
    assert!(
        b.images().await.unwrap().is_empty(),
        "{name}: a new host has no images"
    );
    let u = s.unreachable.as_ref();
    assert!(
        matches!(u.list().await, Err(BackendError::Unreachable { .. })),
        "{name}: list of an unreachable backend"
    );
    assert!(
        matches!(u.images().await, Err(BackendError::Unreachable { .. })),
        "{name}: images of an unreachable backend"
    );

    step("the recovery hooks and removals succeed when there is nothing to clean, twice");
    for _ in 0..2 {
        b.cleanup_new("ghost").await.unwrap();
        b.cleanup_image("ghost-img").await.unwrap();
        b.recover_capture("ghost", "ghost-img", Some(PowerState::Running))
            .await
            .unwrap();
        b.remove("ghost").await.unwrap();
        b.remove_image("ghost-img").await.unwrap();
    }
    assert!(b.get("ghost").await.unwrap().is_none());

    step("the stock image");
    if caps.build_stock_image {
        let ours = boxery_backends::Stock {
            layers: &[],
            name: s.stock,
            image: "stock",
            uid: "uid-stock",
        };
        b.build_image(ours, progress())
            .await
            .unwrap_or_else(|e| panic!("{name}: building {} failed: {}", s.stock, e.chain()));
        // idempotent for its object, refused for another
        b.build_image(ours, progress()).await.unwrap();
        let another = boxery_backends::Stock {
            uid: "uid-other",
            ..ours
        };
        assert!(
            b.build_image(another, progress()).await.is_err(),
            "{name}: an image name taken by another object"
        );
    } else {
        panic!("{name}: the suite needs a backend that builds its stock image");
    }
    let stock = b.images().await.unwrap();
    assert_eq!(stock.len(), 1, "{name}: {stock:?}");
    assert_eq!(stock[0].mark.as_deref(), Some("uid-stock"));

    step("bad requests change nothing");
    let e = b
        .create(&request("nosrc", "no-such-image", identity("nosrc")))
        .await
        .unwrap_err();
    assert!(
        matches!(e, BackendError::NotFound { .. }),
        "{name}: {}",
        e.chain()
    );
    b.cleanup_new("nosrc").await.unwrap();
    assert!(b.get("nosrc").await.unwrap().is_none());
    let e = b
        .create(&request("a/b", "stock", identity("ab")))
        .await
        .unwrap_err();
    assert!(matches!(e, BackendError::Invalid(_)), "{name}: {e:?}");
    for e in [
        b.start("nope").await.unwrap_err(),
        b.stop("nope").await.unwrap_err(),
        b.reimage("nope", "stock", &identity("nope"))
            .await
            .unwrap_err(),
    ] {
        assert!(
            matches!(e, BackendError::NotFound { .. }),
            "{name}: {}",
            e.chain()
        );
    }
    assert!(b.capture("nope", "nope-img", "uid-x").await.is_err());
    assert!(
        b.images()
            .await
            .unwrap()
            .iter()
            .all(|i| i.name != "nope-img")
    );

    step("create a: running, marked, its size");
    let a_id = identity("a");
    b.create(&request("a", "stock", a_id.clone()))
        .await
        .unwrap_or_else(|e| panic!("{name}: create a: {}", e.chain()));
    let info = b.get("a").await.unwrap().expect("a exists");
    assert_eq!(info.state, PowerState::Running);
    assert_eq!(info.mark.as_deref(), Some("uid-a"));
    assert_eq!(info.size.cpus, 1);
    assert_eq!(info.size.memory_mib, 256);
    assert!(info.size.disk_gib >= 1);
    let listed = b.list().await.unwrap();
    assert_eq!(listed.len(), 1, "{name}: {listed:?}");
    assert_eq!(listed[0].name, "a");
    // the same request again is success (not a second VM); another object's is refused
    b.create(&request("a", "stock", a_id.clone()))
        .await
        .unwrap();
    let mut other = request("a", "stock", identity("a"));
    other.uid = "uid-someone-else".into();
    assert!(b.create(&other).await.is_err(), "{name}: a name taken");
    assert_eq!(
        b.get("a").await.unwrap().unwrap().mark.as_deref(),
        Some("uid-a")
    );
    if caps.host_key {
        assert_eq!(
            b.host_key("a").await.unwrap().as_deref(),
            a_id.host_key.as_ref().map(|(_, p)| p.trim()),
            "{name}: the pinned key is the one the request carried"
        );
    }
    let a_machine_id = match &guest {
        Some(g) => {
            assert_eq!(g.run("a", "hostname").await, "a");
            assert_eq!(g.run("a", "cat /home/agent/.boxery/token").await, "token-a");
            g.run("a", "echo one > /home/agent/f && sync").await;
            Some(g.run("a", "cat /etc/machine-id").await)
        }
        None => None,
    };
    if caps.ssh {
        assert!(b.ssh_endpoint("a").await.unwrap().is_some());
    }

    step("the screen of a running VM where the backend has one, Unsupported where not");
    if caps.screen {
        let shown = b
            .screendump("a")
            .await
            .unwrap_or_else(|e| panic!("{name}: screendump a: {}", e.chain()));
        // a PNG of the size it reports (`pixels` checks it; what the guest shows is the screen
        // suites' to check: the contract's guest may show a blank console)
        screen_support::pixels(&shown);
        assert!(
            shown.width > 0 && shown.height > 0,
            "{name}: an empty screen"
        );
        b.send_input("a", &screen_support::keys("a"))
            .await
            .unwrap_or_else(|e| panic!("{name}: send_input a: {}", e.chain()));
        let (w, h) = (shown.width, shown.height);
        b.send_input("a", &[InputEvent::Move { x: w - 1, y: h - 1 }])
            .await
            .unwrap();
        assert!(
            matches!(
                b.send_input("a", &[InputEvent::Move { x: w, y: h }]).await,
                Err(BackendError::Invalid(_))
            ),
            "{name}: a position off the screen"
        );
        assert!(
            matches!(
                b.screendump("nope").await,
                Err(BackendError::NotFound { .. })
            ),
            "{name}: the screen of a VM that does not exist"
        );
    } else {
        assert!(
            matches!(
                b.screendump("a").await,
                Err(BackendError::Unsupported { .. })
            ),
            "{name}: a backend without screens refuses screendump"
        );
        assert!(
            matches!(
                b.send_input("a", &screen_support::keys("a")).await,
                Err(BackendError::Unsupported { .. })
            ),
            "{name}: a backend without screens refuses input"
        );
    }

    step("resize a while it runs: the disk grows, a keeps running; a shrink is Invalid");
    if caps.resize {
        let grown = VmSize {
            cpus: 1,
            memory_mib: 256,
            disk_gib: info.size.disk_gib + 1,
        };
        b.resize("a", grown)
            .await
            .unwrap_or_else(|e| panic!("{name}: resize a: {}", e.chain()));
        let now = b.get("a").await.unwrap().unwrap();
        assert_eq!(
            now.state,
            PowerState::Running,
            "{name}: running before, after"
        );
        assert_eq!(now.size, grown);
        let shrink = VmSize {
            disk_gib: info.size.disk_gib,
            ..grown
        };
        assert!(
            matches!(b.resize("a", shrink).await, Err(BackendError::Invalid(_))),
            "{name}: disks only grow"
        );
        b.resize("a", grown).await.unwrap(); // no change: a no-op
    } else {
        let e = b.resize("a", info.size).await.unwrap_err();
        assert!(matches!(e, BackendError::Unsupported { .. }), "{e:?}");
    }

    step("capture a while it runs: a keeps running, the image is listed and marked");
    if caps.live_capture {
        b.capture("a", "img", "uid-img")
            .await
            .unwrap_or_else(|e| panic!("{name}: capture a: {}", e.chain()));
        assert_eq!(state(b, "a").await, PowerState::Running);
        b.capture("a", "img", "uid-img").await.unwrap(); // idempotent
        assert!(b.capture("a", "img", "uid-other").await.is_err());
    } else {
        b.stop("a").await.unwrap();
        b.capture("a", "img", "uid-img").await.unwrap();
        b.start("a").await.unwrap();
    }
    let imgs = b.images().await.unwrap();
    let img = imgs.iter().find(|i| i.name == "img").expect("img listed");
    assert_eq!(img.mark.as_deref(), Some("uid-img"));
    if let Some(g) = &guest {
        g.run("a", "echo two > /home/agent/f && sync").await;
    }

    step("a clone b from the image: its own identity, the image's data");
    let b_id = identity("b");
    let mut rb = request("b", "img", b_id.clone());
    // at least the image's size (a's disk, grown above)
    rb.disk_gib = b.get("a").await.unwrap().unwrap().size.disk_gib;
    b.create(&rb)
        .await
        .unwrap_or_else(|e| panic!("{name}: create b: {}", e.chain()));
    assert_eq!(state(b, "b").await, PowerState::Running);
    if caps.host_key {
        let (ka, kb) = (
            b.host_key("a").await.unwrap(),
            b.host_key("b").await.unwrap(),
        );
        assert_ne!(ka, kb, "{name}: a clone never has its source's host key");
        assert_eq!(kb.as_deref(), b_id.host_key.as_ref().map(|(_, p)| p.trim()));
    }
    if caps.ssh {
        let (ea, eb) = (
            b.ssh_endpoint("a").await.unwrap(),
            b.ssh_endpoint("b").await,
        );
        if let (Some(ea), Ok(Some(eb))) = (ea, eb) {
            assert_ne!(ea, eb, "{name}: a clone has its own endpoint");
        }
    }
    if let (Some(g), Some(mid_a)) = (&guest, &a_machine_id) {
        assert_eq!(g.run("b", "hostname").await, "b");
        assert_eq!(
            g.run("b", "cat /home/agent/f").await,
            "one",
            "the image's data"
        );
        assert_eq!(g.run("b", "cat /home/agent/.boxery/token").await, "token-b");
        assert_ne!(
            &g.run("b", "cat /etc/machine-id").await,
            mid_a,
            "{name}: a clone gets a new machine-id"
        );
    }

    step(
        "reimage a from the image: the data is back, the identity kept; a missing image is Unchanged",
    );
    let mut keep = a_id.clone();
    keep.host_key = None; // the pinned key stays: same identity
    let mac = match &guest {
        Some(g) => Some(g.run("a", "cat /sys/class/net/eth0/address").await),
        None => None,
    };
    let e = b.reimage("a", "no-such-image", &keep).await.unwrap_err();
    assert!(
        matches!(e, BackendError::Unchanged(_)),
        "{name}: {}",
        e.chain()
    );
    assert_eq!(state(b, "a").await, PowerState::Running);
    b.reimage("a", "img", &keep)
        .await
        .unwrap_or_else(|e| panic!("{name}: reimage a: {}", e.chain()));
    let after = b.get("a").await.unwrap().unwrap();
    assert_eq!(
        after.state,
        PowerState::Running,
        "{name}: a reimage ends running"
    );
    assert_eq!(after.mark.as_deref(), Some("uid-a"));
    if caps.host_key {
        assert_eq!(
            b.host_key("a").await.unwrap().as_deref(),
            a_id.host_key.as_ref().map(|(_, p)| p.trim()),
            "{name}: a reimage keeps the host key"
        );
    }
    if let Some(g) = &guest {
        assert_eq!(g.run("a", "cat /home/agent/f").await, "one");
        assert_eq!(g.run("a", "hostname").await, "a");
        assert_eq!(
            Some(g.run("a", "cat /sys/class/net/eth0/address").await),
            mac,
            "{name}: a reimage keeps the MAC address"
        );
    }

    step("the image is deleted while b uses it: b keeps working (images are independent)");
    b.remove_image("img").await.unwrap();
    b.remove_image("img").await.unwrap();
    assert!(b.images().await.unwrap().iter().all(|i| i.name != "img"));
    b.stop("b").await.unwrap();
    assert_eq!(state(b, "b").await, PowerState::Stopped);
    b.stop("b").await.unwrap(); // a no-op
    assert_eq!(
        b.ssh_endpoint("b").await.unwrap(),
        None,
        "stopped: no endpoint"
    );
    b.start("b")
        .await
        .unwrap_or_else(|e| panic!("{name}: start b without its image: {}", e.chain()));
    assert_eq!(state(b, "b").await, PowerState::Running);
    b.start("b").await.unwrap(); // a no-op
    if let Some(g) = &guest {
        assert_eq!(g.run("b", "cat /home/agent/f").await, "one");
    }

    step("suspend and resume b where the backend claims it: the same boot, memory kept");
    if caps.suspend {
        let boot_id = match &guest {
            Some(g) => Some(g.run("b", "cat /proc/sys/kernel/random/boot_id").await),
            None => None,
        };
        b.suspend("b")
            .await
            .unwrap_or_else(|e| panic!("{name}: suspend b: {}", e.chain()));
        let info = b.get("b").await.unwrap().unwrap();
        assert_eq!(info.state, PowerState::Suspended, "{name}");
        assert_eq!(info.ssh, None, "{name}: suspended: no endpoint");
        let mem = info
            .memory
            .expect("a suspended VM reports its saved memory");
        assert!(mem.bytes > 0 && mem.stale.is_none(), "{name}: {mem:?}");
        b.suspend("b").await.unwrap(); // a no-op
        assert!(
            matches!(
                b.resize(
                    "b",
                    VmSize {
                        cpus: 2,
                        memory_mib: 256,
                        disk_gib: 1
                    }
                )
                .await,
                Err(BackendError::Invalid(_))
            ),
            "{name}: a suspended VM's size is held by its memory"
        );
        b.start("b")
            .await
            .unwrap_or_else(|e| panic!("{name}: resume b: {}", e.chain()));
        let info = b.get("b").await.unwrap().unwrap();
        assert_eq!(info.state, PowerState::Running, "{name}");
        assert_eq!(info.memory, None, "{name}: the state is gone once it runs");
        if let (Some(g), Some(boot_id)) = (&guest, boot_id) {
            assert_eq!(
                g.run("b", "cat /proc/sys/kernel/random/boot_id").await,
                boot_id,
                "{name}: resumed, not rebooted"
            );
        }
        // stop discards a suspended VM's memory
        b.suspend("b").await.unwrap();
        b.stop("b").await.unwrap();
        let info = b.get("b").await.unwrap().unwrap();
        assert_eq!(info.state, PowerState::Stopped, "{name}");
        assert_eq!(info.memory, None, "{name}");
        assert!(
            matches!(b.suspend("b").await, Err(BackendError::Invalid(_))),
            "{name}: a stopped VM has no memory to suspend"
        );
        b.start("b").await.unwrap();
    } else {
        assert!(
            matches!(b.suspend("b").await, Err(BackendError::Unsupported { .. })),
            "{name}: a backend that does not claim suspend refuses it"
        );
    }

    step("a memory snapshot of b and a revert to it, where the backend claims them");
    if caps.memory_snapshots {
        let before = match &guest {
            Some(g) => {
                g.run("b", "echo snap > /home/agent/m && sync").await;
                Some(g.run("b", "cat /proc/sys/kernel/random/boot_id").await)
            }
            None => None,
        };
        b.capture_memory("b", "b.mem", "uid-b-mem")
            .await
            .unwrap_or_else(|e| panic!("{name}: capture_memory b: {}", e.chain()));
        assert_eq!(
            state(b, "b").await,
            PowerState::Running,
            "{name}: b runs on"
        );
        let img = b
            .images()
            .await
            .unwrap()
            .into_iter()
            .find(|i| i.name == "b.mem");
        assert!(
            img.and_then(|i| i.memory_bytes).is_some_and(|m| m > 0),
            "{name}: the image carries memory"
        );
        if let Some(g) = &guest {
            g.run("b", "echo later > /home/agent/m && sync").await;
        }
        b.reimage_memory("b", "b.mem", &b_id)
            .await
            .unwrap_or_else(|e| panic!("{name}: reimage_memory b: {}", e.chain()));
        assert_eq!(state(b, "b").await, PowerState::Running, "{name}");
        if let (Some(g), Some(before)) = (&guest, before) {
            assert_eq!(g.run("b", "cat /home/agent/m").await, "snap", "{name}");
            assert_eq!(
                g.run("b", "cat /proc/sys/kernel/random/boot_id").await,
                before,
                "{name}: back running from the snapshot's instant, not booted"
            );
        }
        b.remove_image("b.mem").await.unwrap();
    } else {
        assert!(
            matches!(
                b.capture_memory("b", "b.mem", "uid-b-mem").await,
                Err(BackendError::Unsupported { .. })
            ),
            "{name}: a backend that does not claim memory snapshots refuses them"
        );
        assert!(b.images().await.unwrap().iter().all(|i| i.name != "b.mem"));
    }

    step("stop a; capture and resize it stopped: it stays stopped; it has no screen");
    b.stop("a").await.unwrap();
    assert_eq!(state(b, "a").await, PowerState::Stopped);
    if caps.screen {
        assert!(
            matches!(b.screendump("a").await, Err(BackendError::Invalid(_))),
            "{name}: a stopped VM has no screen"
        );
        assert!(
            matches!(
                b.send_input("a", &screen_support::keys("a")).await,
                Err(BackendError::Invalid(_))
            ),
            "{name}: a stopped VM takes no input"
        );
    }
    b.capture("a", "img2", "uid-img2")
        .await
        .unwrap_or_else(|e| panic!("{name}: capture of a stopped VM: {}", e.chain()));
    assert_eq!(state(b, "a").await, PowerState::Stopped);
    assert!(b.images().await.unwrap().iter().any(|i| i.name == "img2"));
    if caps.resize {
        let size = b.get("a").await.unwrap().unwrap().size;
        let more = VmSize {
            memory_mib: size.memory_mib + 64,
            ..size
        };
        b.resize("a", more).await.unwrap();
        let now = b.get("a").await.unwrap().unwrap();
        assert_eq!(
            now.state,
            PowerState::Stopped,
            "{name}: stopped before, after"
        );
        assert_eq!(now.size, more);
    }

    step("the recovery hooks on real leftovers: the image goes, the VM stays");
    b.recover_capture("b", "never-made", Some(PowerState::Running))
        .await
        .unwrap();
    assert_eq!(
        state(b, "b").await,
        PowerState::Running,
        "never removes the VM"
    );
    b.cleanup_image("img2").await.unwrap();
    b.cleanup_image("img2").await.unwrap();
    assert!(b.images().await.unwrap().iter().all(|i| i.name != "img2"));

    step("remove both: gone, and removing again succeeds");
    for vm in ["a", "b"] {
        b.remove(vm).await.unwrap();
        b.remove(vm).await.unwrap();
        assert!(b.get(vm).await.unwrap().is_none(), "{name}: {vm} removed");
    }
    assert_eq!(b.list().await.unwrap(), vec![]);
    let left: Vec<String> = b
        .images()
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.name)
        .collect();
    assert_eq!(left, ["stock"], "{name}: VMs' removal leaves images alone");
    step("done");
}

/// Each backend's fixture is one function making its `Subject`; one line runs the suite.
macro_rules! contract {
    ($name:ident, $feature:literal, $fixture:path) => {
        #[cfg(feature = $feature)]
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            contract($fixture().await).await;
        }
    };
    ($name:ident, $fixture:path) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            contract($fixture().await).await;
        }
    };
}

async fn fake() -> Subject {
    use boxery_backends::fake::{FakeBackend, FaultAction, FaultConfig, FaultRule};
    let tmp = tempfile::tempdir().unwrap();
    let backend = FakeBackend::new(tmp.path().join("fake"));
    backend.init().await.unwrap();
    // the fake's "unreachable" is its fault injection: the inventory steps fail as a daemon
    // that is not there would
    let blind = FakeBackend::new(tmp.path().join("blind"));
    blind.init().await.unwrap();
    blind
        .set_faults(&FaultConfig::rules([
            FaultRule::new("list", FaultAction::Unreachable),
            FaultRule::new("images", FaultAction::Unreachable),
        ]))
        .unwrap();
    Subject {
        backend: Arc::new(backend),
        unreachable: Arc::new(blind),
        stock: "tiny",
        _cleanup: Box::new(()),
        tmp,
    }
}

#[cfg(feature = "qemu")]
mod qemu_support;

#[cfg(feature = "qemu")]
async fn qemu() -> Subject {
    use boxery_backends::qemu::QemuBackend;
    let env = qemu_support::Env::new().await;
    let backend: Arc<dyn Backend> = Arc::new(env.backend.clone());
    // a state directory that is not there (not initialised, not mounted)
    let gone = env.tmp.path().join("not-mounted/qemu");
    let unreachable = Arc::new(QemuBackend::with_config(gone, env.backend.config().clone()));
    let tmp = tempfile::tempdir().unwrap();
    Subject {
        backend,
        unreachable,
        stock: "tiny",
        // dropping the env kills every QEMU under its state directory
        _cleanup: Box::new(env),
        tmp,
    }
}

#[cfg(feature = "libvirt")]
mod libvirt_support;

#[cfg(feature = "libvirt")]
async fn libvirt() -> Subject {
    use boxery_backends::libvirt::{LibvirtBackend, LibvirtConfig};
    struct Cleanup(LibvirtBackend, tempfile::TempDir);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            libvirt_support::clean(&self.0);
        }
    }
    libvirt_support::need_libvirtd();
    let dir = tempfile::Builder::new()
        .prefix("bxc")
        .tempdir_in("/tmp")
        .unwrap();
    let mut config = LibvirtConfig::from_env();
    config.powerdown_timeout = Duration::from_secs(20);
    let backend = LibvirtBackend::with_config(dir.path().join("libvirt"), config.clone());
    let cleanup = Cleanup(backend.clone(), dir);
    backend.init().await.expect("init: pool, filter, network");
    // libvirtd at a socket that is not there, and a state directory never initialised
    config.uri = format!(
        "qemu+unix:///system?socket={}/gone.sock",
        cleanup.1.path().display()
    );
    let unreachable = Arc::new(LibvirtBackend::with_config(
        cleanup.1.path().join("elsewhere"),
        config,
    ));
    Subject {
        backend: Arc::new(backend),
        unreachable,
        stock: "tiny",
        _cleanup: Box::new(cleanup),
        tmp: tempfile::tempdir().unwrap(),
    }
}

#[cfg(feature = "incus")]
mod incus_support;

#[cfg(feature = "incus")]
async fn incus() -> Subject {
    let home = incus_support::Home::new().await;
    Subject {
        backend: Arc::new(home.backend.clone()),
        unreachable: Arc::new(home.unreachable()),
        // a system container of the debian-12 guest (there is no tiny one)
        stock: "debian-12",
        _cleanup: Box::new(home),
        tmp: tempfile::tempdir().unwrap(),
    }
}

contract!(fake_backend, fake);
contract!(qemu_backend, "qemu", qemu);
contract!(libvirt_backend, "libvirt", libvirt);
contract!(incus_backend, "incus", incus);
