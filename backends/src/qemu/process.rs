//! One daemonized QEMU per VM: choosing the accelerator, building the command line,
//! launching, finding a VM's process again after a restart, and ending it.
//!
//! Guarantees: a process is only ever signalled after its `/proc/PID/cmdline` was checked to
//! be a `qemu-system-*` whose arguments name this VM's own directory, so a stale pidfile (or a
//! PID reused by something else) is never acted on.
//!
//! QEMU's stderr goes to `qemu.log` while it starts (the part shown when a start fails); once
//! daemonized, QEMU would point it at /dev/null, so `-D qemu-run.log` keeps what it says later
//! (an assertion that aborts it, the signal that ended it).

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use crate::host::Accel;
use crate::storage::records::Boot;
use std::time::Duration;

use serde_json::json;

/// A failed process operation.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// The QEMU binary is not there.
    #[error(
        "QEMU is not installed ({binary} not found): run scripts/install-deps.sh (Debian: qemu-system-x86 from bookworm-backports)"
    )]
    Missing {
        /// The binary looked for.
        binary: String,
    },
    /// Spawning QEMU failed.
    #[error("could not run {binary}")]
    Spawn {
        /// The binary.
        binary: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// QEMU exited with an error while starting; `log` is the tail of its stderr.
    #[error("QEMU failed to start VM {vm} ({status}): {log}")]
    Start {
        /// The VM.
        vm: String,
        /// Its exit status.
        status: String,
        /// The tail of its stderr.
        log: String,
    },
    /// QEMU did not finish starting in time.
    #[error("QEMU did not finish starting VM {vm} within {timeout:?}")]
    StartTimeout {
        /// The VM.
        vm: String,
        /// How long we waited.
        timeout: Duration,
    },
    /// It started but wrote no usable pidfile.
    #[error("QEMU started VM {vm} but its pidfile {path} is unreadable")]
    Pidfile {
        /// The VM.
        vm: String,
        /// The pidfile.
        path: PathBuf,
    },
    /// Preparing QEMU's log file failed.
    #[error("could not open QEMU's log {path}")]
    Log {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Signalling a process failed.
    #[error("could not signal QEMU process {pid}")]
    Signal {
        /// The process.
        pid: i32,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// It would not die.
    #[error("QEMU process {pid} is still alive after SIGKILL")]
    Unkillable {
        /// The process.
        pid: i32,
    },
}

/// Everything one QEMU command line needs.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    /// The VM's name.
    pub name: String,
    /// Its directory (named in the command line: how its process is recognised).
    pub dir: PathBuf,
    /// SMBIOS UUID.
    pub uuid: String,
    /// MAC address.
    pub mac: String,
    /// Host loopback port forwarded to the guest's port 22.
    pub port: u16,
    /// vCPUs.
    pub cpus: u32,
    /// Memory in MiB.
    pub memory_mib: u64,
    /// The read-only base.
    pub base: PathBuf,
    /// Read-only layers between the base and the active overlay, bottom first, with their node
    /// names (a captured or linked layer a stream has not pulled up yet); usually none.
    pub backing: Vec<(PathBuf, String)>,
    /// The VM's active overlay (backed by the last of `backing`, or by `base`).
    pub disk: PathBuf,
    /// The active overlay's node name (`ov<generation>`).
    pub disk_node: String,
    /// The seed ISO.
    pub seed: PathBuf,
    /// The QMP socket.
    pub qmp: PathBuf,
    /// The guest agent socket.
    pub qga: PathBuf,
    /// The serial console log.
    pub serial: PathBuf,
    /// Where QEMU's stderr goes once it has daemonized (`-D`, truncated at each start).
    pub run_log: PathBuf,
    /// The pidfile.
    pub pidfile: PathBuf,
    /// How it boots.
    pub boot: Boot,
    /// The accelerator.
    pub accel: Accel,
    /// TCG translation cache size in MiB (`None`: QEMU's default).
    pub tcg_tb_size_mib: Option<u32>,
    /// Confine QEMU with its seccomp filter (`-sandbox`).
    pub sandbox: bool,
    /// The credential proxy's channel: a guest connection to [`GUEST_PROXY_ADDR`] runs
    /// `socat` to this host unix socket (slirp `guestfwd`, one process per connection).
    pub proxy: PathBuf,
    /// The `socat` that carries it when there is no relay.
    pub socat: PathBuf,
    /// `boxery-relay`, which carries it when given (`relay SOCKET`).
    pub relay: Option<PathBuf>,
    /// The VM's `boxery-net` socket, when that helper runs its network instead of QEMU's
    /// own slirp (`-netdev stream`; the helper forwards the port and the proxy's channel).
    pub net: Option<PathBuf>,
    /// Start paused, waiting for its memory to be loaded (`-incoming defer`): a resume
    /// (super::memory). Not part of [`command_line`], which is what a saved state is tied to.
    pub incoming: bool,
    /// Where the guest's RAM lives when not in QEMU's own memory (super::memory). Not part
    /// of [`command_line`]: where RAM lives is not part of the guest's state.
    pub ram: Option<RamFile>,
    /// Never run the guest (`-S`; a conversion of saved memory, which only loads and saves).
    pub frozen: bool,
    /// Give it a screen ([`SCREEN_DEVICES`]). Always, but for a restore of a state saved
    /// before VMs had screens: its devices are the state's ([`had_screen`]).
    pub screen: bool,
}

/// A file that holds the guest's RAM (`-object memory-backend-file,id=pc.ram`, the id of the
/// machine's own RAM, so saved states name the same RAM block either way).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RamFile {
    /// Mapped privately from a memory image's RAM file, which is never written: the pages
    /// the guest does not write stay shared with every VM mapping the same file.
    Private(PathBuf),
    /// Written through to the file.
    Shared(PathBuf),
}

