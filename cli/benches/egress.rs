//! The egress policy's cost inside a guest (docs/benchmarks.md, "Egress (issue 14)"), qemu
//! backend, tiny guests under TCG, in the same run:
//! - `on`: a VM as boxery runs it (restricted slirp in its `boxery-net`, policy `Public`): its
//!   HTTP goes through the control plane's egress proxy (`http_proxy`, each connection
//!   connected to the VM's proxy socket by the helper);
//! - `off` (the limit): a second VM's very QEMU command line started by hand with QEMU's own
//!   slirp, unrestricted, in place of its network (and with its own pidfile and sockets, so the
//!   control plane leaves it alone): slirp NATs its connections straight to the listener.
//!
//! In each guest, interleaved: a 100 MiB download (busybox `time wget`), and 50 sequential
//! one-byte requests, each on a new connection. The "internet" is a listener at 203.0.113.40
//! in a network namespace (`proxy/benches/standin`). Needs root.
//!
//! `cargo build --release -p boxery-net && cargo bench -p boxery --bench egress` (release; the
//! `on` VM's network is its `boxery-net`, found beside `boxery`). `BOXERY_BENCH_RUNS=N` rounds
//! (default 3).

#[path = "../../proxy/benches/standin/mod.rs"]
mod standin;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

struct H {
    home: PathBuf,
}

impl H {
    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_boxery"));
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
    /// `script` in a VM through `boxery run`, or in the hand-started one over plain ssh.
    fn guest(&self, vm: &str, via_boxery: bool, script: &str) -> String {
        let o = if via_boxery {
            self.cmd(&["run", vm, "--", script]).output().unwrap()
        } else {
            Command::new("ssh")
                .arg("-F")
                .arg(self.home.join("ssh/config"))
                .args(["-o", "ControlPath=none", &format!("{vm}.boxery"), script])
                .stdin(Stdio::null())
                .output()
                .unwrap()
        };
        // busybox `time` reports on stderr
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    }
}

/// Seconds from busybox `time`'s `real\t0m 1.86s`.
fn real(out: &str) -> f64 {
    let line = out
        .lines()
        .find(|l| l.trim_start().starts_with("real"))
        .unwrap_or_else(|| panic!("no `real` line in: {out}"));
    let t = line.trim_start().trim_start_matches("real").trim();
    let (m, s) = t.split_once('m').unwrap();
    m.trim().parse::<f64>().unwrap() * 60.0 + s.trim().trim_end_matches('s').parse::<f64>().unwrap()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// `serve`, killed and reaped when dropped.
struct Serve(std::process::Child);

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The hand-started QEMU (daemonized: only its pid is known), killed when dropped.
struct Killed(u32);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = Command::new("kill").arg(self.0.to_string()).status();
    }
}

