//! The hands: reaching VMs over OpenSSH with a generated ssh_config per VM
//! (`$BOXERY_HOME/ssh/vms/NAME.conf`: the pinned host key, one ControlMaster per VM so repeated
//! calls reuse one connection), and `ssh`, `run` and `cp` on top of it. [`ssh`] holds the config,
//! keys and probes (the reconcilers use them too); [`keys`] the key pairs of the leases this
//! host holds; [`reach`] is the one check that a VM can be reached, shared by the CLI and the
//! MCP tools.

use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};

use boxery_api::name::safe;
use boxery_api::{Vm, VmPhase};
use boxery_store::{ObjectStore, ObjectStoreExt};

use crate::ssh::{SshDir, Target};

pub mod forward;
pub mod keys;
pub mod mux;
pub mod ssh;
mod unpack;
pub use unpack::{Kind, Top, UnpackError, filter};

/// What a hand could not do; the message says what to do next.
#[derive(Debug, thiserror::Error)]
pub enum HandsError {
    /// The arguments are wrong.
    #[error("{0}")]
    Invalid(String),
    /// A VM, file or path does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The VM exists but cannot be reached now.
    #[error("{0}")]
    NotReady(String),
    /// Something is in the way (a directory where a file would land).
    #[error("{0}")]
    Conflict(String),
    /// Anything else.
    #[error("{0}")]
    Failed(String),
    /// Unpacking what a VM sent failed.
    #[error("{what}")]
    Copy {
        /// What was being copied.
        what: String,
        /// Why it failed.
        #[source]
        source: UnpackError,
    },
    /// A local file or process operation failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// Reading the store failed.
    #[error(transparent)]
    Store(#[from] boxery_store::StoreError),
}

/// Result alias for the hands.
pub type Result<T = (), E = HandsError> = std::result::Result<T, E>;

/// Who reads a message, so its hint names what they can run: the CLI's commands or the MCP
/// tools. The facts in a message are the same in both voices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Voice {
    /// `boxery …` commands.
    Cli,
    /// `vm_*` tools.
    Tool,
}

/// What the control plane pushes into a guest (the reconcilers' `guest` module writes it):
/// tmpfs, so never in a disk image, and gone at the guest's next boot.
pub mod guest {
    /// The directory (0700, the login user's).
    pub const DIR: &str = "/run/boxery";
    /// The shell file of variables: `BOXERY_PROXY`, `BOXERY_TOKEN`, the providers' and the
    /// `env` grants' (0400).
    pub const ENV: &str = "/run/boxery/env";
    /// `file` grants, each at its target path below this (0400).
    pub const FILES: &str = "/run/boxery/files";
    /// What a remote command line starts with so it sees those variables as a login shell
    /// does (`boxery run`, `boxery ssh VM -- CMD`, MCP `vm_bash`).
    pub const SOURCE: &str = "[ -r /run/boxery/env ] && . /run/boxery/env; ";
}

/// Quote one word for the remote shell.
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,@%+".contains(&b))
    {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// A path for the remote shell: `~` and `~/…` expand to the home, the rest is quoted.
pub fn qpath(p: &str) -> String {
    if p == "~" {
        "\"$HOME\"".into()
    } else if let Some(rest) = p.strip_prefix("~/") {
        format!("\"$HOME\"/{}", shell_quote(rest))
    } else {
        shell_quote(p)
    }
}

/// The not-found message for VM `vm`, listing the known VMs (`names`, at most 30 shown).
pub fn vm_not_found(vm: &str, names: &[String], voice: Voice) -> HandsError {
    let vm = boxery_api::name::shown(vm);
    let cap = if voice == Voice::Cli { 20 } else { 30 };
    let names: Vec<&str> = names.iter().map(String::as_str).take(cap).collect();
    HandsError::NotFound(match (voice, names.is_empty()) {
        (Voice::Cli, true) => {
            format!("VM {vm} not found: there are no VMs (`boxery new NAME` makes one)")
        }
        (Voice::Cli, false) => format!("VM {vm} not found: known VMs: {}", names.join(", ")),
        (Voice::Tool, true) => {
            format!("VM {vm} not found: there are no VMs (vm_manage {{action: new}} makes one)")
        }
        (Voice::Tool, false) => format!("VM {vm} not found; known VMs: {}", names.join(", ")),
    })
}

/// Why `v` cannot be reached over ssh now, and what to do, in `voice`; `None` when it can.
/// The status text comes from controllers and backends, some of it from the guest: it is
/// made [`safe`].
pub fn not_ready(v: &Vm, voice: Voice) -> Option<HandsError> {
    not_ready_from(v, voice, true)
}

/// [`not_ready`] asked from another machine than the VM host (a context).
pub fn not_ready_remote(v: &Vm, voice: Voice) -> Option<HandsError> {
    not_ready_from(v, voice, false)
}

/// [`not_ready`], asked on the VM host itself (`on_host`: its boot id is compared with the
/// VM's last sighting) or from another machine (whose boot says nothing of the VM host's).
fn not_ready_from(v: &Vm, voice: Voice, on_host: bool) -> Option<HandsError> {
    let vm = v.metadata.name.as_str();
    // A VM being deleted still answers: the CLI reaches it until it is gone, a tool does not.
    let deleting = voice == Voice::Tool && v.metadata.is_deleting();
    // Seen running on a boot before the host's last reboot: not running now, whatever it says.
    let rebooted = v
        .status
        .boot_id
        .as_deref()
        .is_some_and(|b| on_host && b != boxery_store::boot_id());
    if rebooted && !deleting {
        return Some(HandsError::NotReady(format!(
            "VM {vm} has not been seen since the host rebooted: a control plane brings it back \
             (runStrategy: Running); {}",
            match voice {
                Voice::Cli => format!("wait with `boxery wait vm {vm} --for=condition=Ready`"),
                Voice::Tool => format!("wait with vm_wait {{kind: vm, name: {vm}}}"),
            }
        )));
    }
    // Held suspended or stopped for a lease's or pool's budget: no use brings it back.
    if let Some(c) = boxery_api::usage::exhausted(&v.status.conditions)
        && !deleting
    {
        return Some(HandsError::NotReady(format!(
            "VM {vm} is held {}: {}",
            if v.status.phase == VmPhase::Stopped {
                "stopped"
            } else {
                "suspended"
            },
            safe(&c.message)
        )));
    }
    if Target::of(v).is_some() && !deleting {
        return None;
    }
    let status = safe(
        &v.status
            .printable_status
            .clone()
            .unwrap_or_else(|| format!("{:?}", v.status.phase)),
    )
    .into_owned();
    let message = v
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .map(|c| safe(&c.message).into_owned());
    let ready = v
        .status
        .conditions
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == boxery_api::ConditionStatus::True);
    if ready && !deleting {
        // Ready, yet no ssh endpoint: its backend runs no guest (the fake backend). Waiting
        // would not help, so no hint to wait.
        let backend = v.status.backend.as_deref().unwrap_or("its backend");
        return Some(HandsError::NotReady(format!(
            "VM {vm} is Ready but has no guest to reach: {} gives no ssh endpoint; the shell, \
             file and copy {} need a backend that boots a guest (qemu, libvirt)",
            safe(backend),
            match voice {
                Voice::Cli => "commands",
                Voice::Tool => "tools",
            }
        )));
    }
    Some(HandsError::NotReady(match voice {
        Voice::Cli => {
            let why = match v.status.phase {
                VmPhase::Stopped => format!("it is stopped: `boxery start {vm} --wait`"),
                VmPhase::Suspended => format!(
                    "it is suspended (its memory is on disk): `boxery resume {vm} --wait` brings it back in about a second"
                ),
                _ => format!(
                    "it is {status} ({}): wait for it with `boxery wait vm {vm} --for=condition=Ready`",
                    message.unwrap_or_default()
                ),
            };
            format!("VM {vm} cannot be reached: {why}")
        }
        Voice::Tool => {
            let msg = message.map(|m| format!(" ({m})")).unwrap_or_default();
            let hint = match v.status.phase {
                _ if deleting => "it is being deleted".to_string(),
                VmPhase::Stopped => "start it with vm_manage {action: start}".to_string(),
                VmPhase::Suspended => {
                    "resume it with vm_manage {action: resume} (about a second; its processes carry on)".to_string()
                }
                _ => format!("wait with vm_wait {{kind: vm, name: {vm}}} (condition=Ready)"),
            };
            format!("VM {vm} is not ready: its status is {status}{msg}; {hint}")
        }
    }))
}