/// The id of the RAM object [`RamFile`] makes.
const RAM_ID: &str = "pc.ram";

/// The arguments that put the guest's RAM in `ram`.
fn ram_args(memory_mib: u64, ram: &RamFile) -> [String; 4] {
    let (path, how) = match ram {
        RamFile::Private(p) => (p, "share=off,readonly=on,rom=off"),
        RamFile::Shared(p) => (p, "share=on"),
    };
    [
        "-object".into(),
        format!(
            "memory-backend-file,id={RAM_ID},size={memory_mib}M,mem-path={},{how}",
            path.display()
        ),
        "-machine".into(),
        format!("memory-backend={RAM_ID}"),
    ]
}

/// Where a qemu guest reaches the credential proxy: an address inside slirp's network that
/// nothing else answers on (`guestfwd`).
pub const GUEST_PROXY_ADDR: &str = "10.0.2.100:80";
/// Where a qemu guest sees the host: slirp's gateway (`restrict=on`: the host's loopback is
/// reached there only through what is forwarded).
pub const GUEST_GATEWAY: std::net::Ipv4Addr = std::net::Ipv4Addr::new(10, 0, 2, 2);

/// slirp's DNS address, where a qemu guest's name lookups go (`boxery-net` takes them to the
/// control plane); the guest push names it to the guest's resolver (restricted slirp's DHCP
/// names none).
pub const GUEST_DNS: std::net::Ipv4Addr = std::net::Ipv4Addr::new(10, 0, 2, 3);

/// The name of the node the base is opened as (every stream job names it as its base).
pub const BASE_NODE: &str = "base";
/// The qdev id of the VM's disk.
pub const DISK_DEVICE: &str = "vda";

fn os(s: impl Into<OsString>) -> OsString {
    s.into()
}

