//! What the benches of a real VM (computer use, the agent's browser, `boxery forward`) share:
//! a home with its `serve`, a manifest applied and waited for, a bare ssh through the home's
//! ControlMaster, one `boxery mcp` session, and paired timings interleaved so the machine's
//! drift hits both sides alike.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_boxery")
}

pub struct Home(pub PathBuf);

impl Home {
    pub fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(bin());
        c.args(args)
            .env("BOXERY_HOME", &self.0)
            .env("BOXERY_BACKEND", "qemu")
            .env_remove("BOXERY_CONTEXT")
            .stdin(Stdio::null());
        c
    }
    /// Write `text` as the home's file `name`; its path.
    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }
    /// `boxery apply -f manifest --wait --timeout timeout`.
    pub fn apply_wait(&self, manifest: &std::path::Path, timeout: &str) {
        self.ok(&[
            "apply",
            "-f",
            manifest.to_str().unwrap(),
            "--wait",
            "--timeout",
            timeout,
        ]);
    }
    pub fn ok(&self, args: &[&str]) -> String {
        let o = self.cmd(args).output().unwrap();
        assert!(
            o.status.success(),
            "{args:?} ({:?}): {}{}",
            o.status.code(),
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }
    /// A bare ssh to the VM through the home's ssh config (its ControlMaster), stdout dropped.
    pub fn ssh(&self, vm: &str, command: &str) {
        let o = Command::new("ssh")
            .arg("-F")
            .arg(self.0.join("ssh/config"))
            .args([&format!("{vm}.boxery"), command])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        assert!(o.status.success(), "ssh {command}: {o:?}");
        std::hint::black_box(o.stdout.len());
    }
    /// A bare ssh to the VM through the home's ssh config with `input` on its stdin; its
    /// stdout.
    pub fn ssh_in(&self, vm: &str, command: &str, input: &[u8]) -> Vec<u8> {
        let mut c = Command::new("ssh")
            .arg("-F")
            .arg(self.0.join("ssh/config"))
            .args([&format!("{vm}.boxery"), command])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        c.stdin.take().unwrap().write_all(input).unwrap();
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "ssh {command}: {o:?}");
        o.stdout
    }
}

/// A child killed (and reaped) when dropped.
pub struct Kid(pub Child);
impl Drop for Kid {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One `boxery mcp` session over stdio (newline-delimited JSON-RPC).
pub struct Mcp {
    _kid: Kid,
    tx: ChildStdin,
    rx: BufReader<ChildStdout>,
    id: u64,
}

impl Mcp {
    pub fn start(h: &Home) -> Mcp {
        let mut c = h.cmd(&["mcp"]);
        c.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        let mut kid = c.spawn().unwrap();
        let tx = kid.stdin.take().unwrap();
        let rx = BufReader::new(kid.stdout.take().unwrap());
        let mut m = Mcp {
            _kid: Kid(kid),
            tx,
            rx,
            id: 0,
        };
        m.request(
            "initialize",
            json!({"protocolVersion": "2025-06-18", "capabilities": {},
                   "clientInfo": {"name": "bench", "version": "0"}}),
        );
        m.send(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
        m
    }
    pub fn send(&mut self, v: &Value) {
        writeln!(self.tx, "{v}").unwrap();
        self.tx.flush().unwrap();
    }
    pub fn request(&mut self, method: &str, params: Value) -> Value {
        self.id += 1;
        let id = self.id;
        self.send(&json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}));
        loop {
            let mut line = String::new();
            assert!(
                self.rx.read_line(&mut line).unwrap() > 0,
                "boxery mcp ended"
            );
            let v: Value = serde_json::from_str(&line).unwrap();
            if v["id"] == id {
                return v;
            }
        }
    }
    /// The tool `name` with `args`; panics on a tool error.
    pub fn tool(&mut self, name: &str, args: Value) -> Value {
        let r = self.request("tools/call", json!({"name": name, "arguments": args}));
        assert!(
            r["result"]["isError"] != true && r.get("error").is_none(),
            "{name} {args}: {r}"
        );
        r
    }
}

/// The pairs a bench times: `$BOXERY_BENCH_PAIRS`, else `default`.
pub fn bench_pairs(default: usize) -> usize {
    std::env::var("BOXERY_BENCH_PAIRS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// A new home in a temporary directory with its `serve` running: the directory (removed when
/// dropped), the home and the `serve` (killed when dropped).
pub fn serving() -> (tempfile::TempDir, Home, Kid) {
    let dir = tempfile::tempdir().unwrap();
    let h = Home(dir.path().to_path_buf());
    let serve = Kid(h
        .cmd(&["serve"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap());
    (dir, h, serve)
}

pub fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

pub fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1000.0)
}

/// `n` interleaved pairs: `a` then `b`, `b` then `a`, …
pub fn pairs(
    n: usize,
    mut a: impl FnMut(usize),
    mut b: impl FnMut(usize),
) -> (Vec<Duration>, Vec<Duration>) {
    let (mut ta, mut tb) = (Vec::new(), Vec::new());
    for i in 0..n {
        let time = |f: &mut dyn FnMut(usize)| {
            let t = Instant::now();
            f(i);
            t.elapsed()
        };
        if i % 2 == 0 {
            ta.push(time(&mut a));
            tb.push(time(&mut b));
        } else {
            tb.push(time(&mut b));
            ta.push(time(&mut a));
        }
    }
    (ta, tb)
}

pub fn row(
    what: &str,
    n: usize,
    a: &mut [Duration],
    b: &mut [Duration],
    floor: &str,
    target: &str,
) {
    let (a50, b50) = (pct(a, 0.5), pct(b, 0.5));
    println!(
        "| {what} ({n} pairs) | {} (p90 {}) | {floor}: {} (p90 {}) | {:.2}× | {target} |",
        ms(a50),
        ms(pct(a, 0.9)),
        ms(b50),
        ms(pct(b, 0.9)),
        a50.as_secs_f64() / b50.as_secs_f64()
    );
}
