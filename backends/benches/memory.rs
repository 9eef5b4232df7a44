//! Suspend and resume on the qemu backend against a cold boot of the same VM, measured in
//! the same run (docs/live-memory.md; the tiny guest under TCG here).
//!
//! `cargo bench -p boxery-backends --features qemu --bench memory` (env `RUNS`, default 3;
//! `MEMORY_MIB`, default 1024: the guest's memory; `TOUCH_MIB`, default 256: what the guest
//! fills with random bytes before the suspend, in its `/tmp`; `IMAGE`, `tiny` (default) or
//! `debian-12`: the stock image, built or taken from the image cache).
//!
//! | figure | limit beside it |
//! |---|---|
//! | resume → first ssh command | cold boot (start of the stopped VM) → first ssh command |
//! | suspend of a MEMORY_MIB guest with TOUCH_MIB touched, s per GiB touched | target 4 s/GiB |
//! | saved state on disk | the touched memory |
//! | reset by memory: `reimage_memory` from a memory snapshot → first ssh command | reset by reboot: `reimage` from the same image → first ssh command (a pool member's two kinds of reset) |
//! | fork ×4: `capture_memory` of the running VM, then four new VMs started from that memory (`NewVm::memory`, created concurrently) → all four answer an ssh command | cold boot; target ≤ 2 s |
//! | the source's pause in the fork (`capture_memory`) | — |
//! | private memory of each child's QEMU (`/proc/PID/smaps_rollup`), split into guest RAM, TCG code buffer and the rest (`/proc/PID/smaps`) | target ≤ 64 MiB per child; the source's own QEMU |

#[path = "../tests/qemu_support/mod.rs"]
mod qemu_support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use boxery_backends::Backend;
use qemu_support::{Env, median, stats};