/// The QEMU arguments for `spec` (without `-daemonize`/`-pidfile`).
pub fn command_line(spec: &LaunchSpec) -> Vec<OsString> {
    let p = |p: &Path| p.display().to_string();
    let mut a: Vec<OsString> = Vec::new();
    let mut push = |items: &[&str]| a.extend(items.iter().map(os));
    push(&["-name", &format!("guest={},debug-threads=on", spec.name)]);
    push(&["-uuid", &spec.uuid]);
    push(&["-machine", spec.boot.machine.as_deref().unwrap_or("q35")]);
    match spec.accel {
        Accel::Kvm => push(&["-accel", "kvm", "-cpu", "host"]),
        Accel::Tcg => {
            let accel = match spec.tcg_tb_size_mib {
                Some(mib) => format!("tcg,tb-size={mib}"),
                None => "tcg".into(),
            };
            push(&["-accel", &accel, "-cpu", "max"]);
        }
    }
    push(&[
        "-smp",
        &spec.cpus.to_string(),
        "-m",
        &spec.memory_mib.to_string(),
    ]);
    push(&["-nodefaults", "-no-user-config", "-display", "none"]);
    // a new generation id at every start: a guest resumed or forked from saved memory
    // (Linux 5.18+) reseeds its random pool before anything can use the old one
    push(&["-device", "vmgenid,guid=auto"]);
    // Daemonized QEMU points its stderr at the -D file instead of /dev/null: an abort's
    // message (an assertion) or the signal that ended it stays readable.
    push(&["-D", &p(&spec.run_log)]);
    if spec.sandbox {
        // seccomp: no obsolete syscalls, no scheduler/affinity changes. `elevateprivileges`
        // and `spawn` stay allowed: -daemonize needs setsid() and fork()
        push(&["-sandbox", "on,obsolete=deny,resourcecontrol=deny"]);
    }
    if let Some(k) = &spec.boot.kernel {
        push(&["-kernel", &p(k)]);
        if let Some(i) = &spec.boot.initrd {
            push(&["-initrd", &p(i)]);
        }
        if let Some(c) = &spec.boot.cmdline {
            push(&["-append", c]);
        }
    }
    push(&[
        "-chardev",
        &format!("file,id=serial0,path={}", p(&spec.serial)),
        "-serial",
        "chardev:serial0",
    ]);
    push(&[
        "-chardev",
        &format!("socket,id=qmp,path={},server=on,wait=off", p(&spec.qmp)),
        "-mon",
        "chardev=qmp,mode=control",
    ]);
    push(&[
        "-chardev",
        &format!("socket,id=qga0,path={},server=on,wait=off", p(&spec.qga)),
        "-device",
        "virtio-serial-pci,id=vser0",
        "-device",
        "virtserialport,chardev=qga0,name=org.qemu.guest_agent.0",
    ]);
    let blockdev = |v: serde_json::Value| v.to_string();
    push(&[
        "-blockdev",
        &blockdev(
            json!({"driver": "file", "filename": p(&spec.base), "node-name": "base-file", "read-only": true}),
        ),
        "-blockdev",
        &blockdev(
            json!({"driver": "qcow2", "file": "base-file", "node-name": BASE_NODE, "read-only": true}),
        ),
    ]);
    // the layers in between: read-only, so a layer shared with an image is never written
    let mut below = BASE_NODE.to_string();
    for (path, node) in &spec.backing {
        push(&[
            "-blockdev",
            &blockdev(
                json!({"driver": "file", "filename": p(path), "node-name": format!("{node}-file"), "read-only": true}),
            ),
            "-blockdev",
            &blockdev(
                json!({"driver": "qcow2", "file": format!("{node}-file"), "backing": below, "node-name": node, "read-only": true}),
            ),
        ]);
        below = node.clone();
    }
    let node = &spec.disk_node;
    push(&[
        "-blockdev",
        &blockdev(
            // auto-read-only: once a snapshot has frozen this layer (it may become an image),
            // QEMU reopens the file read-only instead of keeping its writable descriptor
            json!({"driver": "file", "filename": p(&spec.disk), "node-name": format!("{node}-file"), "discard": "unmap", "auto-read-only": true}),
        ),
        "-blockdev",
        &blockdev(
            json!({"driver": "qcow2", "file": format!("{node}-file"), "backing": below, "node-name": node, "discard": "unmap"}),
        ),
        "-device",
        &format!("virtio-blk-pci,drive={node},id={DISK_DEVICE},bootindex=1"),
        "-blockdev",
        &blockdev(
            json!({"driver": "file", "filename": p(&spec.seed), "node-name": "seed-file", "read-only": true}),
        ),
        "-blockdev",
        &blockdev(
            json!({"driver": "raw", "file": "seed-file", "node-name": "seed", "read-only": true}),
        ),
        "-device",
        "virtio-blk-pci,drive=seed,id=seed",
    ]);
    // The guest's only way out (docs/egress.md): `restrict=on` drops every connection the
    // guest opens but the guestfwd (DNS and 10.0.2.2 included: the host's loopback is out of
    // reach), `ipv6=off` leaves no uncovered IPv6 path; the hostfwd still carries sshd in.
    // The proxy's channel: each guest connection to GUEST_PROXY_ADDR spawns socat to the
    // VM's own socket (a chardev would carry one connection only). The netdev option parser
    // splits on commas (the state directory has none: `init` refuses it); the command is
    // split like a shell's words, hence the quotes.
    if let Some(sock) = &spec.net {
        // the same network, run by boxery-net (super::net): restricted slirp, the ssh
        // forward and the proxy's channel there; QEMU reconnects if the helper restarts
        push(&[
            "-netdev",
            &format!(
                "stream,id=n0,server=off,addr.type=unix,addr.path={},reconnect-ms=200",
                p(sock)
            ),
            "-device",
            &format!("virtio-net-pci,netdev=n0,mac={},romfile=", spec.mac),
            "-device",
            "virtio-rng-pci",
        ]);
    } else {
        user_network(spec, &mut a);
    }
    if spec.screen {
        // its VNC server on the VM's own socket, for a person to watch (`boxery desktop`)
        a.push(os("-vnc"));
        a.push(os(format!("unix:{}", p(&vnc_socket(&spec.dir)))));
        a.extend(SCREEN_DEVICES.iter().map(os));
    }
    a
}

