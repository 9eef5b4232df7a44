//! Benchmarks of the qemu backend against their limits, measured in the same run, with the
//! tiny guest under whatever accelerator the host has (TCG here: absolute times are TCG times).
//!
//! `cargo bench -p boxery-backends --features qemu --bench qemu` (env `RUNS`, default 3;
//! `WRITE_MIB`, default 1024: what the guest writes before the capture).
//!
//! | figure | limit beside it |
//! |---|---|
//! | backend create → first ssh command | raw QEMU with the same arguments → first ssh command |
//! | capture of a running VM with WRITE_MIB written since boot | a bare QMP `blockdev-snapshot-sync` |
//! | reimage (call, and → first ssh command) | the raw boot |
//! | create from that image (call, and → first ssh command) | the raw boot |
//! | 2 VMs from the image in parallel → both answer ssh | one create |
//! | QEMU RSS beyond guest RAM | guest RAM |

#[path = "../tests/qemu_support/mod.rs"]
mod qemu_support;

use std::time::{Duration, Instant};

use boxery_backends::qemu::process::{self, LaunchSpec};
use boxery_backends::qemu::qmp::Qmp;
use boxery_backends::storage::records::Boot;
use boxery_backends::storage::seed;
use boxery_backends::{Backend, identity};
use qemu_support::{Env, stats, wait_banner, wait_ssh};

const BOOT: Duration = Duration::from_secs(240);

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// Boot the tiny base with raw QEMU (the backend's own command line, no backend code around
/// it): launch → "SSH-" banner, and → first ssh command. Returns (banner, first command, RSS).
async fn raw_boot(env: &Env, run: usize, tb_size: Option<u32>) -> (f64, f64, (u64, u64)) {
    let l = env.backend.layout();
    let base_id = std::fs::read_dir(l.bases())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| n.starts_with("tiny-"))
        .unwrap();
    let base_dir = l.base_dir(&base_id);
    let rec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(l.base_record(&base_id)).unwrap()).unwrap();
    let dir = env.tmp.path().join(format!("raw{run}"));
    std::fs::create_dir_all(&dir).unwrap();
    let base = base_dir.join("disk.qcow2");
    let disk = dir.join("disk-1.qcow2");
    let st = std::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
        .arg(&base)
        .arg(&disk)
        .status()
        .unwrap();
    assert!(st.success());
    let id = identity::generate("raw", std::slice::from_ref(&env.public)).unwrap();
    seed::write_seed_iso(
        "genisoimage".as_ref(),
        "raw",
        "raw-1",
        &id,
        seed::Guest::Boxery,
        &dir.join(".seed"),
        &dir.join("seed.iso"),
    )
    .await
    .unwrap();
    let port = 21900 + run as u16;
    let kh = dir.join("known_hosts");
    std::fs::write(
        &kh,
        identity::known_hosts_line(&format!("[127.0.0.1]:{port}"), &id.host_key.unwrap().1) + "\n",
    )
    .unwrap();
    let spec = LaunchSpec {
        name: "raw".into(),
        dir: dir.clone(),
        uuid: uuid::Uuid::new_v4().to_string(),
        mac: "52:54:00:aa:bb:cc".into(),
        port,
        cpus: 1,
        memory_mib: 256,
        base,
        backing: vec![],
        disk,
        disk_node: "ov1".into(),
        seed: dir.join("seed.iso"),
        qmp: dir.join("qmp.sock"),
        qga: dir.join("qga.sock"),
        serial: dir.join("serial.log"),
        run_log: dir.join("qemu-run.log"),
        pidfile: dir.join("qemu.pid"),
        boot: Boot {
            kernel: Some(base_dir.join("vmlinuz")),
            initrd: Some(base_dir.join("initrd.img")),
            cmdline: rec["boot"]["cmdline"].as_str().map(String::from),
            machine: None,
            acpi_shutdown: true,
        },
        accel: env.backend.accel().accel,
        tcg_tb_size_mib: tb_size,
        sandbox: env.backend.config().sandbox,
        proxy: dir.join("proxy.sock"),
        socat: env.backend.config().socat.clone(),
        relay: env.backend.config().relay.clone(),
        // the limit: QEMU alone, its own slirp
        net: None,
        incoming: false,
        ram: None,
        frozen: false,
        screen: true,
    };
    let t = Instant::now();
    let st = tokio::process::Command::new("qemu-system-x86_64")
        .args(process::command_line(&spec))
        .arg("-daemonize")
        .arg("-pidfile")
        .arg(&spec.pidfile)
        .status()
        .await
        .unwrap();
    assert!(st.success());
    let pid = process::read_pid(&spec.pidfile).unwrap();
    let guard = scopeguard(pid, dir.clone());
    let banner = wait_banner(port, BOOT).await.unwrap();
    wait_ssh(&env.key, &kh, port, BOOT).await.unwrap();
    let first = t.elapsed();
    let rss = process::rss_split(pid, 256).unwrap_or((0, 0));
    drop(guard);
    (secs(banner), secs(first), rss)
}