/// What reaching VM `vm` of this home's store needs read: the VM, and the key of a lease this
/// host holds on it. The one way both front ends get to a VM in this home: one read of the VM
/// (the others are listed only to say a name is not found), then [`reach_vm`] (which writes
/// files: off the async workers).
pub async fn reach_read(
    home: &Path,
    store: &dyn ObjectStore,
    vm: &str,
    voice: Voice,
) -> Result<(Vm, Option<PathBuf>)> {
    let Some(v) = store.get_as::<Vm>(vm).await? else {
        let all = store.list_as::<Vm>(&Default::default()).await?;
        let names: Vec<String> = all.into_iter().map(|v| v.metadata.name).collect();
        return Err(vm_not_found(vm, &names, voice));
    };
    let key = keys::held_key(home, store, vm).await;
    Ok((v, key))
}

/// [`reach`] for a VM already read (from any store: a remote one's VMs are reached through
/// `ssh`'s [`ssh::Via`]): check it can be reached, write its ssh files in `ssh`, and log in with
/// `key` (a lease's) or the files' own key.
pub fn reach_vm(ssh: SshDir, v: &Vm, key: Option<PathBuf>, voice: Voice) -> Result<Reach> {
    if let Some(e) = not_ready_from(v, voice, !ssh.is_via()) {
        return Err(e);
    }
    // `not_ready` passed: it has an endpoint and a pinned key.
    let t = Target::of(v).ok_or_else(|| {
        HandsError::NotReady(format!("VM {} has no ssh endpoint", safe(&v.metadata.name)))
    })?;
    ssh.write(&t)
        .map_err(|e| HandsError::Failed(format!("cannot write the ssh files: {e}")))?;
    Ok(Reach {
        cm: ssh.control_path(&t, key.as_deref()),
        key,
        ssh,
        vm: t.name.clone(),
    })
}

/// How this host reaches one VM over ssh, shared by the CLI's hands and the tools:
/// `ssh [-i LEASE_KEY -o ControlPath=…] -F vms/NAME.conf NAME.boxery`. A lease this host holds on the
/// VM lends its key (the holder's access is what is exercised), with a ControlMaster of its
/// own so a connection made with the control plane's key is never reused for it (nor the
/// holder's for anyone else); else the control plane's key.
#[derive(Debug, Clone)]
pub struct Reach {
    ssh: SshDir,
    vm: String,
    key: Option<PathBuf>,
    cm: PathBuf,
}

impl Reach {
    /// The VM.
    pub fn vm(&self) -> &str {
        &self.vm
    }

    /// The ControlMaster socket [`Reach::std_command`] uses (a lease's key has its own).
    pub fn control_path(&self) -> &Path {
        &self.cm
    }

    /// The ssh command, to finish with arguments (`std::process`).
    pub fn std_command(&self) -> std::process::Command {
        self.build(false)
    }

    /// [`Reach::command`] on a connection of its own, never the VM's ControlMaster: for what
    /// must end with the process (a reverse forward, which a master would keep).
    pub fn alone_command(&self) -> tokio::process::Command {
        tokio::process::Command::from(self.build(true))
    }

    fn build(&self, alone: bool) -> std::process::Command {
        let mut c = std::process::Command::new("ssh");
        c.args(crate::ssh::debug_log_args());
        if alone {
            // first on the line: ssh keeps the first value it reads of an option
            c.args(["-S", "none", "-o", "ControlMaster=no"]);
        }
        if let Some(key) = &self.key {
            let mut cp = std::ffi::OsString::from("ControlPath=");
            cp.push(&self.cm);
            c.arg("-i").arg(key).arg("-o").arg(cp);
        }
        c.arg("-F")
            .arg(self.ssh.vm_config(&self.vm))
            .arg(crate::ssh::alias(&self.vm));
        c
    }