fn main() {
    let helper = std::path::Path::new(env!("CARGO_BIN_EXE_boxery")).with_file_name("boxery-net");
    assert!(
        helper.is_file(),
        "{} is missing: cargo build --release -p boxery-net (the VMs' network)",
        helper.display()
    );
    let runs: usize = std::env::var("BOXERY_BENCH_RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let net = standin::Net::make(
        "boxery-bench-guest",
        "bxbenchg0",
        "203.0.113.40",
        "198.51.100.41",
    );
    let to = net.serve();
    let tmp = tempfile::Builder::new()
        .prefix("boxery-egress-bench-")
        .tempdir()
        .unwrap();
    let h = H {
        home: tmp.path().join("home"),
    };
    std::fs::create_dir_all(&h.home).unwrap();
    let _serve = Serve(
        h.cmd(&["serve"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    for vm in ["e-on", "e-off"] {
        let f = h.home.join(format!("{vm}.yaml"));
        std::fs::write(&f, format!("apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata: {{name: {vm}}}\nspec:\n  source: {{image: tiny}}\n  resources: {{cpus: 1, memory: 256Mi, disk: 1Gi}}\n")).unwrap();
        h.ok(&[
            "apply",
            "-f",
            f.to_str().unwrap(),
            "--wait",
            "--timeout",
            "10m",
        ]);
    }
    // `off`: settled (stop, start), its command line read, stopped, started by hand without
    // restrict=on, on its own pidfile and QMP/agent sockets.
    h.ok(&["stop", "e-off", "--wait"]);
    h.ok(&["start", "e-off", "--wait", "--timeout", "5m"]);
    let dir = h.home.join("qemu/vms/e-off");
    let pid = std::fs::read_to_string(dir.join("qemu.pid")).unwrap();
    let args: Vec<String> = std::fs::read(format!("/proc/{}/cmdline", pid.trim()))
        .unwrap()
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let endpoint = h.ok(&[
        "get",
        "vm",
        "e-off",
        "-o",
        "jsonpath={.status.ssh.endpoint}",
    ]);
    let port = endpoint.trim().rsplit(':').next().unwrap().to_string();
    h.ok(&["stop", "e-off", "--wait"]);
    let d = dir.display().to_string();
    let t = tmp.path().display().to_string();
    let args: Vec<String> = args
        .into_iter()
        .map(|a| {
            // boxery-net runs the VM's network: QEMU's own slirp instead, unrestricted
            if a.starts_with("stream,id=n0,") {
                return format!("user,id=n0,ipv6=off,hostfwd=tcp:127.0.0.1:{port}-:22");
            }
            a.replace("restrict=on,", "")
                .replace(&format!("{d}/qemu.pid"), &format!("{t}/off.pid"))
                .replace(&format!("{d}/qmp.sock"), &format!("{t}/off-qmp.sock"))
                .replace(&format!("{d}/qga.sock"), &format!("{t}/off-qga.sock"))
        })
        .collect();
    assert!(
        args.iter()
            .any(|a| a.starts_with("user,") && !a.contains("restrict"))
    );
    let st = Command::new(&args[0]).args(&args[1..]).status().unwrap();
    assert!(st.success(), "the hand-started QEMU did not start");
    let raw_pid: u32 = std::fs::read_to_string(tmp.path().join("off.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let _raw = Killed(raw_pid);
    let t0 = Instant::now();
    while !h.guest("e-off", false, "echo up").contains("up") {
        assert!(
            t0.elapsed() < Duration::from_secs(180),
            "the hand-started VM never answered ssh"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    // `on` has its proxy variables once the control plane pushed them.
    let t0 = Instant::now();
    while h
        .guest("e-on", true, "echo \"${http_proxy:-}\"")
        .trim()
        .is_empty()
    {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "no http_proxy in the guest"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let big = format!("time wget -q -O /dev/null http://{to}/104857600 || echo FAILED");
    let small = format!(
        "time sh -c 'for i in $(seq 50); do wget -q -O /dev/null http://{to}/1 || echo FAILED; done'"
    );
    let (mut b_on, mut b_off, mut s_on, mut s_off) = (vec![], vec![], vec![], vec![]);
    for _ in 0..runs {
        for (via, bulk, setup) in [
            (false, &mut b_off, &mut s_off),
            (true, &mut b_on, &mut s_on),
        ] {
            let vm = if via { "e-on" } else { "e-off" };
            let out = h.guest(vm, via, &big);
            assert!(!out.contains("FAILED"), "{vm}: {out}");
            bulk.push(real(&out));
            let out = h.guest(vm, via, &small);
            assert!(!out.contains("FAILED"), "{vm}: {out}");
            setup.push(real(&out) / 50.0 * 1e3);
        }
    }
    let (bon, boff, son, soff) = (
        median(&mut b_on),
        median(&mut b_off),
        median(&mut s_on),
        median(&mut s_off),
    );
    println!("egress in a guest: tiny guests (1 vCPU, 256 MiB) under TCG, {runs} rounds, medians");
    println!(
        "| figure | policy off (slirp NAT) | through the egress proxy | ratio / added | limit |"
    );
    println!("|---|---|---|---|---|");
    println!(
        "| 100 MiB download | {boff:.2} s ({:.1} MiB/s) | {bon:.2} s ({:.1} MiB/s) | {:.0} % | ≥ 80 % |",
        100.0 / boff,
        100.0 / bon,
        boff / bon * 100.0
    );
    println!(
        "| a one-byte request on a new connection (50 in a row) | {soff:.1} ms | {son:.1} ms | {:+.1} ms | ≤ 2 ms added |",
        son - soff
    );
    drop(_raw);
    h.ok(&["delete", "vm", "e-on", "e-off", "--wait"]);
    drop(net);
}
