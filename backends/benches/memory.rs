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

#[path = "../tests/qemu_support/mod.rs"]
mod qemu_support;

use std::time::{Duration, Instant};

use boxery_backends::Backend;
use qemu_support::{Env, median, stats};

const BOOT: Duration = Duration::from_secs(480);

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
    let env = Env::new().await;
    let progress: boxery_backends::Progress = std::sync::Arc::new(|_line: &str| {});
    env.backend
        .build_image(
            boxery_backends::Stock {
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
    println!(
        "resume is {ratio:.1}× faster than a cold boot (target ≥ 20×, ≤ 1 s); suspend {:.2} s/GiB touched (target ≤ 4); a reset by memory is {:.1}× faster than by reboot (target ≤ 1.5 s)",
        median(&per_gib),
        median(&reset_disk) / median(&reset_memory)
    );
}