/// `DIR/vnc.sock`: where the QEMU of the VM in `DIR` serves its screen as VNC (no listener
/// elsewhere; the socket is QEMU's user's alone). Not tied to a saved state: a VNC server is
/// not part of the guest's machine.
pub fn vnc_socket(dir: &Path) -> PathBuf {
    dir.join("vnc.sock")
}

/// The VM's screen, added after every other device so theirs keep the PCI addresses they had
/// before VMs had a screen (a guest names its NIC by its slot): a standard VGA, whose text
/// mode is what a guest without a graphics driver shows (the tiny guest's and Debian's cloud
/// kernels have VGA text consoles and no DRM), with QEMU's PS/2 keyboard (always on the
/// machine) for keys, and a virtio tablet for an absolute pointer (a guest without its driver
/// ignores it). No window (`-display none`): the screen is read with QMP's `screendump` and
/// driven with `input-send-event` (super::screen), and watched over VNC on the VM's own unix
/// socket ([`vnc_socket`]).
pub const SCREEN_DEVICES: [&str; 4] = ["-device", "VGA", "-device", "virtio-tablet-pci"];

/// Whether a QEMU command line (a running QEMU's, or the one a saved state is tied to) gives
/// the VM a screen. One from before VMs had screens does not: a state saved under it is
/// restored without one (the devices are part of the state), so an upgrade loses no suspended
/// VM and no memory image.
pub fn had_screen(args: &[String]) -> bool {
    args.windows(SCREEN_DEVICES.len())
        .any(|w| w.iter().zip(SCREEN_DEVICES).all(|(a, b)| a == b))
}

/// QEMU's own user network (slirp) for `spec`, into `a`.
fn user_network(spec: &LaunchSpec, a: &mut Vec<OsString>) {
    let p = |p: &Path| p.display().to_string();
    let mut push = |items: &[&str]| a.extend(items.iter().map(os));
    let guestfwd = match &spec.relay {
        Some(relay) => format!(
            "guestfwd=tcp:{GUEST_PROXY_ADDR}-cmd:{} {}",
            shell_word(&p(relay)),
            shell_word(&p(&spec.proxy)),
        ),
        None => format!(
            "guestfwd=tcp:{GUEST_PROXY_ADDR}-cmd:{} STDIO UNIX-CONNECT:{}",
            shell_word(&p(&spec.socat)),
            shell_word(&p(&spec.proxy)),
        ),
    };
    push(&[
        "-netdev",
        &format!(
            "user,id=n0,restrict=on,ipv6=off,hostfwd=tcp:127.0.0.1:{}-:22,{guestfwd}",
            spec.port
        ),
        "-device",
        &format!("virtio-net-pci,netdev=n0,mac={},romfile=", spec.mac),
        "-device",
        "virtio-rng-pci",
    ]);
}

