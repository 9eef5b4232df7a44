//! A VM's network outside QEMU: `boxery-net` (crate `net/`), one helper per running VM.
//!
//! QEMU's own slirp spawns a process (glib forks the whole QEMU twice) for every guest
//! connection to the credential proxy's `guestfwd`, ~+6 ms each under TCG
//! (docs/research/egress-connection-cost.md). The helper runs the same restricted slirp
//! network as its own small process behind QEMU's `-netdev stream` on `vms/NAME/net.sock`,
//! forwards `127.0.0.1:PORT` to the guest's sshd and connects each guest connection to
//! `10.0.2.100:80` to the VM's `proxy.sock` in its own loop: no process per connection.
//!
//! Its life follows QEMU's: started just before QEMU (ready once its pidfile names it), it
//! ends by itself within a second of the exit of the QEMU named in `qemu.pid`, however that
//! QEMU ended; `stop` ends it at once (shutdown, destroy, a failed launch). A control-plane
//! restart leaves both running. A helper that dies while its QEMU runs is drift like any
//! other: `get` reports the VM degraded, and `repair` starts a new helper on the same socket,
//! to which QEMU reconnects within a fraction of a second (the guest keeps running; the
//! connections through the old helper are lost).

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::process::{is_alive, read_pid, runs_for};
use crate::storage::files::tail;

/// What one VM's helper is given.
#[derive(Debug, Clone)]
pub struct NetSpec {
    /// The VM's directory (every path below is in it; how a helper is told to be ours).
    pub dir: PathBuf,
    /// The socket QEMU's stream netdev connects to.
    pub sock: PathBuf,
    /// The helper's pidfile (written once it listens).
    pub pidfile: PathBuf,
    /// Its stderr (appended).
    pub log: PathBuf,
    /// QEMU's pidfile: the helper ends when that QEMU has.
    pub qemu_pidfile: PathBuf,
    /// Where it keeps the guest's network byte counts ([`read_counts`]).
    pub stats: PathBuf,
    /// The credential proxy's channel (the VM's `proxy.sock`).
    pub proxy: PathBuf,
    /// Where the control plane answers the guest's name lookups (the VM's `dns.sock`).
    pub dns: PathBuf,
    /// Where it answers them over TCP (the VM's `dns-tcp.sock`).
    pub dns_tcp: PathBuf,
    /// The loopback port forwarded to the guest's sshd.
    pub port: u16,
}

/// Why a helper did not start.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// The binary could not be run.
    #[error(
        "cannot run {binary} (build it: cargo build --release -p boxery-net; or BOXERY_NET=off)"
    )]
    Spawn {
        /// The helper binary.
        binary: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// It exited before it was ready.
    #[error("boxery-net exited at start ({status}): {log}")]
    Exited {
        /// Its exit status.
        status: String,
        /// The end of its log.
        log: String,
    },
    /// It was not ready in time.
    #[error("boxery-net was not ready within {timeout:?}: {log}")]
    NotReady {
        /// How long it was given.
        timeout: Duration,
        /// The end of its log.
        log: String,
    },
}

/// Start the helper (after ending one left from an earlier run); its pid once it listens.
pub async fn start(binary: &Path, spec: &NetSpec, timeout: Duration) -> Result<i32, NetError> {
    stop(&spec.pidfile, &spec.dir).await;
    let spawn_err = |source| NetError::Spawn {
        binary: binary.display().to_string(),
        source,
    };
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&spec.log)
        .map_err(spawn_err)?;
    let mut child = tokio::process::Command::new(binary)
        .arg("--net-sock")
        .arg(&spec.sock)
        .arg("--ssh-port")
        .arg(spec.port.to_string())
        .arg("--proxy-sock")
        .arg(&spec.proxy)
        .arg("--dns-sock")
        .arg(&spec.dns)
        .arg("--dns-tcp-sock")
        .arg(&spec.dns_tcp)
        .arg("--pidfile")
        .arg(&spec.pidfile)
        .arg("--qemu-pidfile")
        .arg(&spec.qemu_pidfile)
        .arg("--stats")
        .arg(&spec.stats)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(log)
        // its own process group: a ^C at the terminal of a `boxery` that booted the VM does
        // not reach it; it outlives this process if this one exits first
        .process_group(0)
        .spawn()
        .map_err(spawn_err)?;
    let pid = child.id().unwrap_or_default() as i32;
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if read_pid(&spec.pidfile) == Some(pid) {
            // reaped the moment it exits (no zombie left in a long-running `serve`)
            tokio::spawn(async move {
                let _ = child.wait().await;
            });
            return Ok(pid);
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(NetError::Exited {
                status: status.to_string(),
                log: tail(&spec.log, 6),
            });
        }
        if tokio::time::Instant::now() >= deadline {
            let _ = child.kill().await;
            return Err(NetError::NotReady {
                timeout,
                log: tail(&spec.log, 6),
            });
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// End the VM's helper, if one runs and is ours (SIGTERM, then SIGKILL after 2 s), and wait
/// until it has gone.
pub async fn stop(pidfile: &Path, dir: &Path) {
    let Some(pid) = read_pid(pidfile).filter(|p| is_our_helper(*p, dir)) else {
        return;
    };
    let Some(p) = rustix::process::Pid::from_raw(pid) else {
        return;
    };
    let _ = rustix::process::kill_process(p, rustix::process::Signal::TERM);
    for _ in 0..200 {
        if !is_alive(pid) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
    for _ in 0..100 {
        if !is_alive(pid) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Whether `pid` is a live `boxery-net` whose command line names `dir`.
pub fn is_our_helper(pid: i32, dir: &Path) -> bool {
    runs_for(pid, dir, |exe| exe == "boxery-net")
}

/// The guest's network bytes from a helper's stats file (`rx BYTES tx BYTES`, written by
/// `boxery-net --stats`, net/src/helper.rs `Counts`): what it received, what it sent. `None`
/// when there is no such file yet (no traffic counted, or a helper from before it kept one).
pub fn read_counts(path: &Path) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(path).ok()?;
    let mut f = text.split_whitespace();
    match (f.next(), f.next(), f.next(), f.next()) {
        (Some("rx"), Some(rx), Some("tx"), Some(tx)) => Some((rx.parse().ok()?, tx.parse().ok()?)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_boxery_net_naming_the_vms_directory_is_ours() {
        let dir = tempfile::tempdir().unwrap();
        let arg = dir.path().join("net.sock");
        // a shell that waits on its stdin, with the path as an argument (and no child)
        let mut other = std::process::Command::new("sh")
            .args(["-c", "read x", "sh"])
            .arg(&arg)
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let pid = other.id() as i32;
        // spawn returns once exec has begun, before the new command line is readable
        let t = std::time::Instant::now();
        while !std::fs::read(format!("/proc/{pid}/cmdline"))
            .is_ok_and(|c| c.ends_with(b"net.sock\0"))
        {
            assert!(t.elapsed() < Duration::from_secs(5), "sh never started");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(runs_for(pid, dir.path(), |e| e == "sh"));
        assert!(!is_our_helper(pid, dir.path()), "not boxery-net");
        assert!(!runs_for(pid, Path::new("/elsewhere"), |e| e == "sh"));
        other.kill().unwrap();
        other.wait().unwrap();
        assert!(!runs_for(pid, dir.path(), |e| e == "sh"), "gone");
    }
}
