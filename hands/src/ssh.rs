//! Reaching VMs over OpenSSH, always with the pinned host key.
//!
//! Everything lives in `$BOXERY_HOME/ssh/`:
//! - `id_ed25519` (+ `.pub`): the control plane's key, generated once, put in every VM's
//!   `authorized_keys` through its seed;
//! - `vms/NAME.conf`: one VM's whole ssh_config: a `Host NAME.boxery` block (`HostName`,
//!   `Port`, `HostKeyAlias`, its own `UserKnownHostsFile`), `StrictHostKeyChecking yes`, and a
//!   ControlMaster so repeated calls reuse one connection; boxery runs
//!   `ssh -F vms/NAME.conf NAME.boxery`, so a call reads only its own VM's files;
//! - `vms/NAME.known_hosts`: `NAME.boxery ssh-ed25519 …`, from `status.ssh.hostKey`, which was
//!   generated on the host when the VM got its identity (never trust on first use);
//! - `config`: `Include vms/*.conf`, for people: `ssh -F $BOXERY_HOME/ssh/config dev1.boxery`
//!   works by hand (and an `Include` of it in `~/.ssh/config` makes `ssh dev1.boxery` work);
//! - `cm/`: ControlMaster sockets, one per VM endpoint, host key and login key
//!   ([`SshDir::control_path`]: boxery names them itself, not with ssh's `%C`, so that it can
//!   talk to a live master without running `ssh`: [`crate::mux`]).
//!
//! A VM's two files are written from its object (temp file + rename, only when they changed)
//! before each use of that VM: one call costs the same with one VM or a thousand. They are
//! removed when the VM is deleted ([`SshDir::close`]).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use boxery_api::Vm;
use boxery_api::fnv::Fnv;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

/// The guest user boxery logs in as.
pub const USER: &str = "agent";

/// ssh errors.
#[derive(Debug, thiserror::Error)]
pub enum SshError {
    /// Making the control plane's key failed.
    #[error("cannot create the control plane's ssh key in {dir}")]
    Key {
        /// The ssh dir.
        dir: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Writing the config failed.
    #[error("cannot write {path}")]
    Write {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Running ssh failed.
    #[error("cannot run ssh (is openssh-client installed?)")]
    Spawn(#[source] std::io::Error),
    /// The VM cannot be reached.
    #[error("VM {vm} is not reachable over ssh: {reason}")]
    Unreachable {
        /// The VM.
        vm: String,
        /// Why.
        reason: String,
    },
}

/// The host alias of a VM in the generated ssh_config.
pub fn alias(vm: &str) -> String {
    format!("{vm}.boxery")
}

/// One VM as the ssh files describe it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// Name.
    pub name: String,
    /// `HOST:PORT`.
    pub endpoint: String,
    /// The pinned public host key.
    pub host_key: String,
}

impl Target {
    /// The target of a Vm object, when it is running with an endpoint and a pinned key.
    pub fn of(vm: &Vm) -> Option<Target> {
        let ssh = vm.status.ssh.as_ref()?;
        Some(Target {
            name: vm.metadata.name.clone(),
            endpoint: ssh.endpoint.clone()?,
            host_key: ssh.host_key.clone()?,
        })
    }
}

/// The ssh files of one `$BOXERY_HOME` (or of one context of it, for a control plane on
/// another machine).
#[derive(Debug, Clone)]
pub struct SshDir {
    dir: PathBuf,
    via: Option<Via>,
}

/// How the VMs of a control plane on another machine are reached: ssh runs `proxy_command`
/// (`boxery --context NAME connect VM`: the VM's sshd, carried through that machine's API)
/// and logs in with this dir's own key, which that control plane put in the VM's
/// `authorized_keys`. The host key is still the pinned one from the VM's object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Via {
    /// The command, as ssh_config's `ProxyCommand` takes it (run by `/bin/sh`; `%` doubled).
    pub proxy_command: String,
}

fn write_atomic(path: &Path, text: &str, mode: u32) -> Result<(), SshError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let err = |source| SshError::Write {
        path: path.display().to_string(),
        source,
    };
    // Unique per process and per call: two threads (or tasks) of one process writing the same
    // file must not share a temp file.
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp{}-{seq}", std::process::id()));
    let tmp = path.with_file_name(name);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)
        .map_err(err)?;
    let written = f
        .write_all(text.as_bytes())
        .and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.map_err(err)
}