pub use crate::storage::files::tail;

/// `s` as one word for the shell-like splitting of a slirp `cmd:` (single-quoted unless plain).
fn shell_word(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=@%+".contains(&b))
    {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// Launch QEMU for `spec`, daemonized; returns its PID once it has finished starting.
/// Its stderr goes to `log`.
pub async fn launch(
    binary: &Path,
    spec: &LaunchSpec,
    log: &Path,
    timeout: Duration,
) -> Result<i32, ProcessError> {
    let bin = binary.display().to_string();
    let _ = std::fs::remove_file(&spec.pidfile);
    let _ = std::fs::remove_file(&spec.qmp);
    let _ = std::fs::remove_file(&spec.qga);
    let logf = std::fs::File::create(log).map_err(|source| ProcessError::Log {
        path: log.into(),
        source,
    })?;
    let logf2 = logf.try_clone().map_err(|source| ProcessError::Log {
        path: log.into(),
        source,
    })?;
    let mut cmd = tokio::process::Command::new(binary);
    cmd.args(command_line(spec));
    if spec.incoming {
        cmd.args(["-incoming", "defer"]);
    }
    if let Some(ram) = &spec.ram {
        cmd.args(ram_args(spec.memory_mib, ram));
    }
    if spec.frozen {
        cmd.arg("-S");
    }
    cmd.arg("-daemonize")
        .arg("-pidfile")
        .arg(&spec.pidfile)
        .stdin(std::process::Stdio::null())
        .stdout(logf)
        .stderr(logf2)
        .kill_on_drop(true);
    let mut child = cmd.spawn().map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            ProcessError::Missing {
                binary: bin.clone(),
            }
        } else {
            ProcessError::Spawn {
                binary: bin.clone(),
                source,
            }
        }
    })?;
    let status = match tokio::time::timeout(timeout, child.wait()).await {
        Ok(Ok(s)) => s,
        Ok(Err(source)) => {
            return Err(ProcessError::Spawn {
                binary: bin,
                source,
            });
        }
        Err(_) => {
            let _ = child.kill().await;
            return Err(ProcessError::StartTimeout {
                vm: spec.name.clone(),
                timeout,
            });
        }
    };
    if !status.success() {
        let log = tail(log, 12);
        return Err(ProcessError::Start {
            vm: spec.name.clone(),
            status: status.to_string(),
            log: if log.is_empty() {
                "QEMU printed nothing".into()
            } else {
                log
            },
        });
    }
    read_pid(&spec.pidfile).ok_or_else(|| ProcessError::Pidfile {
        vm: spec.name.clone(),
        path: spec.pidfile.clone(),
    })
}

/// The PID in a pidfile.
pub fn read_pid(pidfile: &Path) -> Option<i32> {
    std::fs::read_to_string(pidfile)
        .ok()?
        .trim()
        .parse()
        .ok()
        .filter(|p| *p > 0)
}

/// Whether `pid` is a live QEMU whose command line names `dir`.
pub fn is_our_qemu(pid: i32, dir: &Path) -> bool {
    runs_for(pid, dir, |exe| exe.starts_with("qemu-system"))
}

/// Whether `pid` is a live process whose program's file name passes `exe` and whose command
/// line names a path in `dir` (how a process is told to be this VM's, not another's that
/// took its PID).
pub fn runs_for(pid: i32, dir: &Path, exe: impl Fn(&str) -> bool) -> bool {
    let Some(args) = cmdline(pid) else {
        return false;
    };
    let argv0 = &args[0];
    if !exe(argv0.rsplit('/').next().unwrap_or(argv0)) {
        return false;
    }
    let needle = format!("{}/", dir.display());
    args[1..].iter().any(|a| a.contains(&needle))
}

