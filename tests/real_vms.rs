//! End to end with real VMs: the `boxery` binary on each real backend (`qemu`, and `libvirt`
//! against a real libvirtd), guests under TCG. The same tests, the same manifests, run on both:
//! `qemu::…` and `libvirt::…`.
//!
//! apply a Vm (the small `tiny` guest) → Ready → `run` → write a file → `snap` → change it →
//! `revert` → the file is back → `fork` into two → both reachable with their own hostname,
//! machine-id, MAC and host key → `stop`/`start` → `resize` → `cp` both ways → delete → no
//! VM process or domain, disk, image or port left. Crashes: `serve` SIGKILLed during a create
//! and during a capture of a running VM converges with nothing leaked; a VM whose QEMU is
//! killed under it is started again (Warning `Restarted`). The example manifests
//! (`manifests/examples/{vm,snapshot,fork}.yaml`) unchanged, on the full `debian-12` guest. A
//! pool's lease cycle. These tests fail (never pass) when QEMU or libvirt is missing, and the
//! libvirt ones fail when the binary was built without `--features libvirt`.

#[path = "real_vms/cloud_image.rs"]
mod cloud_image;
mod common;
#[path = "real_vms/desktop.rs"]
mod desktop;
#[path = "real_vms/dev_traffic.rs"]
mod dev_traffic;
#[path = "real_vms/layers.rs"]
mod layers;
#[path = "real_vms/ssh_agent.rs"]
mod ssh_agent;
#[path = "real_vms/usage.rs"]
mod usage;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::Home;

/// Which real backend a test drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Qemu,
    Libvirt,
    /// System containers on a real incusd (where `tiny` is the debian-12 container).
    Incus,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Qemu => "qemu",
            Kind::Libvirt => "libvirt",
            Kind::Incus => "incus",
        }
    }
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn require_qemu() {
    let ok = std::process::Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "qemu-system-x86_64 is not installed: run scripts/install-deps.sh (as root); real-VM tests cannot run without it"
    );
}

/// A libvirtd that answers: started by scripts/libvirtd.sh unless one already does.
fn require_libvirtd() {
    let out = std::process::Command::new("bash")
        .arg(repo().join("scripts/libvirtd.sh"))
        .arg("start")
        .output()
        .expect("run scripts/libvirtd.sh");
    assert!(
        out.status.success(),
        "no libvirtd: scripts/libvirtd.sh start failed (install libvirt with scripts/install-libvirt.sh): {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// An incusd that answers: started by scripts/incusd.sh unless one already does.
fn require_incusd() {
    let out = std::process::Command::new("bash")
        .arg(repo().join("scripts/incusd.sh"))
        .arg("start")
        .output()
        .expect("run scripts/incusd.sh");
    assert!(
        out.status.success(),
        "no incusd: scripts/incusd.sh start failed (install Incus with scripts/install-incus.sh): {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `incus ARGS` (the daemon's own client): its stdout.
fn incus(args: &[&str]) -> String {
    let o = std::process::Command::new("incus")
        .args(args)
        .output()
        .expect("incus is installed (scripts/install-incus.sh)");
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn virsh(args: &[&str]) -> String {
    let o = std::process::Command::new("virsh")
        .args(["-q", "-c", "qemu:///system"])
        .args(args)
        .output()
        .expect("virsh is installed (scripts/install-libvirt.sh)");
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A home on one real backend; on drop, every VM it started is killed (QEMU: by its pidfile;
/// libvirt: its namespace's domains destroyed and undefined, its storage pool removed).
struct RealHome {
    home: Home,
    kind: Kind,
    /// Environment for every command and `serve` of this home.
    env: Vec<(String, String)>,
}

impl RealHome {
    fn new(kind: Kind) -> Self {
        match kind {
            Kind::Qemu => require_qemu(),
            Kind::Libvirt => {
                require_qemu();
                require_libvirtd();
            }
            Kind::Incus => require_incusd(),
        }
        let home = Home::new();
        let log = home.path().join("ssh-debug.log").display().to_string();
        let mut env = vec![("BOXERY_SSH_LOG".into(), log)];
        // e.g. BOXERY_TEST_LOG=boxery_reconcilers=debug: serve's and every command's log level
        if let Ok(filter) = std::env::var("BOXERY_TEST_LOG") {
            env.push(("BOXERY_LOG".into(), filter));
        }
        RealHome { home, kind, env }
    }
    /// `boxery ARGS`, bounded: a command that outlives its own `--timeout` by two minutes (or
    /// runs six minutes without one) is killed and the test fails saying which, with the
    /// objects' state: a test here never waits without a bound.
    fn cmd(&self, args: &[&str]) -> std::process::Output {
        let mut c = self.home.cmd();
        c.env("BOXERY_BACKEND", self.kind.name())
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .args(args);
        let limit =
            own_timeout(args).unwrap_or(Duration::from_secs(240)) + Duration::from_secs(120);
        bounded(c, limit).unwrap_or_else(|partial| {
            panic!(
                "boxery {args:?} on {} did not finish within {limit:?} (killed):\nstdout: {}\nstderr: {}\n{}",
                self.kind.name(),
                String::from_utf8_lossy(&partial.stdout),
                String::from_utf8_lossy(&partial.stderr),
                self.state_report()
            )
        })
    }
    fn ok(&self, args: &[&str]) -> String {
        let o = self.cmd(args);
        assert!(
            o.status.success(),
            "boxery {args:?} on {} failed ({:?}):\nstdout: {}\nstderr: {}\n{}",
            self.kind.name(),
            o.status.code(),
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr),
            self.state_report()
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }
    /// For a failure message: the end of serve's log (first: CI shows the start of a long
    /// failure message) and who leads the store, then every object of this home described
    /// (status, conditions, events).
    fn state_report(&self) -> String {
        let log = std::fs::read_to_string(self.home.path().join("serve.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(40).collect();
        let version = self.cmd(&["version"]);
        let mut out = format!(
            "--- serve.log, newest first:\n{}\n--- boxery version:\n{}",
            tail.join("\n"),
            String::from_utf8_lossy(&version.stdout)
        );
        for kind in ["vm", "image", "pool", "lease"] {
            let names = self.cmd(&["get", kind, "-o", "name"]);
            for n in String::from_utf8_lossy(&names.stdout).lines() {
                let name = n.rsplit('/').next().unwrap_or(n);
                let d = self.cmd(&["describe", kind, name]);
                out.push_str(&format!(
                    "--- {kind} {name}\n{}",
                    String::from_utf8_lossy(&d.stdout)
                ));
            }
        }
        out
    }
    /// `boxery run VM -- CMD`; on failure, the end of ssh's own debug log (`BOXERY_SSH_LOG`,
    /// set for every command and `serve` of these homes) besides boxery's output.
    fn run(&self, vm: &str, cmd: &str) -> String {
        let o = self.cmd(&["run", vm, "--", cmd]);
        if !o.status.success() {
            let log = std::fs::read_to_string(self.ssh_log()).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(60).collect();
            panic!(
                "boxery run {vm} -- {cmd:?} on {} failed ({:?}):\nstdout: {}\nstderr: {}\nssh log (last lines, newest first): {tail:#?}",
                self.kind.name(),
                o.status.code(),
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
        }
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    }
    /// `bash -c SCRIPT` in this home's environment, with `$BOXERY` the binary (bounded).
    fn shell(&self, script: &str) -> std::process::Output {
        let base = self.home.cmd();
        let mut c = std::process::Command::new("bash");
        c.arg("-c").arg(script).env("BOXERY", base.get_program());
        for (k, v) in base.get_envs() {
            match v {
                Some(v) => c.env(k, v),
                None => c.env_remove(k),
            };
        }
        c.env("BOXERY_BACKEND", self.kind.name())
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(std::process::Stdio::null());
        bounded(c, Duration::from_secs(120))
            .unwrap_or_else(|p| panic!("bash -c {script:?} did not finish in 2 min: {p:?}"))
    }
    fn ssh_log(&self) -> PathBuf {
        self.home.path().join("ssh-debug.log")
    }
    fn apply_file(&self, path: &Path, timeout: &str) {
        self.ok(&[
            "apply",
            "-f",
            path.to_str().unwrap(),
            "--wait",
            "--timeout",
            timeout,
        ]);
    }
    fn qemu_dir(&self) -> PathBuf {
        self.home.path().join("qemu")
    }
    /// The libvirt domain prefix of this home (`bx-<namespace>-`).
    fn domain_prefix(&self) -> String {
        format!("bx-{}-", self.namespace())
    }
    #[cfg(feature = "libvirt")]
    fn libvirt(&self) -> boxery_backends::libvirt::LibvirtBackend {
        boxery_backends::libvirt::LibvirtBackend::new(boxery_backends::state_dir(
            self.home.path(),
            "libvirt",
        ))
    }
    #[cfg(feature = "libvirt")]
    fn namespace(&self) -> String {
        self.libvirt().namespace().to_string()
    }
    #[cfg(not(feature = "libvirt"))]
    fn namespace(&self) -> String {
        unreachable!("libvirt tests exist only with --features libvirt")
    }
    fn incus_backend(&self) -> boxery_backends::incus::IncusBackend {
        boxery_backends::incus::IncusBackend::new(boxery_backends::state_dir(
            self.home.path(),
            "incus",
        ))
    }
    /// This home's Incus instances (`all`: stopped ones and images too): their names.
    fn instances(&self, all: bool) -> Vec<String> {
        let b = self.incus_backend();
        let mut projects = vec![b.project().to_string()];
        if all {
            projects.push(b.image_project().to_string());
        }
        projects
            .iter()
            .flat_map(|p| {
                incus(&["list", "--project", p, "-f", "csv", "-c", "ns"])
                    .lines()
                    .filter(|l| all || l.ends_with(",RUNNING"))
                    .map(|l| format!("{p}/{}", l.split(',').next().unwrap_or("")))
                    .collect::<Vec<_>>()
            })
            .collect()
    }
    fn domains(&self, all: bool) -> Vec<String> {
        let prefix = self.domain_prefix();
        let list = if all {
            virsh(&["list", "--all", "--name"])
        } else {
            virsh(&["list", "--name"])
        };
        list.lines()
            .map(str::trim)
            .filter(|l| l.starts_with(&prefix))
            .map(String::from)
            .collect()
    }
    /// The VMs running now: QEMU PIDs this home started, or this home's running domains.
    fn running(&self) -> Vec<String> {
        match self.kind {
            Kind::Qemu => {
                let mut out = Vec::new();
                let Ok(vms) = std::fs::read_dir(self.qemu_dir().join("vms")) else {
                    return out;
                };
                for vm in vms.flatten() {
                    if let Some(pid) = std::fs::read_to_string(vm.path().join("qemu.pid"))
                        .ok()
                        .and_then(|s| s.trim().parse::<u32>().ok())
                        && Path::new(&format!("/proc/{pid}")).exists()
                    {
                        out.push(pid.to_string());
                    }
                }
                out
            }
            Kind::Libvirt => self.domains(false),
            Kind::Incus => self.instances(false),
        }
    }
    /// The PID of `vm`'s hypervisor process (QEMU's pidfile, or libvirt's for the domain).
    fn hypervisor_pid(&self, vm: &str) -> u32 {
        if self.kind == Kind::Incus {
            // the container's init, as the host sees it
            let b = self.incus_backend();
            let state = incus(&[
                "query",
                &format!(
                    "/1.0/instances/{}/state?project={}",
                    boxery_backends::incus::instance_name(vm),
                    b.project()
                ),
            ]);
            let v: serde_json::Value = serde_json::from_str(&state).unwrap();
            return v["pid"].as_u64().filter(|p| *p > 0).unwrap() as u32;
        }
        let file = match self.kind {
            Kind::Qemu => self.qemu_dir().join("vms").join(vm).join("qemu.pid"),
            Kind::Libvirt => PathBuf::from(format!(
                "/run/libvirt/qemu/{}{vm}.pid",
                self.domain_prefix()
            )),
            Kind::Incus => unreachable!(),
        };
        std::fs::read_to_string(&file)
            .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
            .trim()
            .parse()
            .unwrap()
    }
    /// What a backend keeps per VM or image, when none should exist (bases are a cache and stay).
    fn leftovers(&self) -> Vec<String> {
        let list = |d: PathBuf, keep: &dyn Fn(&str) -> bool| -> Vec<String> {
            std::fs::read_dir(&d)
                .into_iter()
                .flatten()
                .flatten()
                .filter(|e| keep(&e.file_name().to_string_lossy()))
                .map(|e| e.path().display().to_string())
                .collect()
        };
        match self.kind {
            Kind::Qemu => ["vms", "images", "ports"]
                .iter()
                .flat_map(|d| list(self.qemu_dir().join(d), &|_| true))
                .collect(),
            Kind::Libvirt => {
                let mut out = self.domains(true);
                out.extend(list(self.home.path().join("libvirt/images"), &|_| true));
                out.extend(list(self.pool_dir(), &|f| !f.starts_with("base-")));
                out
            }
            Kind::Incus => self.instances(true),
        }
    }
    #[cfg(feature = "libvirt")]
    fn pool_dir(&self) -> PathBuf {
        self.libvirt().pool_dir().to_path_buf()
    }
    #[cfg(not(feature = "libvirt"))]
    fn pool_dir(&self) -> PathBuf {
        unreachable!("libvirt tests exist only with --features libvirt")
    }
    /// Start following `boxery get KIND -o json --watch` (every stored revision of every object
    /// of the kind, none missed, unlike polling); returns once its first list is read,
    /// so that every later revision is seen (start it before the change to watch for: a change
    /// that is over before the watch starts shows only in the list, as its end state).
    fn watch(&self, kind: &str) -> Watch<'_> {
        let mut c = self.home.cmd();
        c.env("BOXERY_BACKEND", self.kind.name())
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .args(["get", kind, "-o", "json", "--watch"])
            .stdout(std::process::Stdio::piped());
        let mut child = c.spawn().expect("spawn boxery get --watch");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let docs =
                serde_json::Deserializer::from_reader(stdout).into_iter::<serde_json::Value>();
            // the first document is the listing (a List, or the object when there is one),
            // then one object per change
            for (i, doc) in docs.map_while(Result::ok).enumerate() {
                let objs = match doc.get("items").and_then(|i| i.as_array()) {
                    Some(items) => items.clone(),
                    None => vec![doc],
                };
                for o in objs {
                    if tx.send(Some(o)).is_err() {
                        return;
                    }
                }
                if i == 0 && tx.send(None).is_err() {
                    return;
                }
            }
        });
        let mut seen = Vec::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match rx.recv_timeout(left) {
                Ok(Some(o)) => seen.push(o),
                Ok(None) => break,
                Err(_) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!("`boxery get {kind} --watch` listed nothing within 60 s");
                }
            }
        }
        Watch {
            h: self,
            kind: kind.to_string(),
            child,
            rx,
            seen,
        }
    }
    fn vm_json(&self, vm: &str) -> serde_json::Value {
        serde_json::from_str(&self.ok(&["get", "vm", vm, "-o", "json"])).unwrap()
    }
    /// `boxery serve` on this home's backend and environment (the common helper, whose
    /// `fake` default these override).
    fn serve(&self) -> common::Serve {
        self.serve_with(&[])
    }
    /// [`RealHome::serve`] with `extra` in its environment.
    fn serve_with(&self, extra: &[(&str, &str)]) -> common::Serve {
        self.serve_args(&[], extra)
    }
    /// [`RealHome::serve`] with `args` and `extra` in its environment.
    fn serve_args(&self, args: &[&str], extra: &[(&str, &str)]) -> common::Serve {
        let mut envs: Vec<(&str, &str)> = vec![("BOXERY_BACKEND", self.kind.name())];
        envs.extend(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        envs.extend_from_slice(extra);
        self.home.serve_env(args, &envs)
    }
}

/// A `boxery get KIND -o json --watch` under way ([`RealHome::watch`]); killed when dropped.
struct Watch<'a> {
    h: &'a RealHome,
    kind: String,
    child: std::process::Child,
    rx: std::sync::mpsc::Receiver<Option<serde_json::Value>>,
    /// What the first list held, checked first.
    seen: Vec<serde_json::Value>,
}

impl Watch<'_> {
    /// Until `pred` holds for `name` in the list or a later revision; the matching object. On
    /// timeout, panics with `what`, the object last seen and serve's log.
    fn until(
        mut self,
        name: &str,
        timeout: Duration,
        what: &str,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let deadline = std::time::Instant::now() + timeout;
        let mut last = serde_json::Value::Null;
        let mut seen = std::mem::take(&mut self.seen).into_iter();
        let found = loop {
            let next = match seen.next() {
                Some(o) => Ok(Some(o)),
                None => self
                    .rx
                    .recv_timeout(deadline.saturating_duration_since(std::time::Instant::now())),
            };
            match next {
                Ok(Some(o)) if o["metadata"]["name"] == name => {
                    if pred(&o) {
                        break Some(o);
                    }
                    last = o;
                }
                Ok(_) => {}
                Err(_) => break None,
            }
        };
        found.unwrap_or_else(|| {
            panic!(
                "{what}: not seen in {timeout:?} on {}; {} {name} last seen: {last:#}\nserve.log:\n{}",
                self.h.kind.name(),
                self.kind,
                std::fs::read_to_string(self.h.home.path().join("serve.log")).unwrap_or_default()
            )
        })
    }
}

impl Drop for Watch<'_> {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for RealHome {
    fn drop(&mut self) {
        match self.kind {
            Kind::Qemu => {
                for pid in self.running() {
                    let _ = std::process::Command::new("kill")
                        .args(["-9", &pid])
                        .status();
                }
            }
            Kind::Libvirt => {
                for d in self.domains(true) {
                    virsh(&["destroy", &d]);
                    virsh(&["undefine", &d]);
                }
                let pool = format!("boxery-{}", self.namespace());
                virsh(&["pool-destroy", &pool]);
                virsh(&["pool-undefine", &pool]);
                let _ = std::fs::remove_dir_all(self.pool_dir());
            }
            Kind::Incus => {
                let b = self.incus_backend();
                let done = std::thread::spawn(move || {
                    tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .unwrap()
                        .block_on(b.teardown())
                })
                .join();
                if !matches!(done, Ok(Ok(()))) {
                    eprintln!("the incus home's teardown failed: {done:?}");
                }
            }
        }
    }
}

/// The `--timeout D` / `--timeout=D` a command was given (`s`, `m` units), if any.
fn own_timeout(args: &[&str]) -> Option<Duration> {
    let v = args.iter().enumerate().find_map(|(i, a)| {
        a.strip_prefix("--timeout=").or_else(|| {
            (*a == "--timeout")
                .then(|| args.get(i + 1).copied())
                .flatten()
        })
    })?;
    let (n, unit) = v.split_at(v.find(|c: char| !c.is_ascii_digit())?);
    let n: u64 = n.parse().ok()?;
    match unit {
        "s" => Some(Duration::from_secs(n)),
        "m" => Some(Duration::from_secs(n * 60)),
        "h" => Some(Duration::from_secs(n * 3600)),
        _ => None,
    }
}

/// Run `c` to the end, or kill it after `limit` (then `Err` with what it printed so far).
fn bounded(
    mut c: std::process::Command,
    limit: Duration,
) -> Result<std::process::Output, std::process::Output> {
    use std::io::Read;
    use std::process::Stdio;
    let mut child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run boxery");
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut buf);
            }
            buf
        })
    };
    let out = drain(
        child
            .stdout
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let err = drain(
        child
            .stderr
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let deadline = std::time::Instant::now() + limit;
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait for boxery") {
            break Some(st);
        }
        if std::time::Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // a killed command's children (ssh, a ControlMaster) may hold the pipes: never join them
    // past the command's own end by more than a moment
    let join = |h: std::thread::JoinHandle<Vec<u8>>| {
        let t = std::time::Instant::now();
        while !h.is_finished() && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
        if h.is_finished() {
            h.join().unwrap_or_default()
        } else {
            Vec::new()
        }
    };
    let (stdout, stderr) = (join(out), join(err));
    match status {
        Some(status) => Ok(std::process::Output {
            status,
            stdout,
            stderr,
        }),
        None => Err(std::process::Output {
            status: std::os::unix::process::ExitStatusExt::from_raw(9),
            stdout,
            stderr,
        }),
    }
}