    /// Run `line` (one line for the remote shell) without a tty, with this process's stdio,
    /// and return its exit status as `ssh` would (255: ssh failed, or the session was lost).
    /// Over the VM's live ControlMaster, when one answers, without running `ssh` ([`mux`]);
    /// else `ssh -T -o BatchMode=yes` (which also starts the master).
    pub fn run_line(&self, line: &str) -> Result<u8> {
        match mux::open(&self.cm) {
            Ok(s) => {
                let term = std::env::var("TERM").unwrap_or_default();
                match s.run(line, &term) {
                    Ok(outcome) => {
                        mux_log(&format!("ran over {}: {outcome:?}", self.cm.display()));
                        return Ok(match outcome {
                            // `exit()` keeps the low 8 bits, as ssh's does.
                            mux::Outcome::Exit(code) => code as u8,
                            mux::Outcome::Lost | mux::Outcome::ReaderGone => 255,
                        });
                    }
                    Err(e @ mux::Error::Broken(_)) => {
                        eprintln!("boxery: {e}");
                        return Ok(255);
                    }
                    Err(e) => mux_log(&e.to_string()),
                }
            }
            Err(e) => mux_log(&e.to_string()),
        }
        let status = self
            .std_command()
            .args(["-T", "-o", "BatchMode=yes", "--", line])
            .status()
            .map_err(|e| HandsError::Failed(format!("cannot run ssh: {e}")))?;
        Ok(match status.code() {
            Some(c) => c.clamp(0, 255) as u8,
            None => 128 + 9,
        })
    }

    /// The ssh command, to finish with arguments (`tokio::process`).
    pub fn command(&self) -> tokio::process::Command {
        tokio::process::Command::from(self.std_command())
    }
}

/// A child's exit code as a shell reports it (128 + 9 for one killed by a signal).
fn code_of(status: std::process::ExitStatus) -> u8 {
    match status.code() {
        Some(c) => c.clamp(0, 255) as u8,
        None => 128 + 9,
    }
}

/// One remote shell line for a command's words: one word is the line itself (`run VM -- 'a |
/// b'`), several are quoted each.
pub fn line_of(cmd: &[String]) -> String {
    if cmd.len() == 1 {
        cmd[0].clone()
    } else {
        cmd.iter()
            .map(|w| shell_quote(w))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// Whether this process's stdout is a pipe whose reader has left (`boxery run VM -- yes | head
/// -1`): a 255 then is the remote command stopped by SIGPIPE (ssh exits 255 when the session
/// ends without a status), not ssh failing, and says nothing.
fn stdout_reader_gone() -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    let out = std::io::stdout();
    let mut fds = [PollFd::new(&out, PollFlags::OUT)];
    let now = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    poll(&mut fds, Some(&now)).is_ok() && fds[0].revents().contains(PollFlags::ERR)
}

/// With `BOXERY_SSH_LOG=FILE`, a line about the ControlMaster session there (beside ssh's own
/// log): which way a command went.
fn mux_log(what: &str) {
    if let Some(f) = std::env::var_os("BOXERY_SSH_LOG").filter(|f| !f.is_empty()) {
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(f)
        {
            // One write of the whole line: ssh's own processes append to the same file, and
            // `writeln!` would write the line in pieces that theirs can land between.
            let _ = f.write_all(format!("boxery mux: {what}\n").as_bytes());
        }
    }
}

/// `boxery ssh VM [-- CMD…]`: an interactive shell (or a command), with the pinned key.
/// A command without a terminal runs as `boxery run` does.
pub fn ssh(reach: &Reach, cmd: &[String]) -> Result<ExitCode> {
    ssh_code(reach, cmd).map(ExitCode::from)
}

/// [`ssh`], its exit code as a number (for the audit).
pub fn ssh_code(reach: &Reach, cmd: &[String]) -> Result<u8> {
    let line = (!cmd.is_empty()).then(|| {
        let words: Vec<String> = cmd.iter().map(|w| shell_quote(w)).collect();
        words.join(" ")
    });
    ssh_line_code(reach, line.as_deref())
}

/// [`ssh`] with one remote shell line (or none: a shell), run after the guest's variables are
/// read ([`guest::SOURCE`]).
pub fn ssh_line(reach: &Reach, line: Option<&str>) -> Result<ExitCode> {
    ssh_line_code(reach, line).map(ExitCode::from)
}

fn ssh_line_code(reach: &Reach, line: Option<&str>) -> Result<u8> {
    let tty = std::io::IsTerminal::is_terminal(&std::io::stdin());
    let line = line.map(|l| format!("{}{l}", guest::SOURCE));
    let mut c = reach.std_command();
    match line {
        Some(line) if !tty => return reach.run_line(&line),
        Some(line) => c.args(["-t", "--", &line]),
        None if tty => c.arg("-t"),
        None => &mut c,
    };
    let status = c
        .status()
        .map_err(|e| HandsError::Failed(format!("cannot run ssh: {e}")))?;
    Ok(code_of(status))
}

/// `boxery run VM -- CMD…`: run a command, stream its output, exit with its code.
pub fn run(reach: &Reach, cmd: &[String]) -> Result<ExitCode> {
    run_code(reach, cmd).map(ExitCode::from)
}

/// [`run`], its exit code as a number (for the audit).
pub fn run_code(reach: &Reach, cmd: &[String]) -> Result<u8> {
    if cmd.is_empty() {
        return Err(HandsError::Invalid(
            "give a command: boxery run VM -- CMD [ARGS…]".into(),
        ));
    }
    let line = format!("{}{}", guest::SOURCE, line_of(cmd));
    let vm = reach.vm();
    let code = reach.run_line(&line)?;
    if code == 255 && !stdout_reader_gone() {
        eprintln!(
            "boxery: ssh to {vm} failed (exit 255); `boxery describe vm {vm}` shows its state"
        );
    }
    Ok(code)
}

/// A `cp` operand: a local path or `VM:path`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Place {
    /// On this host.
    Local(String),
    /// In a VM.
    Vm(String, String),
}

impl Place {
    /// `VM:path` (a VM name is a DNS label; `./a:b` or `/x:y` are local), or a local path.
    pub fn parse(s: &str) -> Place {
        if let Some(l) = s.strip_prefix("local:") {
            return Place::Local(l.to_string());
        }
        match s.split_once(':') {
            Some((vm, path))
                if boxery_api::validate::check_label_name(vm).is_ok() && !vm.contains('/') =>
            {
                Place::Vm(
                    vm.to_string(),
                    if path.is_empty() {
                        ".".into()
                    } else {
                        path.to_string()
                    },
                )
            }
            _ => Place::Local(s.to_string()),
        }
    }
}

