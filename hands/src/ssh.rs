//! Reaching VMs over OpenSSH, always with the pinned host key.
//!
//! Everything lives in `$BOXERY_HOME/ssh/`:
//! - `id_ed25519` (+ `.pub`): the control plane's key, generated once, put in every VM's
//!   `authorized_keys` through its seed;
//! - `config`: an ssh_config with one `Host NAME.boxery` block per VM (`HostName`, `Port`,
//!   `HostKeyAlias`), `StrictHostKeyChecking yes`, and a ControlMaster per VM so repeated
//!   calls reuse one connection (`ssh -F $BOXERY_HOME/ssh/config dev1.boxery` works by hand);
//! - `known_hosts`: `NAME.boxery ssh-ed25519 …` for every VM, from `status.ssh.hostKey`, which
//!   was generated on the host when the VM got its identity (never trust on first use);
//! - `cm/`: ControlMaster sockets.
//!
//! Both files are rewritten from the store (temp file + rename) before each use, so they
//! always match the objects.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use boxery_api::Vm;
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

/// The ssh files of one `$BOXERY_HOME`.
#[derive(Debug, Clone)]
pub struct SshDir {
    dir: PathBuf,
}

fn write_atomic(path: &Path, text: &str, mode: u32) -> Result<(), SshError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let err = |source| SshError::Write {
        path: path.display().to_string(),
        source,
    };
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)
        .map_err(err)?;
    f.write_all(text.as_bytes()).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

impl SshDir {
    /// The ssh dir of a boxery home.
    pub fn new(home: &Path) -> Self {
        SshDir {
            dir: home.join("ssh"),
        }
    }

    /// The config file.
    pub fn config(&self) -> PathBuf {
        self.dir.join("config")
    }

    /// The control plane's private key.
    pub fn key(&self) -> PathBuf {
        self.dir.join("id_ed25519")
    }

    /// The control plane's public key line, generating the pair on first use.
    pub fn public_key(&self) -> Result<String, SshError> {
        let key_err = |source| SshError::Key {
            dir: self.dir.display().to_string(),
            source,
        };
        let pubf = self.dir.join("id_ed25519.pub");
        if let Ok(p) = std::fs::read_to_string(&pubf)
            && self.key().exists()
        {
            return Ok(p.trim().to_string());
        }
        std::fs::create_dir_all(self.dir.join("cm")).map_err(key_err)?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&self.dir, std::fs::Permissions::from_mode(0o700))
            .map_err(key_err)?;
        // Generate beside, then rename: two processes racing each keep a complete pair.
        let tmp = self
            .dir
            .join(format!("id_ed25519.tmp{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        let _ = std::fs::remove_file(tmp.with_extension(format!("tmp{}.pub", std::process::id())));
        let out = std::process::Command::new("ssh-keygen")
            .args([
                "-q",
                "-t",
                "ed25519",
                "-N",
                "",
                "-C",
                "boxery-control-plane",
                "-f",
            ])
            .arg(&tmp)
            .output()
            .map_err(key_err)?;
        if !out.status.success() {
            return Err(key_err(std::io::Error::other(
                String::from_utf8_lossy(&out.stderr).trim().to_string(),
            )));
        }
        let tmp_pub = PathBuf::from(format!("{}.pub", tmp.display()));
        if !self.key().exists() {
            std::fs::rename(&tmp, self.key()).map_err(key_err)?;
            std::fs::rename(&tmp_pub, &pubf).map_err(key_err)?;
        } else {
            let _ = std::fs::remove_file(&tmp);
            let _ = std::fs::remove_file(&tmp_pub);
        }
        Ok(std::fs::read_to_string(&pubf)
            .map_err(key_err)?
            .trim()
            .to_string())
    }

    /// Rewrite `config` and `known_hosts` for these VMs.
    pub fn write(&self, targets: &[Target]) -> Result<(), SshError> {
        self.public_key()?;
        let d = self.dir.display();
        let mut cfg =
            String::from("# Generated by boxery from its store; rewritten before every use.\n");
        let mut known = String::new();
        for t in targets {
            // Only what reads back as an address and one key line reaches the files: a
            // newline here would add ssh_config directives (ProxyCommand runs on this host).
            let addr_ok = t.endpoint.parse::<std::net::SocketAddr>().is_ok();
            let key_ok = boxery_api::lease::check_public_key(t.host_key.trim()).is_ok();
            if !addr_ok || !key_ok || boxery_api::Name::label(&t.name).is_err() {
                tracing::warn!(vm = %boxery_api::name::shown(&t.name), "an ssh endpoint or host key that is not an address and one key line: left out of the ssh config");
                continue;
            }
            let (host, port) = t.endpoint.rsplit_once(':').unwrap_or((&t.endpoint, "22"));
            cfg.push_str(&format!(
                "Host {}\n  HostName {host}\n  Port {port}\n  HostKeyAlias {}\n",
                alias(&t.name),
                alias(&t.name)
            ));
            known.push_str(&format!("{} {}\n", alias(&t.name), t.host_key.trim()));
        }
        cfg.push_str(&format!(
            "Host *.boxery\n  User {USER}\n  IdentityFile {d}/id_ed25519\n  IdentitiesOnly yes\n  \
             StrictHostKeyChecking yes\n  UserKnownHostsFile {d}/known_hosts\n  GlobalKnownHostsFile /dev/null\n  \
             CheckHostIP no\n  UpdateHostKeys no\n  PasswordAuthentication no\n  KbdInteractiveAuthentication no\n  \
             ForwardAgent no\n  ForwardX11 no\n  ControlMaster auto\n  ControlPath {d}/cm/%C\n  ControlPersist 300\n  \
             ConnectTimeout 10\n  ServerAliveInterval 15\n  ServerAliveCountMax 4\n  LogLevel ERROR\n"
        ));
        // Unchanged files are left alone (this runs before every `boxery run`).
        for (path, text) in [
            (self.dir.join("known_hosts"), &known),
            (self.config(), &cfg),
        ] {
            if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
                write_atomic(&path, text, 0o600)?;
            }
        }
        Ok(())
    }

    /// `ssh -F config NAME.boxery` plus `args`, as a command to finish and run.
    pub fn command(&self, vm: &str) -> Command {
        Command::from(self.std_command(vm))
    }

    /// `ssh -F config NAME.boxery`, for `std::process`.
    pub fn std_command(&self, vm: &str) -> std::process::Command {
        let mut c = std::process::Command::new("ssh");
        c.args(debug_log_args())
            .arg("-F")
            .arg(self.config())
            .arg(alias(vm));
        c
    }

    /// Close a VM's ControlMaster, if one runs (best effort).
    pub async fn close(&self, vm: &str) {
        let _ = Command::new("ssh")
            .args(debug_log_args())
            .arg("-F")
            .arg(self.config())
            .args(["-O", "exit"])
            .arg(alias(vm))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .await;
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
