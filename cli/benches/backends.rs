//! The user-facing operations through the CLI on each real backend, alternating backend by
//! backend in every round of one run (so both see the same machine load), `tiny` guest under
//! TCG, a `boxery serve` per backend:
//! - create: `apply` a Vm `--wait` (Ready) → first `run -- true`;
//! - snapshot: `snap VM LABEL --wait` of the running VM (1 MiB written first);
//! - revert: `revert VM LABEL --wait` → first `run` (the file is the snapshot's);
//! - fork ×2: `fork VM A B --wait` → a `run` on each.
//!
//! `cargo bench -p boxery --features libvirt --bench backends` (release). `BOXERY_BENCH_RUNS=N`
//! (default 3), `BOXERY_BENCH_BACKENDS=qemu,libvirt` (the default when built with the libvirt
//! feature; `qemu` otherwise). libvirtd is started by `scripts/libvirtd.sh start` when it does
//! not answer (and left running). Every VM, image and storage pool made here is removed.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Home {
    dir: tempfile::TempDir,
    backend: String,
    serve: Option<Child>,
}

impl Home {
    fn new(backend: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("boxery-bench-")
            .tempdir()
            .unwrap();
        let mut h = Home {
            dir,
            backend: backend.to_string(),
            serve: None,
        };
        // The image is built (or found in the cache) before anything is timed.
        let img = h.dir.path().join("tiny.yaml");
        std::fs::write(&img, "apiVersion: boxery.dev/v1alpha1\nkind: Image\nmetadata: {name: tiny}\nspec: {source: {build: {base: tiny}}}\n").unwrap();
        h.ok(&[
            "apply",
            "-f",
            img.to_str().unwrap(),
            "--wait",
            "--timeout",
            "10m",
        ]);
        h.serve = Some(
            h.cmd(&["serve"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        h
    }
    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_boxery"));
        c.args(args)
            .env("BOXERY_HOME", self.dir.path())
            .env("BOXERY_BACKEND", &self.backend)
            .stdin(Stdio::null());
        c
    }
    fn ok(&self, args: &[&str]) -> String {
        let o = self.cmd(args).output().unwrap();
        assert!(
            o.status.success(),
            "{} {args:?}: {}",
            self.backend,
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }
    fn timed(&self, steps: &[&[&str]]) -> Duration {
        let t = Instant::now();
        for s in steps {
            self.ok(s);
        }
        t.elapsed()
    }
    /// One round: the four figures, then everything made in it removed.
    fn round(&self, i: usize) -> [Duration; 4] {
        let (vm, a, b) = (format!("v{i}"), format!("v{i}a"), format!("v{i}b"));
        let f = self.dir.path().join(format!("{vm}.yaml"));
        std::fs::write(&f, format!("apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata: {{name: {vm}}}\nspec:\n  source: {{image: tiny}}\n  resources: {{cpus: 1, memory: 256Mi, disk: 1Gi}}\n")).unwrap();
        let f = f.to_str().unwrap();
        let create = self.timed(&[
            &["apply", "-f", f, "--wait", "--timeout", "10m"],
            &["run", &vm, "--", "true"],
        ]);
        self.ok(&[
            "run",
            &vm,
            "--",
            "head -c 1048576 /dev/urandom > ~/blob && md5sum ~/blob > ~/sum && sync",
        ]);
        let snap = self.timed(&[&["snap", &vm, "s", "--wait", "--timeout", "5m"]]);
        self.ok(&["run", &vm, "--", "rm ~/blob"]);
        let revert = self.timed(&[
            &["revert", &vm, "s", "--wait", "--timeout", "5m"],
            &["run", &vm, "--", "md5sum -c ~/sum >/dev/null"],
        ]);
        let fork = self.timed(&[
            &["fork", &vm, &a, &b, "--wait", "--timeout", "10m"],
            &["run", &a, "--", "true"],
            &["run", &b, "--", "true"],
        ]);
        self.ok(&["rm", &vm, &a, &b, "--wait", "--timeout", "5m"]);
        [create, snap, revert, fork]
    }
}

impl Drop for Home {
    fn drop(&mut self) {
        // a round that failed half-way leaves VMs: remove them with their backend objects
        let left = self
            .cmd(&["get", "vms", "-o", "name"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let left: Vec<&str> = left
            .lines()
            .map(|l| l.trim().trim_start_matches("vm/"))
            .filter(|l| !l.is_empty())
            .collect();
        if !left.is_empty() {
            let mut args = vec!["rm"];
            args.extend(&left);
            args.extend(["--wait", "--timeout", "5m"]);
            let _ = self.cmd(&args).output();
        }
        if let Some(mut s) = self.serve.take() {
            let _ = s.kill();
            let _ = s.wait();
        }
        #[cfg(feature = "libvirt")]
        if self.backend == "libvirt" {
            let _ = self
                .cmd(&["delete", "image", "tiny", "--wait", "--timeout", "1m"])
                .output();
            let b = boxery_backends::libvirt::LibvirtBackend::new(boxery_backends::state_dir(
                self.dir.path(),
                "libvirt",
            ));
            for args in [["pool-destroy", ""], ["pool-undefine", ""]] {
                let _ = Command::new("virsh")
                    .args(["-q", "-c", "qemu:///system", args[0], &b.pool_name()])
                    .output();
            }
            let _ = std::fs::remove_dir_all(b.pool_dir());
        }
    }
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn median(mut v: Vec<Duration>) -> (Duration, Duration, Duration) {
    v.sort();
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn main() {
    let runs: usize = std::env::var("BOXERY_BENCH_RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let default = if cfg!(feature = "libvirt") {
        "qemu,libvirt"
    } else {
        "qemu"
    };
    let names: Vec<String> = std::env::var("BOXERY_BENCH_BACKENDS")
        .unwrap_or_else(|_| default.into())
        .split(',')
        .map(|s| s.trim().to_string())
        .collect();
    if names.iter().any(|n| n == "libvirt") {
        let st = Command::new("bash")
            .arg(repo().join("scripts/libvirtd.sh"))
            .arg("start")
            .status()
            .unwrap();
        assert!(
            st.success(),
            "libvirtd does not answer (scripts/libvirtd.sh start)"
        );
    }
    let homes: Vec<Home> = names.iter().map(|n| Home::new(n)).collect();
    let mut figures: Vec<[Vec<Duration>; 4]> = names.iter().map(|_| Default::default()).collect();
    for i in 0..runs {
        for (h, f) in homes.iter().zip(figures.iter_mut()) {
            let r = h.round(i);
            eprintln!(
                "round {i} {}: create {:.2} s, snapshot {:.2} s, revert {:.2} s, fork×2 {:.2} s",
                h.backend,
                r[0].as_secs_f64(),
                r[1].as_secs_f64(),
                r[2].as_secs_f64(),
                r[3].as_secs_f64()
            );
            for (k, d) in r.into_iter().enumerate() {
                f[k].push(d);
            }
        }
    }
    println!(
        "\nmedian (min–max) over {runs} rounds, through the CLI with `boxery serve` running:\n"
    );
    println!("| | {} |", names.join(" | "));
    println!("|---|{}", "---|".repeat(names.len()));
    let rows = [
        "apply → Ready → first run",
        "snap (running VM) → Ready",
        "revert → first run",
        "fork ×2 → both run",
    ];
    for (k, row) in rows.iter().enumerate() {
        let cells: Vec<String> = figures
            .iter()
            .map(|f| {
                let (m, lo, hi) = median(f[k].clone());
                format!(
                    "{:.2} s ({:.2}–{:.2})",
                    m.as_secs_f64(),
                    lo.as_secs_f64(),
                    hi.as_secs_f64()
                )
            })
            .collect();
        println!("| {row} | {} |", cells.join(" | "));
    }
}