/// Text for a double-quoted string in a remote script, for a message the guest prints with
/// `printf '%s\n' "…"` (never `echo`, which reads backslashes in some shells): what the shell
/// expands there (`"`, `\`, `$`, `` ` ``) becomes `_`, control characters are escaped
/// ([`safe`]). The one way user text goes into a remote message.
pub fn dquoted(text: &str) -> String {
    safe(&text.replace(['"', '\\', '$', '`'], "_")).into_owned()
}

/// The remote script that sends the file or directory at `path` (in the VM) as a tar stream on
/// stdout, exit 3 when there is none; and the top-level name its archive has.
pub fn send_script(path: &str) -> (String, Top) {
    let p = Path::new(path);
    let base = if path == "~" {
        None
    } else {
        p.file_name().and_then(|n| n.to_str())
    };
    let check = format!(
        "s={}; [ -e \"$s\" ] || [ -L \"$s\" ] || {{ printf '%s\\n' \"{}: no such file or directory\" >&2; exit 3; }}; ",
        qpath(path),
        dquoted(path)
    );
    match base {
        Some(b) => {
            let parent = p
                .parent()
                .and_then(|p| p.to_str())
                .filter(|p| !p.is_empty())
                .unwrap_or(".");
            (
                // `./NAME`: a name starting with `-` is a member, not an option
                format!("{check}tar -C {} -cf - ./{}", qpath(parent), shell_quote(b)),
                Top::Name(b.to_string()),
            )
        }
        None => (format!("{check}tar -C \"$s\" -cf - ."), Top::Dot),
    }
}

/// The remote script that receives a [`unpack::filter`]ed archive (top [`unpack::TOP`]) on
/// stdin and puts it at `path` in the VM with the rules of [`Landing`]: through a fresh
/// directory beside it, a file at PATH or PATH/NAME, a directory only where nothing is; and
/// nothing at all unless the archive ends with [`unpack::DONE`].
pub fn receive_script(path: &str, top: &Top, shown: &str) -> String {
    let shown = dquoted(shown);
    let into = match top {
        Top::Name(n) => format!("\"$d\"/{}", shell_quote(n)),
        Top::Dot => "\"$d\"".into(),
    };
    format!(
        "d={d}; if [ -d \"$d\" ]; then p=\"$d\"; f={into}; else p=$(dirname \"$d\"); f=\"$d\"; fi; \
         mkdir -p \"$p\" || exit 1; t=$(mktemp -d \"$p/.boxery-cp.XXXXXX\") || exit 1; \
         if tar -C \"$t\" -xf - && [ -f \"$t/{done}\" ]; then \
           if [ -d \"$t/{top}\" ]; then \
             if [ -e \"$d\" ] || [ -L \"$d\" ]; then printf '%s\\n' \"{shown} exists: a directory is copied to a new path, never into an existing one\" >&2; rc=5; \
             else mv \"$t/{top}\" \"$d\"; rc=$?; fi; \
           elif [ -d \"$f\" ]; then printf '%s\\n' \"{shown}: a directory is in the way of the file\" >&2; rc=5; \
           else mv -f \"$t/{top}\" \"$f\"; rc=$?; fi; \
         else rc=1; fi; rm -rf \"$t\"; exit $rc",
        d = qpath(path),
        top = unpack::TOP,
        done = unpack::DONE,
    )
}

/// Copy a VM's stderr (ssh's and the remote script's) to ours, one line at a time, escaped:
/// a guest cannot write escape sequences to the terminal through `cp`.
fn relay_stderr(from: Option<std::process::ChildStderr>) -> Option<std::thread::JoinHandle<()>> {
    use std::io::{BufRead, Read};
    let from = from?;
    Some(std::thread::spawn(move || {
        let mut r = std::io::BufReader::new(from);
        let mut line = Vec::new();
        loop {
            line.clear();
            match (&mut r).take(64 << 10).read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    let text = String::from_utf8_lossy(&line);
                    eprintln!("{}", safe(text.trim_end_matches('\n')));
                }
            }
        }
    }))
}

/// Read what is left of a stream after its tar archive (the padding to a record), up to
/// 1 MiB; false when there is more (the guest sent something else too).
pub fn drain<R: std::io::Read>(r: &mut R) -> bool {
    let mut rest = <&mut R as std::io::Read>::take(r, (1 << 20) + 1);
    matches!(std::io::copy(&mut rest, &mut std::io::sink()), Ok(n) if n <= 1 << 20)
}

/// A copy from a VM arriving at a local path `dst`. The archive is unpacked into a fresh
/// staging directory beside where the copy lands (same filesystem), checked member by member
/// ([`unpack`]), then renamed into place:
/// - a file lands at DST, or at DST/NAME when DST is a directory (replacing a file there, as
///   `cp` does; never a directory);
/// - a directory lands at DST, which must not exist: it is never merged into an existing
///   directory (so a guest asked for `report.txt` that sends a directory holding `.bashrc`
///   instead writes nothing into an existing DST, and only DST itself when it is new).
///
/// Parent directories of DST are made.
#[derive(Debug)]
pub struct Landing {
    dst: PathBuf,
    top: Top,
    into_dir: bool,
    staging: tempfile::TempDir,
}

impl Landing {
    /// Make the staging directory for a copy whose archive has `top`, to land at `dst`.
    pub fn new(dst: &Path, top: Top) -> Result<Landing> {
        let into_dir = dst.is_dir();
        let beside = if into_dir {
            dst.to_path_buf()
        } else {
            dst.parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(Path::new("."))
                .to_path_buf()
        };
        let shown = safe(&beside.to_string_lossy()).into_owned();
        std::fs::create_dir_all(&beside)
            .map_err(|e| HandsError::Failed(format!("cannot make {shown}: {e}")))?;
        let staging = tempfile::Builder::new()
            .prefix(".boxery-cp.")
            .tempdir_in(&beside)
            .map_err(|e| HandsError::Failed(format!("cannot write in {shown}: {e}")))?;
        Ok(Landing {
            dst: dst.to_path_buf(),
            top,
            into_dir,
            staging,
        })
    }

    /// Unpack the archive read from `r` into the staging directory.
    pub fn unpack(&self, r: impl std::io::Read) -> Result<Kind, UnpackError> {
        unpack::unpack(r, self.top.clone(), self.staging.path())
    }

