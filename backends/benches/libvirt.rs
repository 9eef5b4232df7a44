//! Benchmarks of the libvirt backend beside the qemu backend, measured in the same run, with
//! the tiny guest under whatever accelerator the host has (TCG here: absolute times are TCG
//! times). Both backends go through the same `Backend` calls and the same readiness check
//! (`ssh_endpoint` + the pinned `host_key`, first ssh command answered).
//!
//! `cargo bench -p boxery-backends --features libvirt --bench libvirt` (env `RUNS`, default 2).
//! Starts libvirtd by `scripts/libvirtd.sh start` when it does not answer; removes every VM,
//! image and pool it made.
//!
//! | figure | what |
//! |---|---|
//! | new | `create` from the stock image → first ssh command |
//! | snapshot | `capture` of the running VM (the call) |
//! | revert | `reimage` to that image → first ssh command, the captured file back |
//! | fork ×2 | two `create`s from the image in parallel → both answer ssh |

#[path = "../tests/qemu_support/mod.rs"]
mod qemu_support;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use boxery_backends::libvirt::{LibvirtBackend, LibvirtConfig};
use boxery_backends::{Backend, DiskSource, NewVm, identity};
use qemu_support::stats;

const BOOT: Duration = Duration::from_secs(240);
const URI: &str = "qemu:///system";

fn virsh(args: &[&str]) {
    let _ = std::process::Command::new("virsh")
        .args(["-q", "-c", URI])
        .args(args)
        .output();
}

/// The libvirt backend on a temp state dir; undefines its domains and pool when dropped.
struct LibvirtEnv {
    backend: LibvirtBackend,
}