const BOOT: Duration = Duration::from_secs(480);
/// How many VMs the fork starts from one memory image (issue 32: "fork ×4").
const CHILDREN: usize = 4;
/// How long a child started from memory gets to answer ssh.
const FORK_SSH: Duration = Duration::from_secs(120);

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let runs = env_u64("RUNS", 3) as usize;
    let memory_mib = env_u64("MEMORY_MIB", 1024);
    let touch_mib = env_u64("TOUCH_MIB", 256);
    let image = std::env::var("IMAGE").unwrap_or_else(|_| "tiny".into());
    let env = Arc::new(Env::new().await);
    let progress: boxery_backends::Progress = std::sync::Arc::new(|_line: &str| {});
    env.backend
        .build_image(
            boxery_backends::Stock {
                layers: &[],
                name: &image,
                image: &image,
                uid: "uid-bench",
            },
            progress,
        )
        .await
        .unwrap_or_else(|e| panic!("building {image}: {}", e.chain()));
    let (mut cold, mut resume, mut suspend, mut per_gib, mut state_mib) =
        (vec![], vec![], vec![], vec![], vec![]);
    let (mut snapshot, mut reset_disk, mut reset_memory) = (vec![], vec![], vec![]);
    let (mut fork_pause, mut fork_all, mut fork_each, mut fork_load) =
        (vec![], vec![], vec![], vec![]);
    let (mut child_mem, mut source_mem) = (Mem::default(), Mem::default());
    for run in 0..runs {
        let name = format!("b{run}");
        let mut req = env.vm(&name, &image);
        req.memory_mib = memory_mib;
        req.disk_gib = if image == "tiny" { 1 } else { 4 };
        env.backend.create(&req).await.unwrap();
        env.wait_ssh(&name, BOOT).await;
        // the limit: a cold boot of the same VM (stopped, then started → first command)
        env.backend.stop(&name).await.unwrap();
        let t = Instant::now();
        env.backend.start(&name).await.unwrap();
        env.wait_ssh(&name, BOOT).await;
        cold.push(t.elapsed().as_secs_f64());
        // touch memory: random bytes (zero pages are not saved) in the RAM-backed root
        env.run(
            &name,
            &format!(
                "dd if=/dev/urandom of=/tmp/fill bs=1048576 count={touch_mib} 2>/dev/null && echo ok"
            ),
        )
        .await;
        let t = Instant::now();
        env.backend.suspend(&name).await.unwrap();
        let s = t.elapsed().as_secs_f64();
        suspend.push(s);
        per_gib.push(s / (touch_mib as f64 / 1024.0));
        let info = env.backend.get(&name).await.unwrap().unwrap();
        state_mib.push(info.memory.unwrap().bytes as f64 / (1 << 20) as f64);
        let t = Instant::now();
        env.backend.start(&name).await.unwrap();
        env.wait_ssh(&name, Duration::from_secs(60)).await;
        resume.push(t.elapsed().as_secs_f64());
        fork(&env, &req, run, &mut source_mem, &mut child_mem)
            .await
            .record(
                &mut fork_pause,
                &mut fork_all,
                &mut fork_each,
                &mut fork_load,
            );
        // a pool member's reset, both ways, from one memory snapshot
        let snap = format!("{name}.clean");
        let t = Instant::now();
        env.backend
            .capture_memory(&name, &snap, &format!("uid-{snap}"))
            .await
            .unwrap();
        snapshot.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        env.backend
            .reimage(&name, &snap, &req.identity)
            .await
            .unwrap();
        env.wait_ssh(&name, BOOT).await;
        reset_disk.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        env.backend
            .reimage_memory(&name, &snap, &req.identity)
            .await
            .unwrap();
        env.wait_ssh(&name, Duration::from_secs(60)).await;
        reset_memory.push(t.elapsed().as_secs_f64());
        env.backend.remove(&name).await.unwrap();
        env.backend.remove_image(&snap).await.unwrap();
    }
    let ratio = median(&cold) / median(&resume);
    println!(
        "# suspend/resume, {image} guest, {memory_mib} MiB, {touch_mib} MiB touched, {:?}",
        env.backend.accel().accel
    );
    println!("| figure | seconds |\n|---|---|");
    println!(
        "| cold boot → first ssh command (the limit) | {} |",
        stats(&cold, " s")
    );
    println!("| resume → first ssh command | {} |", stats(&resume, " s"));
    println!("| suspend | {} |", stats(&suspend, " s"));
    println!("| suspend per GiB touched | {} |", stats(&per_gib, " s"));
    println!(
        "| saved state (MiB on disk) | {} |",
        stats(&state_mib, " MiB")
    );
    println!(
        "| memory snapshot (guest paused, disk + memory) | {} |",
        stats(&snapshot, " s")
    );
    println!(
        "| reset by reboot: reimage → first ssh command (the limit) | {} |",
        stats(&reset_disk, " s")
    );
    println!(
        "| reset by memory: reimage_memory → first ssh command | {} |",
        stats(&reset_memory, " s")
    );
    let cold_m = median(&cold);
    println!(
        "| fork ×{CHILDREN}: capture_memory → all {CHILDREN} children answer an ssh command | {} ({:.2}× a cold boot) |",
        stats(&fork_all, " s"),
        median(&fork_all) / cold_m
    );
    println!(
        "| fork: the source's pause (capture_memory) | {} |",
        stats(&fork_pause, " s")
    );
    println!(
        "| fork: one child, create → it answers (each of {CHILDREN}, concurrent) | {} |",
        stats(&fork_each, " s")
    );
    println!(
        "| fork: one child, create → create returned (memory loaded, guest running) | {} |",
        stats(&fork_load, " s")
    );
    println!(
        "\n| QEMU process memory (MiB) | Private (Clean+Dirty) | Rss | Pss | private guest RAM | private TCG code buffer | private other |\n|---|---|---|---|---|---|---|"
    );
    child_mem.print(&format!("fork child (n={})", child_mem.private.len()));
    source_mem.print("source (resumed from its own memory) before the fork");
    println!(
        "fork ×{CHILDREN} → all answer: {:.2} s, {:.2}× a cold boot (target ≤ 2 s); private memory per child {:.0} MiB (target ≤ 64 MiB), of which guest RAM {:.0} MiB",
        median(&fork_all),
        median(&fork_all) / cold_m,
        median(&child_mem.private),
        median(&child_mem.ram),
    );
    println!(
        "resume is {ratio:.1}× faster than a cold boot (target ≥ 20×, ≤ 1 s); suspend {:.2} s/GiB touched (target ≤ 4); a reset by memory is {:.1}× faster than by reboot (target ≤ 1.5 s)",
        median(&per_gib),
        median(&reset_disk) / median(&reset_memory)
    );
}