    /// Rename the unpacked copy into place; returns where it landed. The staging directory
    /// goes, whatever happens.
    pub fn place(self, kind: Kind) -> Result<PathBuf> {
        let from = self.staging.path().join(unpack::TOP);
        let shown = |p: &Path| safe(&p.to_string_lossy()).into_owned();
        let to = match (kind, self.into_dir, &self.top) {
            (Kind::File, true, Top::Name(n)) => self.dst.join(n),
            (Kind::File, true, Top::Dot) | (Kind::Dir, true, _) => {
                return Err(HandsError::Conflict(format!(
                    "{} exists: a directory from a VM is copied to a new path, never into an existing directory (name one that does not exist, e.g. {})",
                    shown(&self.dst),
                    shown(&self.dst.join(match &self.top {
                        Top::Name(n) => n.as_str(),
                        Top::Dot => "copy",
                    }))
                )));
            }
            (_, false, _) => self.dst.clone(),
        };
        match (kind, to.symlink_metadata()) {
            (Kind::Dir, Ok(_)) => {
                return Err(HandsError::Conflict(format!(
                    "{} exists: a directory from a VM is copied to a new path, never over another file",
                    shown(&to)
                )));
            }
            (Kind::File, Ok(m)) if m.is_dir() => {
                return Err(HandsError::Conflict(format!(
                    "{} is a directory: name the file to write",
                    shown(&to)
                )));
            }
            _ => {}
        }
        // rename(2): replaces a file (or a symlink itself) at `to`, never follows one
        std::fs::rename(&from, &to)
            .map_err(|e| HandsError::Failed(format!("cannot write {}: {e}", shown(&to))))?;
        Ok(to)
    }
}

/// `boxery cp SRC DST` and `vm_copy`: local ⇄ VM or VM ⇄ VM, files or directories, streamed
/// through tar over ssh; `reach` gives the way to each VM named in `src` or `dst` (the
/// source's first).
pub fn cp(mut reach: impl FnMut(&str) -> Result<Reach>, src: &str, dst: &str) -> Result<()> {
    match (Place::parse(src), Place::parse(dst)) {
        (Place::Local(l), Place::Vm(vm, path)) => {
            let ssh = reach(&vm)?;
            let lp = Path::new(&l);
            let meta = std::fs::metadata(lp)
                .map_err(|e| HandsError::NotFound(format!("{}: {e}", safe(&l))))?;
            let (dir, name) = if meta.is_dir() {
                (lp.to_path_buf(), ".".to_string())
            } else {
                (
                    lp.parent()
                        .filter(|p| !p.as_os_str().is_empty())
                        .unwrap_or(Path::new("."))
                        .to_path_buf(),
                    lp.file_name()
                        .and_then(|n| n.to_str())
                        .unwrap_or("")
                        .to_string(),
                )
            };
            // A directory's contents go to PATH (made if needed); a file goes to PATH, or into
            // PATH when PATH is a directory.
            let q = qpath(&path);
            let remote = if meta.is_dir() {
                format!("mkdir -p {q} && tar -C {q} -xf -")
            } else {
                let n = shell_quote(&name);
                format!(
                    "set -e; if [ -d {q} ]; then tar -C {q} -xf -; else d=$(dirname {q}); mkdir -p \"$d\"; t=$(mktemp -d \"$d/.boxery-cp.XXXXXX\"); tar -C \"$t\" -xf -; mv -f \"$t\"/{n} {q}; rmdir \"$t\"; fi"
                )
            };
            let mut tar = pack_command(&dir, &name)
                .stdout(Stdio::piped())
                .spawn()
                .map_err(|e| HandsError::Failed(format!("cannot run tar: {e}")))?;
            let out = tar.stdout.take().expect("piped");
            let mut sshc = spawn_ssh(&ssh, &remote, out.into(), Stdio::inherit())?;
            let relay = relay_stderr(sshc.stderr.take());
            let status = sshc.wait()?;
            if let Some(r) = relay {
                let _ = r.join();
            }
            let tar_status = tar.wait()?;
            if !tar_status.success() {
                return Err(HandsError::Failed(format!("reading {} failed", safe(&l))));
            }
            if !status.success() {
                return Err(HandsError::Failed(format!(
                    "writing {vm}:{} failed (ssh exit {:?})",
                    safe(&path),
                    status.code()
                )));
            }
            Ok(())
        }
        (Place::Vm(vm, path), Place::Local(l)) => {
            let ssh = reach(&vm)?;
            let (remote, top) = send_script(&path);
            let shown = format!("{vm}:{}", safe(&path));
            let landing = Landing::new(Path::new(&l), top)?;
            let mut sshc = spawn_ssh(&ssh, &remote, Stdio::null(), Stdio::piped())?;
            let relay = relay_stderr(sshc.stderr.take());
            let mut out = sshc.stdout.take().expect("piped");
            let unpacked = landing.unpack(&mut out);
            if unpacked.is_err() || !drain(&mut out) {
                let _ = sshc.kill();
            }
            drop(out);
            let status = sshc.wait()?;
            if let Some(r) = relay {
                let _ = r.join();
            }
            if status.code() == Some(3) {
                return Err(HandsError::NotFound(format!(
                    "{shown}: no such file or directory in the VM"
                )));
            }
            let kind = unpacked.map_err(|e| HandsError::Copy {
                what: format!("copying {shown}"),
                source: e,
            })?;
            if !status.success() {
                return Err(HandsError::Failed(format!(
                    "reading {shown} failed (ssh exit {:?}): nothing was copied",
                    status.code()
                )));
            }
            landing.place(kind)?;
            Ok(())
        }
        (Place::Vm(sv, sp), Place::Vm(dv, dp)) => {
            let from = reach(&sv)?;
            vm_to_vm(&from, &reach(&dv)?, (&sv, &sp), (&dv, &dp))
        }
        (Place::Local(_), Place::Local(_)) => Err(HandsError::Invalid(
            "one side must be a VM: write VM:PATH (e.g. dev1:/home/agent/file)".into(),
        )),
    }
}

