//! Helpers for the end-to-end tests: an isolated `$BOXERY_HOME`, running the `boxery` binary,
//! and a `boxery serve` child process that is always killed (by PID) when dropped.
#![allow(dead_code)]

pub mod api;
pub mod http;
pub mod invariants;
pub mod mcp_stdio;
pub mod upstream;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use boxery_backends::fake::FakeBackend;
use boxery_store::Store;

/// The python with `modules` (`mcp, jsonschema`): $BOXERY_TEST_PYTHON, else
/// target/mcp-venv (scripts/test.sh installs the MCP SDK, the kubernetes client and
/// Playwright there); a missing one fails the test, saying so.
pub fn python_with(modules: &str) -> PathBuf {
    let python = std::env::var_os("BOXERY_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/mcp-venv/bin/python")
        });
    let has = Command::new(&python)
        .args(["-c", &format!("import {modules}")])
        .output();
    assert!(
        has.is_ok_and(|o| o.status.success()),
        "no python with `{modules}` at {}: scripts/test.sh installs it into target/mcp-venv (pip install mcp jsonschema kubernetes playwright)",
        python.display()
    );
    python
}

/// The boxery binary under test.
pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_boxery")
}

/// An isolated boxery home on the fake backend.
pub struct Home {
    pub dir: tempfile::TempDir,
}

impl Home {
    pub fn new() -> Self {
        Home {
            dir: tempfile::Builder::new()
                .prefix("boxery-test-")
                .tempdir()
                .expect("tempdir"),
        }
    }
    pub fn path(&self) -> &Path {
        self.dir.path()
    }
    pub fn cmd(&self) -> Command {
        let mut c = Command::new(bin());
        c.env("BOXERY_HOME", self.path())
            .env("BOXERY_BACKEND", "fake")
            .env_remove("BOXERY_FAKE_FAULTS")
            .stdin(Stdio::null());
        c
    }
    /// Run `boxery ARGS…` and return its output.
    pub fn run(&self, args: &[&str]) -> Output {
        self.cmd().args(args).output().expect("run boxery")
    }
    /// Run and assert success; returns stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let o = self.run(args);
        assert!(
            o.status.success(),
            "boxery {args:?} failed ({:?}):\nstdout: {}\nstderr: {}",
            o.status.code(),
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }
    pub fn store(&self) -> Store {
        std::fs::create_dir_all(self.path()).unwrap();
        Store::open(&self.path().join("store.db")).expect("open store")
    }
    pub fn fake(&self) -> FakeBackend {
        FakeBackend::new(self.path().join("fake"))
    }
    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    }
    /// Start `boxery serve`.
    pub fn serve(&self, extra: &[&str]) -> Serve {
        self.serve_env(extra, &[])
    }

    /// Start `boxery serve` with extra environment variables.
    pub fn serve_env(&self, extra: &[&str], envs: &[(&str, &str)]) -> Serve {
        let log = self.path().join("serve.log");
        let logf = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        // Every second unless the test says otherwise.
        let inventory: &[&str] = if extra.contains(&"--inventory-every") {
            &[]
        } else {
            &["--inventory-every", "1s"]
        };
        let child = self
            .cmd()
            .args(["serve"])
            .args(inventory)
            .args(extra)
            .env("BOXERY_LOG", "warn")
            .envs(envs.iter().copied())
            .stdout(logf.try_clone().unwrap())
            .stderr(logf)
            .spawn()
            .expect("spawn serve");
        Serve {
            child: Some(child),
            log,
        }
    }
}

/// A running `boxery serve`, killed by PID on drop.
pub struct Serve {
    child: Option<Child>,
    pub log: PathBuf,
}

impl Serve {
    /// Wait until it leads the store (so no `--wait` runs the controllers in-process first).
    pub fn wait_leading(&self) {
        eventually(Duration::from_secs(20), || {
            std::fs::read_to_string(&self.log)
                .unwrap_or_default()
                .contains("leading")
                .then_some(())
        })
        .unwrap_or_else(|| panic!("serve does not lead: see {}", self.log.display()));
    }
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }
    /// SIGKILL it and reap it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
    /// Whether it is still running.
    pub fn alive(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Poll `f` until it returns Some or `timeout` passes.
pub fn eventually<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub const VM_YAML: &str = "apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata:\n  name: NAME\nspec:\n  source:\n    image: debian-12\n";

/// A Vm manifest named `name`.
pub fn vm_yaml(name: &str) -> String {
    VM_YAML.replace("NAME", name)
}

/// Drives a command on a pseudo-terminal (python's `pty`): answers `ANSWER` once the prompt
/// asks for `yes`; prints what the terminal showed; exits with the command's code.
const PTY_DRIVER: &str = r#"
import os, pty, sys, select, time
answer = sys.argv[1]; args = sys.argv[2:]
pid, fd = pty.fork()
if pid == 0:
    os.execv(args[0], args)
out = b""; sent = False; deadline = time.time() + 120
while time.time() < deadline:
    r, _, _ = select.select([fd], [], [], 0.2)
    if r:
        try:
            data = os.read(fd, 4096)
        except OSError:
            break
        if not data:
            break
        out += data
        if not sent and b"Type yes" in out:
            os.write(fd, (answer + "\n").encode()); sent = True
_, status = os.waitpid(pid, 0)
sys.stdout.write(out.decode(errors="replace"))
sys.exit(os.waitstatus_to_exitcode(status))
"#;

/// Run `boxery ARGS` on a pseudo-terminal (the fake backend, `envs` set), typing `answer` at
/// the prompt that asks for `yes`: what the terminal showed is the output's stdout.
pub fn on_a_terminal(
    home: &Home,
    answer: &str,
    args: &[&str],
    envs: &[(&str, &str)],
) -> std::process::Output {
    let driver = home.write("pty_driver.py", PTY_DRIVER);
    std::process::Command::new("python3")
        .arg(driver)
        .arg(answer)
        .arg(bin())
        .args(args)
        .env("BOXERY_HOME", home.path())
        .env("BOXERY_BACKEND", "fake")
        .envs(envs.iter().copied())
        .stdin(std::process::Stdio::null())
        .output()
        .expect("python3 runs the pty driver")
}
