//! The first hands: `ssh`, `run` and `cp`, over OpenSSH with the generated ssh_config
//! (`$BOXERY_HOME/ssh/config`): the pinned host key, and one ControlMaster per VM so repeated
//! calls reuse one connection.

use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};

use boxery_api::{Vm, VmPhase};
use boxery_reconcilers::ssh::{SshDir, Target};
use boxery_store::Store;

use crate::env::Env;
use crate::exit::{CliError, CliResult, Code};

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

/// Check the VM can be reached and write the ssh files; returns how to reach it.
fn prepare(env: &Env, store: &Store, vm: &str) -> CliResult<Reach> {
    let v: Vm = store.get_as(vm)?.ok_or_else(|| {
        let names: Vec<String> = store
            .list_as::<Vm>(&Default::default())
            .unwrap_or_default()
            .into_iter()
            .map(|v| v.metadata.name)
            .collect();
        CliError::not_found(format!(
            "VM {vm} not found: {}",
            if names.is_empty() {
                "there are no VMs (`boxery new NAME --wait` makes one)".to_string()
            } else {
                format!("known VMs: {}", names.join(", "))
            }
        ))
    })?;
    if Target::of(&v).is_none() {
        let why = match v.status.phase {
            VmPhase::Stopped => "it is stopped: `boxery start NAME --wait`".to_string(),
            p => format!(
                "it is {} ({}): wait for it with `boxery wait vm {vm} --for=condition=Ready`",
                v.status
                    .printable_status
                    .clone()
                    .unwrap_or_else(|| format!("{p:?}")),
                v.status
                    .conditions
                    .iter()
                    .find(|c| c.type_ == "Ready")
                    .map(|c| c.message.clone())
                    .unwrap_or_default()
            ),
        };
        return Err(CliError::new(
            Code::Conflict,
            anyhow::anyhow!("VM {vm} cannot be reached: {why}"),
        ));
    }
    let ssh = SshDir::new(&env.home);
    let targets: Vec<Target> = store
        .list_as::<Vm>(&Default::default())?
        .iter()
        .filter_map(Target::of)
        .collect();
    ssh.write(&targets)
        .map_err(|e| CliError::failed(format!("{e:#}")))?;
    Ok(Reach::new(env, store, ssh, vm))
}

/// How this host reaches one VM over ssh, shared by the CLI's hands and the tools:
/// `ssh -F config [-i LEASE_KEY -o ControlPath=…] NAME.boxery`. A lease this host holds on the
/// VM lends its key (the holder's access is what is exercised), with a ControlMaster of its
/// own so a connection made with the control plane's key is never reused for it (nor the
/// holder's for anyone else); else the control plane's key.
#[derive(Debug, Clone)]
pub(crate) struct Reach {
    ssh: SshDir,
    vm: String,
    key: Option<PathBuf>,
}

impl Reach {
    /// How to reach `vm` with the ssh files in `ssh` (looks up a lease this host holds on it).
    pub(crate) fn new(env: &Env, store: &Store, ssh: SshDir, vm: &str) -> Reach {
        Reach {
            key: crate::pools::held_key(env, store, vm),
            ssh,
            vm: vm.to_string(),
        }
    }

    /// The VM.
    pub(crate) fn vm(&self) -> &str {
        &self.vm
    }

    /// The ssh command, to finish with arguments (`std::process`).
    pub(crate) fn std_command(&self) -> std::process::Command {
        let mut c = std::process::Command::new("ssh");
        c.args(boxery_reconcilers::ssh::debug_log_args());
        if let Some(key) = &self.key {
            // A short, stable name per key: socket paths are limited to ~100 bytes.
            let tag = key
                .as_os_str()
                .as_encoded_bytes()
                .iter()
                .fold(0xcbf29ce484222325u64, |h, b| {
                    (h ^ u64::from(*b)).wrapping_mul(0x100000001b3)
                });
            let cm = self
                .ssh
                .config()
                .with_file_name("cm")
                .join(format!("%C-{:08x}", tag as u32));
            c.arg("-i")
                .arg(key)
                .arg("-o")
                .arg(format!("ControlPath={}", cm.display()));
        }
        c.arg("-F")
            .arg(self.ssh.config())
            .arg(boxery_reconcilers::ssh::alias(&self.vm));
        c
    }

    /// The ssh command, to finish with arguments (`tokio::process`).
    pub(crate) fn command(&self) -> tokio::process::Command {
        tokio::process::Command::from(self.std_command())
    }
}

