//! End to end with real VMs: the `boxery` binary on the `qemu` backend, guests under TCG.
//!
//! apply a Vm (the small `tiny` guest) → Ready → `run` → write a file → `snap` → change it →
//! `revert` → the file is back → `fork` into two → both reachable with their own hostname,
//! machine-id, MAC and host key → `stop`/`start` → `resize` → `cp` both ways → delete → no
//! QEMU process, disk, image, port or pidfile left. Crashes: `serve` SIGKILLed during a create
//! and during a capture of a running VM converges with nothing leaked. And one run of the full
//! `debian-12` guest. These tests fail (never pass) when QEMU is missing.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::Home;

fn require_qemu() {
    let ok = std::process::Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "qemu-system-x86_64 is not installed: run scripts/install-deps.sh (as root); real-VM tests cannot run without it"
    );
}

/// A home on the qemu backend whose QEMU processes are killed (by their pidfiles) on drop.
struct QemuHome {
    home: Home,
}

impl QemuHome {
    fn new() -> Self {
        require_qemu();
        QemuHome { home: Home::new() }
    }
    fn cmd(&self, args: &[&str]) -> std::process::Output {
        let mut c = self.home.cmd();
        c.env("BOXERY_BACKEND", "qemu").args(args);
        c.output().expect("run boxery")
    }
    fn ok(&self, args: &[&str]) -> String {
        let o = self.cmd(args);
        assert!(
            o.status.success(),
            "boxery {args:?} failed ({:?}):\nstdout: {}\nstderr: {}",
            o.status.code(),
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }
    fn run(&self, vm: &str, cmd: &str) -> String {
        self.ok(&["run", vm, "--", cmd]).trim().to_string()
    }
    fn qemu_dir(&self) -> PathBuf {
        self.home.path().join("qemu")
    }
    /// PIDs of live QEMU processes this home started.
    fn live_qemus(&self) -> Vec<u32> {
        let mut out = Vec::new();
        let Ok(vms) = std::fs::read_dir(self.qemu_dir().join("vms")) else {
            return out;
        };
        for vm in vms.flatten() {
            if let Some(pid) = std::fs::read_to_string(vm.path().join("qemu.pid"))
                .ok()
                .and_then(|s| s.trim().parse::<u32>().ok())
                && Path::new(&format!("/proc/{pid}")).exists()
            {
                out.push(pid);
            }
        }
        out
    }
    fn vm_json(&self, vm: &str) -> serde_json::Value {
        serde_json::from_str(&self.ok(&["get", "vm", vm, "-o", "json"])).unwrap()
    }
    fn serve(&self) -> common::Serve {
        // The serve helper sets BOXERY_BACKEND=fake; use the CLI env instead.
        let log = self.home.path().join("serve.log");
        let logf = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let child = self
            .home
            .cmd()
            .env("BOXERY_BACKEND", "qemu")
            .args(["serve", "--inventory-every", "2s", "--lease", "2s"])
            .stdout(logf.try_clone().unwrap())
            .stderr(logf)
            .spawn()
            .unwrap();
        common::Serve::from_child(child, log)
    }
}

impl Drop for QemuHome {
    fn drop(&mut self) {
        for pid in self.live_qemus() {
            let _ = std::process::Command::new("kill")
                .arg("-9")
                .arg(pid.to_string())
                .status();
        }
    }
}

fn tiny_vm(name: &str) -> String {
    format!(
        "apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata:\n  name: {name}\nspec:\n  source:\n    image: tiny\n  resources:\n    cpus: 1\n    memory: 256Mi\n    disk: 1Gi\n"
    )
}

#[test]
fn lifecycle_with_real_vms() {
    let h = QemuHome::new();
    let f = h.home.write("vm.yaml", &tiny_vm("t1"));
    h.ok(&[
        "apply",
        "-f",
        f.to_str().unwrap(),
        "--wait",
        "--timeout",
        "10m",
    ]);
    let v = h.vm_json("t1");
    assert!(
        v["status"]["ssh"]["hostKey"]
            .as_str()
            .unwrap()
            .starts_with("ssh-ed25519 "),
        "{v}"
    );
    assert_eq!(h.run("t1", "hostname"), "t1");
    // Exit codes come back; output streams.
    assert_eq!(h.cmd(&["run", "t1", "--", "exit 7"]).status.code(), Some(7));

    // snapshot → change → revert → the file is back
    h.run("t1", "echo before > ~/f && sync");
    h.ok(&["snap", "t1", "s1", "--wait", "--timeout", "2m"]);
    h.run("t1", "echo after > ~/f && sync");
    h.ok(&["revert", "t1", "s1", "--wait", "--timeout", "5m"]);
    assert_eq!(h.run("t1", "cat ~/f"), "before");

    // fork into two: both reachable, each with its own identity
    h.run("t1", "echo forked > ~/f && sync");
    h.ok(&["fork", "t1", "t2", "t3", "--wait", "--timeout", "10m"]);
    let mut seen = std::collections::BTreeSet::new();
    for n in ["t1", "t2", "t3"] {
        let id = h.run(
            n,
            "hostname; cat /etc/machine-id; cat /sys/class/net/eth0/address",
        );
        assert!(seen.insert(id.clone()), "{n} shares an identity: {id}");
        if n != "t1" {
            assert_eq!(h.run(n, "cat ~/f"), "forked", "{n} has the source's disk");
            assert!(id.starts_with(n), "{n}: {id}");
        }
    }
    let keys: std::collections::BTreeSet<String> = ["t1", "t2", "t3"]
        .iter()
        .map(|n| {
            h.vm_json(n)["status"]["ssh"]["hostKey"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(keys.len(), 3, "every VM has its own host key");

    // cp both ways
    let local = h.home.write("payload.txt", "hello from the host\n");
    h.ok(&["cp", local.to_str().unwrap(), "t2:/home/agent/in.txt"]);
    assert_eq!(h.run("t2", "cat /home/agent/in.txt"), "hello from the host");
    let back = h.home.path().join("back.txt");
    h.ok(&["cp", "t2:/home/agent/in.txt", back.to_str().unwrap()]);
    assert_eq!(
        std::fs::read_to_string(&back).unwrap(),
        "hello from the host\n"
    );

    // stop / start / resize while stopped
    h.ok(&["stop", "t3", "--wait", "--timeout", "2m"]);
    assert_eq!(
        h.cmd(&["run", "t3", "--", "true"]).status.code(),
        Some(5),
        "a stopped VM is refused with a clear error"
    );
    h.ok(&[
        "resize",
        "t3",
        "--memory",
        "320Mi",
        "--disk",
        "2Gi",
        "--wait",
        "--timeout",
        "2m",
    ]);
    h.ok(&["start", "t3", "--wait", "--timeout", "5m"]);
    let mem_kib: u64 = h
        .run("t3", "awk '/MemTotal/{print $2}' /proc/meminfo")
        .parse()
        .unwrap();
    assert!(mem_kib > 256 * 1024, "memory grew: {mem_kib} KiB");

    // delete everything: nothing left
    h.ok(&["rm", "t1", "t2", "t3", "--wait", "--timeout", "3m"]);
    h.ok(&["delete", "image", "tiny", "--wait", "--timeout", "1m"]);
    assert!(
        h.live_qemus().is_empty(),
        "QEMU processes left: {:?}",
        h.live_qemus()
    );
    let leftovers: Vec<String> = ["vms", "images", "ports"]
        .iter()
        .flat_map(|d| {
            std::fs::read_dir(h.qemu_dir().join(d))
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path().display().to_string())
        })
        .collect();
    assert!(leftovers.is_empty(), "left behind: {leftovers:?}");
}

#[test]
fn crash_during_create_and_capture_with_real_vms() {
    let h = QemuHome::new();
    let mut serve = h.serve();
    let f = h.home.write("a.yaml", &tiny_vm("c1"));
    h.ok(&["apply", "-f", f.to_str().unwrap()]);
    h.ok(&["wait", "vm", "c1", "--for=condition=Ready", "--timeout=10m"]);
    // Kill during a create: as soon as the Create operation is recorded.
    let f = h.home.write("b.yaml", &tiny_vm("c2"));
    h.ok(&["apply", "-f", f.to_str().unwrap()]);
    common::eventually(Duration::from_secs(60), || {
        (h.vm_json("c2")["status"]["operation"]["type"] == "Create").then_some(())
    })
    .expect("the create started");
    std::thread::sleep(Duration::from_millis(300));
    serve.kill();
    serve = h.serve();
    // Kill during a capture of the running c1.
    h.run("c1", "head -c 33554432 /dev/urandom > ~/blob && sync");
    h.ok(&["snap", "c1", "s1"]);
    common::eventually(Duration::from_secs(60), || {
        let img: serde_json::Value =
            serde_json::from_str(&h.ok(&["get", "image", "c1.s1", "-o", "json"])).unwrap();
        (img["status"]["operation"]["type"] == "Capture" || img["status"]["phase"] == "Ready")
            .then_some(())
    })
    .expect("the capture started");
    serve.kill();
    let _serve = h.serve();
    h.ok(&["wait", "vm", "c2", "--for=condition=Ready", "--timeout=10m"]);
    h.ok(&[
        "wait",
        "image",
        "c1.s1",
        "--for=condition=Ready",
        "--timeout=5m",
    ]);
    h.ok(&["wait", "vm", "c1", "--for=condition=Ready", "--timeout=5m"]);
    assert_eq!(h.run("c1", "ls ~/blob"), "/home/agent/blob");
    // One QEMU per VM, no more.
    assert_eq!(h.live_qemus().len(), 2, "one QEMU per VM");
    h.ok(&["rm", "c1", "c2", "--wait", "--timeout", "3m"]);
    assert!(h.live_qemus().is_empty());
}

#[test]
fn full_debian_guest() {
    let h = QemuHome::new();
    let f = h.home.write(
        "vm.yaml",
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests/examples/vm.yaml"),
        )
        .unwrap(),
    );
    h.ok(&[
        "apply",
        "-f",
        f.to_str().unwrap(),
        "--wait",
        "--timeout",
        "20m",
    ]);
    let out = h.run(
        "dev1",
        "uname -a; id -un; cat /etc/boxery/build-info; sudo -n true && echo sudo-ok",
    );
    assert!(
        out.contains("Linux dev1")
            && out.contains("agent")
            && out.contains("layers=")
            && out.contains("sudo-ok"),
        "{out}"
    );
    h.ok(&["rm", "dev1", "--wait", "--timeout", "3m"]);
    assert!(h.live_qemus().is_empty());
}

/// ssh to `vm` with exactly one key (not the control plane's): does the guest accept it?
fn ssh_with_key(h: &QemuHome, vm: &str, key: &Path) -> bool {
    let v = h.vm_json(vm);
    let endpoint = v["status"]["ssh"]["endpoint"].as_str().unwrap().to_string();
    let (host, port) = endpoint.rsplit_once(':').unwrap();
    std::process::Command::new("ssh")
        .args([
            "-F",
            "/dev/null",
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "ControlMaster=no",
            "-o",
            "ControlPath=none",
        ])
        .arg("-o")
        .arg(format!(
            "UserKnownHostsFile={}",
            h.home.path().join("ssh/known_hosts").display()
        ))
        .arg("-o")
        .arg(format!("HostKeyAlias={vm}.boxery"))
        .arg("-i")
        .arg(key)
        .args(["-p", port, &format!("agent@{host}"), "true"])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn pool_leases_with_real_vms() {
    let h = QemuHome::new();
    let _serve = h.serve();
    let f = h.home.write(
        "pool.yaml",
        "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {name: rp}\nspec:\n  replicas: 1\n  template:\n    spec:\n      source: {image: tiny}\n      resources: {cpus: 1, memory: 256Mi, disk: 1Gi}\n",
    );
    h.ok(&["apply", "-f", f.to_str().unwrap()]);
    h.ok(&[
        "wait",
        "pool",
        "rp",
        "--for=condition=Ready",
        "--timeout=10m",
    ]);
    // Alice leases the only member: her key works, and `boxery run` uses it.
    h.ok(&[
        "lease",
        "acquire",
        "rp",
        "--holder",
        "alice",
        "--name",
        "la",
        "--wait",
        "--timeout",
        "5m",
    ]);
    let alice_key = h.home.path().join("leases/la/id_ed25519");
    let alice_copy = h.home.path().join("alice_key");
    std::fs::copy(&alice_key, &alice_copy).unwrap();
    assert!(
        ssh_with_key(&h, "rp-0", &alice_copy),
        "the holder's key works"
    );
    h.run("rp-0", "echo secret > ~/during-lease && sync");
    let token = h.run("rp-0", "cat ~/.boxery/token");
    assert!(
        boxery_reconcilers::lease::token_valid(h.home.path(), "rp-0", &token),
        "the lease's token is live"
    );
    // Release: the VM is reset; Bob gets it; Alice's key and token are dead, her files gone.
    h.ok(&["lease", "release", "la", "--wait"]);
    h.ok(&[
        "lease",
        "acquire",
        "rp",
        "--holder",
        "bob",
        "--name",
        "lb",
        "--wait",
        "--timeout",
        "5m",
    ]);
    let bob_key = h.home.path().join("leases/lb/id_ed25519");
    assert!(
        ssh_with_key(&h, "rp-0", &bob_key),
        "the new holder's key works"
    );
    assert!(
        !ssh_with_key(&h, "rp-0", &alice_copy),
        "the previous holder's key no longer works"
    );
    assert!(
        !boxery_reconcilers::lease::token_valid(h.home.path(), "rp-0", &token),
        "the old token is revoked"
    );
    assert_eq!(
        h.run("rp-0", "ls ~/during-lease 2>/dev/null || echo gone"),
        "gone",
        "files written during the lease are gone"
    );
    h.ok(&["lease", "release", "lb", "--wait"]);
    h.ok(&["delete", "pool", "rp", "--wait", "--timeout", "3m"]);
}