/// Write `text` to `path` unless it already holds exactly that.
fn write_if_changed(path: &Path, text: &str) -> Result<(), SshError> {
    if std::fs::read(path).ok().as_deref() == Some(text.as_bytes()) {
        return Ok(());
    }
    write_atomic(path, text, 0o600)
}

/// A path as one ssh_config argument (quoted: a home may hold spaces).
fn arg(p: &Path) -> String {
    format!("\"{}\"", p.display())
}

impl SshDir {
    /// The ssh dir of a boxery home.
    pub fn new(home: &Path) -> Self {
        SshDir {
            dir: boxery_home::layout::ssh(home),
            via: None,
        }
    }

    /// The ssh files of a home whose VMs are reached `via` another machine.
    pub fn via(home: &Path, via: Via) -> Self {
        SshDir {
            dir: boxery_home::layout::ssh(home),
            via: Some(via),
        }
    }

    /// Whether its VMs are reached through another machine's API.
    pub fn is_via(&self) -> bool {
        self.via.is_some()
    }

    /// The ssh dir itself.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The config file for people: it includes every VM's.
    pub fn config(&self) -> PathBuf {
        self.dir.join("config")
    }

    /// VM `vm`'s own ssh_config, the one boxery's ssh commands use (`-F`).
    pub fn vm_config(&self, vm: &str) -> PathBuf {
        self.dir.join("vms").join(format!("{vm}.conf"))
    }

    /// VM `vm`'s pinned host key, as a known_hosts file.
    pub fn vm_known_hosts(&self, vm: &str) -> PathBuf {
        self.dir.join("vms").join(format!("{vm}.known_hosts"))
    }

    /// The control plane's private key (of a context's folder: this machine's key for it).
    pub fn key(&self) -> PathBuf {
        self.dir.join("id_ed25519")
    }

    /// The keys of `boxery` on other machines (contexts with a full token) that every VM's
    /// `authorized_keys` also holds: one line each, `TYPE BASE64 boxery-api:TOKEN`.
    pub fn remote_keys(&self) -> PathBuf {
        self.dir.join("remote_keys")
    }

    /// What every VM's `authorized_keys` holds: the control plane's key (made on first use)
    /// and the keys of [`SshDir::remote_keys`].
    pub fn authorized_lines(&self) -> Result<Vec<String>, SshError> {
        let mut lines = vec![self.public_key()?];
        lines.extend(self.read_remote_keys());
        Ok(lines)
    }

    fn read_remote_keys(&self) -> Vec<String> {
        std::fs::read_to_string(self.remote_keys())
            .unwrap_or_default()
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(String::from)
            .collect()
    }

    /// Add `public_key` (one OpenSSH public key line; its comment is replaced by `comment`) to
    /// [`SshDir::remote_keys`], once: the line as VMs hold it.
    pub fn add_remote_key(&self, public_key: &str, comment: &str) -> Result<String, SshError> {
        let mut words = public_key.split_whitespace();
        let (Some(ty), Some(body)) = (words.next(), words.next()) else {
            return Err(SshError::Key {
                dir: self.dir.display().to_string(),
                source: std::io::Error::other("not a public key line"),
            });
        };
        let line = format!("{ty} {body} {comment}");
        let mut lines = self.read_remote_keys();
        let same_key = |l: &String| l.split_whitespace().nth(1) == Some(body);
        if !lines.iter().any(|l| l == &line) {
            lines.retain(|l| !same_key(l));
            lines.push(line.clone());
            self.public_key()?;
            write_atomic(&self.remote_keys(), &(lines.join("\n") + "\n"), 0o600)?;
        }
        Ok(line)
    }

    /// Remove the keys added with `comment` (a token revoked): VMs made from now on do not
    /// hold them. Returns how many were removed.
    pub fn remove_remote_keys(&self, comment: &str) -> Result<usize, SshError> {
        let lines = self.read_remote_keys();
        let kept: Vec<String> = lines
            .iter()
            .filter(|l| l.split_whitespace().nth(2) != Some(comment))
            .cloned()
            .collect();
        let removed = lines.len() - kept.len();
        if removed > 0 {
            let text = if kept.is_empty() {
                String::new()
            } else {
                kept.join("\n") + "\n"
            };
            write_atomic(&self.remote_keys(), &text, 0o600)?;
        }
        Ok(removed)
    }

