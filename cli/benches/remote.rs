//! The connect tunnel (issue 16): a warm `boxery run VM -- true` from a second home that holds
//! only a context for the VM host (ssh carried by `boxery connect` through the API server),
//! against the same command run on the VM host itself, interleaved in one run so the
//! machine's drift hits both alike. Also `boxery get vm` both ways (the store over the API).
//!
//! qemu backend, the `tiny` guest under TCG, one VM. `cargo bench -p boxery --bench remote`
//! (release); `BOXERY_BENCH_PAIRS=N` (default 100).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_boxery")
}

struct Home {
    path: PathBuf,
    context: Option<&'static str>,
}

impl Home {
    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(bin());
        c.args(args)
            .env("BOXERY_HOME", &self.path)
            .env("BOXERY_BACKEND", "qemu")
            .env_remove("BOXERY_CONTEXT")
            .stdin(Stdio::null());
        if let Some(ctx) = self.context {
            c.env("BOXERY_CONTEXT", ctx);
        }
        c
    }
    fn ok(&self, args: &[&str]) -> String {
        let o = self.cmd(args).output().unwrap();
        assert!(
            o.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }
    fn timed(&self, args: &[&str]) -> Duration {
        let t = Instant::now();
        self.ok(args);
        t.elapsed()
    }
    fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.path.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }
}

struct Serve(std::process::Child);
impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

fn wait_for(p: &Path) {
    let t = Instant::now();
    while !p.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "{} never appeared",
            p.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `n` interleaved pairs of `args` on the VM host and through the context.
fn pairs(host: &Home, laptop: &Home, args: &[&str], n: usize) -> (Vec<Duration>, Vec<Duration>) {
    host.ok(args);
    laptop.ok(args);
    let (mut local, mut remote) = (Vec::new(), Vec::new());
    for i in 0..n {
        if i % 2 == 0 {
            local.push(host.timed(args));
            remote.push(laptop.timed(args));
        } else {
            remote.push(laptop.timed(args));
            local.push(host.timed(args));
        }
    }
    (local, remote)
}

fn row(what: &str, local: &mut [Duration], remote: &mut [Duration], target: &str) -> String {
    let (l50, l99) = (pct(local, 0.5), pct(local, 0.99));
    let (r50, r99) = (pct(remote, 0.5), pct(remote, 0.99));
    format!(
        "| {what} ({} pairs) | {} / {} | {} / {} | {:.2}× / {:.2}× | {target} |",
        local.len(),
        ms(r50),
        ms(r99),
        ms(l50),
        ms(l99),
        r50.as_secs_f64() / l50.as_secs_f64(),
        r99.as_secs_f64() / l99.as_secs_f64()
    )
}

fn main() {
    let n: usize = std::env::var("BOXERY_BENCH_PAIRS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100);
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let host = Home {
        path: a.path().to_path_buf(),
        context: None,
    };
    let laptop = Home {
        path: b.path().to_path_buf(),
        context: Some("vmhost"),
    };
    let img = host.write("tiny.yaml", "apiVersion: boxery.dev/v1alpha1\nkind: Image\nmetadata: {name: tiny}\nspec: {source: {build: {base: tiny}}}\n");
    host.ok(&[
        "apply",
        "-f",
        img.to_str().unwrap(),
        "--wait",
        "--timeout",
        "10m",
    ]);
    let _serve = Serve(
        host.cmd(&["serve", "--api-listen", "127.0.0.1:0"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for(&host.path.join("api/addr"));
    let kc = host.write("kc.yaml", &host.ok(&["kubeconfig", "--name", "bench"]));
    laptop.ok(&[
        "config",
        "add-context",
        "vmhost",
        "-f",
        kc.to_str().unwrap(),
    ]);
    let vm = laptop.write("vm.yaml", "apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata: {name: r0}\nspec:\n  source: {image: tiny}\n  resources: {cpus: 1, memory: 256Mi, disk: 2Gi}\n");
    laptop.ok(&[
        "apply",
        "-f",
        vm.to_str().unwrap(),
        "--wait",
        "--timeout",
        "10m",
    ]);
    // the first remote run authorizes the laptop's key in the guest; timed once, apart
    let first = laptop.timed(&["run", "r0", "--", "true"]);
    let (mut lr, mut rr) = pairs(&host, &laptop, &["run", "r0", "--", "true"], n);
    let (mut lg, mut rg) = pairs(&host, &laptop, &["get", "vm", "r0", "-o", "name"], n);
    println!(
        "real VM, qemu backend, tiny guest (1 vCPU, 256 MiB) under TCG, 2 cores; API on loopback"
    );
    println!(
        "first `boxery --context run r0 -- true` (authorizes the laptop's key): {}",
        ms(first)
    );
    println!(
        "| measure | through the context p50 / p99 | on the VM host p50 / p99 | ratio p50 / p99 | target |"
    );
    println!("|---|---|---|---|---|");
    println!(
        "{}",
        row("warm `boxery run r0 -- true`", &mut lr, &mut rr, "≤ 1.2×")
    );
    println!(
        "{}",
        row("`boxery get vm r0 -o name`", &mut lg, &mut rg, "")
    );
    laptop.ok(&["delete", "vm", "r0", "--wait", "--timeout", "5m"]);
}
