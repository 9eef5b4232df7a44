//! Shared by the qemu tests and benchmarks: a state dir with a real qemu backend, the tiny
//! guest image, ssh with the pinned host key, and a guard that kills every QEMU it started.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use boxery_backends::qemu::config::QemuConfig;
use boxery_backends::qemu::{QemuBackend, process};
use boxery_backends::{Backend, DiskSource, NewVm, identity};

/// Fail (never skip) when QEMU is missing: the reason is the message.
pub fn need_qemu() {
    let ok = std::process::Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "qemu-system-x86_64 is not installed: these tests boot real VMs. Run scripts/install-deps.sh (Debian 12: qemu-system-x86 from bookworm-backports)"
    );
}

static NEXT_RANGE: AtomicU16 = AtomicU16::new(0);

/// A state dir, a backend on it and a client key; kills its QEMUs when dropped.
pub struct Env {
    /// Holds the state dir (removed on drop).
    pub tmp: tempfile::TempDir,
    /// The backend.
    pub backend: QemuBackend,
    /// The client's private key.
    pub key: PathBuf,
    /// Its public line.
    pub public: String,
}

impl Env {
    /// A fresh env. Each one gets its own 40-port range so parallel tests never race for a
    /// port between reserving and binding it.
    pub async fn new() -> Env {
        need_qemu();
        let tmp = tempfile::Builder::new()
            .prefix("bxq")
            .tempdir_in("/tmp")
            .unwrap();
        let mut config = QemuConfig::from_env();
        let slot = NEXT_RANGE.fetch_add(1, Ordering::SeqCst);
        let start = 23000 + (std::process::id() % 50) as u16 * 200 + (slot % 5) * 40;
        config.ports = start..=start + 39;
        config.powerdown_timeout = Duration::from_secs(20);
        let backend = QemuBackend::with_config(tmp.path().join("qemu"), config);
        backend.init().await.unwrap();
        let key = tmp.path().join("id_ed25519");
        let out = std::process::Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-C", "boxery-test", "-f"])
            .arg(&key)
            .output()
            .unwrap();
        assert!(out.status.success());
        let public = std::fs::read_to_string(key.with_extension("pub"))
            .unwrap()
            .trim()
            .to_string();
        Env {
            tmp,
            backend,
            key,
            public,
        }
    }

    /// The tiny guest as image `name` (built by image/build-tiny.sh; cached).
    pub async fn tiny_image(&self, name: &str) {
        let progress: boxery_backends::Progress = Arc::new(|_line: &str| {});
        self.backend
            .build_image(
                boxery_backends::Stock {
                    layers: &[],
                    name: "tiny",
                    image: name,
                    uid: &format!("uid-{name}"),
                },
                progress,
            )
            .await
            .unwrap_or_else(|e| panic!("building the tiny image failed: {e}"));
    }

    /// A request for VM `name` from `image`: 1 CPU, 256 MiB, 1 GiB, a fresh identity.
    pub fn vm(&self, name: &str, image: &str) -> NewVm {
        NewVm {
            name: name.into(),
            uid: format!("uid-{name}"),
            source: DiskSource::Image(image.into()),
            cpus: 1,
            memory_mib: 256,
            disk_gib: 1,
            start: true,
            identity: identity::generate(name, std::slice::from_ref(&self.public)).unwrap(),
            egress: boxery_api::network::EgressPolicy::Public,
            memory: false,
        }
    }