/// Whether an argument of live process `pid` names `path` (a QEMU's netdev naming the
/// VM's `net.sock`, say).
pub fn names_path(pid: i32, path: &Path) -> bool {
    let needle = path.display().to_string();
    cmdline(pid).is_some_and(|args| args[1..].iter().any(|a| a.contains(&needle)))
}

/// The arguments live QEMU `pid` was launched with as [`command_line`] made them (its
/// program, `-daemonize`, `-S`, `-pidfile FILE`, `-incoming defer` and where its RAM lives
/// left out): what a state saved from it is tied to.
pub fn launched_args(pid: i32) -> Option<Vec<String>> {
    Some(as_launched(cmdline(pid)?.into_iter().skip(1)))
}

fn as_launched(args: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut out = Vec::new();
    let mut it = args.into_iter().peekable();
    while let Some(a) = it.next() {
        let ram_object = |next: Option<&String>| {
            next.is_some_and(|n| n.starts_with(&format!("memory-backend-file,id={RAM_ID},")))
        };
        match a.as_str() {
            "-daemonize" | "-S" => {}
            "-pidfile" | "-incoming" => {
                it.next();
            }
            "-object" if ram_object(it.peek()) => {
                it.next();
            }
            "-machine"
                if it.peek().map(String::as_str) == Some(&format!("memory-backend={RAM_ID}")) =>
            {
                it.next();
            }
            _ => out.push(a),
        }
    }
    out
}

/// The arguments of live process `pid`, its program first; `None` when it is gone or a
/// zombie (whose cmdline is empty).
fn cmdline(pid: i32) -> Option<Vec<String>> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let args: Vec<String> = raw
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    (!args.is_empty()).then_some(args)
}

/// The PID of the VM's running QEMU, from its pidfile, when that process is alive and ours.
pub fn running_pid(pidfile: &Path, dir: &Path) -> Option<i32> {
    read_pid(pidfile).filter(|pid| is_our_qemu(*pid, dir))
}

fn signal(pid: i32, sig: rustix::process::Signal) -> Result<(), ProcessError> {
    let Some(p) = rustix::process::Pid::from_raw(pid) else {
        return Ok(());
    };
    match rustix::process::kill_process(p, sig) {
        Ok(()) | Err(rustix::io::Errno::SRCH) => Ok(()),
        Err(e) => Err(ProcessError::Signal {
            pid,
            source: e.into(),
        }),
    }
}

/// Whether `pid` exists and has not exited. A zombie has exited, but the leader of a
/// multi-threaded process turns zombie before its other threads have closed the process's
/// files and sockets, so every thread is checked. A process that is exiting also loses its
/// command line early, so this, not [`is_our_qemu`], tells when its port is free again.
pub fn is_alive(pid: i32) -> bool {
    let running = |stat: &str| {
        // "PID (comm) STATE ...": the state follows the last ')'
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next());
        !matches!(state, Some('Z' | 'X') | None)
    };
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks
        .flatten()
        .any(|t| std::fs::read_to_string(t.path().join("stat")).is_ok_and(|s| running(&s)))
}

