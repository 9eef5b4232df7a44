//! MCP figures with a real `tiny` VM (QEMU): `vm_bash {command: "true"}` through `boxery mcp`
//! versus a bare `ssh … true` over the same ControlMaster (interleaved, same run; target
//! ≤ 1.1×), the cold first call (no ControlMaster yet), and the MCP server's own overhead per
//! tool call (`vm_use`, which does no I/O; target ≤ 2 ms p50).
//!
//! `cargo bench -p boxery --bench mcp` (N=… sets the sample count, default 40).

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

struct Mcp {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    id: u64,
}

impl Mcp {
    fn start(home: &Path) -> Mcp {
        let mut child = Command::new(env!("CARGO_BIN_EXE_boxery"))
            .arg("mcp")
            .env("BOXERY_HOME", home)
            .env("BOXERY_BACKEND", "qemu")
            .env("BOXERY_LOG", "error")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("boxery mcp");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut m = Mcp {
            child,
            stdin,
            stdout,
            id: 0,
        };
        m.request(
            "initialize",
            serde_json::json!({"protocolVersion": "2025-06-18", "capabilities": {},
                               "clientInfo": {"name": "bench", "version": "1"}}),
        );
        m.send(serde_json::json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
        m
    }
    fn send(&mut self, v: serde_json::Value) {
        writeln!(self.stdin, "{v}").unwrap();
        self.stdin.flush().unwrap();
    }
    fn request(&mut self, method: &str, params: serde_json::Value) -> serde_json::Value {
        self.id += 1;
        let id = self.id;
        self.send(
            serde_json::json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}),
        );
        loop {
            let mut line = String::new();
            assert!(
                self.stdout.read_line(&mut line).unwrap() > 0,
                "boxery mcp exited"
            );
            let v: serde_json::Value = serde_json::from_str(&line).unwrap();
            if v["id"] == id {
                return v;
            }
        }
    }
    fn call(&mut self, tool: &str, args: serde_json::Value) -> serde_json::Value {
        let r = self.request(
            "tools/call",
            serde_json::json!({"name": tool, "arguments": args}),
        );
        assert!(
            r["result"]["isError"] != true && r.get("error").is_none(),
            "{tool}: {r}"
        );
        r
    }
}

impl Drop for Mcp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Qemus<'a>(&'a Path);

impl Drop for Qemus<'_> {
    fn drop(&mut self) {
        let Ok(vms) = std::fs::read_dir(self.0.join("qemu/vms")) else {
            return;
        };
        for vm in vms.flatten() {
            if let Some(pid) = std::fs::read_to_string(vm.path().join("qemu.pid"))
                .ok()
                .and_then(|s| s.trim().parse::<u32>().ok())
            {
                let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
            }
        }
    }
}

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let n: usize = std::env::var("N")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40);
    let dir = tempfile::Builder::new()
        .prefix("boxery-bench-mcp-")
        .tempdir()
        .unwrap();
    let home = dir.path();
    let _q = Qemus(home);
    let manifest = home.join("vm.yaml");
    std::fs::write(
        &manifest,
        "apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata:\n  name: b1\nspec:\n  source:\n    image: tiny\n  resources:\n    cpus: 1\n    memory: 256Mi\n    disk: 1Gi\n",
    )
    .unwrap();
    let mut m = Mcp::start(home);
    let t = Instant::now();
    m.call(
        "vm_apply",
        serde_json::json!({"manifest": std::fs::read_to_string(&manifest).unwrap(), "timeout_seconds": 900}),
    );
    println!("vm_apply tiny → Ready: {:.1} s", t.elapsed().as_secs_f64());
    let cfg = home.join("ssh/config");
    let bare = || {
        let st = Command::new("ssh")
            .arg("-F")
            .arg(&cfg)
            .args(["b1.boxery", "-T", "-o", "BatchMode=yes", "--", "true"])
            .stdin(Stdio::null())
            .status()
            .unwrap();
        assert!(st.success());
    };
    // Cold: no ControlMaster.
    let _ = Command::new("ssh")
        .arg("-F")
        .arg(&cfg)
        .args(["-O", "exit", "b1.boxery"])
        .stderr(Stdio::null())
        .status();
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    m.call("vm_bash", serde_json::json!({"command": "true"}));
    let cold = t.elapsed();
    // Warm, interleaved.
    let (mut tool, mut ssh) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        m.call("vm_bash", serde_json::json!({"command": "true"}));
        bare();
    }
    for _ in 0..n {
        let t = Instant::now();
        m.call("vm_bash", serde_json::json!({"command": "true"}));
        tool.push(t.elapsed());
        let t = Instant::now();
        bare();
        ssh.push(t.elapsed());
    }
    // Server overhead: a tool that does no I/O.
    let mut over = Vec::new();
    for _ in 0..(n * 5) {
        let t = Instant::now();
        m.call("vm_use", serde_json::json!({}));
        over.push(t.elapsed());
    }
    let (tp50, tp99) = (pct(&mut tool, 0.5), pct(&mut tool, 0.99));
    let (sp50, sp99) = (pct(&mut ssh, 0.5), pct(&mut ssh, 0.99));
    println!("samples: {n} warm pairs, {} overhead calls", n * 5);
    println!("cold first vm_bash (new ControlMaster): {}", ms(cold));
    println!("warm vm_bash true:  p50 {}  p99 {}", ms(tp50), ms(tp99));
    println!("warm bare ssh true: p50 {}  p99 {}", ms(sp50), ms(sp99));
    println!(
        "ratio p50 {:.2}x (target <= 1.1x)",
        tp50.as_secs_f64() / sp50.as_secs_f64()
    );
    println!(
        "MCP overhead per call (vm_use): p50 {}  p99 {} (target p50 <= 2 ms)",
        ms(pct(&mut over, 0.5)),
        ms(pct(&mut over, 0.99))
    );
    m.call(
        "vm_delete",
        serde_json::json!({"names": ["b1"], "timeout_seconds": 120}),
    );
}