/// One fork's times, in seconds.
struct Fork {
    pause: f64,
    all: f64,
    /// Per child: create → it answers.
    each: Vec<f64>,
    /// Per child: create → create returned (the guest runs: its memory is loaded).
    load: Vec<f64>,
}

impl Fork {
    fn record(
        self,
        pause: &mut Vec<f64>,
        all: &mut Vec<f64>,
        each: &mut Vec<f64>,
        load: &mut Vec<f64>,
    ) {
        pause.push(self.pause);
        all.push(self.all);
        each.extend(self.each);
        load.extend(self.load);
    }
}

/// Fork ×[`CHILDREN`] from VM `req` (running): its memory image, then that many new VMs
/// started from it concurrently, timed until every one answers an ssh command; their QEMUs'
/// memory; then every child and the image go.
async fn fork(
    env: &Arc<Env>,
    req: &boxery_backends::NewVm,
    run: usize,
    source_mem: &mut Mem,
    child_mem: &mut Mem,
) -> Fork {
    let name = req.name.clone();
    let source_pid = env.backend.pid(&name).expect("the source runs");
    source_mem.add(source_pid, req.memory_mib);
    let boot_id = env.run(&name, "cat /proc/sys/kernel/random/boot_id").await;
    let host_key = req.identity.host_key.clone().unwrap().1;
    let image = format!("{name}.fork");
    let t = Instant::now();
    env.backend
        .capture_memory(&name, &image, &format!("uid-{image}"))
        .await
        .unwrap();
    let pause = t.elapsed().as_secs_f64();
    let mut tasks = tokio::task::JoinSet::new();
    let children: Vec<String> = (0..CHILDREN).map(|i| format!("{name}c{i}")).collect();
    for child in &children {
        let mut r = env.vm(child, &image);
        r.memory = true;
        r.memory_mib = req.memory_mib;
        r.cpus = req.cpus;
        r.disk_gib = req.disk_gib;
        let (env, key) = (Arc::clone(env), host_key.clone());
        tasks.spawn(async move {
            let t = Instant::now();
            env.backend
                .create(&r)
                .await
                .unwrap_or_else(|e| panic!("starting {} from memory: {}", r.name, e.chain()));
            let load = t.elapsed().as_secs_f64();
            pin(&env, &r.name, &key).await;
            env.wait_ssh(&r.name, FORK_SSH).await;
            (t.elapsed().as_secs_f64(), load)
        });
    }
    let (mut each, mut load) = (Vec::new(), Vec::new());
    while let Some(done) = tasks.join_next().await {
        let (answered, loaded) = done.expect("a child's task");
        each.push(answered);
        load.push(loaded);
    }
    let all = t.elapsed().as_secs_f64();
    // they continue the source's boot (not a cold boot of their own)
    for child in &children {
        assert_eq!(
            env.run(child, "cat /proc/sys/kernel/random/boot_id").await,
            boot_id,
            "{child} continues the source's boot"
        );
    }
    for (i, child) in children.iter().enumerate() {
        let pid = env.backend.pid(child).expect("the child runs");
        if run == 0 && i == 0 {
            largest_mappings(pid);
        }
        child_mem.add(pid, req.memory_mib);
    }
    for child in &children {
        env.backend.remove(child).await.unwrap();
    }
    env.backend.remove_image(&image).await.unwrap();
    Fork {
        pause,
        all,
        each,
        load,
    }
}

