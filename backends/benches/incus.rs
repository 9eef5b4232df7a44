//! Benchmarks of the incus backend against Incus itself, measured in the same run: every
//! boxery figure beside the floor the same work costs through the `incus` client alone, on
//! the same image (the debian-12 container). The backend goes through the same `Backend` calls
//! and readiness check as the VM backends (`ssh_endpoint` + the pinned `host_key`, first ssh
//! command answered); the floor's readiness is the first `incus exec … true` that succeeds.
//!
//! `cargo bench -p boxery-backends --features incus --bench incus` (env `RUNS`, default 3).
//! Starts incusd by `scripts/incusd.sh start` when it does not answer; tears down every
//! instance, project, network and pool it made.
//!
//! | figure | boxery | floor (the incus client) |
//! |---|---|---|
//! | new | `create` from the image → first ssh command | `incus copy` + `incus start` → first `incus exec true` |
//! | snapshot | `capture` of the running VM | `incus snapshot create` + `incus copy` of it + `incus snapshot delete` |
//! | revert (a pool reset) | `reimage` to that image → first ssh command | `incus delete -f` + `incus copy` + `incus start` → first `incus exec true` |
//! | fork ×4 | four `create`s from the image at once → all answer ssh | four `incus copy` + `incus start` at once → all answer `incus exec true` |
//! | warm command | `ssh` over a live ControlMaster connection (what `boxery run` does) | `incus exec … true` |

#[path = "../tests/incus_support/mod.rs"]
mod incus_support;
#[path = "../tests/qemu_support/mod.rs"]
mod qemu_support;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use boxery_backends::incus::{IncusBackend, instance_name};
use boxery_backends::{Backend, DiskSource, NewVm, identity};
use qemu_support::stats;

const BOOT: Duration = Duration::from_secs(120);

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