fn exit_of(status: std::process::ExitStatus) -> ExitCode {
    match status.code() {
        Some(c) => ExitCode::from(c.clamp(0, 255) as u8),
        None => ExitCode::from(128 + 9),
    }
}

/// `boxery ssh VM [-- CMD…]`: an interactive shell (or a command), with the pinned key.
pub fn ssh(env: &Env, vm: &str, cmd: &[String]) -> CliResult<ExitCode> {
    let store = env.store()?;
    let mut c = prepare(env, &store, vm)?.std_command();
    if std::io::IsTerminal::is_terminal(&std::io::stdin()) {
        c.arg("-t");
    }
    if !cmd.is_empty() {
        c.arg("--").arg(
            cmd.iter()
                .map(|w| shell_quote(w))
                .collect::<Vec<_>>()
                .join(" "),
        );
    }
    let status = c
        .status()
        .map_err(|e| CliError::failed(format!("cannot run ssh: {e}")))?;
    Ok(exit_of(status))
}

/// `boxery run VM -- CMD…`: run a command, stream its output, exit with its code.
pub fn run(env: &Env, vm: &str, cmd: &[String]) -> CliResult<ExitCode> {
    if cmd.is_empty() {
        return Err(CliError::invalid(
            "give a command: boxery run VM -- CMD [ARGS…]",
        ));
    }
    let store = env.store()?;
    let ssh = prepare(env, &store, vm)?;
    let line = if cmd.len() == 1 {
        cmd[0].clone()
    } else {
        cmd.iter()
            .map(|w| shell_quote(w))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let status = ssh
        .std_command()
        .args(["-T", "-o", "BatchMode=yes", "--", &line])
        .status()
        .map_err(|e| CliError::failed(format!("cannot run ssh: {e}")))?;
    if status.code() == Some(255) {
        eprintln!(
            "boxery: ssh to {vm} failed (exit 255); `boxery describe vm {vm}` shows its state"
        );
    }
    Ok(exit_of(status))
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

/// `boxery cp SRC DST`: local ⇄ VM, files or directories, streamed through tar over ssh.
pub fn cp(env: &Env, src: &str, dst: &str) -> CliResult<ExitCode> {
    let store = env.store()?;
    match (Place::parse(src), Place::parse(dst)) {
        (Place::Local(l), Place::Vm(vm, path)) => {
            let ssh = prepare(env, &store, &vm)?;
            let lp = Path::new(&l);
            let meta =
                std::fs::metadata(lp).map_err(|e| CliError::not_found(format!("{l}: {e}")))?;
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
            // A directory goes to PATH (made if needed); a file goes to PATH, or into PATH when
            // PATH is a directory.
            let q = shell_quote(&path);
            let remote = if meta.is_dir() {
                format!("mkdir -p {q} && tar -C {q} -xf -")
            } else {
                let n = shell_quote(&name);
                format!(
                    "set -e; if [ -d {q} ]; then tar -C {q} -xf -; else d=$(dirname {q}); mkdir -p \"$d\"; t=$(mktemp -d \"$d/.boxery-cp.XXXXXX\"); tar -C \"$t\" -xf -; mv -f \"$t\"/{n} {q}; rmdir \"$t\"; fi"
                )
            };
            let mut tar = std::process::Command::new("tar")
                .arg("-C")
                .arg(&dir)
                .args(["-cf", "-", &name])
                .stdout(Stdio::piped())
                .spawn()
                .map_err(|e| CliError::failed(format!("cannot run tar: {e}")))?;
            let out = tar.stdout.take().expect("piped");
            let status = ssh
                .std_command()
                .args(["-T", "-o", "BatchMode=yes", "--", &remote])
                .stdin(out)
                .status()
                .map_err(|e| CliError::failed(format!("cannot run ssh: {e}")))?;
            let tar_status = tar.wait()?;
            if !tar_status.success() {
                return Err(CliError::failed(format!("reading {l} failed")));
            }
            if !status.success() {
                return Err(CliError::failed(format!(
                    "writing {vm}:{path} failed (ssh exit {:?})",
                    status.code()
                )));
            }
            Ok(ExitCode::SUCCESS)
        }
        (Place::Vm(vm, path), Place::Local(l)) => {
            let ssh = prepare(env, &store, &vm)?;
            let q = shell_quote(&path);
            let lp = Path::new(&l);
            // Directories copy their contents into L (made if needed); a file lands at L, or
            // inside L when L is a directory.
            let is_dir = ssh
                .std_command()
                .args(["-T", "-o", "BatchMode=yes", "--", &format!("test -d {q}")])
                .status()
                .map_err(|e| CliError::failed(format!("cannot run ssh: {e}")))?
                .success();
            let (remote, target_dir, rename) = if is_dir {
                std::fs::create_dir_all(lp)?;
                (format!("tar -C {q} -cf - ."), lp.to_path_buf(), None)
            } else {
                let base = Path::new(&path)
                    .file_name()
                    .and_then(|n| n.to_str())
                    .unwrap_or("file")
                    .to_string();
                let parent = shell_quote(
                    Path::new(&path)
                        .parent()
                        .and_then(|p| p.to_str())
                        .filter(|p| !p.is_empty())
                        .unwrap_or("."),
                );
                let remote = format!(
                    "test -e {q} || {{ echo \"{path}: no such file\" >&2; exit 3; }}; tar -C {parent} -cf - {}",
                    shell_quote(&base)
                );
                if lp.is_dir() {
                    (remote, lp.to_path_buf(), None)
                } else {
                    let dir = lp
                        .parent()
                        .filter(|p| !p.as_os_str().is_empty())
                        .unwrap_or(Path::new("."))
                        .to_path_buf();
                    (
                        remote,
                        dir.clone(),
                        Some((dir.join(&base), lp.to_path_buf())),
                    )
                }
            };
            let tmp = match &rename {
                Some(_) => tempfile::Builder::new()
                    .prefix(".boxery-cp.")
                    .tempdir_in(&target_dir)?,
                None => tempfile::tempdir()?,
            };
            let extract_into = if rename.is_some() {
                tmp.path().to_path_buf()
            } else {
                target_dir.clone()
            };
            let mut sshc = ssh
                .std_command()
                .args(["-T", "-o", "BatchMode=yes", "--", &remote])
                .stdout(Stdio::piped())
                .spawn()
                .map_err(|e| CliError::failed(format!("cannot run ssh: {e}")))?;
            let out = sshc.stdout.take().expect("piped");
            let tar_status = std::process::Command::new("tar")
                .arg("-C")
                .arg(&extract_into)
                .args(["-xf", "-"])
                .stdin(out)
                .status()
                .map_err(|e| CliError::failed(format!("cannot run tar: {e}")))?;
            let status = sshc.wait()?;
            if !status.success() {
                return Err(CliError::new(
                    if status.code() == Some(3) {
                        Code::NotFound
                    } else {
                        Code::Failed
                    },
                    anyhow::anyhow!("reading {vm}:{path} failed (ssh exit {:?})", status.code()),
                ));
            }
            if !tar_status.success() {
                return Err(CliError::failed(format!("writing {l} failed")));
            }
            if let Some((from, to)) = rename {
                let name = from.file_name().expect("a file name").to_owned();
                std::fs::rename(tmp.path().join(name), &to)?;
            }
            Ok(ExitCode::SUCCESS)
        }
        (Place::Vm(..), Place::Vm(..)) => Err(CliError::invalid(
            "copying from one VM to another is not supported yet: copy to a local path first",
        )),
        (Place::Local(_), Place::Local(_)) => Err(CliError::invalid(
            "one side must be a VM: write VM:PATH (e.g. dev1:/home/agent/file)",
        )),
    }
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

    /// A held lease's key goes first, with a ControlMaster of its own; otherwise plain.
    #[test]
    fn lease_keys_get_their_own_connection() {
        let home = tempfile::tempdir().unwrap();
        let args = |key: Option<PathBuf>| -> Vec<String> {
            Reach {
                ssh: SshDir::new(home.path()),
                vm: "a".into(),
                key,
            }
            .std_command()
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
        };
        let plain = args(None);
        assert_eq!(plain[0], "-F");
        assert_eq!(plain.last().unwrap(), "a.boxery");
        let leased = args(Some(home.path().join("leases/l1/id_ed25519")));
        assert_eq!(leased[0], "-i");
        assert!(leased[1].ends_with("leases/l1/id_ed25519"));
        assert_eq!(leased[2], "-o");
        let cm = leased[3].strip_prefix("ControlPath=").unwrap();
        assert!(
            cm.starts_with(&home.path().join("ssh/cm/%C-").display().to_string()),
            "{cm}"
        );
        let other = args(Some(home.path().join("leases/l2/id_ed25519")));
        assert_ne!(other[3], leased[3], "two leases share a ControlMaster");
        assert_eq!(&leased[4..], &plain[..]);
    }

    #[test]
    fn quoting() {
        assert_eq!(shell_quote("abc"), "abc");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
        assert_eq!(shell_quote(""), "''");
    }
}