    /// The VM's ssh port.
    pub async fn port(&self, vm: &str) -> u16 {
        let ep = self
            .backend
            .ssh_endpoint(vm)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("VM {vm} has no endpoint"));
        ep.rsplit(':').next().unwrap().parse().unwrap()
    }

    /// `ssh agent@127.0.0.1 -p PORT CMD` with the pinned host key only.
    pub async fn ssh(&self, vm: &str, cmd: &str) -> Output {
        let port = self.port(vm).await;
        let kh = self.backend.layout().vm_known_hosts(vm);
        ssh_cmd(&self.key, &kh, port, cmd).await
    }

    /// Run CMD over ssh; its stdout, trimmed; panics with stderr on failure.
    pub async fn run(&self, vm: &str, cmd: &str) -> String {
        let out = self.ssh(vm, cmd).await;
        assert!(
            out.status.success(),
            "ssh {vm} `{cmd}` failed ({}): {}\nserial tail:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            process::tail(&self.backend.layout().vm_serial(vm), 15)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Wait until the guest answers an ssh command; returns how long it took.
    ///
    /// A QEMU that aborted with TCG's multi-thread race (an upstream QEMU 10.0 bug seen on
    /// 2-vCPU boots: docs/backends.md, "Known QEMU faults") is started again once, with a note;
    /// a QEMU that ended otherwise fails the test with what it said.
    pub async fn wait_ssh(&self, vm: &str, timeout: Duration) -> Duration {
        let t = Instant::now();
        let port = self.port(vm).await;
        let kh = self.backend.layout().vm_known_hosts(vm);
        let mut restarted = false;
        loop {
            let left = timeout.saturating_sub(t.elapsed());
            let attempt = wait_ssh(&self.key, &kh, port, left.min(Duration::from_secs(15))).await;
            let Err(e) = attempt else { break };
            let run_log = self.backend.layout().vm_run_log(vm);
            if self.backend.pid(vm).is_none() {
                let said = std::fs::read_to_string(&run_log).unwrap_or_default();
                if !restarted && said.contains(KNOWN_TCG_RACE) {
                    eprintln!(
                        "note: QEMU of {vm} aborted with the known TCG race; starting it again"
                    );
                    restarted = true;
                    self.backend.start(vm).await.unwrap();
                    continue;
                }
                panic!("the QEMU of {vm} ended while booting; it said: {said}");
            }
            if t.elapsed() >= timeout {
                panic!(
                    "{e}\nserial tail of {vm}:\n{}",
                    process::tail(&self.backend.layout().vm_serial(vm), 20)
                );
            }
        }
        t.elapsed()
    }

    /// Every QEMU under this env's state dir.
    pub fn qemu_pids(&self) -> Vec<i32> {
        let vms = self.backend.layout().vms();
        let Ok(entries) = std::fs::read_dir(&vms) else {
            return vec![];
        };
        entries
            .flatten()
            .filter_map(|e| process::running_pid(&e.path().join("qemu.pid"), &e.path()))
            .collect()
    }
}

/// QEMU 10.0's assertion when multi-threaded TCG races a memory-map update (upstream bug).
pub const KNOWN_TCG_RACE: &str = "iotlb_to_section: Assertion";

impl Drop for Env {
    fn drop(&mut self) {
        let vms = self.backend.layout().vms();
        if let Ok(entries) = std::fs::read_dir(&vms) {
            for e in entries.flatten() {
                if let Some(pid) = process::read_pid(&e.path().join("qemu.pid")) {
                    process::kill_now(pid, &e.path());
                }
            }
        }
    }
}

/// Wait for the "SSH-" banner on a port (slirp accepts connections before the guest listens).
pub async fn wait_banner(port: u16, timeout: Duration) -> Result<Duration, String> {
    use tokio::io::AsyncReadExt;
    let t = Instant::now();
    while t.elapsed() < timeout {
        if let Ok(Ok(mut s)) = tokio::time::timeout(
            Duration::from_secs(1),
            tokio::net::TcpStream::connect(("127.0.0.1", port)),
        )
        .await
        {
            let mut buf = [0u8; 4];
            if let Ok(Ok(n)) =
                tokio::time::timeout(Duration::from_secs(1), s.read_exact(&mut buf)).await
                && n == 4
                && &buf == b"SSH-"
            {
                return Ok(t.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(format!(
        "no ssh banner on 127.0.0.1:{port} within {timeout:?}"
    ))
}

/// ssh with only the pinned key in `known_hosts` trusted.
pub async fn ssh_cmd(key: &Path, known_hosts: &Path, port: u16, cmd: &str) -> Output {
    tokio::process::Command::new("ssh")
        .arg("-i")
        .arg(key)
        .args([
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=10",
        ])
        .args([
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            "GlobalKnownHostsFile=/dev/null",
            "-o",
            "LogLevel=ERROR",
        ])
        .arg("-o")
        .arg(format!("UserKnownHostsFile={}", known_hosts.display()))
        .args(["-p", &port.to_string(), "agent@127.0.0.1", cmd])
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .unwrap()
}

/// Wait for the banner, then for a first successful `true` over ssh.
pub async fn wait_ssh(
    key: &Path,
    known_hosts: &Path,
    port: u16,
    timeout: Duration,
) -> Result<(), String> {
    let t = Instant::now();
    wait_banner(port, timeout).await?;
    let mut last = String::new();
    while t.elapsed() < timeout {
        let out = ssh_cmd(key, known_hosts, port, "true").await;
        if out.status.success() {
            return Ok(());
        }
        last = String::from_utf8_lossy(&out.stderr).into_owned();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(format!(
        "ssh to 127.0.0.1:{port} did not succeed within {timeout:?}: {last}"
    ))
}

/// The median of `v` (a benchmark's runs).
pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    s[s.len() / 2]
}

/// `median M UNIT (min A, max B, n=N)`: a benchmark figure over its runs.
pub fn stats(v: &[f64], unit: &str) -> String {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    format!(
        "median {:.2}{unit} (min {:.2}, max {:.2}, n={})",
        s[s.len() / 2],
        s[0],
        s[s.len() - 1],
        s.len()
    )
}