fn ssh_args(dir: &Path, key: &Path, vm: &str, host_key: &str) -> Vec<String> {
    let kh = dir.join(format!("kh-{vm}"));
    std::fs::write(&kh, format!("{vm}.boxery {host_key}\n")).unwrap();
    let mut a: Vec<String> = [
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
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.push("-o".into());
    a.push(format!("UserKnownHostsFile={}", kh.display()));
    a.push("-o".into());
    a.push(format!("HostKeyAlias={vm}.boxery"));
    a.push("-i".into());
    a.push(key.display().to_string());
    a
}

/// Run `cmd` on `vm` once its endpoint and sshd answer (pinned host key); its stdout.
async fn run(b: &dyn Backend, dir: &Path, key: &Path, vm: &str, cmd: &str) -> String {
    let t = Instant::now();
    loop {
        if let Some(ep) = b.ssh_endpoint(vm).await.unwrap()
            && let Some(hk) = b.host_key(vm).await.unwrap()
        {
            let host = ep.rsplit_once(':').unwrap().0;
            let o = tokio::process::Command::new("ssh")
                .args(ssh_args(dir, key, vm, &hk))
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
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `incus ARGS` in project `project`; panics with its stderr when it fails.
async fn incus(project: &str, args: &[&str]) {
    let o = tokio::process::Command::new("incus")
        .arg("--project")
        .arg(project)
        .args(args)
        .output()
        .await
        .unwrap();
    assert!(
        o.status.success(),
        "incus {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// The first `incus exec INST -- true` that succeeds.
async fn exec_ready(project: &str, inst: &str) {
    let t = Instant::now();
    loop {
        let ok = tokio::process::Command::new("incus")
            .args(["--project", project, "exec", inst, "--", "true"])
            .output()
            .await
            .is_ok_and(|o| o.status.success());
        if ok {
            return;
        }
        assert!(t.elapsed() < BOOT, "{inst} did not run `true` in {BOOT:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[derive(Default)]
struct Figures {
    new: (Vec<f64>, Vec<f64>),
    snapshot: (Vec<f64>, Vec<f64>),
    revert: (Vec<f64>, Vec<f64>),
    fork4: (Vec<f64>, Vec<f64>),
    warm: (Vec<f64>, Vec<f64>),
}

/// One round: each figure through boxery, then its floor through the incus client.
async fn round(b: &IncusBackend, dir: &Path, key: &Path, public: &str, n: usize, f: &mut Figures) {
    let p = b.project().to_string();
    let ip = b.image_project().to_string();
    let tiny = instance_name("tiny");

    // new
    let vm = format!("n{n}");
    let t = Instant::now();
    b.create(&new_vm(&vm, "tiny", public)).await.unwrap();
    run(b, dir, key, &vm, "true").await;
    f.new.0.push(t.elapsed().as_secs_f64());
    let raw = format!("r{n}");
    let t = Instant::now();
    incus(&ip, &["copy", &tiny, &raw, "--target-project", &p]).await;
    incus(&p, &["start", &raw]).await;
    exec_ready(&p, &raw).await;
    f.new.1.push(t.elapsed().as_secs_f64());

    // warm command: 20 each, alternating
    let hk = b.host_key(&vm).await.unwrap().unwrap();
    let host = b.ssh_endpoint(&vm).await.unwrap().unwrap();
    let host = host.rsplit_once(':').unwrap().0.to_string();
    let mux = dir.join(format!("mux-{vm}"));
    let mut base = ssh_args(dir, key, &vm, &hk);
    base.extend([
        "-o".into(),
        "ControlMaster=auto".into(),
        "-o".into(),
        format!("ControlPath={}", mux.display()),
        "-o".into(),
        "ControlPersist=60".into(),
    ]);
    run(b, dir, key, &vm, "true").await;
    let _ = tokio::process::Command::new("ssh")
        .args(&base)
        .arg(format!("agent@{host}"))
        .arg("true")
        .output()
        .await;
    for _ in 0..20 {
        let t = Instant::now();
        let o = tokio::process::Command::new("ssh")
            .args(&base)
            .arg(format!("agent@{host}"))
            .arg("true")
            .output()
            .await
            .unwrap();
        assert!(o.status.success());
        f.warm.0.push(t.elapsed().as_secs_f64() * 1000.0);
        let t = Instant::now();
        incus(&p, &["exec", &raw, "--", "true"]).await;
        f.warm.1.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    let _ = tokio::process::Command::new("ssh")
        .args(&base)
        .args(["-O", "exit"])
        .arg(format!("agent@{host}"))
        .output()
        .await;

    // snapshot
    run(b, dir, key, &vm, "echo one > /home/agent/m && sync").await;
    let img = format!("s{n}");
    let t = Instant::now();
    b.capture(&vm, &img, &format!("uid-{img}")).await.unwrap();
    f.snapshot.0.push(t.elapsed().as_secs_f64());
    let t = Instant::now();
    incus(&p, &["snapshot", "create", &raw, "snap"]).await;
    incus(
        &p,
        &[
            "copy",
            &format!("{raw}/snap"),
            &format!("{raw}-img"),
            "--target-project",
            &ip,
        ],
    )
    .await;
    incus(&p, &["snapshot", "delete", &raw, "snap"]).await;
    f.snapshot.1.push(t.elapsed().as_secs_f64());

    // revert (a pool reset)
    run(b, dir, key, &vm, "echo two > /home/agent/m && sync").await;
    let mut same = new_vm(&vm, "tiny", public).identity;
    same.host_key = None;
    let t = Instant::now();
    b.reimage(&vm, &img, &same).await.unwrap();
    let back = run(b, dir, key, &vm, "cat /home/agent/m").await;
    f.revert.0.push(t.elapsed().as_secs_f64());
    assert_eq!(back, "one", "revert brought the captured file back");
    let t = Instant::now();
    incus(&p, &["delete", "-f", &raw]).await;
    incus(
        &ip,
        &["copy", &format!("{raw}-img"), &raw, "--target-project", &p],
    )
    .await;
    incus(&p, &["start", &raw]).await;
    exec_ready(&p, &raw).await;
    f.revert.1.push(t.elapsed().as_secs_f64());

    // fork ×4
    let forks: Vec<String> = (0..4).map(|i| format!("f{n}x{i}")).collect();
    let specs: Vec<NewVm> = forks.iter().map(|v| new_vm(v, &img, public)).collect();
    let t = Instant::now();
    let made = futures::future::join_all(specs.iter().map(|s| b.create(s))).await;
    for m in made {
        m.unwrap();
    }
    futures::future::join_all(forks.iter().map(|v| run(b, dir, key, v, "true"))).await;
    f.fork4.0.push(t.elapsed().as_secs_f64());
    let raws: Vec<String> = (0..4).map(|i| format!("g{n}x{i}")).collect();
    let t = Instant::now();
    futures::future::join_all(raws.iter().map(|r| {
        let (ip, p, src) = (ip.clone(), p.clone(), format!("{raw}-img"));
        async move {
            incus(&ip, &["copy", &src, r, "--target-project", &p]).await;
            incus(&p, &["start", r]).await;
            exec_ready(&p, r).await;
        }
    }))
    .await;
    f.fork4.1.push(t.elapsed().as_secs_f64());

    for v in std::iter::once(&vm).chain(&forks) {
        b.remove(v).await.unwrap();
    }
    b.remove_image(&img).await.unwrap();
    for r in std::iter::once(&raw).chain(&raws) {
        incus(&p, &["delete", "-f", r]).await;
    }
    incus(&ip, &["delete", "-f", &format!("{raw}-img")]).await;
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let runs: usize = std::env::var("RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let home = incus_support::Home::new().await;
    let b = home.backend.clone();
    let key = home.dir.path().join("id_ed25519");
    assert!(
        std::process::Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-C", "bench", "-f"])
            .arg(&key)
            .status()
            .unwrap()
            .success()
    );
    let public = std::fs::read_to_string(key.with_extension("pub"))
        .unwrap()
        .trim()
        .to_string();
    let p: boxery_backends::Progress = Arc::new(|_l: &str| {});
    let t = Instant::now();
    b.build_image(
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
    println!(
        "image tiny (the debian-12 container, from the builder's cache): {:.1} s",
        t.elapsed().as_secs_f64()
    );
    println!(
        "loadavg before: {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    let dir: PathBuf = home.dir.path().to_path_buf();
    let mut f = Figures::default();
    for n in 0..runs {
        round(&b, &dir, &key, &public, n, &mut f).await;
    }
    println!("\n## incus (system containers), debian-12 container, 1 CPU, 256 MiB, medians");
    println!("| | boxery | floor: the incus client | ratio |\n|---|---|---|---|");
    let row = |what: &str, (a, b): &(Vec<f64>, Vec<f64>), unit: &str| {
        let ratio = qemu_support::median(a) / qemu_support::median(b);
        println!(
            "| {what} | {} | {} | {ratio:.2}× |",
            stats(a, unit),
            stats(b, unit)
        );
    };
    row("new → first command", &f.new, " s");
    row("snapshot of a running VM", &f.snapshot, " s");
    row("revert / pool reset → first command", &f.revert, " s");
    row("fork ×4 → all answer", &f.fork4, " s");
    row("warm command (`true`)", &f.warm, " ms");
    println!(
        "\nloadavg after: {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    drop(home);
}