/// Run `script` in a VM by `ssh -T` (batch mode), its stderr piped.
fn spawn_ssh(
    ssh: &Reach,
    script: &str,
    stdin: Stdio,
    stdout: Stdio,
) -> Result<std::process::Child> {
    ssh.std_command()
        .args(["-T", "-o", "BatchMode=yes", "--", script])
        .stdin(stdin)
        .stdout(stdout)
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| HandsError::Failed(format!("cannot run ssh: {e}")))
}

/// Read at most 64 KiB of a child's stderr, in a thread (so a chatty child never blocks).
fn stderr_of(e: Option<std::process::ChildStderr>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        use std::io::Read;
        let mut buf = Vec::new();
        if let Some(e) = e {
            let _ = e.take(64 << 10).read_to_end(&mut buf);
        }
        safe(String::from_utf8_lossy(&buf).trim()).into_owned()
    })
}

/// Stream a copy from one VM into another, through this host and never to disk. The source
/// guest is not trusted by the destination: its archive is checked and re-written here
/// ([`filter`]: one top, no path out, no special files, no link out), and the destination
/// lands it with the rules of `boxery cp` (a fresh directory beside it, a directory never
/// merged into an existing one, nothing unless the whole archive passed).
fn vm_to_vm(from: &Reach, to: &Reach, (sv, sp): (&str, &str), (dv, dp): (&str, &str)) -> Result {
    let (src_script, top) = send_script(sp);
    let dst_script = receive_script(dp, &top, &format!("{dv}:{dp}"));
    let (src_shown, dst_shown) = (format!("{sv}:{}", safe(sp)), format!("{dv}:{}", safe(dp)));
    let mut a = spawn_ssh(from, &src_script, Stdio::null(), Stdio::piped())?;
    let mut b = match spawn_ssh(to, &dst_script, Stdio::piped(), Stdio::null()) {
        Ok(b) => b,
        Err(e) => {
            let _ = a.kill();
            let _ = a.wait();
            return Err(e);
        }
    };
    let (a_err, b_err) = (stderr_of(a.stderr.take()), stderr_of(b.stderr.take()));
    let mut a_out = a.stdout.take().expect("piped");
    let b_in = b.stdin.take().expect("piped");
    let filtered = filter(&mut a_out, top, b_in);
    if filtered.is_err() || !drain(&mut a_out) {
        let _ = a.kill();
    }
    drop(a_out);
    let waited = |e| HandsError::Failed(format!("waiting for ssh failed: {e}"));
    let a_status = a.wait().map_err(waited)?;
    let b_status = b.wait().map_err(waited)?;
    let (a_msg, b_msg) = (
        a_err.join().unwrap_or_default(),
        b_err.join().unwrap_or_default(),
    );
    if a_status.code() == Some(3) {
        return Err(HandsError::NotFound(format!(
            "{src_shown}: no such file or directory in the VM"
        )));
    }
    // the destination stopped reading: its own message says why
    let dst_gave_up = !b_status.success() && matches!(&filtered, Err(UnpackError::Write { .. }));
    if let Err(e) = filtered
        && !dst_gave_up
    {
        return Err(HandsError::Copy {
            what: format!("copying {src_shown}"),
            source: e,
        });
    }
    if !a_status.success() {
        return Err(HandsError::Failed(format!(
            "reading {src_shown} failed: {a_msg}"
        )));
    }
    match b_status.code() {
        Some(0) => Ok(()),
        Some(5) => Err(HandsError::Conflict(b_msg)),
        _ => Err(HandsError::Failed(format!(
            "writing {dst_shown} failed: {b_msg}"
        ))),
    }
}