fn tiny_vm(name: &str) -> String {
    format!(
        "apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata:\n  name: {name}\nspec:\n  source:\n    image: tiny\n  resources:\n    cpus: 1\n    memory: 256Mi\n    disk: 1Gi\n"
    )
}

/// The isolation drill (`boxery drill`, docs/egress.md) from inside a real guest, with a
/// sibling VM, for each egress policy in turn, changed while the VM runs: every probe matches
/// and every control works, and the VM was not restarted for it. Needs root (the drill's
/// stand-ins live in a network namespace it makes); without it the drill fails saying so.
fn egress_drill(kind: Kind) {
    let h = RealHome::new(kind);
    // The name the allow list names, answered by the egress proxy (and, on qemu, to the
    // guest's name lookups) with the drill's internet stand-in (no DNS for it on a test
    // machine), and one no allow list names, whose lookup shows the policy refusing it.
    h.home.write(
        "config.yaml",
        "proxy: {egress: {resolve: {internet.drill.test: 203.0.113.10, unlisted.drill.invalid: 203.0.113.10}}}\n",
    );
    let serve = h.serve();
    serve.wait_leading();
    let f = h.home.write(
        "vms.yaml",
        &format!("{}---\n{}", tiny_vm("e1"), tiny_vm("e2")),
    );
    h.apply_file(&f, "10m");
    // The guest's proxy variables are pushed once it is ready.
    common::eventually(Duration::from_secs(120), || {
        (!h.run("e1", "echo \"${http_proxy:-}\"").is_empty()).then_some(())
    })
    .expect("the egress proxy variables reach the guest");
    let boot = |h: &RealHome| h.vm_json("e1")["status"]["conditions"].clone();
    let before = boot(&h);
    for (policy, allow) in [
        ("Public", "[]"),
        ("Allowlist", r#"["internet.drill.test", "*.pypi.org"]"#),
        ("Deny", "[]"),
    ] {
        h.ok(&[
            "patch",
            "vm",
            "e1",
            "-p",
            &format!(
                r#"{{"spec":{{"network":{{"egress":{{"policy":"{policy}","allow":{allow}}}}}}}}}"#
            ),
        ]);
        // In force once the controller observed the new generation (the egress proxy's file
        // and, on libvirt, the NIC's filter).
        common::eventually(Duration::from_secs(60), || {
            let v = h.vm_json("e1");
            (v["status"]["observedGeneration"] == v["metadata"]["generation"]).then_some(())
        })
        .expect("the controller observes the new policy");
        let state = std::fs::read_to_string(h.home.path().join("egress/e1")).unwrap();
        assert!(state.contains(policy), "{state}");
        let o = h.cmd(&["drill", "e1", "--sibling", "e2"]);
        let out = String::from_utf8_lossy(&o.stdout);
        eprintln!("--- drill of e1 on {} under {policy}:\n{out}", kind.name());
        assert!(
            o.status.success() && out.contains("probes matched"),
            "drill under {policy} on {} failed:\n{out}\n{}",
            kind.name(),
            String::from_utf8_lossy(&o.stderr)
        );
        if policy == "Allowlist" {
            let row = out
                .lines()
                .find(|l| l.contains("internet.drill.test (listed)"))
                .unwrap_or_default();
            assert!(
                row.split_whitespace().any(|w| w == "reached"),
                "the listed name reaches the stand-in:\n{out}"
            );
        }
        // on qemu the control plane answers the guest's lookups, by the policy
        let lookup = |name: &str| {
            out.lines()
                .find(|l| l.contains(&format!("name lookup of {name}")))
                .map(str::to_string)
        };
        match (kind, policy) {
            (Kind::Qemu, "Deny") => {
                let row = lookup("internet.drill.test (not allowed)")
                    .unwrap_or_else(|| panic!("a refused lookup probed:\n{out}"));
                assert!(
                    row.trim_start().starts_with("ok ") && row.contains("no answer"),
                    "{row}"
                );
            }
            (Kind::Qemu, _) => {
                let row = lookup("internet.drill.test (allowed)")
                    .unwrap_or_else(|| panic!("an allowed lookup probed:\n{out}"));
                assert!(
                    row.trim_start().starts_with("ok ") && row.contains(" answer "),
                    "{row}"
                );
                if policy == "Allowlist" {
                    assert!(
                        lookup("unlisted.drill.invalid (not allowed)").is_some(),
                        "a refused lookup probed:\n{out}"
                    );
                }
            }
            _ => assert!(
                lookup("internet.drill.test").is_none(),
                "libvirt's guests use their network's DNS:\n{out}"
            ),
        }
    }
    // The Ready condition never changed: the policies changed on the running VM.
    let after = boot(&h);
    let ready = |c: &serde_json::Value| {
        c.as_array()
            .and_then(|a| a.iter().find(|c| c["type"] == "Ready"))
            .map(|c| c["lastTransitionTime"].clone())
    };
    assert_eq!(ready(&before), ready(&after), "the VM was not restarted");
    // With no control plane serving it, a qemu guest's way out says what to run.
    if kind == Kind::Qemu {
        drop(serve);
        // the VM's boxery-net routes the proxy's address to its 503 within half a second of
        // seeing no listener on the proxy's socket (the killed serve left the file behind)
        let net_log = h.home.path().join("qemu/vms/e1/net.log");
        assert!(
            net_log.exists(),
            "the VM's network is its boxery-net's (built beside boxery by `cargo build -p boxery-net`; the workspace's tests build it)"
        );
        common::eventually(Duration::from_secs(5), || {
            std::fs::read_to_string(&net_log)
                .ok()?
                .lines()
                .last()?
                .contains("503")
                .then_some(())
        })
        .unwrap_or_else(|| {
            panic!(
                "boxery-net did not route to its 503: {}",
                std::fs::read_to_string(&net_log).unwrap_or_default()
            )
        });
        let out = h.run(
            "e1",
            "wget -q -O - http://203.0.113.10/ 2>&1; nc -w 3 10.0.2.100 80 </dev/null 2>&1 | tail -1",
        );
        assert!(
            out.contains("503") && out.contains("boxery serve"),
            "no control plane: {out}"
        );
    }
}

fn lifecycle(kind: Kind) {
    let h = RealHome::new(kind);
    let f = h.home.write("vm.yaml", &tiny_vm("t1"));
    h.ok(&[
        "apply",
        "-f",
        f.to_str().unwrap(),
        "--wait",
        "--timeout",
        "10m",
    ]);
    let v = h.vm_json("t1");
    assert!(
        v["status"]["ssh"]["hostKey"]
            .as_str()
            .unwrap()
            .starts_with("ssh-ed25519 "),
        "{v}"
    );
    assert_eq!(h.run("t1", "hostname"), "t1");
    // Exit codes come back; output streams.
    assert_eq!(h.cmd(&["run", "t1", "--", "exit 7"]).status.code(), Some(7));

    // snapshot → change → revert → the file is back
    h.run("t1", "echo before > ~/f && sync");
    h.ok(&["snap", "t1", "s1", "--wait", "--timeout", "2m"]);
    h.run("t1", "echo after > ~/f && sync");
    h.ok(&["revert", "t1", "s1", "--wait", "--timeout", "5m"]);
    assert_eq!(h.run("t1", "cat ~/f"), "before");

    // fork into two: both reachable, each with its own identity
    h.run("t1", "echo forked > ~/f && sync");
    h.ok(&["fork", "t1", "t2", "t3", "--wait", "--timeout", "10m"]);
    let mut seen = std::collections::BTreeSet::new();
    for n in ["t1", "t2", "t3"] {
        let id = h.run(
            n,
            "hostname; cat /etc/machine-id; cat /sys/class/net/eth0/address",
        );
        assert!(seen.insert(id.clone()), "{n} shares an identity: {id}");
        if n != "t1" {
            assert_eq!(h.run(n, "cat ~/f"), "forked", "{n} has the source's disk");
            assert!(id.starts_with(n), "{n}: {id}");
        }
    }
    let keys: std::collections::BTreeSet<String> = ["t1", "t2", "t3"]
        .iter()
        .map(|n| {
            h.vm_json(n)["status"]["ssh"]["hostKey"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(keys.len(), 3, "every VM has its own host key");

    // cp both ways
    let local = h.home.write("payload.txt", "hello from the host\n");
    h.ok(&["cp", local.to_str().unwrap(), "t2:/home/agent/in.txt"]);
    assert_eq!(h.run("t2", "cat /home/agent/in.txt"), "hello from the host");
    let back = h.home.path().join("back.txt");
    h.ok(&["cp", "t2:/home/agent/in.txt", back.to_str().unwrap()]);
    assert_eq!(
        std::fs::read_to_string(&back).unwrap(),
        "hello from the host\n"
    );

    // stop / start / resize while stopped
    h.ok(&["stop", "t3", "--wait", "--timeout", "2m"]);
    assert_eq!(
        h.cmd(&["run", "t3", "--", "true"]).status.code(),
        Some(5),
        "a stopped VM is refused with a clear error"
    );
    h.ok(&[
        "resize",
        "t3",
        "--memory",
        "320Mi",
        "--disk",
        "2Gi",
        "--wait",
        "--timeout",
        "2m",
    ]);
    h.ok(&["start", "t3", "--wait", "--timeout", "5m"]);
    let mem_kib: u64 = h
        .run("t3", "awk '/MemTotal/{print $2}' /proc/meminfo")
        .parse()
        .unwrap();
    assert!(mem_kib > 256 * 1024, "memory grew: {mem_kib} KiB");

    // delete everything: nothing left
    h.ok(&["rm", "t1", "t2", "t3", "--wait", "--timeout", "3m"]);
    h.ok(&["delete", "image", "tiny", "--wait", "--timeout", "1m"]);
    assert!(
        h.running().is_empty(),
        "VMs left running: {:?}",
        h.running()
    );
    assert!(h.leftovers().is_empty(), "left behind: {:?}", h.leftovers());
}

fn crash_during_create_and_capture(kind: Kind) {
    let h = RealHome::new(kind);
    let mut serve = h.serve();
    let f = h.home.write("a.yaml", &tiny_vm("c1"));
    h.ok(&["apply", "-f", f.to_str().unwrap()]);
    h.ok(&["wait", "vm", "c1", "--for=condition=Ready", "--timeout=10m"]);
    // Kill during a create: as soon as the Create operation is recorded.
    let f = h.home.write("b.yaml", &tiny_vm("c2"));
    let create = h.watch("vm");
    h.ok(&["apply", "-f", f.to_str().unwrap()]);
    create.until("c2", Duration::from_secs(180), "c2's create", |vm| {
        vm["status"]["operation"]["type"] == "Create"
    });
    std::thread::sleep(Duration::from_millis(300));
    serve.kill();
    serve = h.serve();
    // Kill during a capture of the running c1.
    h.run("c1", "head -c 33554432 /dev/urandom > ~/blob && sync");
    // the watch starts first: a small capture can be over before a watch started after it
    let capture = h.watch("image");
    h.ok(&["snap", "c1", "s1"]);
    capture.until("c1.s1", Duration::from_secs(180), "c1's capture", |img| {
        img["status"]["operation"]["type"] == "Capture"
    });
    serve.kill();
    let _serve = h.serve();
    h.ok(&["wait", "vm", "c2", "--for=condition=Ready", "--timeout=10m"]);
    h.ok(&[
        "wait",
        "image",
        "c1.s1",
        "--for=condition=Ready",
        "--timeout=5m",
    ]);
    h.ok(&["wait", "vm", "c1", "--for=condition=Ready", "--timeout=5m"]);
    assert_eq!(h.run("c1", "ls ~/blob"), "/home/agent/blob");
    // One QEMU per VM, no more.
    assert_eq!(
        h.running().len(),
        2,
        "one running VM per Vm: {:?}",
        h.running()
    );
    // The hypervisor ends under a running VM (as QEMU does on an internal assertion): the
    // ordinary reconcile starts it again and says so, with what QEMU said last.
    let pid = h.hypervisor_pid("c2");
    // a container's init (systemd) takes TERM as "re-execute": it ends on KILL
    let signal = if kind == Kind::Incus { "KILL" } else { "TERM" };
    assert!(
        std::process::Command::new("kill")
            .args(["-s", signal, &pid.to_string()])
            .status()
            .unwrap()
            .success()
    );
    // Noticed by the inventory pass (every 1 s here) or, when a `serve` takes over the store
    // just then, by its first reconcile; not by the 60 s resync.
    let events = common::eventually(Duration::from_secs(30), || {
        let d = h.ok(&["describe", "vm", "c2"]);
        d.contains("Restarted").then_some(d)
    })
    .unwrap_or_else(|| {
        panic!(
            "no Restarted event after c2's QEMU was killed:\n{}",
            h.ok(&["describe", "vm", "c2"])
        )
    });
    if kind != Kind::Incus {
        assert!(
            events.contains("terminating on signal 15"),
            "the event quotes QEMU's last words: {events}"
        );
    }
    h.ok(&["wait", "vm", "c2", "--for=condition=Ready", "--timeout=5m"]);
    assert_eq!(h.run("c2", "hostname"), "c2");
    assert_ne!(h.hypervisor_pid("c2"), pid, "a new hypervisor process");
    assert_eq!(h.running().len(), 2, "{:?}", h.running());
    h.ok(&["rm", "c1", "c2", "--wait", "--timeout", "3m"]);
    // c1's snapshot is owned by c1 and goes with it
    h.ok(&["wait", "image", "c1.s1", "--for=delete", "--timeout=1m"]);
    h.ok(&["delete", "image", "tiny", "--wait", "--timeout", "1m"]);
    assert!(h.running().is_empty());
    assert!(h.leftovers().is_empty(), "left behind: {:?}", h.leftovers());
}

/// The example manifests, unchanged: `vm.yaml` (the full `debian-12` guest), then
/// `snapshot.yaml` (a capture of it running) and `fork.yaml` (two VMs from its disk).
fn example_manifests(kind: Kind) {
    let h = RealHome::new(kind);
    let _serve = h.serve();
    let example = |f: &str| repo().join("manifests/examples").join(f);
    h.apply_file(&example("vm.yaml"), "20m");
    // The Debian guest reaches the credential proxy with curl and its own token (pushed within
    // seconds of Ready): no grant yet, so a 403 from the proxy itself.
    let probe = "curl -s -o /dev/null -w '%{http_code}' -H \"x-api-key: $BOXERY_TOKEN\" \"$BOXERY_PROXY/llm/anthropic/v1/models\"";
    let answered = common::eventually(Duration::from_secs(120), || {
        let o = h.cmd(&["run", "dev1", "--", probe]);
        (String::from_utf8_lossy(&o.stdout).trim() == "403").then_some(())
    });
    assert!(
        answered.is_some(),
        "the guest reaches the proxy: {:?}\n{}",
        h.cmd(&[
            "run",
            "dev1",
            "--",
            &format!("cat /run/boxery/env; {probe}")
        ]),
        h.state_report()
    );
    // ssh to other hosts goes through the egress proxy (the same push as the proxy's
    // variables, a moment after them)
    let via_proxy = common::eventually(Duration::from_secs(60), || {
        let o = h.cmd(&[
            "run",
            "dev1",
            "--",
            "ssh -G github.com 2>/dev/null | grep -i '^proxycommand'",
        ]);
        let line = String::from_utf8_lossy(&o.stdout).trim().to_string();
        (line.contains("socat - PROXY:") && line.contains(":%h:%p,proxyport=")).then_some(line)
    });
    assert!(
        via_proxy.is_some(),
        "no ProxyCommand through the egress proxy: {:?}",
        h.cmd(&[
            "run",
            "dev1",
            "--",
            "ls -la /etc/ssh/ssh_config.d /run/boxery; ssh -G github.com | grep -i proxy"
        ])
    );
    let out = h.run(
        "dev1",
        "uname -a; id -un; cat /etc/boxery/build-info; sudo -n true && echo sudo-ok",
    );
    assert!(
        out.contains("Linux dev1")
            && out.contains("agent")
            && out.contains("layers=")
            && out.contains("sudo-ok"),
        "{out}"
    );
    h.run("dev1", "echo from-dev1 > ~/mark && sync");
    h.apply_file(&example("snapshot.yaml"), "5m");
    h.apply_file(&example("fork.yaml"), "20m");
    for n in ["dev2", "dev3"] {
        assert_eq!(
            h.run(n, "hostname; cat ~/mark"),
            format!("{n}\nfrom-dev1"),
            "{n} is dev1's disk with its own identity"
        );
    }
    h.ok(&["rm", "dev1", "dev2", "dev3", "--wait", "--timeout", "5m"]);
    h.ok(&[
        "delete",
        "image",
        "dev1.before-upgrade",
        "debian-12",
        "--wait",
        "--timeout",
        "2m",
    ]);
    assert!(h.running().is_empty());
    assert!(h.leftovers().is_empty(), "left behind: {:?}", h.leftovers());
}

/// ssh to `vm` with exactly one key (not the control plane's): does the guest accept it?
/// Bounded: connect within 10 s, a silent server dropped after 15 s, the whole call killed
/// after 60 s (the test then fails saying so).
fn ssh_with_key(h: &RealHome, vm: &str, key: &Path) -> bool {
    let v = h.vm_json(vm);
    let endpoint = v["status"]["ssh"]["endpoint"].as_str().unwrap().to_string();
    let (host, port) = endpoint.rsplit_once(':').unwrap();
    let mut c = std::process::Command::new("ssh");
    c.args([
        "-F",
        "/dev/null",
        "-o",
        "ConnectTimeout=10",
        "-o",
        "ServerAliveInterval=5",
        "-o",
        "ServerAliveCountMax=3",
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        "ControlMaster=no",
        "-o",
        "ControlPath=none",
    ])
    .arg("-o")
    .arg(format!(
        "UserKnownHostsFile={}",
        h.home
            .path()
            .join(format!("ssh/vms/{vm}.known_hosts"))
            .display()
    ))
    .arg("-o")
    .arg(format!("HostKeyAlias={vm}.boxery"))
    .arg("-i")
    .arg(key)
    .args(["-p", port, &format!("agent@{host}"), "true"])
    .stdin(std::process::Stdio::null());
    match bounded(c, Duration::from_secs(60)) {
        Ok(o) => o.status.success(),
        Err(_) => panic!(
            "ssh to {vm} with {} did not finish within 60 s",
            key.display()
        ),
    }
}

/// `clean_memory`: the pool keeps its members' clean state in memory (`cleanState:
/// Memory`): a reset resumes the clean instant (the same boot) instead of booting.
fn pool_leases(kind: Kind, clean_memory: bool) {
    let h = RealHome::new(kind);
    let _serve = h.serve();
    let f = h.home.write(
        "pool.yaml",
        &format!(
            "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {{name: rp}}\nspec:\n  replicas: 1\n{}  template:\n    spec:\n      source: {{image: tiny}}\n      resources: {{cpus: 1, memory: 256Mi, disk: 1Gi}}\n",
            if clean_memory { "  cleanState: Memory\n" } else { "" }
        ),
    );
    h.ok(&["apply", "-f", f.to_str().unwrap()]);
    h.ok(&[
        "wait",
        "pool",
        "rp",
        "--for=condition=Ready",
        "--timeout=10m",
    ]);
    // Alice leases the only member: her key works, and `boxery run` uses it.
    h.ok(&[
        "lease",
        "acquire",
        "rp",
        "--holder",
        "alice",
        "--name",
        "la",
        "--wait",
        "--timeout",
        "5m",
    ]);
    let alice_key = h.home.path().join("leases/la/id_ed25519");
    let alice_copy = h.home.path().join("alice_key");
    std::fs::copy(&alice_key, &alice_copy).unwrap();
    assert!(
        ssh_with_key(&h, "rp-0", &alice_copy),
        "the holder's key works"
    );
    h.run("rp-0", "echo secret > ~/during-lease && sync");
    let token = h.run("rp-0", "cat ~/.boxery/token");
    if kind == Kind::Qemu {
        // Pushed before Bound: the holder's shells carry the lease's token.
        assert_eq!(h.run("rp-0", "echo \"$BOXERY_TOKEN\""), token);
    }
    assert!(
        boxery_reconcilers::lease::token_valid(h.home.path(), "rp-0", &token),
        "the lease's token is live"
    );
    let boot_id = "cat /proc/sys/kernel/random/boot_id";
    let leased_boot = h.run("rp-0", boot_id);
    if clean_memory {
        let clean = h.ok(&["get", "image", "rp-0.boxery-clean", "-o", "json"]);
        assert!(
            clean.contains("\"memoryBytes\""),
            "the clean image holds memory: {clean}"
        );
        // in its shared form (RAM file + device state), which resets and new members map
        let dir = h.qemu_dir().join("image-memory");
        assert!(
            dir.join("rp-0.boxery-clean.ram").exists()
                && dir.join("rp-0.boxery-clean.dev").exists(),
            "{:?}",
            std::fs::read_dir(&dir).unwrap().collect::<Vec<_>>()
        );
    }
    // Release: the VM is reset; Bob gets it; Alice's key and token are dead, her files gone.
    let t = std::time::Instant::now();
    h.ok(&["lease", "release", "la", "--wait"]);
    h.ok(&[
        "wait",
        "pool",
        "rp",
        "--for=condition=Ready",
        "--timeout=5m",
    ]);
    eprintln!(
        "reset ({}): release → pool Ready again in {:?}",
        if clean_memory { "memory" } else { "disk" },
        t.elapsed()
    );
    h.ok(&[
        "lease",
        "acquire",
        "rp",
        "--holder",
        "bob",
        "--name",
        "lb",
        "--wait",
        "--timeout",
        "5m",
    ]);
    let bob_key = h.home.path().join("leases/lb/id_ed25519");
    assert!(
        ssh_with_key(&h, "rp-0", &bob_key),
        "the new holder's key works"
    );
    assert!(
        !ssh_with_key(&h, "rp-0", &alice_copy),
        "the previous holder's key no longer works"
    );
    assert!(
        !boxery_reconcilers::lease::token_valid(h.home.path(), "rp-0", &token),
        "the old token is revoked"
    );
    assert_eq!(
        h.run("rp-0", "ls ~/during-lease 2>/dev/null || echo gone"),
        "gone",
        "files written during the lease are gone"
    );
    if clean_memory {
        // resumed, not booted: the guest printed no boot line on its new console (the boot
        // id would not tell: the kernel makes it on first read, and the clean instant came
        // before any read)
        let serial = std::fs::read_to_string(h.qemu_dir().join("vms/rp-0/serial.log")).unwrap();
        assert!(
            !serial.contains("] start ("),
            "reset from memory: the clean instant resumed, not a boot:\n{serial}\n{}",
            h.ok(&["describe", "vm", "rp-0"])
        );
        // a warm pool grows by forking a clean member's memory: the new member continues
        // that instant (no boot on its console) with its own name and host key
        let t = std::time::Instant::now();
        h.ok(&["scale", "pool/rp", "--replicas", "2"]);
        h.ok(&[
            "wait",
            "pool/rp",
            "--for=jsonpath={.status.free}=1",
            "--timeout",
            "3m",
        ]);
        eprintln!("scale-up by fork -> the new member Free: {:?}", t.elapsed());
        let d = h.ok(&["describe", "vm", "rp-1"]);
        assert!(
            d.contains("image rp-0.boxery-clean's memory, continuing from its instant"),
            "{d}"
        );
        let serial = std::fs::read_to_string(h.qemu_dir().join("vms/rp-1/serial.log")).unwrap();
        assert!(
            !serial.contains("] start ("),
            "forked, not booted:\n{serial}"
        );
        assert_eq!(h.run("rp-1", "hostname"), "rp-1");
        assert_ne!(
            h.run("rp-1", "cat /etc/machine-id"),
            h.run("rp-0", "cat /etc/machine-id")
        );
    } else {
        assert_ne!(h.run("rp-0", boot_id), leased_boot, "reset by disk: a boot");
    }
    h.ok(&["lease", "release", "lb", "--wait"]);
    h.ok(&["delete", "pool", "rp", "--wait", "--timeout", "3m"]);
    // the pool waits for its members to leave (its finalizer), each VM through its own
    h.ok(&["wait", "vm", "rp-0", "--for=delete", "--timeout=3m"]);
    h.ok(&["wait", "vm", "rp-1", "--for=delete", "--timeout=3m"]);
    h.ok(&["delete", "image", "tiny", "--wait", "--timeout", "1m"]);
    assert!(h.running().is_empty());
    assert!(h.leftovers().is_empty(), "left behind: {:?}", h.leftovers());
}

/// A host reboot as boxery sees it: every QEMU and `serve` killed, a new boot id, `serve`
/// started again. A Vm with `runStrategy: Running` comes back on its own disk (a file written
/// before is there); a lease from before the reboot is void, its holder's key no longer works,
/// and its member is reset and free again.
fn host_reboot(kind: Kind) {
    let mut h = RealHome::new(kind);
    h.env.push(("BOXERY_BOOT_ID".into(), "boot-before".into()));
    let mut serve = h.serve();
    let f = h.home.write(
        "reboot.yaml",
        &format!(
            "{}---\napiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {{name: rb}}\nspec:\n  replicas: 1\n  template:\n    spec:\n      source: {{image: tiny}}\n      resources: {{cpus: 1, memory: 256Mi, disk: 1Gi}}\n",
            tiny_vm("keeper")
        ),
    );
    h.apply_file(&f, "10m");
    h.run("keeper", "echo kept > ~/kept && sync");
    h.ok(&[
        "lease",
        "acquire",
        "rb",
        "--holder",
        "alice",
        "--name",
        "before",
        "--wait",
        "--timeout",
        "5m",
    ]);
    let alice = h.home.path().join("alice_key");
    std::fs::copy(h.home.path().join("leases/before/id_ed25519"), &alice).unwrap();
    assert!(ssh_with_key(&h, "rb-0", &alice), "the holder's key works");

    // The reboot: everything boxery started dies at once; the machine has a new boot id.
    serve.kill();
    let pids = h.running();
    assert_eq!(pids.len(), 2, "two VMs ran: {pids:?}");
    for pid in &pids {
        let _ = std::process::Command::new("kill")
            .args(["-9", pid])
            .status();
    }
    common::eventually(Duration::from_secs(10), || {
        h.running().is_empty().then_some(())
    })
    .expect("every QEMU is gone");
    for (k, v) in h.env.iter_mut() {
        if k == "BOXERY_BOOT_ID" {
            *v = "boot-after".into();
        }
    }
    let _serve = h.serve();

    h.ok(&[
        "wait",
        "vm",
        "keeper",
        "--for=condition=Ready",
        "--timeout=5m",
    ]);
    assert_eq!(
        h.run("keeper", "cat ~/kept"),
        "kept",
        "back on its own disk"
    );
    let said = h.ok(&["describe", "vm", "keeper"]);
    assert!(
        said.contains("StartedAfterReboot") && !said.contains("Restarted"),
        "the event says the host rebooted, not that the VM stopped on its own:\n{said}"
    );
    h.ok(&[
        "wait",
        "lease",
        "before",
        "--for=jsonpath={.status.phase}=Expired",
        "--timeout=2m",
    ]);
    assert!(
        h.ok(&["describe", "lease", "before"]).contains("rebooted"),
        "the lease says why it ended"
    );
    h.ok(&[
        "wait",
        "pool",
        "rb",
        "--for=jsonpath={.status.free}=1",
        "--timeout=5m",
    ]);
    assert!(
        !ssh_with_key(&h, "rb-0", &alice),
        "the key of a lease from before the reboot no longer works"
    );
}

/// `boxery run` over a live ControlMaster speaks its mux protocol itself (no `ssh` process:
/// ssh's client would log `Reading configuration data` to `BOXERY_SSH_LOG`; the mux client
/// logs `boxery mux: ran over …`): stdout, stderr and the exit code come back, stdin is
/// passed, a reader that leaves early ends it quietly; without a live master (`ssh -O exit`,
/// or its socket removed) it falls back to `ssh`, which starts a master again.
/// The processes whose command line mentions `needle` (a home's path): what a test must not
/// leave behind.
fn processes_with(needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if cmd.contains(needle) {
            found.push(format!("{}: {cmd}", e.file_name().to_string_lossy()));
        }
    }
    found
}

/// A second home that holds only a context for this one (no store, none of its keys) drives
/// a real guest through the API alone: applies it, `run`s commands in it (ssh carried by
/// `boxery connect`, the host key pinned from the VM's object), copies a file both ways, and
/// an MCP client through `boxery mcp` with the context does the same with the tools. When the
/// VM is deleted, nothing of the second home keeps running.
/// A running `boxery forward`: its first line of stdout read (the address it names), killed
/// and waited for on drop if the test did not stop it.
struct Forwarding {
    child: std::process::Child,
    /// The lines it printed before carrying anything: one per pair.
    lines: Vec<String>,
    err: PathBuf,
}

impl Forwarding {
    /// Start `c` (a `boxery forward …` command with `pairs` pairs) and read its line for each
    /// pair (at most 2 minutes).
    fn start(mut c: std::process::Command, pairs: usize, err: PathBuf) -> Forwarding {
        use std::io::BufRead;
        let mut child = c
            .stdout(std::process::Stdio::piped())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut lines = Vec::new();
        while lines.len() < pairs {
            match rx.recv_timeout(Duration::from_secs(120)) {
                Ok(l) => lines.push(l.trim().to_string()),
                Err(_) => break,
            }
        }
        let f = Forwarding { child, lines, err };
        assert!(
            f.lines.len() == pairs && f.lines.iter().all(|l| l.starts_with("forwarding ")),
            "boxery forward said {:?}; stderr: {}",
            f.lines,
            f.stderr()
        );
        f
    }
    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }
    /// The local address of pair `i`, a forward to the guest (`forwarding 127.0.0.1:P -> vm:R`).
    fn local(&self, i: usize) -> String {
        self.lines[i].split_whitespace().nth(1).unwrap().to_string()
    }
    /// Ctrl-C, as a person stops it; it exits 0.
    fn interrupt(mut self) {
        let pid = self.child.id().to_string();
        assert!(
            std::process::Command::new("kill")
                .args(["-INT", &pid])
                .status()
                .unwrap()
                .success()
        );
        let mut waited = None;
        for _ in 0..100 {
            if let Some(s) = self.child.try_wait().unwrap() {
                waited = Some(s);
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let s = waited.expect("boxery forward ends on Ctrl-C");
        assert!(s.success(), "{s:?}: {}", self.stderr());
    }
}

impl Drop for Forwarding {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.0 GET of `/` at `addr`: the whole answer.
fn http_get(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

/// `boxery forward` both ways on VM `vm`: `forward` makes a `boxery forward` command (on this
/// host's home or through a context), `run` runs a line in the guest.
fn check_forwards(
    forward: impl Fn(&[&str]) -> std::process::Command,
    run: impl Fn(&str) -> String,
    vm: &str,
    scratch: &Path,
) {
    // a web server on the guest's loopback only
    run(
        "mkdir -p /tmp/www && echo hello-forward > /tmp/www/index.html && \
         (setsid busybox httpd -f -p 127.0.0.1:8080 -h /tmp/www </dev/null >/dev/null 2>&1 &); true",
    );
    let f = Forwarding::start(forward(&[":8080", ":8081"]), 2, scratch.join("fwd.err"));
    let addr = f.local(0);
    assert!(addr.starts_with("127.0.0.1:"), "{:?}", f.lines);
    assert!(
        f.lines[0].ends_with(&format!("-> {vm}:8080")),
        "{:?}",
        f.lines
    );
    let page = common::eventually(Duration::from_secs(30), || {
        let a = http_get(&addr);
        a.contains("hello-forward").then_some(a)
    });
    assert!(
        page.is_some(),
        "the guest's page through {addr}: {}",
        f.stderr()
    );
    // again (a second connection: a channel of the same master)
    assert!(http_get(&addr).contains("hello-forward"));
    // nothing listens on 8081 in the guest: the connection closes, and stderr says so
    let closed = f.local(1);
    let _ = http_get(&closed);
    let said = common::eventually(Duration::from_secs(30), || {
        let e = f.stderr();
        e.contains(&format!("nothing listens on port 8081 in {vm}"))
            .then_some(())
    });
    assert!(said.is_some(), "stderr: {}", f.stderr());
    f.interrupt();
    assert!(
        std::net::TcpStream::connect(&addr).is_err(),
        "{addr} still listens after Ctrl-C"
    );
    // the other way: the guest's 127.0.0.1:9090 reaches a listener here
    let here = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = here.local_addr().unwrap().port();
    let server = std::thread::spawn(move || {
        use std::io::{BufRead, Write};
        let (mut c, _) = here.accept().unwrap();
        let mut line = String::new();
        std::io::BufReader::new(c.try_clone().unwrap())
            .read_line(&mut line)
            .unwrap();
        c.write_all(format!("from-host {}", line).as_bytes())
            .unwrap();
    });
    let r = Forwarding::start(
        forward(&["-R", &format!("{port}:9090")]),
        1,
        scratch.join("rev.err"),
    );
    assert!(
        r.lines[0].contains(&format!("{vm}:127.0.0.1:9090 -> 127.0.0.1:{port}")),
        "{:?}",
        r.lines
    );
    assert_eq!(run("echo ping | nc -w 10 127.0.0.1 9090"), "from-host ping");
    server.join().unwrap();
    // a guest port that is taken is refused before anything is said to be forwarded
    let mut c = forward(&["-R", &format!("{port}:9090")]);
    c.stdin(std::process::Stdio::null());
    let o = bounded(c, Duration::from_secs(120)).expect("finished");
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("port 9090 in"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        o.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    r.interrupt();
    let gone = common::eventually(Duration::from_secs(30), || {
        (run("nc -w 2 127.0.0.1 9090 </dev/null && echo open || echo closed") == "closed")
            .then_some(())
    });
    assert!(
        gone.is_some(),
        "the guest's port 9090 still listens after Ctrl-C"
    );
}

/// The agents layer and `boxery prompt` (issue 33): an Image built with `layers: [agents]`
/// (a second Image with the same layers reuses the build), a VM from it holding an
/// `llm:anthropic` grant, and the real Claude Code CLI in the guest answering a prompt from a
/// stand-in Messages API on this host: the upstream saw the real key, the guest never held it,
/// and the agent's context file names the VM and its grant.
fn agents_in_a_guest() {
    const KEY: &str = "sk-canary-agents-41c7";
    const OPENAI_KEY: &str = "sk-canary-openai-9d2e";
    let up = common::upstream::Upstream::start();
    let h = RealHome::new(Kind::Qemu);
    h.home.write(
        "config.yaml",
        &format!(
            "grants: {{confirm: false}}\nproxy: {{upstreams: {{anthropic: 'http://127.0.0.1:{p}', openai: 'http://127.0.0.1:{p}'}}}}\n",
            p = up.port
        ),
    );
    let values = [
        ("AGENTS_TEST_KEY", KEY),
        ("AGENTS_TEST_OPENAI_KEY", OPENAI_KEY),
    ];
    let mut serve = h.serve_with(&values);
    serve.wait_leading();
    let started = std::time::Instant::now();
    h.apply_file(&repo().join("manifests/examples/agents-image.yaml"), "45m");
    let built = started.elapsed();
    let layers = h.ok(&["images", "layers"]);
    assert!(
        layers.contains("agents") && layers.contains("claude"),
        "{layers}"
    );
    // the same layers again: the built disk is reused
    let again = h.home.write(
        "again.yaml",
        "apiVersion: boxery.dev/v1alpha1\nkind: Image\nmetadata: {name: agents2}\n\
         spec: {source: {build: {base: debian-12, layers: [agents]}}}\n",
    );
    let started = std::time::Instant::now();
    h.apply_file(&again, "10m");
    let reused = started.elapsed();
    eprintln!("agents image: built in {built:?}, the same layers again in {reused:?}");
    let vm = h.home.write(
        "a1.yaml",
        "apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata: {name: a1}\n\
         spec: {source: {image: agents}, resources: {cpus: 1, memory: 2Gi}}\n",
    );
    h.apply_file(&vm, "20m");
    let o = h.shell(&format!(
        "export AGENTS_TEST_KEY={KEY}; \"$BOXERY\" grant a1 llm:anthropic --from-env AGENTS_TEST_KEY --wait"
    ));
    assert!(o.status.success(), "grant: {o:?}");
    let o = h.shell(&format!(
        "export AGENTS_TEST_OPENAI_KEY={OPENAI_KEY}; \"$BOXERY\" grant a1 llm:openai --from-env AGENTS_TEST_OPENAI_KEY --wait"
    ));
    assert!(o.status.success(), "grant: {o:?}");
    let versions = h.run(
        "a1",
        // (not `opencode --version`: opencode takes minutes to start under TCG, below)
        "claude --version; codex --version; command -v opencode; node --version",
    );
    eprintln!("agents in the guest: {versions}");
    assert!(
        versions.contains("Claude Code")
            && versions.contains("codex-cli 0.")
            && versions.contains("/usr/local/bin/opencode")
            && versions.contains("v22."),
        "{versions}"
    );
    // each agent, headless, through the credential proxy: Claude Code calls the Messages API,
    // codex the Responses API. opencode is not run here: under TCG it had not reached its
    // first model call after 15 minutes (docs/benchmarks.md, "Issue 33"); its settings are
    // checked below, and were run on a host against this stand-in (docs/agents.md).
    let token = h.run("a1", "echo \"$BOXERY_TOKEN\"");
    assert!(token.trim().len() > 8, "no token in the guest: {token:?}");
    for (agent, line, api) in [
        ("claude", "claude -p", "/v1/messages"),
        ("codex", "codex exec", "/v1/responses"),
    ] {
        let before = up.seen().len();
        let calls = || -> Vec<String> {
            up.seen()[before..]
                .iter()
                .filter_map(|s| s.lines().next().map(str::to_string))
                .collect()
        };
        // `prompt` has no --timeout: bounded here, with what the guest holds if it runs over
        let mut c = h.home.cmd();
        c.env("BOXERY_BACKEND", h.kind.name())
            .envs(h.env.iter().map(|(k, v)| (k, v)))
            .args(["prompt", "a1", "--agent", agent, "say hi"]);
        let limit = Duration::from_secs(900);
        let started = std::time::Instant::now();
        let o = bounded(c, limit).unwrap_or_else(|partial| {
            panic!(
                "boxery prompt --agent {agent} did not finish within {limit:?} (killed): {partial:?}\n\
                 the upstream saw: {:?}\nin the guest: {}",
                calls(),
                h.run(
                    "a1",
                    "ps -eo pid,etime,rss,args | grep -v ' \\[' | tail -n 25; cat /etc/codex/config.toml"
                )
            )
        });
        let took = started.elapsed();
        assert!(
            o.status.success(),
            "boxery prompt --agent {agent}: {o:?}\nstdout: {}\nstderr: {}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(
            String::from_utf8_lossy(&o.stdout).contains(common::upstream::ANSWER),
            "{agent}: {}",
            String::from_utf8_lossy(&o.stdout)
        );
        eprintln!("boxery prompt a1 --agent {agent} 'say hi' ({line}): {took:?}");
        let calls = calls();
        assert!(
            calls.iter().any(|c| c.contains(api)),
            "{agent} did not call {api} upstream: {calls:?}"
        );
    }
    // the upstream saw the real keys, each in its provider's header, and never the token
    let seen = up.seen();
    let (anthropic, openai) = (
        format!("x-api-key: {KEY}"),
        format!("authorization: bearer {OPENAI_KEY}"),
    );
    for head in &seen {
        let lower = head.to_ascii_lowercase();
        let want = if lower.contains(" /v1/responses ") {
            &openai
        } else if lower.contains(" /v1/messages") {
            &anthropic
        } else {
            // anything else (a model list): one of the two
            if lower.contains(&openai) {
                &openai
            } else {
                &anthropic
            }
        };
        assert!(lower.contains(want.as_str()), "{want} not in {head}");
        assert!(
            !head.contains(token.trim()),
            "the token reached the upstream: {head}"
        );
    }
    // opencode's settings, as the guest's login shell has them: the granted providers at the
    // proxy, with the `/v1` its Anthropic client wants
    let opencode = h.run(
        "a1",
        "node -e 'const c = JSON.parse(process.env.OPENCODE_CONFIG_CONTENT); \
         for (const p of c.enabled_providers) console.log(p, c.provider[p].options.baseURL)'; \
         echo \"proxy $BOXERY_PROXY\"",
    );
    let proxy = opencode
        .lines()
        .find_map(|l| l.strip_prefix("proxy "))
        .unwrap_or_else(|| panic!("{opencode}"));
    assert!(
        opencode.contains(&format!("anthropic {proxy}/llm/anthropic/v1\n"))
            && opencode.contains(&format!("openai {proxy}/llm/openai/v1\n")),
        "{opencode}"
    );
    // an agent that is not there, and a bad prompt, are clear errors
    let o = h.cmd(&["prompt", "a1", "--agent", "opencode", ""]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("give a prompt"),
        "{o:?}"
    );
    // what the agent is told
    let told = h.run(
        "a1",
        "cat ~/CLAUDE.md; readlink ~/AGENTS.md ~/.codex/AGENTS.md",
    );
    assert!(
        told.contains("`a1`")
            && told.contains("llm:anthropic")
            && told.contains("llm:openai")
            && told.contains("/run/boxery/AGENTS.md"),
        "{told}"
    );
    assert!(!told.contains(KEY));
    // the real keys are nowhere in the guest (split, so the search does not find itself)
    for key in [KEY, OPENAI_KEY] {
        let everywhere = h.run(
            "a1",
            &format!(
                "k={}; env; grep -rl \"$k{}\" /run /home /etc /tmp 2>/dev/null; echo end",
                &key[..8],
                &key[8..]
            ),
        );
        assert!(
            !everywhere.contains(key),
            "the key is in the guest: {everywhere}"
        );
    }
    h.ok(&["rm", "a1", "--wait", "--timeout", "5m"]);
    h.ok(&[
        "delete",
        "image",
        "agents",
        "agents2",
        "--wait",
        "--timeout",
        "2m",
    ]);
    serve.kill();
}

/// `boxery forward` on this VM host (the VM's own ssh and ControlMaster).
fn forward_ports(kind: Kind) {
    let h = RealHome::new(kind);
    let _serve = h.serve();
    let f = h.home.write("vm.yaml", &tiny_vm("fw1"));
    h.apply_file(&f, "10m");
    h.run("fw1", "true"); // a master runs: each connection is a channel of it, no `ssh`
    let log = h.ssh_log();
    std::fs::write(&log, "").unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let forward = |args: &[&str]| {
        let mut c = h.home.cmd();
        c.env("BOXERY_BACKEND", h.kind.name())
            .envs(h.env.iter().map(|(k, v)| (k, v)))
            .args(["forward", "fw1"])
            .args(args);
        c
    };
    check_forwards(forward, |line| h.run("fw1", line), "fw1", scratch.path());
    let l = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(l.contains("boxery mux: forwarded to 8080 over"), "{l}");
    let refused = l
        .find("boxery mux: forward to 8081 refused")
        .unwrap_or_else(|| panic!("no refusal over the master: {l}"));
    // no forwarded connection fell back to `ssh -W` (the control plane's own ssh commands,
    // e.g. its guest push, log to the same file: not a sign)
    assert!(!l[..refused].contains("not over the master"), "{l}");

    // A client that goes away mid-download (a cancelled download, 16 MiB mostly unread): its
    // channel closes (the master logs it freed) and the next connection is served.
    h.run("fw1", "head -c 16777216 /dev/zero > /tmp/www/big");
    let f = Forwarding::start(forward(&[":8080"]), 1, scratch.path().join("fwd2.err"));
    let addr = f.local(0);
    std::fs::write(&log, "").unwrap();
    {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.write_all(b"GET /big HTTP/1.0\r\n\r\n").unwrap();
        let mut some = [0u8; 4096];
        s.read_exact(&mut some).unwrap();
    }
    let freed = common::eventually(Duration::from_secs(60), || {
        let l = std::fs::read_to_string(&log).unwrap_or_default();
        (l.contains("channel_connect_stdio_fwd: 127.0.0.1:8080")
            && l.contains("free: direct-tcpip"))
        .then_some(())
    });
    assert!(
        freed.is_some(),
        "the cancelled download's channel is still open: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    assert!(http_get(&addr).contains("hello-forward"), "{}", f.stderr());
    f.interrupt();
    h.ok(&["delete", "vm", "fw1", "--wait", "--timeout", "3m"]);
}

/// Another machine's home (a "laptop") with a context `vmhost` to `h`'s API (its `serve` runs
/// with `--api-listen`): the kubeconfig `h` gives it, added (not yet in use).
fn laptop_of(h: &RealHome) -> Home {
    let addr = h.home.path().join("api/addr");
    common::eventually(Duration::from_secs(30), || addr.exists().then_some(()))
        .expect("serve wrote api/addr");
    let kc = h
        .home
        .write("kc.yaml", &h.ok(&["kubeconfig", "--name", "laptop"]));
    let laptop = Home::new();
    let mut c = laptop.cmd();
    c.args(["config", "add-context", "vmhost", "-f"]).arg(&kc);
    let o = bounded(c, Duration::from_secs(60)).expect("add-context finished");
    assert!(
        o.status.success(),
        "boxery config add-context (laptop): {}",
        String::from_utf8_lossy(&o.stderr)
    );
    laptop
}

fn remote_context(kind: Kind) {
    let h = RealHome::new(kind);
    let _serve = h.serve_args(&["--api-listen", "127.0.0.1:0"], &[]);
    let laptop = laptop_of(&h);
    let lap = |args: &[&str]| -> std::process::Output {
        let mut c = laptop.cmd();
        c.env("BOXERY_CONTEXT", "vmhost")
            .env("BOXERY_SSH_LOG", laptop.path().join("ssh.log"))
            .args(args);
        bounded(c, Duration::from_secs(600))
            .unwrap_or_else(|p| panic!("boxery {args:?} (laptop) did not finish in 10 min: {p:?}"))
    };
    let lap_ok = |args: &[&str]| -> String {
        let o = lap(args);
        assert!(
            o.status.success(),
            "boxery {args:?} (laptop) failed ({:?}):\nstdout: {}\nstderr: {}\nssh log: {}\n{}",
            o.status.code(),
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr),
            std::fs::read_to_string(laptop.path().join("ssh.log")).unwrap_or_default(),
            h.state_report()
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let f = laptop.write("vm.yaml", &tiny_vm("far1"));
    lap_ok(&[
        "apply",
        "-f",
        f.to_str().unwrap(),
        "--wait",
        "--timeout",
        "10m",
    ]);
    assert_eq!(lap_ok(&["run", "far1", "--", "hostname"]).trim(), "far1");
    let o = lap(&["run", "far1", "--", "exit 7"]);
    assert_eq!(o.status.code(), Some(7), "the exit code comes through");
    // connect dials only what the backend observes: an endpoint written into the VM's status
    // (the reported SSRF: a token rewrote it to a host-loopback service) is never dialled
    {
        let bait = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        bait.set_nonblocking(true).unwrap();
        let store = h.home.store();
        let write_endpoint = |e: serde_json::Value| {
            let mut v = store.get("Vm", "far1").unwrap().unwrap();
            let real = v.rest["status"]["ssh"]["endpoint"].clone();
            v.rest.get_mut("status").unwrap()["ssh"]["endpoint"] = e;
            store.update_status(v).unwrap();
            real
        };
        let real = write_endpoint(serde_json::json!(bait.local_addr().unwrap().to_string()));
        let _ = lap(&["run", "far1", "--", "true"]);
        assert!(
            matches!(bait.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
            "connect dialled the endpoint written in the VM's status"
        );
        write_endpoint(real);
    }
    // port forwards through the API tunnel
    check_forwards(
        |args| {
            let mut c = laptop.cmd();
            c.env("BOXERY_CONTEXT", "vmhost")
                .args(["forward", "far1"])
                .args(args);
            c
        },
        |line| h.run("far1", line),
        "far1",
        laptop.path(),
    );
    // a file both ways
    let src = laptop.write("in.txt", "from the laptop\n");
    lap_ok(&["cp", src.to_str().unwrap(), "far1:in.txt"]);
    assert_eq!(h.run("far1", "cat in.txt"), "from the laptop");
    let back = laptop.path().join("back.txt");
    lap_ok(&["cp", "far1:in.txt", back.to_str().unwrap()]);
    assert_eq!(std::fs::read_to_string(&back).unwrap(), "from the laptop\n");
    // the ssh config pins the VM's host key and goes through the API
    let conf =
        std::fs::read_to_string(laptop.path().join("contexts/vmhost/ssh/vms/far1.conf")).unwrap();
    assert!(
        conf.contains("connect %n") && conf.contains("StrictHostKeyChecking yes"),
        "{conf}"
    );
    let known = std::fs::read_to_string(
        laptop
            .path()
            .join("contexts/vmhost/ssh/vms/far1.known_hosts"),
    )
    .unwrap();
    let pinned = h.vm_json("far1")["status"]["ssh"]["hostKey"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(known.contains(pinned.trim()), "{known}");
    // MCP through the context (the official SDK)
    let out = laptop.path().join("mcp-out");
    std::fs::create_dir_all(&out).unwrap();
    let mut py = std::process::Command::new(common::python_with("mcp"));
    py.arg(repo().join("tests/mcp/client.py"))
        .args(["remote", common::bin(), "far1"])
        .arg(&out)
        .env("BOXERY_HOME", laptop.path())
        .env("BOXERY_CONTEXT", "vmhost");
    let o = bounded(py, Duration::from_secs(300)).expect("the MCP client finished");
    assert!(
        o.status.success(),
        "MCP through the context: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    // nothing of the VM host's lives in the second home
    let top: Vec<String> = std::fs::read_dir(laptop.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !top.iter().any(|n| n == "store.db" || n == "ssh"),
        "{top:?}"
    );
    lap_ok(&["delete", "vm", "far1", "--wait", "--timeout", "5m"]);
    let needle = laptop.path().display().to_string();
    let left = common::eventually(Duration::from_secs(30), || {
        let p = processes_with(&needle);
        p.is_empty().then_some(())
    });
    assert!(
        left.is_some(),
        "left running after the VM was deleted: {:?}",
        processes_with(&needle)
    );
}

fn run_over_the_control_master(kind: Kind) {
    let h = RealHome::new(kind);
    let f = h.home.write("vm.yaml", &tiny_vm("m1"));
    h.ok(&[
        "apply",
        "-f",
        f.to_str().unwrap(),
        "--wait",
        "--timeout",
        "10m",
    ]);
    h.run("m1", "true"); // a master runs (the probe or this started it)
    let log = h.ssh_log();
    // What one command logged: the mux client's line, or ssh's own (a client reads its config;
    // a master only logs sessions).
    let took = |f: &dyn Fn() -> std::process::Output| {
        std::fs::write(&log, "").unwrap();
        let o = f();
        let l = std::fs::read_to_string(&log).unwrap_or_default();
        let mux = l.contains("boxery mux: ran over");
        let ssh = l.contains("Reading configuration data");
        assert!(mux != ssh, "neither or both ways taken: {l}");
        (o, if mux { "mux" } else { "ssh" })
    };
    let three = || {
        h.cmd(&[
            "run",
            "m1",
            "--",
            "sh",
            "-c",
            "echo out; echo err >&2; exit 7",
        ])
    };
    let check = |o: &std::process::Output| {
        assert_eq!(o.status.code(), Some(7), "{o:?}");
        assert_eq!(String::from_utf8_lossy(&o.stdout), "out\n");
        assert_eq!(String::from_utf8_lossy(&o.stderr), "err\n");
    };
    let (o, way) = took(&three);
    assert_eq!(way, "mux");
    check(&o);
    // `boxery ssh VM -- CMD` without a terminal goes the same way.
    let (o, way) = took(&|| {
        h.cmd(&[
            "ssh",
            "m1",
            "--",
            "sh",
            "-c",
            "echo out; echo err >&2; exit 7",
        ])
    });
    assert_eq!(way, "mux");
    check(&o);
    // stdin is passed; a closed stdout ends the command quietly.
    let (o, way) = took(&|| h.shell(r#"printf abc | "$BOXERY" run m1 -- cat"#));
    assert_eq!(way, "mux");
    assert_eq!(String::from_utf8_lossy(&o.stdout), "abc", "{o:?}");
    assert!(o.status.success(), "{o:?}");
    let t = std::time::Instant::now();
    let (o, way) = took(&|| h.shell(r#""$BOXERY" run m1 -- yes | head -1"#));
    assert_eq!(way, "mux");
    assert_eq!(String::from_utf8_lossy(&o.stdout), "y\n", "{o:?}");
    assert_eq!(String::from_utf8_lossy(&o.stderr), "", "{o:?}");
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());

    // No master: ssh runs (and starts one), the next command takes the mux again.
    let conf = h.home.path().join("ssh/vms/m1.conf");
    let ssh = |args: &[&str]| {
        std::process::Command::new("ssh")
            .arg("-F")
            .arg(&conf)
            .args(args)
            .arg("m1.boxery")
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap()
    };
    let o = ssh(&["-O", "exit"]);
    assert!(o.status.success(), "{o:?}");
    let (o, way) = took(&three);
    assert_eq!(way, "ssh");
    check(&o);
    let (o, way) = took(&three);
    assert_eq!(way, "mux");
    check(&o);
    // The socket removed (its master still runs, unreachable): ssh again.
    let g = String::from_utf8(ssh(&["-G"]).stdout).unwrap();
    let cm = g
        .lines()
        .find_map(|l| l.strip_prefix("controlpath "))
        .unwrap()
        .to_string();
    std::fs::remove_file(&cm).unwrap();
    let (o, way) = took(&three);
    assert_eq!(way, "ssh");
    check(&o);
    let (_, way) = took(&three);
    assert_eq!(way, "mux");
    h.ok(&["rm", "m1", "--wait", "--timeout", "3m"]);
    assert!(
        h.running().is_empty(),
        "VMs left running: {:?}",
        h.running()
    );
}

/// Grants from inside a real guest (docs/grants.md, "The guest side"): the guest reaches the
/// credential proxy at `$BOXERY_PROXY` with its own token, an `llm` grant's call reaches a
/// stand-in upstream with the real key, which is nowhere in the guest (environment, files,
/// processes) nor on its disk; `env` and `file` grants are pushed to tmpfs (0400) and taken
/// away on revoke; a login shell has the variables; a wrong token is refused.
fn guest_uses_grants(kind: Kind) {
    const KEY: &str = "sk-canary-guest-5b1f0e";
    const ENV_VALUE: &str = "env-canary-3a9d";
    const FILE_VALUE: &str = "file-canary-7c2e";
    let up = common::upstream::Upstream::start();
    let h = RealHome::new(kind);
    h.home.write(
        "config.yaml",
        &format!(
            "grants: {{confirm: false}}\nproxy: {{upstreams: {{anthropic: 'http://127.0.0.1:{}'}}}}\n",
            up.port
        ),
    );
    // Outside $BOXERY_HOME (files under it are never granted).
    let outside = tempfile::tempdir().unwrap();
    let value_file = outside.path().join("app.conf");
    std::fs::write(&value_file, format!("{FILE_VALUE}\n")).unwrap();
    // The values live in the control plane's environment only (and the approver checks it can
    // read them too).
    let values = [("GRANT_TEST_KEY", KEY), ("GRANT_TEST_ENV", ENV_VALUE)];
    let mut serve = h.serve_with(&values);
    serve.wait_leading();
    let f = h.home.write("vm.yaml", &tiny_vm("g1"));
    h.apply_file(&f, "10m");
    let o = h.shell(&format!(
        "export GRANT_TEST_KEY={KEY} GRANT_TEST_ENV={ENV_VALUE}; set -e
         \"$BOXERY\" grant g1 llm:anthropic --from-env GRANT_TEST_KEY --wait
         \"$BOXERY\" grant g1 env:APP_SECRET --from-env GRANT_TEST_ENV --wait
         \"$BOXERY\" grant g1 file:app/app.conf --from-file {} --wait",
        value_file.display()
    ));
    assert!(o.status.success(), "grants: {o:?}");
    // Pushed before the grant shows Applied (what `grant --wait` waited for).
    assert_eq!(
        h.run("g1", "echo \"${APP_SECRET:-unset}\""),
        ENV_VALUE,
        "the env grant is in the guest once Applied"
    );
    // qemu: slirp's guestfwd address; libvirt: the network's gateway, on this home's port.
    let proxy = h.run("g1", "echo \"$BOXERY_PROXY\"");
    match kind {
        Kind::Qemu => assert_eq!(proxy, "http://10.0.2.100"),
        Kind::Libvirt => {
            let port = std::fs::read_to_string(h.home.path().join("libvirt/proxy-port")).unwrap();
            assert!(
                proxy.starts_with("http://") && proxy.ends_with(&format!(":{}", port.trim())),
                "{proxy}"
            );
        }
        // the bridge's gateway, on the port the home's namespace gives
        Kind::Incus => assert!(proxy.starts_with("http://10.2"), "{proxy}"),
    }
    assert_eq!(
        h.run("g1", "echo \"$ANTHROPIC_BASE_URL\""),
        format!("{proxy}/llm/anthropic")
    );
    let token = h.run("g1", "echo \"$BOXERY_TOKEN\"");
    assert!(token.starts_with("bxt_"), "{token}");
    assert_eq!(
        h.run("g1", "echo \"$ANTHROPIC_API_KEY\""),
        token,
        "the key variable holds the token"
    );
    // A login shell with nothing inherited has them too (/etc/profile.d/boxery-env.sh).
    assert_eq!(
        h.run(
            "g1",
            "env -i HOME=/home/agent PATH=/bin:/usr/bin sh -l -c 'echo \"$BOXERY_PROXY\"'"
        ),
        proxy
    );
    // The guest's call reaches the upstream with the real key, never the token. (HTTP by
    // hand over busybox nc: the tiny guest's busybox wget crashes on libvirt's CPU model. Its
    // input stays open until the answer is in: a client that shuts its sending side before the
    // answer gets none (docs/grants.md, "Listening").)
    let post = |key: &str| {
        format!(
            "{NC_FALLBACK}hp=${{BOXERY_PROXY#http://}}; h=${{hp%:*}}; p=${{hp##*:}}; [ \"$p\" != \"$hp\" ] || p=80; \
             {{ printf 'POST /llm/anthropic/v1/messages HTTP/1.1\\r\\nhost: %s\\r\\nx-api-key: %s\\r\\ncontent-type: application/json\\r\\ncontent-length: 2\\r\\nconnection: close\\r\\n\\r\\n{{}}' \"$h\" \"{key}\"; sleep 2; }} \
             | nc \"$h\" \"$p\" | tr -d '\\r'"
        )
    };
    let call = post("$ANTHROPIC_API_KEY");
    let answer = h.run("g1", &call);
    assert!(
        answer.starts_with("HTTP/1.1 200") && answer.ends_with("{\"ok\":true}"),
        "{answer:?} from {call}: {}",
        h.run("g1", &format!("set -x; {call} 2>&1; echo rc=$?"))
    );
    let seen = up.seen();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert!(
        seen[0].contains(&format!("x-api-key: {KEY}")),
        "{}",
        seen[0]
    );
    assert!(
        !seen[0].contains(&token),
        "the token never reaches the upstream"
    );
    // A wrong token is refused, and the upstream sees nothing.
    let wrong = h.run("g1", &post("bxt_0000"));
    assert!(wrong.starts_with("HTTP/1.1 401"), "{wrong}");
    assert_eq!(up.seen().len(), 1);
    // A client that ignores no_proxy sends the call to $http_proxy, in absolute form, for the
    // proxy's own address: it is served as if sent directly (it used to be refused, 403, as a
    // private address).
    let absolute = format!(
        "{NC_FALLBACK}hp=${{BOXERY_PROXY#http://}}; h=${{hp%:*}}; p=${{hp##*:}}; [ \"$p\" != \"$hp\" ] || p=80; \
         {{ printf 'POST %s/llm/anthropic/v1/messages HTTP/1.1\\r\\nhost: %s\\r\\nproxy-authorization: Bearer %s\\r\\nx-api-key: %s\\r\\ncontent-type: application/json\\r\\ncontent-length: 2\\r\\nconnection: close\\r\\n\\r\\n{{}}' \"$BOXERY_PROXY\" \"$hp\" \"$BOXERY_TOKEN\" \"$ANTHROPIC_API_KEY\"; sleep 2; }} \
         | nc \"$h\" \"$p\" | tr -d '\\r'"
    );
    let answer = h.run("g1", &absolute);
    assert!(
        answer.starts_with("HTTP/1.1 200") && answer.ends_with("{\"ok\":true}"),
        "{answer:?} from {absolute}"
    );
    assert_eq!(
        up.seen().len(),
        2,
        "the upstream saw the absolute-form call"
    );
    // The file grant: in tmpfs, 0400.
    assert_eq!(
        h.run("g1", "cat /run/boxery/files/app/app.conf; stat -c %a /run/boxery/files/app/app.conf /run/boxery/env"),
        format!("{FILE_VALUE}\n400\n400")
    );
    // The real key is nowhere in the guest: environment, processes, files.
    let everywhere = h.run(
        "g1",
        // (the key spelled in two halves, so this command line does not hold it)
        &format!(
            "k={}; env; ps -o pid,args 2>/dev/null || ps; grep -rl \"$k{}\" /run /home /etc /tmp /root 2>/dev/null; echo end",
            &KEY[..8],
            &KEY[8..]
        ),
    );
    assert!(
        !everywhere.contains(KEY),
        "the key is in the guest: {everywhere}"
    );
    // Nor on its disk, nor in a snapshot of it; and the pushed values are not on disk either.
    h.run("g1", "sync");
    h.ok(&["snap", "g1", "s1", "--wait", "--timeout", "5m"]);
    let files = |d: PathBuf| -> Vec<PathBuf> {
        std::fs::read_dir(&d)
            .unwrap_or_else(|e| panic!("{}: {e}", d.display()))
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.is_file()
                    && !p
                        .file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with("base-"))
            })
            .collect()
    };
    // Every disk of the VM and the snapshot (never a shared base: it predates the VM).
    let disks: Vec<PathBuf> = match kind {
        Kind::Qemu => {
            let mut d: Vec<PathBuf> = files(h.qemu_dir().join("vms/g1"))
                .into_iter()
                .filter(|p| p.extension().is_some_and(|x| x == "qcow2"))
                .collect();
            d.push(h.qemu_dir().join("images/g1.s1.qcow2"));
            d
        }
        Kind::Libvirt => files(h.pool_dir()),
        // a container's disk is a directory tree in the pool: every file of the VM's and of
        // its snapshot's
        Kind::Incus => {
            let b = h.incus_backend();
            let pool = PathBuf::from("/var/lib/incus/storage-pools")
                .join(b.pool())
                .join("containers");
            let o = std::process::Command::new("find")
                .arg(pool.join(format!("{}_g1", b.project())))
                .arg(pool.join(format!(
                    "{}_{}",
                    b.image_project(),
                    boxery_backends::incus::instance_name("g1.s1")
                )))
                .args(["-xdev", "-type", "f", "-size", "-64M"])
                .output()
                .unwrap();
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .map(PathBuf::from)
                .collect()
        }
    };
    assert!(disks.len() >= 2, "{disks:?}");
    let mut read = 0;
    for d in &disks {
        // A running VM's capture leaves its old overlay to a stream that pulls it into the
        // active one and then removes it (the qemu backend's disk chain): such a file may go
        // between the listing and the read. Its bytes are the snapshot's own (hard-linked as
        // the image, read here too) and, after the stream, the active overlay's.
        let bytes = match std::fs::read(d) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && kind != Kind::Libvirt => continue,
            Err(e) => panic!("{}: {e}", d.display()),
        };
        read += 1;
        for canary in [KEY, ENV_VALUE, FILE_VALUE] {
            assert!(
                !bytes.windows(canary.len()).any(|w| w == canary.as_bytes()),
                "{canary} is on the disk {}",
                d.display()
            );
        }
    }
    assert!(read >= 2, "read {read} of {disks:?}");
    // Revoking the env grant takes it out of the guest.
    let name = h
        .ok(&["grant", "ls"])
        .lines()
        .find(|l| l.contains("APP_SECRET"))
        .and_then(|l| l.split_whitespace().next().map(str::to_string))
        .expect("the env grant is listed");
    h.ok(&["grant", "revoke", &name]);
    let gone = common::eventually(Duration::from_secs(60), || {
        let o = h.cmd(&["run", "g1", "--", "echo \"${APP_SECRET:-unset}\""]);
        (String::from_utf8_lossy(&o.stdout).trim() == "unset").then_some(())
    });
    assert!(gone.is_some(), "a revoked env grant leaves the guest");
    assert_eq!(
        h.run("g1", "cat /run/boxery/files/app/app.conf"),
        FILE_VALUE
    );
    // A SIGKILL of serve: after the restart the channel answers again, the guest holds what
    // the store says (the revoked grant stays out), and the call still works.
    serve.kill();
    let mut serve = h.serve_with(&values);
    serve.wait_leading();
    let back = common::eventually(Duration::from_secs(60), || {
        let o = h.cmd(&["run", "g1", "--", &call]);
        String::from_utf8_lossy(&o.stdout)
            .trim()
            .ends_with("{\"ok\":true}")
            .then_some(())
    });
    assert!(
        back.is_some(),
        "the channel is served again after a restart"
    );
    assert_eq!(
        h.run(
            "g1",
            "echo \"${APP_SECRET:-unset}\"; cat /run/boxery/files/app/app.conf"
        ),
        format!("unset\n{FILE_VALUE}")
    );
    h.ok(&["delete", "vm", "g1", "--wait", "--timeout", "3m"]);
    serve.kill();
}

/// A VM's network helper killed under its running guest (qemu): the inventory pass marks the
/// Vm `Degraded`, its controller starts a new `boxery-net`, QEMU reconnects to it, and the
/// same boot of the guest answers over ssh again, with no restart.
fn network_helper_repaired() {
    let h = RealHome::new(Kind::Qemu);
    let serve = h.serve_args(&["--inventory-every", "1s"], &[]);
    serve.wait_leading();
    h.apply_file(&h.home.write("vm.yaml", &tiny_vm("n1")), "10m");
    let boot_id = "cat /proc/sys/kernel/random/boot_id";
    let boot = h.run("n1", boot_id);
    let pidfile = h.qemu_dir().join("vms/n1/net.pid");
    let pid_of = || -> Option<i32> { std::fs::read_to_string(&pidfile).ok()?.trim().parse().ok() };
    let old = pid_of().expect("the VM runs on its boxery-net (the workspace's tests build it)");
    let pid = rustix::process::Pid::from_raw(old).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).unwrap();
    // The guest has no network now; within the inventory period and a repair, it has again.
    let back = common::eventually(Duration::from_secs(60), || {
        let new = pid_of().filter(|p| *p != old)?;
        let o = h.cmd(&["run", "n1", "--", boot_id]);
        (o.status.success() && String::from_utf8_lossy(&o.stdout).trim() == boot).then_some(new)
    });
    let new =
        back.unwrap_or_else(|| panic!("the VM's network was not repaired:\n{}", h.state_report()));
    let vm_dir = h.qemu_dir().join("vms/n1");
    assert!(
        std::fs::read_to_string(format!("/proc/{new}/cmdline"))
            .is_ok_and(|c| c.contains("boxery-net") && c.contains(&*vm_dir.to_string_lossy())),
        "the new helper is the VM's boxery-net"
    );
    h.ok(&["wait", "vm/n1", "--for=condition=Ready", "--timeout", "2m"]);
    let d = h.ok(&["describe", "vm", "n1"]);
    assert!(
        d.contains("Degraded") && d.contains("Repaired"),
        "the events say what happened:\n{d}"
    );
    h.ok(&["delete", "vm", "n1", "--wait", "--timeout", "3m"]);
    assert!(
        !std::path::Path::new(&format!("/proc/{new}")).exists()
            || std::fs::read_to_string(format!("/proc/{new}/cmdline")).is_ok_and(|c| c.is_empty()),
        "the repaired helper ends with its VM"
    );
    drop(serve);
}

/// A counter the guest runs in the background (a line a tenth of a second into ~/count),
/// detached from the session; prints its PID.
const COUNTER: &str = "setsid sh -c 'i=0; while true; do i=$((i+1)); echo $i > ~/count; sleep 0.1; done' \
     </dev/null >/dev/null 2>&1 & echo $!; sleep 1";

/// `fork SRC A B --with-memory`: the children continue the source's boot and processes, each
/// with its own hostname, machine-id, host key (pinned: `run` reaches it), MAC, token and
/// random bytes; the source runs on; the fork's image is gone once both exist. A control plane
/// killed between a child's start and its identity step leaves the step to the next one.
fn fork_with_memory(kind: Kind) {
    let h = RealHome::new(kind);
    let mut serve = h.serve();
    h.apply_file(&h.home.write("vm.yaml", &tiny_vm("f0")), "10m");
    let boot_id = "cat /proc/sys/kernel/random/boot_id";
    let boot = h.run("f0", boot_id);
    let counter = h.run("f0", COUNTER);
    let t = std::time::Instant::now();
    let out = h.ok(&[
        "fork",
        "f0",
        "f1",
        "f2",
        "--with-memory",
        "--wait",
        "--timeout",
        "5m",
    ]);
    eprintln!("fork x2 with memory -> both Ready: {:?}", t.elapsed());
    assert!(
        out.contains("vm/f1 created (fork of f0 with its memory)"),
        "{out}"
    );
    let identity = "cat /etc/machine-id; hostname; cat /sys/class/net/eth0/address; \
                    cat ~/.boxery/token; echo; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'";
    let mut seen: Vec<Vec<String>> = Vec::new();
    let mut keys = Vec::new();
    for vm in ["f0", "f1", "f2"] {
        assert_eq!(h.run(vm, boot_id), boot, "{vm} continues the source's boot");
        assert_eq!(
            h.run(vm, &format!("kill -0 {counter} && echo alive")),
            "alive",
            "{vm} runs the counter started before the fork"
        );
        let id: Vec<String> = h.run(vm, identity).lines().map(str::to_string).collect();
        assert_eq!(id.len(), 5, "{vm}: {id:?}");
        assert_eq!(id[1], vm, "{vm}'s hostname");
        assert!(!id[3].is_empty(), "{vm} holds a token: {id:?}");
        seen.push(id);
        let v = h.vm_json(vm);
        keys.push(v["status"]["ssh"]["hostKey"].as_str().unwrap().to_string());
    }
    for field in 0..5 {
        let mut all: Vec<&String> = seen.iter().map(|id| &id[field]).collect();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 3, "field {field} differs in each VM: {seen:?}");
    }
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), 3, "each VM has its own pinned host key");
    let d = h.ok(&["describe", "vm", "f1"]);
    assert!(d.contains("memory, continuing from its instant"), "{d}");
    let images = h.ok(&["get", "images"]);
    assert!(
        !images.contains("f0.fork-"),
        "the fork's image is gone: {images}"
    );

    // A control plane killed after a child started from the memory, before its identity
    // step: the next one finishes the step (the backend kept what was left to do).
    let inherited = h.qemu_dir().join("vms/f3/inherited.json");
    h.ok(&["fork", "f0", "f3", "--with-memory"]);
    common::eventually(Duration::from_secs(120), || {
        inherited.exists().then_some(())
    })
    .expect("f3 starts from the memory");
    serve.kill();
    assert!(
        inherited.exists(),
        "killed before the identity step (starting QEMU alone takes longer than the poll)"
    );
    // within seconds: a network helper the killed boot left no longer holds the VM's port
    // (it did, for about 70 s, until the next boot ended it first)
    let _serve = h.serve();
    h.ok(&["wait", "vm/f3", "--for=condition=Ready", "--timeout", "40s"]);
    assert!(!inherited.exists(), "the step was finished");
    assert_eq!(h.run("f3", "hostname"), "f3");
    assert_ne!(
        h.run("f3", "cat /etc/machine-id"),
        h.run("f0", "cat /etc/machine-id")
    );
    assert_eq!(
        h.run("f3", &format!("kill -0 {counter} && echo alive")),
        "alive"
    );
    h.ok(&["rm", "f1", "f2", "f3", "f0", "--wait", "--timeout", "3m"]);
    h.ok(&["delete", "image", "tiny", "--wait", "--timeout", "1m"]);
}

/// Suspend and resume through the CLI (docs/live-memory.md): a counter started before the
/// suspend still runs after the resume, on the same boot; while suspended the VM is
/// `Suspended` with its saved memory in status, no hypervisor runs for it, a command is
/// refused naming `resume`, and a control plane restarted meanwhile leaves it suspended.
/// `stop` discards the memory; the next start boots cold.
fn suspend_resume(kind: Kind) {
    let h = RealHome::new(kind);
    let mut serve = h.serve();
    h.apply_file(&h.home.write("vm.yaml", &tiny_vm("s1")), "10m");
    let boot_id = "cat /proc/sys/kernel/random/boot_id";
    let boot = h.run("s1", boot_id);
    let counter = h.run("s1", COUNTER);
    let out = h.ok(&["suspend", "s1", "--wait", "--timeout", "2m"]);
    assert!(out.contains("vm/s1 suspending"), "{out}");
    let v = h.vm_json("s1");
    assert_eq!(v["status"]["phase"], "Suspended", "{v}");
    assert!(
        v["status"]["memory"]["bytes"].as_u64().unwrap() > 1 << 20,
        "{v}"
    );
    assert!(v["status"]["memory"]["savedAt"].is_string(), "{v}");
    assert!(
        h.running().is_empty(),
        "no hypervisor while suspended: {:?}",
        h.running()
    );
    let refused = h.cmd(&["run", "s1", "--", "true"]);
    assert_eq!(refused.status.code(), Some(5));
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("boxery resume s1"), "{err}");
    // a control plane that restarts meanwhile leaves it as it is
    serve.kill();
    let _serve = h.serve();
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(h.vm_json("s1")["status"]["phase"], "Suspended");
    assert!(h.running().is_empty(), "{:?}", h.running());

    h.ok(&["resume", "s1", "--wait", "--timeout", "2m"]);
    assert_eq!(h.run("s1", boot_id), boot, "the same boot");
    assert_eq!(
        h.run("s1", &format!("kill -0 {counter} && echo alive")),
        "alive",
        "the process started before the suspend runs on"
    );
    let v = h.vm_json("s1");
    assert!(v["status"]["memory"].is_null(), "{v}");
    let d = h.ok(&["describe", "vm", "s1"]);
    assert!(d.contains("Suspended") && d.contains("Resumed"), "{d}");

    // stop discards the memory; start boots cold
    h.ok(&["suspend", "s1", "--wait", "--timeout", "2m"]);
    h.ok(&["stop", "s1", "--wait", "--timeout", "2m"]);
    h.ok(&["start", "s1", "--wait", "--timeout", "5m"]);
    let cold = h.run("s1", boot_id);
    assert_ne!(cold, boot, "a cold boot");

    // auto-suspend: unused for spec.idle.suspendAfter, suspended; the next command resumes
    // it first (saying so on stderr) and runs on the same boot
    h.ok(&[
        "patch",
        "vm",
        "s1",
        "-p",
        r#"{"spec":{"idle":{"suspendAfter":"10s"}}}"#,
    ]);
    h.ok(&[
        "wait",
        "vm/s1",
        "--for=jsonpath={.status.phase}=Suspended",
        "--timeout",
        "2m",
    ]);
    let v = h.vm_json("s1");
    assert_eq!(v["spec"]["runStrategy"], "Running", "{v}");
    assert!(v["status"]["idleSuspendedAt"].is_string(), "{v}");
    assert!(h.running().is_empty(), "{:?}", h.running());
    let woken = h.cmd(&["run", "s1", "--", boot_id]);
    assert!(
        woken.status.success(),
        "{}",
        String::from_utf8_lossy(&woken.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&woken.stdout).trim(), cold);
    assert!(
        String::from_utf8_lossy(&woken.stderr).contains("suspended while idle; resuming"),
        "{}",
        String::from_utf8_lossy(&woken.stderr)
    );
    let d = h.ok(&["describe", "vm", "s1"]);
    assert!(d.contains("IdleSuspended"), "{d}");
    h.ok(&["rm", "s1", "--wait", "--timeout", "3m"]);
    h.ok(&["delete", "image", "tiny", "--wait", "--timeout", "1m"]);
    assert!(h.running().is_empty());
    assert!(h.leftovers().is_empty(), "left behind: {:?}", h.leftovers());
}

/// A shell function `nc HOST PORT` for guests without netcat (the debian-12 guest, which is
/// also the incus backend's `tiny`): stdin sent whole, then the answer read to its end without
/// shutting the sending side first (docs/grants.md, "Listening").
const NC_FALLBACK: &str = "command -v nc >/dev/null 2>&1 || nc() { python3 -c 'import socket,sys
s=socket.create_connection((sys.argv[1],int(sys.argv[2])))
s.sendall(sys.stdin.buffer.read())
while True:
    d=s.recv(65536)
    if not d: break
    sys.stdout.buffer.write(d)' \"$@\"; }; ";

/// A socat relay to a daemon's socket (libvirtd's, incusd's) that the test can cut: the
/// control plane's view of the daemon going away and coming back, without stopping the daemon
/// other tests share.
struct Relay {
    sock: std::path::PathBuf,
    /// The daemon's own socket.
    target: &'static str,
    child: Option<std::process::Child>,
}

impl Relay {
    /// A relay (not up yet) listening at `sock` for the daemon's socket `target`.
    fn new(sock: std::path::PathBuf, target: &'static str) -> Relay {
        Relay {
            sock,
            target,
            child: None,
        }
    }
    fn uri(&self) -> String {
        format!("qemu+unix:///system?socket={}", self.sock.display())
    }
    fn up(&mut self) {
        use std::os::unix::process::CommandExt;
        // In a process group of its own: socat forks a child per connection, and a cut
        // ends those too.
        let child = std::process::Command::new("socat")
            .arg(format!(
                "UNIX-LISTEN:{},fork,unlink-early",
                self.sock.display()
            ))
            .arg(format!("UNIX-CONNECT:{}", self.target))
            .process_group(0)
            .spawn()
            .expect("socat is installed (scripts/install-deps.sh)");
        self.child = Some(child);
        common::eventually(Duration::from_secs(10), || self.sock.exists().then_some(()))
            .expect("the relay listens");
    }
    /// Cut the relay as libvirtd's death would: the listener and every relayed connection
    /// end (the control plane keeps one connection open and must see it drop), and no
    /// new connection gets through.
    fn down(&mut self) {
        if let Some(mut c) = self.child.take() {
            // The group is socat's own (`process_group(0)` above): its pid is the pgid.
            if let Some(pid) = rustix::process::Pid::from_raw(c.id() as i32) {
                let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_file(&self.sock);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.down();
    }
}

/// The same tests on each real backend.
macro_rules! on_backend {
    ($kind:expr) => {
        #[test]
        fn lifecycle_with_real_vms() {
            super::lifecycle($kind)
        }
        #[test]
        fn crash_during_create_and_capture_with_real_vms() {
            super::crash_during_create_and_capture($kind)
        }
        #[test]
        fn example_manifests_on_the_debian_guest() {
            super::example_manifests($kind)
        }
        #[test]
        fn pool_leases_with_real_vms() {
            super::pool_leases($kind, false)
        }
        #[test]
        fn egress_drill_for_each_policy() {
            super::egress_drill($kind)
        }
        #[test]
        fn metrics_sample_a_running_vm() {
            super::usage::usage_samples($kind)
        }
        #[test]
        fn a_lease_past_its_budget_is_suspended_until_it_is_raised() {
            super::usage::budget_suspends_a_leased_vm($kind)
        }

        #[test]
        fn console_watched_live() {
            super::desktop::console_watched_live($kind)
        }

        #[test]
        fn browser_driven_through_vm_browser() {
            super::desktop::browser_driven_through_vm_browser($kind)
        }
    };
}

mod qemu {
    on_backend!(super::Kind::Qemu);

    #[test]
    fn a_context_on_another_home_reaches_a_real_vm() {
        super::remote_context(super::Kind::Qemu)
    }

    #[test]
    fn run_over_the_control_master() {
        super::run_over_the_control_master(super::Kind::Qemu)
    }

    #[test]
    fn forward_ports_both_ways() {
        super::forward_ports(super::Kind::Qemu)
    }

    #[test]
    fn a_cloud_image_brought_by_its_user_boots_with_boxerys_seed() {
        super::cloud_image::cloud_image(super::Kind::Qemu)
    }

    #[test]
    fn agents_in_a_guest_answer_a_prompt_through_the_proxy() {
        super::agents_in_a_guest()
    }

    #[test]
    fn guest_uses_grants_through_the_proxy() {
        super::guest_uses_grants(super::Kind::Qemu)
    }

    #[test]
    fn host_reboot_brings_vms_back_and_voids_leases() {
        super::host_reboot(super::Kind::Qemu)
    }

    #[test]
    fn a_dead_network_helper_is_repaired_under_a_running_guest() {
        super::network_helper_repaired()
    }

    #[test]
    fn suspend_and_resume_keep_the_guest_processes() {
        super::suspend_resume(super::Kind::Qemu)
    }

    #[test]
    fn pool_members_reset_from_memory() {
        super::pool_leases(super::Kind::Qemu, true)
    }

    #[test]
    fn fork_with_memory_continues_with_fresh_identities() {
        super::fork_with_memory(super::Kind::Qemu)
    }

    #[test]
    fn developer_traffic_through_egress() {
        super::dev_traffic::developer_traffic_through_egress()
    }

    #[test]
    fn ssh_agent_forwarded_with_approval() {
        super::ssh_agent::ssh_agent_forwarded_with_approval()
    }

    #[test]
    fn layers_added_to_a_running_vm_and_made_for_a_new_one() {
        super::layers::layers_on_a_vm(super::Kind::Qemu)
    }

    #[test]
    fn desktop_driven_through_vm_computer() {
        super::desktop::desktop_computer_use(super::Kind::Qemu)
    }
}

#[cfg(feature = "libvirt")]
mod libvirt {
    use super::{Kind, RealHome, tiny_vm};
    use std::time::Duration;

    on_backend!(super::Kind::Libvirt);

    #[test]
    fn a_cloud_image_brought_by_its_user_boots_with_boxerys_seed() {
        super::cloud_image::cloud_image(super::Kind::Libvirt)
    }

    #[test]
    fn guest_uses_grants_through_the_proxy() {
        super::guest_uses_grants(Kind::Libvirt)
    }

    /// libvirtd out of reach: `serve` started while it is waits for it (rather than exit);
    /// cut mid-run, the Vm gets `BackendReachable=False`, is neither deleted nor marked Lost,
    /// and its domain keeps running; reachable again, it is Ready, the same VM.
    #[test]
    fn unreachable_libvirtd_is_a_condition_not_a_deletion() {
        let dir = tempfile::tempdir().unwrap();
        let mut relay =
            super::Relay::new(dir.path().join("lv.sock"), "/var/run/libvirt/libvirt-sock");
        // every command of this home goes through the relay: a `wait` that finds no leader
        // runs the controllers itself, and must not reach libvirtd around the cut
        let mut h = RealHome::new(Kind::Libvirt);
        h.env.push(("BOXERY_LIBVIRT_URI".into(), relay.uri()));
        let mut serve = h.serve();
        std::thread::sleep(Duration::from_secs(4));
        assert!(serve.alive(), "serve waits for an unreachable libvirtd");
        let log = std::fs::read_to_string(h.home.path().join("serve.log")).unwrap();
        assert!(
            log.contains("unreachable") && log.contains("retrying"),
            "{log}"
        );
        relay.up();
        let f = h.home.write("u.yaml", &tiny_vm("u1"));
        h.ok(&["apply", "-f", f.to_str().unwrap()]);
        h.ok(&["wait", "vm", "u1", "--for=condition=Ready", "--timeout=10m"]);
        h.run("u1", "echo kept > ~/mark && sync");
        let uid = h.vm_json("u1")["metadata"]["uid"].clone();

        relay.down();
        let o = h.cmd(&[
            "wait",
            "vm",
            "u1",
            "--for=condition=BackendReachable=False",
            "--timeout=2m",
        ]);
        if !o.status.success() {
            let log = std::fs::read_to_string(h.home.path().join("serve.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            panic!(
                "no BackendReachable=False with the relay cut: {}\nserve.log, newest first:\n{}",
                String::from_utf8_lossy(&o.stderr),
                tail.join("\n")
            );
        }
        std::thread::sleep(Duration::from_secs(5)); // a few inventory passes
        let v = h.vm_json("u1");
        assert_eq!(v["metadata"]["uid"], uid, "the Vm is the same object");
        assert_ne!(v["status"]["phase"], "Lost", "not marked Lost: {v}");
        assert!(v["metadata"]["deletionTimestamp"].is_null(), "not deleted");
        assert_eq!(h.running().len(), 1, "the domain keeps running");

        relay.up();
        h.ok(&["wait", "vm", "u1", "--for=condition=Ready", "--timeout=5m"]);
        let v = h.vm_json("u1");
        assert!(
            v["status"]["conditions"]
                .as_array()
                .unwrap()
                .iter()
                .all(|c| c["type"] != "BackendReachable"),
            "BackendReachable cleared: {v}"
        );
        assert_eq!(h.run("u1", "hostname; cat ~/mark"), "u1\nkept");
        assert!(serve.alive());
        h.ok(&["rm", "u1", "--wait", "--timeout", "3m"]);
        h.ok(&["delete", "image", "tiny", "--wait", "--timeout", "1m"]);
        assert!(h.leftovers().is_empty(), "left behind: {:?}", h.leftovers());
    }
}

/// The backend-neutral tests on system containers (no screen, no memory snapshots).
mod incus {
    /// Incus's own events wake the inventory (`Backend::changes`): with its periodic pass 10
    /// minutes away, a container deleted behind boxery's back is seen as lost within seconds
    /// (without the events it is not: the Vm controller's own resync is a minute away; checked
    /// by hand with the feed turned off). A container stopped behind boxery's back is started
    /// again within seconds too, which the controller's own checks of a running VM also see.
    /// Timed for docs/benchmarks.md.
    #[test]
    fn a_change_behind_boxerys_back_is_seen_at_once() {
        use super::{Kind, RealHome, common, tiny_vm};
        use std::time::{Duration, Instant};
        // within this, a change behind boxery's back is seen (the events' settle is 0.3 s)
        const SEEN_WITHIN: Duration = Duration::from_secs(20);
        let h = RealHome::new(Kind::Incus);
        let _serve = h.serve_args(&["--inventory-every", "10m"], &[]);
        let f = h.home.write("e.yaml", &tiny_vm("e1"));
        h.ok(&["apply", "-f", f.to_str().unwrap()]);
        h.ok(&["wait", "vm", "e1", "--for=condition=Ready", "--timeout=10m"]);
        let b = h.incus_backend();
        let instance = boxery_backends::incus::instance_name("e1");
        // from before the change is made (`incus stop` returns once the container is down)
        let seen = |t: Instant, what: &str, reasons: &[&str]| {
            let d = common::eventually(SEEN_WITHIN, || {
                let d = h.ok(&["describe", "vm", "e1"]);
                reasons.iter().any(|r| d.contains(r)).then_some(d)
            })
            .unwrap_or_else(|| {
                panic!(
                    "{what}: not seen within {SEEN_WITHIN:?}:\n{}",
                    h.ok(&["describe", "vm", "e1"])
                )
            });
            eprintln!(
                "incus events: {what} seen in {:.1} s",
                t.elapsed().as_secs_f64()
            );
            d
        };
        let t = Instant::now();
        super::incus(&["stop", "-f", "--project", b.project(), &instance]);
        // `Exited` (the inventory's condition) lasts until the controller has started it
        // again; `Restarted` is the controller's event when it has
        seen(
            t,
            "a container stopped behind boxery's back",
            &["Exited", "Restarted"],
        );
        h.ok(&["wait", "vm", "e1", "--for=condition=Ready", "--timeout=5m"]);
        let t = Instant::now();
        super::incus(&["delete", "-f", "--project", b.project(), &instance]);
        seen(t, "a container deleted behind boxery's back", &["Lost"]);
        h.ok(&["rm", "e1", "--wait", "--timeout", "3m"]);
        h.ok(&["delete", "image", "tiny", "--wait", "--timeout", "1m"]);
        assert!(h.leftovers().is_empty(), "left behind: {:?}", h.leftovers());
    }

    #[test]
    fn lifecycle_with_real_vms() {
        super::lifecycle(super::Kind::Incus)
    }
    #[test]
    fn crash_during_create_and_capture_with_real_vms() {
        super::crash_during_create_and_capture(super::Kind::Incus)
    }
    #[test]
    fn example_manifests_on_the_debian_guest() {
        super::example_manifests(super::Kind::Incus)
    }
    #[test]
    fn pool_leases_with_real_vms() {
        super::pool_leases(super::Kind::Incus, false)
    }
    #[test]
    fn egress_drill_for_each_policy() {
        super::egress_drill(super::Kind::Incus)
    }
    #[test]
    fn metrics_sample_a_running_vm() {
        super::usage::usage_samples(super::Kind::Incus)
    }
    #[test]
    fn guest_uses_grants_through_the_proxy() {
        super::guest_uses_grants(super::Kind::Incus)
    }

    /// incusd out of reach (its socket cut by a relay): the Vm gets `BackendReachable=False`,
    /// is neither deleted nor marked Lost, and its container keeps running; reachable again,
    /// it is Ready, the same VM. Then its instance deleted behind boxery's back is drift the
    /// ordinary reconcile settles, as on the other backends.
    #[test]
    fn unreachable_incusd_is_a_condition_and_a_deleted_instance_is_drift() {
        use super::{RealHome, common, tiny_vm};
        use std::time::Duration;
        let dir = tempfile::tempdir().unwrap();
        let mut relay =
            super::Relay::new(dir.path().join("incus.sock"), "/var/lib/incus/unix.socket");
        let mut h = RealHome::new(super::Kind::Incus);
        h.env.push((
            "BOXERY_INCUS_SOCKET".into(),
            relay.sock.display().to_string(),
        ));
        relay.up();
        let mut serve = h.serve();
        let f = h.home.write("u.yaml", &tiny_vm("u1"));
        h.ok(&["apply", "-f", f.to_str().unwrap()]);
        h.ok(&["wait", "vm", "u1", "--for=condition=Ready", "--timeout=10m"]);
        h.run("u1", "echo kept > ~/mark && sync");
        let uid = h.vm_json("u1")["metadata"]["uid"].clone();
        assert_eq!(h.vm_json("u1")["status"]["instanceType"], "container");
        // a VM that must be a virtual machine is refused here, not made a container
        let f = h.home.write(
            "vmx.yaml",
            &tiny_vm("vmx").replace("spec:\n", "spec:\n  instanceType: virtual-machine\n"),
        );
        h.ok(&["apply", "-f", f.to_str().unwrap()]);
        let said = common::eventually(Duration::from_secs(60), || {
            let d = h.ok(&["describe", "vm", "vmx"]);
            d.contains("InvalidRequest").then_some(d)
        })
        .unwrap_or_else(|| panic!("not refused:\n{}", h.ok(&["describe", "vm", "vmx"])));
        assert!(
            said.contains("the incus backend makes container only"),
            "{said}"
        );
        h.ok(&["rm", "vmx", "--wait", "--timeout", "1m"]);

        relay.down();
        h.ok(&[
            "wait",
            "vm",
            "u1",
            "--for=condition=BackendReachable=False",
            "--timeout=2m",
        ]);
        std::thread::sleep(Duration::from_secs(5)); // a few inventory passes
        let v = h.vm_json("u1");
        assert_eq!(v["metadata"]["uid"], uid, "the Vm is the same object");
        assert_ne!(v["status"]["phase"], "Lost", "not marked Lost: {v}");
        assert!(v["metadata"]["deletionTimestamp"].is_null(), "not deleted");
        assert_eq!(h.running().len(), 1, "the container keeps running");

        relay.up();
        h.ok(&["wait", "vm", "u1", "--for=condition=Ready", "--timeout=5m"]);
        assert_eq!(h.run("u1", "hostname; cat ~/mark"), "u1\nkept");
        assert!(serve.alive());

        // the instance deleted behind boxery's back
        let b = h.incus_backend();
        super::incus(&[
            "delete",
            "-f",
            "--project",
            b.project(),
            &boxery_backends::incus::instance_name("u1"),
        ]);
        let d = common::eventually(Duration::from_secs(120), || {
            let d = h.ok(&["describe", "vm", "u1"]);
            (d.contains("Lost") || d.contains("Recreat") || d.contains("Restarted")).then_some(d)
        })
        .unwrap_or_else(|| {
            panic!(
                "no reaction to the deleted instance:\n{}",
                h.ok(&["describe", "vm", "u1"])
            )
        });
        eprintln!("after the instance was deleted:\n{d}");
        h.ok(&["rm", "u1", "--wait", "--timeout", "3m"]);
        h.ok(&["delete", "image", "tiny", "--wait", "--timeout", "1m"]);
        assert!(h.leftovers().is_empty(), "left behind: {:?}", h.leftovers());
    }
}

/// Without the libvirt backend in this build, its half of the suite cannot run: say so.
#[cfg(not(feature = "libvirt"))]
#[test]
fn libvirt_backend_is_in_this_build() {
    panic!(
        "the libvirt end-to-end tests need a binary built with the libvirt backend: run them with \
         `--features boxery/libvirt` after scripts/install-libvirt.sh (scripts/test.sh does both)"
    );
}