/// Kills a raw QEMU when dropped.
struct Kill(i32, std::path::PathBuf);
impl Drop for Kill {
    fn drop(&mut self) {
        process::kill_now(self.0, &self.1);
    }
}
fn scopeguard(pid: i32, dir: std::path::PathBuf) -> Kill {
    Kill(pid, dir)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let runs: usize = std::env::var("RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let write_mib: u64 = std::env::var("WRITE_MIB")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1024);
    let env = Env::new().await;
    let b = &env.backend;
    println!("# qemu backend benchmarks ({})", b.accel().reason);
    println!(
        "loadavg before: {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    let t = Instant::now();
    env.tiny_image("tiny").await;
    println!(
        "build_image(tiny) (cached builder output + base registration): {:.2} s",
        secs(t.elapsed())
    );

    // 1. boot: raw QEMU vs the backend
    let (mut raw_banner, mut raw_first, mut raw_rss) = (vec![], vec![], vec![]);
    let (mut create_call, mut create_banner, mut create_first) = (vec![], vec![], vec![]);
    for run in 0..runs {
        let (bn, f, rss) = raw_boot(&env, run, b.config().tcg_tb_size_mib).await;
        raw_banner.push(bn);
        raw_first.push(f);
        raw_rss.push(rss);
        let name = format!("boot{run}");
        let vm = env.vm(&name, "tiny");
        let t = Instant::now();
        b.create(&vm).await.unwrap();
        create_call.push(secs(t.elapsed()));
        let port = env.port(&name).await;
        wait_banner(port, BOOT).await.unwrap();
        create_banner.push(secs(t.elapsed()));
        wait_ssh(&env.key, &b.layout().vm_known_hosts(&name), port, BOOT)
            .await
            .unwrap();
        create_first.push(secs(t.elapsed()));
        b.remove(&name).await.unwrap();
    }
    println!("\n## boot to first ssh command (tiny guest, 1 vCPU, 256 MiB)");
    println!("| | time |\n|---|---|");
    println!(
        "| raw QEMU: launch → sshd banner | {} |",
        stats(&raw_banner, " s")
    );
    println!(
        "| raw QEMU: launch → first ssh command (the limit) | {} |",
        stats(&raw_first, " s")
    );
    println!(
        "| backend create() returns (disk copy, seed, QEMU daemonized) | {} |",
        stats(&create_call, " s")
    );
    println!(
        "| backend create() → sshd banner | {} |",
        stats(&create_banner, " s")
    );
    println!(
        "| backend create() → first ssh command | {} |",
        stats(&create_first, " s")
    );
    let med = |v: &[f64]| {
        let mut s = v.to_vec();
        s.sort_by(|a, b| a.partial_cmp(b).unwrap());
        s[s.len() / 2]
    };
    let over = med(&create_first) - med(&raw_first);
    println!(
        "| overhead (medians) | {:+.3} s ({:+.1} %) |",
        over,
        100.0 * over / med(&raw_first)
    );

    // 2. capture of a running VM with WRITE_MIB written since boot
    let mut vm = env.vm("cap", "tiny");
    vm.disk_gib = 1 + write_mib.div_ceil(1024);
    b.create(&vm).await.unwrap();
    env.wait_ssh("cap", BOOT).await;
    let pid = b.pid("cap").unwrap();
    let rss_idle = process::rss_split(pid, 256).unwrap_or((0, 0));
    let t = Instant::now();
    env.run("cap", &format!("dd if=/dev/urandom of=/home/agent/blob bs=1M count={write_mib} 2>/dev/null && md5sum /home/agent/blob > /home/agent/blob.md5 && sync"))
        .await;
    println!(
        "\n## capture of a running VM after writing {write_mib} MiB in the guest (written in {:.1} s)",
        secs(t.elapsed())
    );
    let t = Instant::now();
    b.capture("cap", "cap.s1", "uid-cap-s1").await.unwrap();
    let capture = secs(t.elapsed());
    let t = Instant::now();
    b.wait_settled("cap", Duration::from_secs(600))
        .await
        .unwrap();
    let stream = secs(t.elapsed());
    // the floor: a bare snapshot-sync of the same VM, same data
    let l = b.layout();
    let generation: u64 = std::fs::read_dir(l.vm_dir("cap"))
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
        .max()
        .unwrap();
    let mut q = Qmp::connect(&l.vm_qmp("cap"), Duration::from_secs(10))
        .await
        .unwrap();
    let floor_file = l.vm_disk("cap", generation + 1);
    let t = Instant::now();
    q.blockdev_snapshot_sync(
        &format!("ov{generation}"),
        &floor_file,
        &format!("ov{}", generation + 1),
    )
    .await
    .unwrap();
    let floor = secs(t.elapsed());
    drop(q);
    b.wait_settled("cap", Duration::from_secs(600))
        .await
        .unwrap();
    let image_bytes = b
        .images()
        .await
        .unwrap()
        .iter()
        .find(|i| i.name == "cap.s1")
        .and_then(|i| i.size_bytes)
        .unwrap_or(0);
    println!("| | time |\n|---|---|");
    println!("| bare QMP blockdev-snapshot-sync (the floor) | {floor:.3} s |");
    println!("| backend capture() of the running VM | {capture:.3} s |");
    println!("| background stream until the VM is one overlay deep again | {stream:.2} s |");
    println!(
        "| image size on the host | {:.0} MiB |",
        image_bytes as f64 / (1 << 20) as f64
    );

    // 3. reimage, create from the image, 2 in parallel
    env.run("cap", "rm /home/agent/blob && sync").await;
    let t = Instant::now();
    b.reimage("cap", "cap.s1", &vm.identity).await.unwrap();
    let reimage_call = secs(t.elapsed());
    env.wait_ssh("cap", BOOT).await;
    let reimage_first = secs(t.elapsed());
    assert_eq!(
        env.run(
            "cap",
            "md5sum -c /home/agent/blob.md5 >/dev/null && echo ok"
        )
        .await,
        "ok"
    );
    let t = Instant::now();
    let mut from = env.vm("from", "cap.s1");
    from.disk_gib = vm.disk_gib;
    b.create(&from).await.unwrap();
    let from_call = secs(t.elapsed());
    env.wait_ssh("from", BOOT).await;
    let from_first = secs(t.elapsed());
    assert_eq!(
        env.run(
            "from",
            "md5sum -c /home/agent/blob.md5 >/dev/null && echo ok"
        )
        .await,
        "ok"
    );
    b.remove("from").await.unwrap();
    b.stop("cap").await.unwrap();
    let t = Instant::now();
    let (mut v1, mut v2) = (env.vm("f1", "cap.s1"), env.vm("f2", "cap.s1"));
    v1.disk_gib = vm.disk_gib;
    v2.disk_gib = vm.disk_gib;
    let (r1, r2) = tokio::join!(b.create(&v1), b.create(&v2));
    r1.unwrap();
    r2.unwrap();
    let (w1, w2) = tokio::join!(env.wait_ssh("f1", BOOT), env.wait_ssh("f2", BOOT));
    let _ = (w1, w2);
    let fork2 = secs(t.elapsed());
    println!("\n## images ({write_mib} MiB image)");
    println!("| | call returns | → first ssh command |\n|---|---|---|");
    println!("| reimage (revert) | {reimage_call:.2} s | {reimage_first:.2} s |");
    println!("| create from the image | {from_call:.2} s | {from_first:.2} s |");
    println!("| 2 VMs from the image in parallel (fork into 2) | | {fork2:.2} s |");

    // 4. memory
    let rss_f1 = b
        .pid("f1")
        .and_then(|p| process::rss_split(p, 256))
        .unwrap_or((0, 0));
    let (_, _, rss_default_tb) = raw_boot(&env, runs + 1, None).await;
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "\n## QEMU memory (guest RAM 256 MiB; RSS of the guest RAM mapping vs the rest of QEMU)"
    );
    println!("| | RSS | of it guest RAM | QEMU beyond guest RAM |\n|---|---|---|---|");
    let row = |what: &str, (total, guest): (u64, u64)| {
        println!(
            "| {what} | {:.0} MiB | {:.0} MiB | {:.0} MiB |",
            mib(total),
            mib(guest),
            mib(total - guest)
        );
    };
    row(
        &format!(
            "raw boot, TCG tb-size {:?} MiB (the backend's)",
            b.config().tcg_tb_size_mib
        ),
        raw_rss[0],
    );
    row("raw boot, TCG tb-size QEMU's default", rss_default_tb);
    row("backend VM, booted, idle", rss_idle);
    row(&format!("VM from a {write_mib} MiB image, booted"), rss_f1);
    for vm in ["f1", "f2", "cap"] {
        b.remove(vm).await.unwrap();
    }
    b.remove_image("cap.s1").await.unwrap();
    println!(
        "\nloadavg after: {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
}