    /// The control plane's public key line, generating the pair on first use.
    pub fn public_key(&self) -> Result<String, SshError> {
        self.keypair(&self.key(), "boxery-control-plane")
    }

    /// The public key line of the ed25519 pair at `key` (and `key.pub`), generated with
    /// `comment` on first use.
    ///
    /// Two processes (or threads) on a fresh home (`boxery serve &` and `boxery apply --wait`
    /// right after it) both find no key: the check and the creation are one step under an
    /// exclusive lock on `key.lock`, and the check is made again once the lock is held, so
    /// one of them makes the pair and the other reads it. The pair is generated beside under
    /// a name of this call's own and renamed into place private half first; a public half
    /// missing beside a private one (a crash between the two renames) is derived from the
    /// private key, never made anew, so the two halves always belong together.
    fn keypair(&self, key: &Path, comment: &str) -> Result<String, SshError> {
        let key_err = |source| SshError::Key {
            dir: self.dir.display().to_string(),
            source,
        };
        let pubf = PathBuf::from(format!("{}.pub", key.display()));
        let read_pair = || -> Option<String> {
            let p = std::fs::read_to_string(&pubf).ok()?;
            (key.exists() && !p.trim().is_empty()).then(|| p.trim().to_string())
        };
        if let Some(p) = read_pair() {
            return Ok(p);
        }
        std::fs::create_dir_all(self.dir.join("cm")).map_err(key_err)?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&self.dir, std::fs::Permissions::from_mode(0o700))
            .map_err(key_err)?;
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(PathBuf::from(format!("{}.lock", key.display())))
            .map_err(key_err)?;
        lock.lock().map_err(key_err)?;
        // Made by whoever held the lock before.
        if let Some(p) = read_pair() {
            return Ok(p);
        }
        let keygen = |args: &[&str], path: &Path| -> Result<Vec<u8>, SshError> {
            let out = std::process::Command::new("ssh-keygen")
                .args(args)
                .arg(path)
                .stdin(std::process::Stdio::null())
                .output()
                .map_err(key_err)?;
            if !out.status.success() {
                return Err(key_err(std::io::Error::other(
                    String::from_utf8_lossy(&out.stderr).trim().to_string(),
                )));
            }
            Ok(out.stdout)
        };
        if key.exists() {
            // The private half without its public one: derive it.
            let line = keygen(&["-y", "-f"], key)?;
            let line = String::from_utf8_lossy(&line).trim().to_string();
            write_atomic(&pubf, &format!("{line} {comment}\n"), 0o644)?;
            return Ok(read_pair().unwrap_or(line));
        }
        // Unique per process and per call (under the lock one call runs at a time, but a
        // temp file a crashed run left is never reused).
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = PathBuf::from(format!("{}.tmp{}-{seq}", key.display(), std::process::id()));
        let tmp_pub = PathBuf::from(format!("{}.pub", tmp.display()));
        let _ = std::fs::remove_file(&tmp);
        let _ = std::fs::remove_file(&tmp_pub);
        let made = keygen(
            &["-q", "-t", "ed25519", "-N", "", "-C", comment, "-f"],
            &tmp,
        )
        .and_then(|_| std::fs::rename(&tmp, key).map_err(key_err))
        .and_then(|()| std::fs::rename(&tmp_pub, &pubf).map_err(key_err));
        if made.is_err() {
            let _ = std::fs::remove_file(&tmp);
            let _ = std::fs::remove_file(&tmp_pub);
        }
        made?;
        read_pair().ok_or_else(|| {
            key_err(std::io::Error::other(format!(
                "{} is empty after it was made",
                pubf.display()
            )))
        })
    }

    /// Write VM `t`'s ssh files (its config and known_hosts, and the shared `config` that
    /// includes them), leaving unchanged files alone: what runs before each use of a VM.
    /// Reads and writes only this VM's files, whatever the number of VMs.
    pub fn write(&self, t: &Target) -> Result<(), SshError> {
        // Only what reads back as an address and one key line reaches the files: a newline
        // here would add ssh_config directives (ProxyCommand runs on this host).
        let addr_ok = t.endpoint.parse::<std::net::SocketAddr>().is_ok();
        let key_ok = boxery_api::lease::check_public_key(t.host_key.trim()).is_ok();
        if !addr_ok || !key_ok || boxery_api::Name::label(&t.name).is_err() {
            return Err(SshError::Unreachable {
                vm: boxery_api::name::shown(&t.name),
                reason: "its ssh endpoint or host key is not an address and one key line: it was left out of the ssh config".into(),
            });
        }
        self.public_key()?;
        let vms = self.dir.join("vms");
        if !vms.is_dir() {
            std::fs::create_dir_all(&vms).map_err(|source| SshError::Write {
                path: vms.display().to_string(),
                source,
            })?;
        }
        write_if_changed(
            &self.config(),
            &format!(
                "# Generated by boxery: each VM's settings are in vms/NAME.conf (boxery itself runs\n\
                 # `ssh -F vms/NAME.conf NAME.boxery`); this file includes them all, for people:\n\
                 # `ssh -F {} NAME.boxery`.\nInclude {}\n",
                self.config().display(),
                arg(&vms.join("*.conf"))
            ),
        )?;
        let (host, port) = t.endpoint.rsplit_once(':').unwrap_or((&t.endpoint, "22"));
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let a = alias(&t.name);
        write_if_changed(
            &self.vm_known_hosts(&t.name),
            &format!("{a} {}\n", t.host_key.trim()),
        )?;
        let via = match &self.via {
            None => String::new(),
            Some(v) if v.proxy_command.contains(['\n', '\r']) => {
                return Err(SshError::Unreachable {
                    vm: t.name.clone(),
                    reason: "the proxy command spans several lines".into(),
                });
            }
            Some(v) => format!("  ProxyCommand {}\n", v.proxy_command),
        };
        write_if_changed(
            &self.vm_config(&t.name),
            &format!(
                "# Generated by boxery from Vm {name}; rewritten when it changes.\n\
                 Host {a}\n  HostName {host}\n  Port {port}\n{via}  HostKeyAlias {a}\n  \
                 UserKnownHostsFile {known}\n  GlobalKnownHostsFile /dev/null\n  \
                 StrictHostKeyChecking yes\n  CheckHostIP no\n  UpdateHostKeys no\n  \
                 User {USER}\n  IdentityFile {key}\n  IdentitiesOnly yes\n  \
                 PasswordAuthentication no\n  KbdInteractiveAuthentication no\n  \
                 ForwardAgent no\n  ForwardX11 no\n  \
                 ControlMaster auto\n  ControlPath {cm}\n  ControlPersist 300\n  \
                 ConnectTimeout 10\n  ServerAliveInterval 15\n  ServerAliveCountMax 4\n  LogLevel ERROR\n",
                name = t.name,
                known = arg(&self.vm_known_hosts(&t.name)),
                key = arg(&self.key()),
                cm = arg(&self.control_path(t, None)),
            ),
        )
    }

    /// The ControlMaster socket for reaching `t` with the control plane's key (`key: None`,
    /// the one its config names) or with a lease's `key` (given with `-o ControlPath=`): a
    /// hash of the VM's name, endpoint and pinned host key, so a VM that comes back elsewhere
    /// or with another identity never reuses a connection to the old one (what ssh's `%C` did),
    /// and of the key, so one holder's connection is never reused for another. Short: socket
    /// paths are limited to ~100 bytes.
    pub fn control_path(&self, t: &Target, key: Option<&Path>) -> PathBuf {
        let mut h = Fnv::default();
        for part in [&t.name, &t.endpoint, t.host_key.trim(), USER] {
            h.part(part.as_bytes());
        }
        let base = format!("{:016x}", h.finish());
        let name = match key {
            None => base,
            Some(k) => {
                let tag = boxery_api::fnv::fnv1a(k.as_os_str().as_encoded_bytes());
                format!("{base}-{:08x}", tag as u32)
            }
        };
        self.dir.join("cm").join(name)
    }

    /// `ssh -F vms/NAME.conf NAME.boxery`, as a command to finish and run.
    pub fn command(&self, vm: &str) -> Command {
        Command::from(self.std_command(vm))
    }

    /// `ssh -F vms/NAME.conf NAME.boxery`, for `std::process`.
    pub fn std_command(&self, vm: &str) -> std::process::Command {
        let mut c = std::process::Command::new("ssh");
        c.args(debug_log_args())
            .arg("-F")
            .arg(self.vm_config(vm))
            .arg(alias(vm));
        c
    }

    /// The VM is gone: close its ControlMaster, if one runs, and remove its ssh files (best
    /// effort).
    pub async fn close(&self, vm: &str) {
        if self.vm_config(vm).exists() {
            let _ = Command::new("ssh")
                .args(debug_log_args())
                .arg("-F")
                .arg(self.vm_config(vm))
                .args(["-O", "exit"])
                .arg(alias(vm))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .await;
        }
        if boxery_api::Name::label(vm).is_ok() {
            let _ = std::fs::remove_file(self.vm_config(vm));
            let _ = std::fs::remove_file(self.vm_known_hosts(vm));
        }
    }

    /// Whether the VM answers: its endpoint speaks SSH, then `true` runs with the pinned key
    /// (which also warms the VM's ControlMaster for the first command).
    pub async fn probe(&self, t: &Target) -> Result<(), SshError> {
        let unreachable = |reason: String| SshError::Unreachable {
            vm: t.name.clone(),
            reason,
        };
        // Poll the banner here rather than across requeues: the first command after a boot
        // should not wait for the next reconcile (docs/benchmarks.md measures this). Early
        // attempts are short (a guest that is not up yet may leave a connect hanging, and
        // retrying finds it the moment it listens); later ones wait longer, since a loaded
        // host's sshd can take seconds to fork and send its banner, and giving up on each
        // connection after a fixed short time would never see it (and piles up half-open
        // connections against sshd's MaxStartups).
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut within = Duration::from_millis(200);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match banner(&t.endpoint, within.min(left)).await {
                Ok(()) => break,
                Err(e) if std::time::Instant::now() >= deadline => return Err(unreachable(e)),
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    within = (within * 2).min(Duration::from_secs(5));
                }
            }
        }
        let mut c = self.command(&t.name);
        c.args(["-o", "BatchMode=yes", "--", "true"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let child = c.spawn().map_err(SshError::Spawn)?;
        match tokio::time::timeout(Duration::from_secs(15), child.wait_with_output()).await {
            Ok(Ok(out)) if out.status.success() => Ok(()),
            Ok(Ok(out)) => Err(unreachable(
                String::from_utf8_lossy(&out.stderr).trim().to_string(),
            )),
            Ok(Err(e)) => Err(SshError::Spawn(e)),
            Err(_) => Err(unreachable("ssh did not answer within 15 s".into())),
        }
    }
}