impl Drop for LibvirtEnv {
    fn drop(&mut self) {
        let prefix = self.backend.domain_name("");
        let out = std::process::Command::new("virsh")
            .args(["-q", "-c", URI, "list", "--all", "--name"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
            .unwrap_or_default();
        for d in out
            .lines()
            .map(str::trim)
            .filter(|l| l.starts_with(&prefix))
        {
            virsh(&["destroy", d]);
            virsh(&["undefine", d]);
        }
        let pool = self.backend.pool_name();
        virsh(&["pool-destroy", &pool]);
        virsh(&["pool-undefine", &pool]);
        let _ = std::fs::remove_dir_all(self.backend.pool_dir());
    }
}

fn new_vm(name: &str, image: &str, public: &str) -> NewVm {
    NewVm {
        name: name.into(),
        uid: format!("uid-{name}"),
        source: DiskSource::Image(image.into()),
        cpus: 1,
        memory_mib: 256,
        disk_gib: 1,
        start: true,
        identity: identity::generate(name, &[public.to_string()]).unwrap(),
        egress: boxery_api::network::EgressPolicy::Public,
        memory: false,
    }
}

/// Run `cmd` on `vm` once its endpoint and sshd answer (pinned host key); its stdout.
async fn run(b: &dyn Backend, dir: &Path, key: &Path, vm: &str, cmd: &str) -> String {
    let t = Instant::now();
    loop {
        if let Some(ep) = b.ssh_endpoint(vm).await.unwrap()
            && let Some(hk) = b.host_key(vm).await.unwrap()
        {
            let (host, port) = ep.rsplit_once(':').unwrap();
            let kh = dir.join(format!("kh-{vm}"));
            std::fs::write(&kh, format!("{vm}.boxery {hk}\n")).unwrap();
            let o = tokio::process::Command::new("ssh")
                .args([
                    "-o",
                    "StrictHostKeyChecking=yes",
                    "-o",
                    "GlobalKnownHostsFile=/dev/null",
                    "-o",
                    "IdentitiesOnly=yes",
                    "-o",
                    "BatchMode=yes",
                    "-o",
                    "ConnectTimeout=3",
                    "-o",
                    "LogLevel=ERROR",
                ])
                .arg("-o")
                .arg(format!("UserKnownHostsFile={}", kh.display()))
                .arg("-o")
                .arg(format!("HostKeyAlias={vm}.boxery"))
                .arg("-i")
                .arg(key)
                .arg("-p")
                .arg(port)
                .arg(format!("agent@{host}"))
                .arg(cmd)
                .output()
                .await
                .unwrap();
            if o.status.success() {
                return String::from_utf8_lossy(&o.stdout).trim().to_string();
            }
        }
        assert!(
            t.elapsed() < BOOT,
            "{vm} did not answer `{cmd}` in {BOOT:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[derive(Default)]
struct Figures {
    new: Vec<f64>,
    snapshot: Vec<f64>,
    revert: Vec<f64>,
    fork2: Vec<f64>,
}

/// One round on `b`: new, snapshot, revert, fork ×2; everything removed afterwards.
async fn round(b: &dyn Backend, dir: &Path, key: &Path, public: &str, n: usize, f: &mut Figures) {
    let (vm, img) = (format!("n{n}"), format!("s{n}"));
    let spec = new_vm(&vm, "tiny", public);
    let t = Instant::now();
    b.create(&spec).await.unwrap();
    run(b, dir, key, &vm, "true").await;
    f.new.push(t.elapsed().as_secs_f64());

    run(b, dir, key, &vm, "echo one > /home/agent/m && sync").await;
    let t = Instant::now();
    b.capture(&vm, &img, &format!("uid-{img}")).await.unwrap();
    f.snapshot.push(t.elapsed().as_secs_f64());

    run(b, dir, key, &vm, "echo two > /home/agent/m && sync").await;
    let mut same = spec.identity.clone();
    same.host_key = None; // keep the pinned key
    let t = Instant::now();
    b.reimage(&vm, &img, &same).await.unwrap();
    let back = run(b, dir, key, &vm, "cat /home/agent/m").await;
    f.revert.push(t.elapsed().as_secs_f64());
    assert_eq!(back, "one", "revert brought the captured file back");

    let (a, c) = (format!("a{n}"), format!("c{n}"));
    let (va, vc) = (new_vm(&a, &img, public), new_vm(&c, &img, public));
    let t = Instant::now();
    let (ra, rc) = tokio::join!(b.create(&va), b.create(&vc));
    ra.unwrap();
    rc.unwrap();
    tokio::join!(run(b, dir, key, &a, "true"), run(b, dir, key, &c, "true"));
    f.fork2.push(t.elapsed().as_secs_f64());

    for v in [&vm, &a, &c] {
        b.remove(v).await.unwrap();
    }
    b.remove_image(&img).await.unwrap();
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let runs: usize = std::env::var("RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let st = std::process::Command::new("bash")
        .arg(repo.join("scripts/libvirtd.sh"))
        .arg("start")
        .status()
        .unwrap();
    assert!(st.success(), "scripts/libvirtd.sh start failed");
    println!(
        "loadavg before: {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );

    // qemu backend (the shared test env: its own state dir, key, tiny image)
    let q = qemu_support::Env::new().await;
    q.tiny_image("tiny").await;
    let qdir = q.tmp.path().to_path_buf();
    let mut qf = Figures::default();

    // libvirt backend
    let tmp = tempfile::Builder::new()
        .prefix("bxlb")
        .tempdir_in("/tmp")
        .unwrap();
    let mut cfg = LibvirtConfig::from_env();
    cfg.powerdown_timeout = Duration::from_secs(20);
    let kind = cfg.kind;
    let l = LibvirtEnv {
        backend: LibvirtBackend::with_config(tmp.path().join("libvirt"), cfg),
    };
    l.backend.init().await.unwrap();
    let p: boxery_backends::Progress = Arc::new(|_l: &str| {});
    l.backend
        .build_image(
            boxery_backends::Stock {
                layers: &[],
                name: "tiny",
                image: "tiny",
                uid: "uid-tiny",
            },
            p,
        )
        .await
        .unwrap();
    let mut lf = Figures::default();

    // alternate the backends run by run, so both see the same host load
    for n in 0..runs {
        round(&q.backend, &qdir, &q.key, &q.public, n, &mut qf).await;
        round(&l.backend, tmp.path(), &q.key, &q.public, n, &mut lf).await;
    }

    println!("\n## libvirt (domain type {kind}) beside qemu, tiny guest, 1 vCPU, 256 MiB, medians");
    println!("| | qemu | libvirt |\n|---|---|---|");
    println!(
        "| new → first ssh command | {} | {} |",
        stats(&qf.new, " s"),
        stats(&lf.new, " s")
    );
    println!(
        "| snapshot (capture of a running VM) | {} | {} |",
        stats(&qf.snapshot, " s"),
        stats(&lf.snapshot, " s")
    );
    println!(
        "| revert (reimage → first ssh command) | {} | {} |",
        stats(&qf.revert, " s"),
        stats(&lf.revert, " s")
    );
    println!(
        "| fork ×2 (2 from the image in parallel → both answer) | {} | {} |",
        stats(&qf.fork2, " s"),
        stats(&lf.fork2, " s")
    );
    println!(
        "\nloadavg after: {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
}
