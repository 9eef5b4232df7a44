//! Real-VM benchmarks through the CLI, qemu backend, the `tiny` guest under TCG (absolute
//! times are emulation times; ratios against limits measured in the same run are the claim):
//! - raw QEMU boot → first ssh command, with the very command line boxery used (the limit),
//!   versus `boxery apply --wait` → `boxery run -- true`;
//! - warm `boxery run -- true` versus a bare `ssh true` over the same ControlMaster;
//! - `snap` of a running VM with 1 GiB written since boot; `revert`; `new --from`;
//!   `fork` into 2 and into 4 (versus one create);
//! - QEMU RSS beyond guest RAM.
//!
//! `cargo bench -p boxery --bench vms` (release). `BOXERY_BENCH_RUNS=N` (default 3);
//! `BOXERY_BENCH_ONLY=warm`: only the warm `run` row (one VM, 100 interleaved pairs).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_boxery")
}

struct H {
    home: PathBuf,
}

impl H {
    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(bin());
        c.args(args)
            .env("BOXERY_HOME", &self.home)
            .env("BOXERY_BACKEND", "qemu")
            .stdin(Stdio::null());
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
    fn apply_vm(&self, name: &str) -> Duration {
        let f = self.home.join(format!("{name}.yaml"));
        std::fs::write(&f, format!("apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata: {{name: {name}}}\nspec:\n  source: {{image: tiny}}\n  resources: {{cpus: 1, memory: 256Mi, disk: 2Gi}}\n")).unwrap();
        let t = Instant::now();
        self.ok(&[
            "apply",
            "-f",
            f.to_str().unwrap(),
            "--wait",
            "--timeout",
            "5m",
        ]);
        self.ok(&["run", name, "--", "true"]);
        t.elapsed()
    }
    fn pid(&self, vm: &str) -> u32 {
        std::fs::read_to_string(self.home.join(format!("qemu/vms/{vm}/qemu.pid")))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }
    fn ssh(&self) -> Command {
        let mut c = Command::new("ssh");
        c.arg("-F").arg(self.home.join("ssh/config"));
        c
    }
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn s(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

fn banner(port: u16) -> bool {
    use std::io::Read;
    let Ok(mut c) = std::net::TcpStream::connect_timeout(
        &format!("127.0.0.1:{port}").parse().unwrap(),
        Duration::from_millis(300),
    ) else {
        return false;
    };
    let _ = c.set_read_timeout(Some(Duration::from_millis(300)));
    let mut b = [0u8; 4];
    c.read_exact(&mut b).is_ok() && &b == b"SSH-"
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn main() {
    let runs: usize = std::env::var("BOXERY_BENCH_RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let dir = tempfile::tempdir().unwrap();
    let h = H {
        home: dir.path().to_path_buf(),
    };
    // The image is built (or found in the cache) before anything is timed.
    let img = h.home.join("tiny.yaml");
    std::fs::write(&img, "apiVersion: boxery.dev/v1alpha1\nkind: Image\nmetadata: {name: tiny}\nspec: {source: {build: {base: tiny}}}\n").unwrap();
    h.ok(&[
        "apply",
        "-f",
        img.to_str().unwrap(),
        "--wait",
        "--timeout",
        "10m",
    ]);
    let start_serve = || {
        Serve(
            h.cmd(&["serve"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        )
    };
    let mut serve = Some(start_serve());

    if std::env::var("BOXERY_BENCH_ONLY").as_deref() == Ok("warm") {
        h.apply_vm("b0");
        let (mut run_rt, mut ssh_rt) = warm(&h, "b0", 100);
        println!("real VMs, qemu backend, tiny guest (1 vCPU, 256 MiB) under TCG, 2 cores");
        println!("| measure | boxery | limit (same run) | ratio p50 / p99 | target |");
        println!("|---|---|---|---|---|");
        println!("{}", warm_row(&mut run_rt, &mut ssh_rt));
        println!("{}", audit_row(&mut run_rt));
        h.ok(&["rm", "b0", "--wait"]);
        drop(serve);
        return;
    }
    // boxery: apply → Ready → first run.
    let mut boxery: Vec<Duration> = Vec::new();
    for i in 0..runs {
        let n = format!("b{i}");
        boxery.push(h.apply_vm(&n));
        if i > 0 {
            h.ok(&["rm", &n, "--wait"]);
        }
    }
    // The limit: the same QEMU command line, launched by hand → banner → first ssh command.
    // A stop and start first, so the disk chain is settled (a new VM streams its image layer
    // up in the background; the command line of a settled VM names only its own overlay).
    h.ok(&["stop", "b0", "--wait"]);
    std::thread::sleep(Duration::from_secs(1));
    h.ok(&["start", "b0", "--wait", "--timeout", "5m"]);
    let pid = h.pid("b0");
    let cmdline: Vec<String> = std::fs::read(format!("/proc/{pid}/cmdline"))
        .unwrap()
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let endpoint = h.ok(&["get", "vm", "b0", "-o", "jsonpath={.status.ssh.endpoint}"]);
    let port: u16 = endpoint.trim().rsplit(':').next().unwrap().parse().unwrap();
    let rss = rss_kib(pid);
    h.ok(&["stop", "b0", "--wait"]);
    // No control plane while QEMU is launched by hand (it would stop a VM its spec says is stopped).
    drop(serve.take());
    let pidfile = h.home.join("qemu/vms/b0/qemu.pid");
    let mut raw: Vec<Duration> = Vec::new();
    for _ in 0..runs {
        let t = Instant::now();
        let st = Command::new(&cmdline[0])
            .args(&cmdline[1..])
            .status()
            .unwrap();
        assert!(st.success(), "raw QEMU failed to start");
        while !banner(port) {
            std::thread::sleep(Duration::from_millis(20));
            assert!(t.elapsed() < Duration::from_secs(120));
        }
        while !h
            .ssh()
            .args([
                "-o",
                "ControlMaster=no",
                "-o",
                "ControlPath=none",
                "b0.boxery",
                "true",
            ])
            .stderr(Stdio::null())
            .status()
            .unwrap()
            .success()
        {
            std::thread::sleep(Duration::from_millis(50));
        }
        raw.push(t.elapsed());
        let qpid: u32 = std::fs::read_to_string(&pidfile)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let _ = Command::new("kill").arg(qpid.to_string()).status();
        while Path::new(&format!("/proc/{qpid}")).exists() {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    serve = Some(start_serve());
    h.ok(&["start", "b0", "--wait", "--timeout", "5m"]);

    let (mut run_rt, mut ssh_rt) = warm(&h, "b0", 30);

    // Snapshot with 1 GiB written since boot, revert, new --from, forks.
    h.ok(&[
        "run",
        "b0",
        "--",
        "head -c 1073741824 /dev/urandom > ~/big && sync",
    ]);
    let snap = h.timed(&["snap", "b0", "s1", "--wait"]);
    let revert = h.timed(&["revert", "b0", "s1", "--wait", "--timeout", "5m"]);
    let t = Instant::now();
    h.ok(&[
        "new",
        "n1",
        "--from",
        "b0.s1",
        "--cpus",
        "1",
        "--memory",
        "256Mi",
        "--disk",
        "2Gi",
        "--wait",
        "--timeout",
        "5m",
    ]);
    h.ok(&["run", "n1", "--", "true"]);
    let new_from = t.elapsed();
    h.ok(&["rm", "n1", "--wait"]);
    let fork2 = h.timed(&["fork", "b0", "f1", "f2", "--wait", "--timeout", "10m"]);
    h.ok(&["rm", "f1", "f2", "--wait"]);
    let fork4 = h.timed(&[
        "fork",
        "b0",
        "g1",
        "g2",
        "g3",
        "g4",
        "--wait",
        "--timeout",
        "10m",
    ]);
    h.ok(&["rm", "g1", "g2", "g3", "g4", "--wait"]);
    h.ok(&["rm", "b0", "--wait"]);

    // Leases on a pool of one real VM: claim → first command, reset, and a raw reimage.
    let pf = h.home.join("pool.yaml");
    std::fs::write(&pf, "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {name: p}\nspec:\n  replicas: 1\n  template:\n    spec: {source: {image: tiny}, resources: {cpus: 1, memory: 256Mi, disk: 2Gi}}\n").unwrap();
    h.ok(&["apply", "-f", pf.to_str().unwrap()]);
    h.ok(&[
        "wait",
        "pool",
        "p",
        "--for=condition=Ready",
        "--timeout=10m",
    ]);
    let (mut claims, mut binds, mut resets) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..runs {
        let name = format!("l{i}");
        let t = Instant::now();
        h.ok(&[
            "lease",
            "acquire",
            "p",
            "--holder",
            "bench",
            "--name",
            &name,
            "--wait",
            "--timeout",
            "5m",
        ]);
        binds.push(t.elapsed());
        h.ok(&["run", "p-0", "--", "true"]);
        claims.push(t.elapsed());
        let t = Instant::now();
        h.ok(&["lease", "release", &name, "--wait"]);
        h.ok(&[
            "wait",
            "pool",
            "p",
            "--for=jsonpath={.status.free}=1",
            "--timeout=5m",
        ]);
        resets.push(t.elapsed());
    }
    let raw_reimage = h.timed(&[
        "revert",
        "p-0",
        "p-0.boxery-clean",
        "--wait",
        "--timeout",
        "5m",
    ]);
    h.ok(&["delete", "pool", "p"]);
    h.ok(&["wait", "vm", "p-0", "--for=delete", "--timeout=3m"]);
    drop(serve);

    let (b, r) = (median(&mut boxery), median(&mut raw));
    let over = b.as_secs_f64() - r.as_secs_f64();
    println!(
        "real VMs, qemu backend, tiny guest (1 vCPU, 256 MiB) under TCG, {runs} runs, 2 cores"
    );
    println!("| measure | boxery | limit (same run) | ratio | target |");
    println!("|---|---|---|---|---|");
    println!(
        "| boot: apply → Ready → first `run` (median) | {} | raw QEMU, same command line, → first ssh: {} | +{:.0} ms ({:+.1} %) | ≤ 5 % and ≤ 150 ms |",
        s(b),
        s(r),
        over * 1000.0,
        over / r.as_secs_f64() * 100.0
    );
    println!("{}", warm_row(&mut run_rt, &mut ssh_rt));
    println!(
        "| `snap --wait`, running VM, 1 GiB written since boot | {} | | | ≤ 1 s |",
        s(snap)
    );
    println!("| `revert --wait` (→ Ready) | {} | | | |", s(revert));
    println!(
        "| `new --from` → first `run` | {} | one create: {} | | |",
        s(new_from),
        s(b)
    );
    println!(
        "| `fork` into 2 (→ both Ready) | {} | one create: {} | {:.2}× | |",
        s(fork2),
        s(b),
        fork2.as_secs_f64() / b.as_secs_f64()
    );
    println!(
        "| `fork` into 4 (→ all Ready) | {} | one create: {} | {:.2}× | ≤ 1.2× on 4+ cores |",
        s(fork4),
        s(b),
        fork4.as_secs_f64() / b.as_secs_f64()
    );
    println!(
        "| lease acquire → Bound (median, includes the `boxery` CLI, key pair, token and key install) | {} | warm ssh round trip: {} | | install ≤ one warm ssh round trip |",
        s(median(&mut binds)),
        ms(pct(&mut ssh_rt, 0.5))
    );
    println!(
        "| lease acquire → Bound → first `run` (median) | {} | | | |",
        s(median(&mut claims))
    );
    println!(
        "| reset: release → member Free again (median) | {} | raw reimage of the same disk (`revert` to its clean image → Ready): {} | {:.2}× | |",
        s(median(&mut resets)),
        s(raw_reimage),
        median(&mut resets).as_secs_f64() / raw_reimage.as_secs_f64()
    );
    println!(
        "| QEMU process RSS, 256 MiB guest (total; the guest touches only part of its RAM, so this is not RAM + overhead: the backend bench measures the overhead) | {:.0} MiB | | | |",
        rss as f64 / 1024.0
    );
}

/// Warm round trips over one ControlMaster, `n` pairs interleaved (so that the machine's
/// drift hits both alike): `boxery run VM -- true`, and the bare `ssh -F $BOXERY_HOME/ssh/config
/// VM.boxery true` a person would type (the limit).
fn warm(h: &H, vm: &str, n: usize) -> (Vec<Duration>, Vec<Duration>) {
    h.ok(&["run", vm, "--", "true"]);
    let host = format!("{vm}.boxery");
    let bare = || {
        let t = Instant::now();
        assert!(h.ssh().args([&host, "true"]).status().unwrap().success());
        t.elapsed()
    };
    bare();
    let (mut run_rt, mut ssh_rt) = (Vec::new(), Vec::new());
    for i in 0..n {
        if i % 2 == 0 {
            run_rt.push(h.timed(&["run", vm, "--", "true"]));
            ssh_rt.push(bare());
        } else {
            ssh_rt.push(bare());
            run_rt.push(h.timed(&["run", vm, "--", "true"]));
        }
    }
    (run_rt, ssh_rt)
}

/// What the audit line every `run` appends costs (the journal's append of a typical action,
/// 1,000 times into a journal of its own), against the warm `run` measured in the same run.
fn audit_row(run_rt: &mut [Duration]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let j = boxery_home::journal::Journal::new(
        dir.path().join("audit/actions.log"),
        boxery_verbs::audit::MAX_BYTES,
        boxery_verbs::audit::MAX_AGE,
    );
    let a = boxery_verbs::audit::Action {
        time: "2026-12-06T05:12:44.031Z".into(),
        who: "user:root".into(),
        via: "cli".into(),
        action: "run".into(),
        vm: Some("b0".into()),
        what: "cargo test --workspace".into(),
        result: "exit 0".into(),
        bytes: None,
        ms: 31,
    };
    let mut t: Vec<Duration> = (0..1000)
        .map(|_| {
            let s = Instant::now();
            j.append(&a);
            s.elapsed()
        })
        .collect();
    let (a50, r50) = (pct(&mut t, 0.5), pct(run_rt, 0.5));
    format!(
        "| audit line appended per `run`, p50 (1,000 appends) | {:.1} µs | warm `boxery run` p50: {} | {:.2} % | ≤ 5 % |",
        a50.as_secs_f64() * 1e6,
        ms(r50),
        100.0 * a50.as_secs_f64() / r50.as_secs_f64()
    )
}

fn warm_row(run_rt: &mut [Duration], ssh_rt: &mut [Duration]) -> String {
    let (r50, r99) = (pct(run_rt, 0.5), pct(run_rt, 0.99));
    let (s50, s99) = (pct(ssh_rt, 0.5), pct(ssh_rt, 0.99));
    format!(
        "| warm `boxery run -- true` p50 / p99 ({} pairs) | {} / {} | bare `ssh true`, same ControlMaster: {} / {} | {:.2}× / {:.2}× | ≤ 1.1× |",
        run_rt.len(),
        ms(r50),
        ms(r99),
        ms(s50),
        ms(s99),
        r50.as_secs_f64() / s50.as_secs_f64(),
        r99.as_secs_f64() / s99.as_secs_f64()
    )
}

struct Serve(std::process::Child);
impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