/// With `BOXERY_SSH_LOG=FILE`: `-E FILE -o LogLevel=DEBUG1`, so ssh appends its own log there
/// (a client's, and that of a ControlMaster it starts) instead of staying silent at `ERROR`:
/// for a connection that fails (exit 255) without a word. Empty otherwise.
pub fn debug_log_args() -> Vec<std::ffi::OsString> {
    match std::env::var_os("BOXERY_SSH_LOG") {
        Some(f) if !f.is_empty() => vec!["-E".into(), f, "-o".into(), "LogLevel=DEBUG1".into()],
        _ => Vec::new(),
    }
}

/// Connect and read the `SSH-` banner `within` a time (user-mode networking accepts TCP
/// before the guest listens, so a connect alone proves nothing).
pub async fn banner(endpoint: &str, within: Duration) -> Result<(), String> {
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(endpoint)
            .await
            .map_err(|e| format!("connect {endpoint}: {e}"))?;
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf)
            .await
            .map_err(|e| format!("no SSH banner at {endpoint}: {e}"))?;
        let _ = s.shutdown().await;
        if &buf == b"SSH-" {
            Ok(())
        } else {
            Err(format!("{endpoint} does not speak SSH"))
        }
    };
    tokio::time::timeout(within, fut)
        .await
        .map_err(|_| format!("no SSH banner at {endpoint} within {within:.1?}"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str =
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl";

    fn target(name: &str, port: u16) -> Target {
        Target {
            name: name.into(),
            endpoint: format!("127.0.0.1:{port}"),
            host_key: KEY.into(),
        }
    }

    /// `ssh -G`: the settings ssh resolves for `host` with config `cfg`, as `key value` lines.
    fn resolved(cfg: &Path, host: &str) -> String {
        let o = std::process::Command::new("ssh")
            .arg("-G")
            .arg("-F")
            .arg(cfg)
            .arg(host)
            .output()
            .expect("ssh (openssh-client) is installed");
        assert!(o.status.success(), "{o:?}");
        String::from_utf8(o.stdout).unwrap()
    }

    /// One VM's files say how to reach it with its pinned key, both through its own config and
    /// the shared one; writing one VM touches no other VM's files, and an unchanged VM's files
    /// are not written again.
    #[test]
    fn each_vm_has_its_own_files() {
        let home = tempfile::tempdir().unwrap();
        let d = SshDir::new(home.path());
        d.write(&target("a", 2201)).unwrap();
        d.write(&target("b", 2202)).unwrap();
        for (vm, port) in [("a", 2201), ("b", 2202)] {
            let host = alias(vm);
            for cfg in [d.vm_config(vm), d.config()] {
                let g = resolved(&cfg, &host);
                assert!(g.contains(&format!("\nport {port}\n")), "{g}");
                assert!(g.contains("\nhostname 127.0.0.1\n"), "{g}");
                assert!(g.contains(&format!("\nhostkeyalias {host}\n")), "{g}");
                assert!(g.contains("\nstricthostkeychecking true\n"), "{g}");
                assert!(g.contains("\ncontrolmaster auto\n"), "{g}");
                // The socket ssh uses is the one the mux client connects to.
                let cm = d.control_path(&target(vm, port), None);
                assert!(
                    g.contains(&format!("\ncontrolpath {}\n", cm.display())),
                    "{g}"
                );
                let known = d.vm_known_hosts(vm).display().to_string();
                assert!(
                    g.contains(&format!("\nuserknownhostsfile {known}\n")),
                    "{g}"
                );
            }
            assert_eq!(
                std::fs::read_to_string(d.vm_known_hosts(vm)).unwrap(),
                format!("{host} {KEY}\n")
            );
        }
        let ino = |p: PathBuf| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).unwrap());
        let before = (
            ino(d.vm_config("a")),
            ino(d.vm_config("b")),
            ino(d.config()),
        );
        d.write(&target("a", 2201)).unwrap();
        assert_eq!(
            (
                ino(d.vm_config("a")),
                ino(d.vm_config("b")),
                ino(d.config())
            ),
            before,
            "unchanged files were written again"
        );
        d.write(&target("a", 2203)).unwrap();
        assert_ne!(ino(d.vm_config("a")), before.0);
        assert_eq!(ino(d.vm_config("b")), before.1, "b's file was written");
        assert!(resolved(&d.vm_config("a"), "a.boxery").contains("\nport 2203\n"));
        // nothing else is left in the directory (no temp files)
        let mut names: Vec<String> = std::fs::read_dir(home.path().join("ssh/vms"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(
            names,
            ["a.conf", "a.known_hosts", "b.conf", "b.known_hosts"]
        );
    }

    /// What is not an address, one key line and a name never reaches an ssh_config.
    #[test]
    fn hostile_targets_write_nothing() {
        let home = tempfile::tempdir().unwrap();
        let d = SshDir::new(home.path());
        for t in [
            Target {
                endpoint: "127.0.0.1:22\n  ProxyCommand touch /tmp/x".into(),
                ..target("a", 22)
            },
            Target {
                host_key: format!("{KEY}\nHost *\n  ProxyCommand x"),
                ..target("a", 22)
            },
            target("../a", 22),
        ] {
            assert!(d.write(&t).is_err(), "{t:?}");
        }
        assert!(!d.vm_config("a").exists());
    }

    /// The body of an OpenSSH public key line (its type and key, without the comment).
    fn key_body(line: &str) -> String {
        line.split_whitespace()
            .take(2)
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Two processes on a fresh home (`boxery serve &` then `boxery apply --wait`, as the
    /// README's own sequence does), here four processes of eight threads each, all making the
    /// control plane's key pair at once: one pair is made, everyone gets its public key, and
    /// that key is the private key's (`ssh-keygen -y`). Before, the halves of two runs could
    /// end up side by side, and no VM made after could be reached.
    #[test]
    fn concurrent_first_uses_make_one_matching_pair() {
        const CHILD: &str = "BOXERY_TEST_KEYPAIR_HOME";
        let race = |home: &Path| -> Vec<String> {
            let barrier = std::sync::Barrier::new(8);
            std::thread::scope(|s| {
                let hs: Vec<_> = (0..8)
                    .map(|_| {
                        let barrier = &barrier;
                        s.spawn(move || {
                            barrier.wait();
                            SshDir::new(home).public_key().unwrap()
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            })
        };
        if let Some(home) = std::env::var_os(CHILD) {
            for line in race(Path::new(&home)) {
                println!("KEY {line}");
            }
            return;
        }
        for round in 0..3 {
            let home = tempfile::tempdir().unwrap();
            let children: Vec<_> = (0..4)
                .map(|_| {
                    std::process::Command::new(std::env::current_exe().unwrap())
                        .args([
                            "--exact",
                            "ssh::tests::concurrent_first_uses_make_one_matching_pair",
                            "--nocapture",
                        ])
                        .env(CHILD, home.path())
                        .stdout(std::process::Stdio::piped())
                        .spawn()
                        .unwrap()
                })
                .collect();
            let mut seen: Vec<String> = race(home.path());
            for c in children {
                let out = c.wait_with_output().unwrap();
                assert!(out.status.success(), "a child failed");
                let text = String::from_utf8_lossy(&out.stdout).into_owned();
                let keys: Vec<String> = text
                    .lines()
                    .filter_map(|l| l.strip_prefix("KEY ").map(String::from))
                    .collect();
                assert_eq!(keys.len(), 8, "{text}");
                seen.extend(keys);
            }
            let d = SshDir::new(home.path());
            let on_disk = std::fs::read_to_string(format!("{}.pub", d.key().display())).unwrap();
            let derived = std::process::Command::new("ssh-keygen")
                .arg("-y")
                .arg("-f")
                .arg(d.key())
                .output()
                .unwrap();
            assert!(derived.status.success());
            let derived = String::from_utf8_lossy(&derived.stdout).into_owned();
            assert_eq!(
                key_body(&derived),
                key_body(&on_disk),
                "round {round}: the public key is not the private key's"
            );
            for k in &seen {
                assert_eq!(key_body(k), key_body(&on_disk), "round {round}");
            }
            let left: Vec<_> = std::fs::read_dir(d.dir())
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .filter(|n| n.to_string_lossy().contains(".tmp"))
                .collect();
            assert!(left.is_empty(), "{left:?}");
        }
    }

    /// A private key whose public half is missing (a crash between the two renames) gets its
    /// own public half back, not a new pair.
    #[test]
    fn a_missing_public_half_is_derived_not_remade() {
        let home = tempfile::tempdir().unwrap();
        let d = SshDir::new(home.path());
        let first = d.public_key().unwrap();
        let private = std::fs::read(d.key()).unwrap();
        std::fs::remove_file(format!("{}.pub", d.key().display())).unwrap();
        let again = d.public_key().unwrap();
        assert_eq!(key_body(&again), key_body(&first));
        assert_eq!(std::fs::read(d.key()).unwrap(), private);
    }

    /// Many threads of one process writing the same VM's files: each write is whole (no two
    /// share a temp file), and none is left behind.
    #[test]
    fn concurrent_writes_of_one_file_stay_whole() {
        let home = tempfile::tempdir().unwrap();
        let d = SshDir::new(home.path());
        d.write(&target("a", 2200)).unwrap();
        std::thread::scope(|s| {
            for i in 0..8u16 {
                let d = &d;
                s.spawn(move || {
                    for j in 0..50u16 {
                        d.write(&target("a", 3000 + i * 100 + j)).unwrap();
                    }
                });
            }
        });
        let g = resolved(&d.vm_config("a"), "a.boxery");
        assert!(g.contains("\nport 3"), "{g}");
        let left: Vec<_> = std::fs::read_dir(home.path().join("ssh/vms"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .filter(|n| n.to_string_lossy().contains(".tmp"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }
}