/// Wait until `pid` (checked to be our QEMU by the caller) has exited; `true` when it is gone
/// in time.
pub async fn wait_gone(pid: i32, timeout: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if !is_alive(pid) {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// End our QEMU `pid` for `dir`: SIGTERM, then SIGKILL after `grace`. Only a process that is
/// checked to be ours is signalled.
pub async fn terminate(pid: i32, dir: &Path, grace: Duration) -> Result<(), ProcessError> {
    if !is_our_qemu(pid, dir) {
        return Ok(());
    }
    signal(pid, rustix::process::Signal::TERM)?;
    if wait_gone(pid, grace).await {
        return Ok(());
    }
    if is_alive(pid) {
        signal(pid, rustix::process::Signal::KILL)?;
    }
    if wait_gone(pid, Duration::from_secs(10)).await {
        Ok(())
    } else {
        Err(ProcessError::Unkillable { pid })
    }
}

/// SIGKILL our QEMU `pid` for `dir` at once, without waiting (for drop guards in tests and
/// benchmarks). Does nothing when the process is not ours.
pub fn kill_now(pid: i32, dir: &Path) {
    if is_our_qemu(pid, dir) {
        let _ = signal(pid, rustix::process::Signal::KILL);
    }
}

/// The resident memory of `pid` in bytes.
pub fn rss_bytes(pid: i32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// QEMU's resident memory split in two: (all, the guest RAM mapping's share), in bytes. The
/// guest RAM is the anonymous mapping exactly `guest_mib` big; the rest is QEMU itself (TCG
/// translation cache, device models, libraries).
pub fn rss_split(pid: i32, guest_mib: u64) -> Option<(u64, u64)> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
    let (mut total, mut guest) = (0u64, 0u64);
    let mut in_guest = false;
    for line in smaps.lines() {
        let mut f = line.split_whitespace();
        match (f.next(), f.next()) {
            (Some("Size:"), Some(kb)) => {
                in_guest = kb.parse::<u64>().ok() == Some(guest_mib * 1024)
            }
            (Some("Rss:"), Some(kb)) => {
                let b = kb.parse::<u64>().unwrap_or(0) * 1024;
                total += b;
                if in_guest {
                    guest += b;
                }
            }
            _ => {}
        }
    }
    Some((total, guest))
}

/// Whether a TCP port on 127.0.0.1 can be bound now (nobody listens on it).
pub fn port_free(port: u16) -> bool {
    std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A launch spec of VM `dev1` (also for super::memory's tests).
    pub(crate) fn spec() -> LaunchSpec {
        let dir = PathBuf::from("/state/qemu/vms/dev1");
        LaunchSpec {
            name: "dev1".into(),
            uuid: "u".into(),
            mac: "52:54:00:12:34:56".into(),
            port: 22001,
            cpus: 2,
            memory_mib: 256,
            base: "/state/qemu/base/tiny-1/disk.qcow2".into(),
            backing: vec![(dir.join("layer-2.qcow2"), "ly2".into())],
            disk: dir.join("disk-3.qcow2"),
            disk_node: "ov3".into(),
            seed: dir.join("seed.iso"),
            qmp: dir.join("qmp.sock"),
            qga: dir.join("qga.sock"),
            serial: dir.join("serial.log"),
            run_log: dir.join("qemu-run.log"),
            pidfile: dir.join("qemu.pid"),
            boot: Boot {
                kernel: Some("/k".into()),
                initrd: Some("/i".into()),
                cmdline: Some("console=ttyS0".into()),
                machine: None,
                acpi_shutdown: true,
            },
            accel: Accel::Tcg,
            tcg_tb_size_mib: None,
            sandbox: true,
            proxy: dir.join("proxy.sock"),
            socat: "/usr/bin/socat".into(),
            relay: None,
            net: None,
            incoming: false,
            ram: None,
            frozen: false,
            screen: true,
            dir,
        }
    }

    #[test]
    fn where_ram_lives_is_not_part_of_the_launched_arguments() {
        let mut s = spec();
        let plain = command_line(&s)
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>();
        s.ram = Some(RamFile::Private("/x/memory.ram".into()));
        let mut launched = plain.clone();
        launched.extend(["-incoming".to_string(), "defer".into(), "-S".into()]);
        launched.extend(ram_args(s.memory_mib, s.ram.as_ref().unwrap()));
        launched.extend([
            "-daemonize".to_string(),
            "-pidfile".into(),
            "/x/qemu.pid".into(),
        ]);
        assert_eq!(as_launched(launched.clone()), plain);
        assert!(
            launched
                .iter()
                .any(|a| a.contains("share=off,readonly=on,rom=off"))
        );
    }

    #[test]
    fn with_boxery_net_qemu_has_no_network_of_its_own() {
        let mut s = spec();
        s.net = Some("/state/qemu/vms/dev1/net.sock".into());
        let joined = command_line(&s)
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect::<Vec<_>>()
            .join(" ");
        assert!(
            joined.contains("-netdev stream,id=n0,server=off,addr.type=unix,addr.path=/state/qemu/vms/dev1/net.sock,reconnect-ms=200 -device virtio-net-pci,netdev=n0,mac=52:54:00:12:34:56,romfile="),
            "{joined}"
        );
        assert!(
            !joined.contains("user,")
                && !joined.contains("hostfwd")
                && !joined.contains("guestfwd"),
            "no slirp in QEMU: {joined}"
        );
        assert!(joined.contains("virtio-rng-pci"));
    }

    #[test]
    fn command_line_names_base_and_loopback_only() {
        let args: Vec<String> = command_line(&spec())
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect();
        let joined = args.join(" ");
        assert!(
            joined.contains("hostfwd=tcp:127.0.0.1:22001-:22"),
            "{joined}"
        );
        assert!(
            joined.contains("\"backing\":\"base\",\"driver\":\"qcow2\",\"file\":\"ly2-file\""),
            "{joined}"
        );
        assert!(joined.contains("\"backing\":\"ly2\""));
        assert!(joined.contains("\"node-name\":\"ov3\""));
        assert!(joined.contains("-accel tcg -cpu max"));
        assert!(joined.contains("mac=52:54:00:12:34:56"));
        assert!(!joined.contains("-daemonize"));
        assert!(
            joined.contains(",guestfwd=tcp:10.0.2.100:80-cmd:/usr/bin/socat STDIO UNIX-CONNECT:/state/qemu/vms/dev1/proxy.sock"),
            "{joined}"
        );
        assert!(
            joined.contains("restrict=on,ipv6=off,hostfwd="),
            "the guest opens no connection of its own: {joined}"
        );
        assert_eq!(shell_word("/a b/it's"), "'/a b/it'\\''s'");
        let mut relayed = spec();
        relayed.relay = Some("/opt/boxery/boxery-relay".into());
        let joined = command_line(&relayed)
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect::<Vec<_>>()
            .join(" ");
        assert!(
            joined.contains(",guestfwd=tcp:10.0.2.100:80-cmd:/opt/boxery/boxery-relay /state/qemu/vms/dev1/proxy.sock"),
            "{joined}"
        );
        assert!(args.iter().any(|a| a.contains("/state/qemu/vms/dev1/")));
    }

    #[test]
    fn the_screen_comes_after_every_other_device_and_shows_no_window() {
        let mut on_slirp = spec();
        on_slirp.relay = None;
        let mut on_helper = spec();
        on_helper.net = Some("/state/qemu/vms/dev1/net.sock".into());
        for s in [on_slirp, on_helper] {
            let args: Vec<String> = command_line(&s)
                .into_iter()
                .map(|a| a.into_string().unwrap())
                .collect();
            assert_eq!(
                args[args.len() - 4..],
                ["-device", "VGA", "-device", "virtio-tablet-pci"],
                "{args:?}"
            );
            assert_eq!(
                args.iter().filter(|a| a.as_str() == "VGA").count(),
                1,
                "{args:?}"
            );
            let joined = args.join(" ");
            assert!(joined.contains("-nodefaults -no-user-config -display none"));
            // VNC on the VM's own socket only
            assert!(
                joined.contains(&format!("-vnc unix:{}/vnc.sock", s.dir.display())),
                "{joined}"
            );
            assert_eq!(joined.matches("-vnc").count(), 1);
            assert!(!joined.contains("-spice"));
            // the devices a VM had before keep their order, so their PCI slots
            let devices: Vec<&str> = args
                .windows(2)
                .filter(|w| w[0] == "-device")
                .map(|w| w[1].split(',').next().unwrap())
                .collect();
            assert_eq!(
                devices,
                [
                    "vmgenid",
                    "virtio-serial-pci",
                    "virtserialport",
                    "virtio-blk-pci",
                    "virtio-blk-pci",
                    "virtio-net-pci",
                    "virtio-rng-pci",
                    "VGA",
                    "virtio-tablet-pci"
                ]
            );
        }
    }

    #[test]
    fn not_our_qemu() {
        assert!(!is_our_qemu(std::process::id() as i32, Path::new("/state")));
        assert!(!is_our_qemu(i32::MAX, Path::new("/state")));
    }
}