/// `tar -C DIR -cf - ./NAME` (`.` for a directory's contents): `./` so that a name starting
/// with `-` is a member, never an option.
fn pack_command(dir: &Path, name: &str) -> std::process::Command {
    let mut c = std::process::Command::new("tar");
    c.arg("-C").arg(dir).args(["-cf", "-"]);
    if name == "." {
        c.arg(".");
    } else {
        c.arg(format!("./{name}"));
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places() {
        assert_eq!(
            Place::parse("dev1:/tmp/x"),
            Place::Vm("dev1".into(), "/tmp/x".into())
        );
        assert_eq!(Place::parse("dev1:"), Place::Vm("dev1".into(), ".".into()));
        assert_eq!(Place::parse("./a:b"), Place::Local("./a:b".into()));
        assert_eq!(Place::parse("/x:y"), Place::Local("/x:y".into()));
        assert_eq!(Place::parse("local:dev1:x"), Place::Local("dev1:x".into()));
        assert_eq!(Place::parse("file.txt"), Place::Local("file.txt".into()));
    }

    /// A VM held for a budget says so, and why, although it has an endpoint: no use wakes it.
    #[test]
    fn a_vm_held_for_a_budget_is_not_reached() {
        use boxery_api::Conditions;
        let mut v: Vm = serde_json::from_value(serde_json::json!({
            "apiVersion": "boxery.dev/v1alpha1", "kind": "Vm", "metadata": {"name": "bp-0"},
            "spec": {"source": {"image": "tiny"}},
            "status": {"phase": "Suspended",
                       "ssh": {"endpoint": "127.0.0.1:2222", "hostKey": "ssh-ed25519 AAAA"}}
        }))
        .unwrap();
        assert!(Target::of(&v).is_some());
        v.status.conditions.set_condition(
            boxery_api::conditions::BUDGET_EXHAUSTED,
            boxery_api::ConditionStatus::True,
            "LeaseBudget",
            "lease lb used its vcpuHours budget",
            None,
        );
        let e = not_ready(&v, Voice::Tool)
            .expect("not reachable")
            .to_string();
        assert!(
            e.contains("VM bp-0 is held suspended: lease lb used its vcpuHours budget"),
            "{e}"
        );
    }

    /// A held lease's key goes first, with a ControlMaster of its own; otherwise plain, with
    /// the config's (the path the mux client connects to is the one ssh is given).
    #[test]
    fn lease_keys_get_their_own_connection() {
        let home = tempfile::tempdir().unwrap();
        let ssh = SshDir::new(home.path());
        let t = Target {
            name: "a".into(),
            endpoint: "127.0.0.1:2222".into(),
            host_key: "ssh-ed25519 AAAA".into(),
        };
        let reach = |key: Option<PathBuf>| Reach {
            cm: ssh.control_path(&t, key.as_deref()),
            ssh: ssh.clone(),
            vm: "a".into(),
            key,
        };
        let args = |r: &Reach| -> Vec<String> {
            r.std_command()
                .get_args()
                .map(|a| a.to_string_lossy().into_owned())
                .collect()
        };
        let plain = args(&reach(None));
        assert_eq!(plain[0], "-F");
        assert_eq!(plain.last().unwrap(), "a.boxery");
        let r = reach(Some(home.path().join("leases/l1/id_ed25519")));
        let leased = args(&r);
        assert_eq!(leased[0], "-i");
        assert!(leased[1].ends_with("leases/l1/id_ed25519"));
        assert_eq!(leased[2], "-o");
        let cm = leased[3].strip_prefix("ControlPath=").unwrap();
        assert_eq!(Path::new(cm), r.control_path());
        assert!(
            cm.starts_with(&home.path().join("ssh/cm/").display().to_string()),
            "{cm}"
        );
        assert_ne!(r.control_path(), reach(None).control_path());
        let other = args(&reach(Some(home.path().join("leases/l2/id_ed25519"))));
        assert_ne!(other[3], leased[3], "two leases share a ControlMaster");
        assert_eq!(&leased[4..], &plain[..]);
        // Another endpoint, another master.
        let moved = Target {
            endpoint: "127.0.0.1:2223".into(),
            ..t.clone()
        };
        assert_ne!(ssh.control_path(&moved, None), ssh.control_path(&t, None));
    }

    /// Run a remote script the way a guest does (`sh -c`, in its home), with `stdin`.
    fn guest(script: &str, home: &Path, stdin: &[u8]) -> std::process::Output {
        use std::io::Write;
        let mut c = std::process::Command::new("sh")
            .env("HOME", home)
            .current_dir(home)
            .args(["-c", script])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut w = c.stdin.take().unwrap();
        let _ = w.write_all(stdin);
        drop(w);
        c.wait_with_output().unwrap()
    }

    /// What a local directory holds, as sorted `path` / `dir/` / `link -> target` lines.
    pub(super) fn tree(root: &Path) -> Vec<String> {
        let mut out = Vec::new();
        let mut stack = vec![root.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let e = e.unwrap();
                let rel = e.path().strip_prefix(root).unwrap().display().to_string();
                let t = e.file_type().unwrap();
                if t.is_symlink() {
                    out.push(format!(
                        "{rel} -> {}",
                        std::fs::read_link(e.path()).unwrap().display()
                    ));
                } else if t.is_dir() {
                    out.push(format!("{rel}/"));
                    stack.push(e.path());
                } else {
                    out.push(rel);
                }
            }
        }
        out.sort();
        out
    }

    /// `boxery cp VM:PATH DST` end to end without a VM: the send script runs under the local
    /// sh as the guest would, its stream is landed by [`Landing`].
    fn cp_from(guest_home: &Path, path: &str, dst: &Path) -> Result<PathBuf> {
        let (script, top) = send_script(path);
        let o = guest(&script, guest_home, b"");
        if o.status.code() == Some(3) {
            return Err(HandsError::NotFound(
                String::from_utf8_lossy(&o.stderr).into_owned(),
            ));
        }
        assert!(o.status.success(), "{o:?}");
        let landing = Landing::new(dst, top)?;
        let kind = landing
            .unpack(&o.stdout[..])
            .map_err(|e| HandsError::Failed(e.to_string()))?;
        landing.place(kind)
    }

    /// The documented `cp` rules, from a VM: a file lands at DST or DST/NAME (replacing a
    /// file), a directory at a new DST only; nothing is left beside them.
    #[test]
    fn cp_from_a_vm_follows_the_documented_rules() {
        let vm = tempfile::tempdir().unwrap();
        let g = vm.path();
        std::fs::create_dir_all(g.join("proj/src")).unwrap();
        std::fs::write(g.join("proj/src/a.rs"), "a").unwrap();
        std::os::unix::fs::symlink("src/a.rs", g.join("proj/link")).unwrap();
        std::fs::write(g.join("report.txt"), "report").unwrap();
        std::fs::write(g.join("-rf"), "dash").unwrap();
        let local = tempfile::tempdir().unwrap();
        let l = local.path();

        // a file to a new path, then over it (cp replaces a file), then into a directory
        assert_eq!(
            cp_from(g, "report.txt", &l.join("r.txt")).unwrap(),
            l.join("r.txt")
        );
        std::fs::write(l.join("r.txt"), "old").unwrap();
        cp_from(g, "~/report.txt", &l.join("r.txt")).unwrap();
        assert_eq!(std::fs::read_to_string(l.join("r.txt")).unwrap(), "report");
        std::fs::create_dir(l.join("in")).unwrap();
        assert_eq!(
            cp_from(g, "report.txt", &l.join("in")).unwrap(),
            l.join("in/report.txt")
        );
        // a name starting with `-` is a file, not a tar option
        cp_from(g, "-rf", &l.join("in")).unwrap();
        assert_eq!(std::fs::read_to_string(l.join("in/-rf")).unwrap(), "dash");
        // a directory to a new path (parents made), whole
        cp_from(g, "proj", &l.join("new/proj2")).unwrap();
        assert_eq!(
            tree(&l.join("new/proj2")),
            ["link -> src/a.rs", "src/", "src/a.rs"]
        );
        // the VM's home (no basename) to a new path
        cp_from(g, "~", &l.join("home-copy")).unwrap();
        assert!(l.join("home-copy/proj/src/a.rs").is_file());
        // a directory is never merged into an existing one
        let e = cp_from(g, "proj", &l.join("in")).unwrap_err();
        assert!(matches!(e, HandsError::Conflict(_)), "{e}");
        let e = cp_from(g, "proj", &l.join("r.txt")).unwrap_err();
        assert!(matches!(e, HandsError::Conflict(_)), "{e}");
        assert_eq!(std::fs::read_to_string(l.join("r.txt")).unwrap(), "report");
        // missing
        let e = cp_from(g, "nope/x", &l.join("x")).unwrap_err();
        assert!(matches!(e, HandsError::NotFound(_)), "{e}");
        assert_eq!(
            tree(l)
                .iter()
                .filter(|p| p.contains(".boxery-cp"))
                .collect::<Vec<_>>(),
            Vec::<&String>::new(),
            "staging directories left behind"
        );
    }

    /// `boxery cp dev1:/x/report.txt ~` with a compromised guest: whatever it sends instead of
    /// report.txt (a dotfile, a directory full of them, a link out), nothing in the home
    /// changes and nothing is left in it.
    #[test]
    fn a_guest_cannot_write_outside_the_copy() {
        let home = tempfile::tempdir().unwrap();
        let h = home.path();
        std::fs::write(h.join(".bashrc"), "mine").unwrap();
        let before = tree(h);
        let vm = tempfile::tempdir().unwrap();
        let g = vm.path();
        // the guest makes report.txt a directory holding dotfiles and a link to the host's home
        std::fs::create_dir_all(g.join("x/report.txt/.ssh")).unwrap();
        std::fs::write(g.join("x/report.txt/.bashrc"), "pwned").unwrap();
        std::fs::write(g.join("x/report.txt/.ssh/authorized_keys"), "pwned").unwrap();
        let tar = |dir: &Path, names: &[&str]| -> Vec<u8> {
            std::process::Command::new("tar")
                .arg("-C")
                .arg(dir)
                .args(["-cf", "-"])
                .args(names)
                .output()
                .unwrap()
                .stdout
        };
        let land = |stream: &[u8]| -> Result<PathBuf> {
            let landing = Landing::new(h, Top::Name("report.txt".into()))?;
            let kind = landing
                .unpack(stream)
                .map_err(|e| HandsError::Failed(e.to_string()))?;
            landing.place(kind)
        };
        // a directory where a file was asked for: never merged into the existing home
        let e = land(&tar(&g.join("x"), &["./report.txt"])).unwrap_err();
        assert!(matches!(e, HandsError::Conflict(_)), "{e}");
        // the dotfiles themselves, `..`, a link out: refused
        assert!(land(&tar(&g.join("x/report.txt"), &["./.bashrc"])).is_err());
        assert!(land(&tar(&g.join("x/report.txt"), &["."])).is_err());
        std::fs::create_dir_all(g.join("y/report.txt")).unwrap();
        std::os::unix::fs::symlink(h, g.join("y/report.txt/home")).unwrap();
        assert!(land(&tar(&g.join("y"), &["./report.txt"])).is_err());
        assert_eq!(tree(h), before, "the home changed");
    }

    /// The remote scripts quote what they are given: a path made of shell syntax and escape
    /// sequences is a path, and its message carries no control character.
    #[test]
    fn remote_scripts_quote_paths() {
        let vm = tempfile::tempdir().unwrap();
        let g = vm.path();
        for path in [
            "$(touch pwned)",
            "`touch pwned`",
            "\"; touch pwned; \"",
            "'; touch pwned; '",
            "a\u{1b}]52;c;eA==\u{7}\n$HOME",
        ] {
            let (script, _) = send_script(path);
            let o = guest(&script, g, b"");
            assert_eq!(o.status.code(), Some(3), "{path}: {o:?}");
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(!err.contains('\u{1b}') && !err.contains('\u{7}'), "{err:?}");
            assert_eq!(err.lines().count(), 1, "{err:?}");
            let o = guest(&receive_script(path, &Top::Name("d".into()), path), g, b"");
            assert!(!o.status.success());
            assert!(!g.join("pwned").exists(), "{path}: ran");
        }
        assert!(tree(g).is_empty(), "{:?}", tree(g));
    }

    /// A VM to VM copy: the source's stream is filtered here and landed by the destination's
    /// script (run under the local sh) with the same rules; a cut or refused stream lands
    /// nothing.
    #[test]
    fn vm_to_vm_lands_only_whole_filtered_copies() {
        let a = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(a.path().join("src/sub")).unwrap();
        std::fs::write(a.path().join("src/sub/f"), "f").unwrap();
        std::fs::write(a.path().join("file"), "file").unwrap();
        let b = tempfile::tempdir().unwrap();
        let b = b.path();
        let copy = |path: &str, dst: &str| -> (std::process::Output, Vec<u8>) {
            let (script, top) = send_script(path);
            let o = guest(&script, a.path(), b"");
            let mut clean = Vec::new();
            filter(&o.stdout[..], top.clone(), &mut clean).unwrap();
            (guest(&receive_script(dst, &top, dst), b, &clean), clean)
        };
        let (o, _) = copy("src", "src2");
        assert!(o.status.success(), "{o:?}");
        assert_eq!(tree(&b.join("src2")), ["sub/", "sub/f"]);
        let (o, _) = copy("src", "src2");
        assert_eq!(
            o.status.code(),
            Some(5),
            "merged into an existing directory: {o:?}"
        );
        assert_eq!(tree(&b.join("src2")), ["sub/", "sub/f"]);
        let (o, _) = copy("file", "src2");
        assert!(o.status.success(), "{o:?}");
        assert_eq!(
            std::fs::read_to_string(b.join("src2/file")).unwrap(),
            "file"
        );
        // a stream cut short between two members (GNU tar unpacks that without a word) lands
        // nothing: `done` is missing
        let (_, clean) = copy("file", "other");
        std::fs::remove_file(b.join("other")).unwrap();
        let cut = &clean[..clean.len() - 3 * 512]; // the `done` header and the two end blocks
        assert!(cut.len() >= 1024 && cut.len() % 512 == 0);
        let o = guest(
            &receive_script("other", &Top::Name("file".into()), "other"),
            b,
            cut,
        );
        assert!(!o.status.success(), "{o:?}");
        assert!(!b.join("other").exists());
        assert!(
            !tree(b).iter().any(|p| p.contains(".boxery-cp")),
            "{:?}",
            tree(b)
        );
    }

    /// A local file whose name starts with `-` is packed as a member, not read as an option.
    #[test]
    fn local_names_are_never_tar_options() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("--version"), "x").unwrap();
        let o = pack_command(d.path(), "--version").output().unwrap();
        assert!(o.status.success(), "{o:?}");
        let list = std::process::Command::new("tar")
            .args(["-tf", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut list = list;
        std::io::Write::write_all(&mut list.stdin.take().unwrap(), &o.stdout).unwrap();
        let names = String::from_utf8(list.wait_with_output().unwrap().stdout).unwrap();
        assert_eq!(names.trim(), "./--version");
    }

    #[test]
    fn quoting() {
        assert_eq!(shell_quote("abc"), "abc");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
        assert_eq!(shell_quote(""), "''");
    }
}