/// Pin `public` as VM `vm`'s host key in the backend's known_hosts: a VM started from
/// another VM's memory answers with that VM's key until it is given its own (as
/// `qemu_memory.rs`'s `pin`).
async fn pin(env: &Env, vm: &str, public: &str) {
    let port = env.port(vm).await;
    let line = boxery_backends::identity::known_hosts_line(&format!("[127.0.0.1]:{port}"), public);
    std::fs::write(env.backend.layout().vm_known_hosts(vm), format!("{line}\n")).unwrap();
}

/// QEMU processes' memory, MiB per process.
#[derive(Default)]
struct Mem {
    private: Vec<f64>,
    rss: Vec<f64>,
    pss: Vec<f64>,
    ram: Vec<f64>,
    tb: Vec<f64>,
    other: Vec<f64>,
}

impl Mem {
    /// Add process `pid` (a QEMU of a `memory_mib` guest).
    fn add(&mut self, pid: i32, memory_mib: u64) {
        let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap();
        let kb = |field: &str| field_kb(&rollup, field) as f64 / 1024.0;
        self.private.push(kb("Private_Clean") + kb("Private_Dirty"));
        self.rss.push(kb("Rss"));
        self.pss.push(kb("Pss"));
        let (mut ram, mut tb, mut other) = (0u64, 0u64, 0u64);
        for m in mappings(pid) {
            // the guest's RAM: its one mapping of at least the guest's size, anonymous or a
            // file mapped privately
            if m.size_kb >= memory_mib * 1024 {
                ram += m.private_kb;
            } else if m.anon && m.perms.contains('x') {
                tb += m.private_kb;
            } else {
                other += m.private_kb;
            }
        }
        self.ram.push(ram as f64 / 1024.0);
        self.tb.push(tb as f64 / 1024.0);
        self.other.push(other as f64 / 1024.0);
    }

    fn print(&self, what: &str) {
        let m = |v: &[f64]| {
            let mut s = v.to_vec();
            s.sort_by(|a, b| a.total_cmp(b));
            format!("{:.0} ({:.0}–{:.0})", median(v), s[0], s[s.len() - 1])
        };
        println!(
            "| {what} | {} | {} | {} | {} | {} | {} |",
            m(&self.private),
            m(&self.rss),
            m(&self.pss),
            m(&self.ram),
            m(&self.tb),
            m(&self.other)
        );
    }
}

/// The `FIELD: N kB` value in an smaps text (0 when absent).
fn field_kb(text: &str, field: &str) -> u64 {
    text.lines()
        .filter_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .filter_map(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// One mapping of `/proc/PID/smaps`.
struct Mapping {
    header: String,
    perms: String,
    anon: bool,
    size_kb: u64,
    private_kb: u64,
}

fn mappings(pid: i32) -> Vec<Mapping> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let mut out: Vec<Mapping> = Vec::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or_default();
        if first.contains('-') && !first.ends_with(':') {
            let perms = words.next().unwrap_or_default().to_string();
            // address perms offset dev inode [path]
            let path = line.split_whitespace().nth(5);
            out.push(Mapping {
                header: line.to_string(),
                perms,
                anon: path.is_none_or(|p| p.starts_with("/memfd:") || p == "[heap]"),
                size_kb: 0,
                private_kb: 0,
            });
        } else if let Some(m) = out.last_mut() {
            match first {
                "Size:" => m.size_kb = field_kb(line, "Size"),
                "Private_Clean:" | "Private_Dirty:" => {
                    m.private_kb += field_kb(line, first.trim_end_matches(':'))
                }
                _ => {}
            }
        }
    }
    out
}

/// Print the mappings that hold the most private memory of process `pid` (what the split
/// into guest RAM, code buffer and the rest rests on).
fn largest_mappings(pid: i32) {
    let mut all = mappings(pid);
    all.sort_by_key(|m| std::cmp::Reverse(m.private_kb));
    eprintln!("largest private mappings of a fork child's QEMU (pid {pid}):");
    for m in all.iter().take(6) {
        eprintln!(
            "  {:>8} kB private of {:>8} kB  {}",
            m.private_kb, m.size_kb, m.header
        );
    }
}
