//! Port forwarding between this machine and a VM (`boxery forward`), over the VM's ssh: the
//! same pinned host key, key and ControlMaster as `run` and `ssh`, and under a remote context
//! the same tunnel through the API (the `ProxyCommand` of the context's ssh config).
//!
//! - **To the guest** ([`Local`]): this process listens on a local port (loopback unless told
//!   otherwise) and carries each connection it accepts to the guest's loopback on a channel of
//!   the VM's ControlMaster, opened over its socket ([`mux`]: a connection costs a channel, no
//!   process and no handshake); with no master up, with `ssh -W 127.0.0.1:PORT`, which starts
//!   one.
//! - **From the guest** ([`Reverse`]): `ssh -R` on a connection of its own (never the shared
//!   master, which would keep the forward after this process ends), so the guest's
//!   `127.0.0.1:PORT` reaches a port here.
//!
//! # Guarantees
//! - Nothing listens beyond the address asked for (default `127.0.0.1`), here or in the
//!   guest (`-R` binds the guest's loopback only).
//! - A local port that is taken, or a guest port that is taken for `-R`, is an error before
//!   anything is said to be forwarded; the ready line names the address to open.
//! - A connection whose guest port has no listener is closed and said so on stderr, with the
//!   port and the VM; the forward goes on for the next connection.
//! - When this process ends (Ctrl-C, the terminal closed, or killed) its listener and its
//!   `ssh` processes go with it (`kill_on_drop`; a reverse forward's session also ends when
//!   its stdin, a pipe of this process, closes).
//!
//! # Caveats
//! - TCP only, one port per pair.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::{AsFd, OwnedFd};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

use crate::{HandsError, Reach, Result, mux};

/// One `[LOCAL:]REMOTE` pair: a port on this machine and one in the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ports {
    /// The port here; `0`: any free one (`:REMOTE`).
    pub local: u16,
    /// The port in the guest.
    pub remote: u16,
}

impl Ports {
    /// `REMOTE` (the same number here), `LOCAL:REMOTE`, or `:REMOTE` (any free port here), as
    /// `kubectl port-forward` reads them.
    pub fn parse(s: &str) -> Result<Ports> {
        let bad = |why: &str| {
            HandsError::Invalid(format!(
                "{}: {why}; give REMOTE, LOCAL:REMOTE or :REMOTE (ports 1-65535), e.g. 8080 or \
                 18080:8080",
                boxery_api::name::shown(s)
            ))
        };
        let port = |p: &str, what: &str| -> Result<u16> {
            match p.parse::<u16>() {
                Ok(0) | Err(_) => Err(bad(&format!("{what} is not a port"))),
                Ok(n) => Ok(n),
            }
        };
        match s.split_once(':') {
            None => {
                let p = port(s, "it")?;
                Ok(Ports {
                    local: p,
                    remote: p,
                })
            }
            Some(("", r)) => Ok(Ports {
                local: 0,
                remote: port(r, "the guest's port")?,
            }),
            Some((l, r)) => Ok(Ports {
                local: port(l, "the local port")?,
                remote: port(r, "the guest's port")?,
            }),
        }
    }
}

/// What a forward says on stderr while it runs (one line each).
pub type Say = std::sync::Arc<dyn Fn(String) + Send + Sync>;

/// A forward from a local port to the guest, listening.
#[derive(Debug)]
pub struct Local {
    listener: TcpListener,
    remote: u16,
}

impl Local {
    /// Listen on `address` at `ports.local` (any free port when 0) for `ports.remote` in the
    /// guest.
    pub async fn bind(address: IpAddr, ports: Ports) -> Result<Local> {
        let at = SocketAddr::new(address, ports.local);
        let listener = TcpListener::bind(at).await.map_err(|e| match e.kind() {
            std::io::ErrorKind::AddrInUse => HandsError::Conflict(format!(
                "port {} on {address} is taken here: forward to another one \
                 (`{}:{}`), or to any free one (`:{}`)",
                ports.local,
                ports.local.saturating_add(10000).max(1024),
                ports.remote,
                ports.remote
            )),
            std::io::ErrorKind::AddrNotAvailable => HandsError::Invalid(format!(
                "{address} is not an address of this machine: give one of its own (--address)"
            )),
            _ => HandsError::Failed(format!("cannot listen on {at}: {e}")),
        })?;
        Ok(Local {
            listener,
            remote: ports.remote,
        })
    }

    /// The address it listens on (the port chosen when `:REMOTE` asked for any).
    pub fn addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// Carry every connection to the guest's port until the future is dropped.
    pub async fn serve(self, reach: Reach, say: Say) -> Result<()> {
        loop {
            let (conn, _) = self.listener.accept().await?;
            let (reach, say) = (reach.clone(), say.clone());
            let remote = self.remote;
            tokio::spawn(async move {
                if let Err(e) = carry(&reach, conn, remote).await {
                    say(e);
                }
            });
        }
    }
}

/// One connection, on a channel of the VM's ControlMaster when one is up ([`over_master`]),
/// else with `ssh -W 127.0.0.1:REMOTE` (which also starts the master). `Err`: what to say.
async fn carry(reach: &Reach, conn: TcpStream, remote: u16) -> Result<(), String> {
    let vm = reach.vm().to_string();
    let nothing_listens = || {
        format!(
            "boxery forward: nothing listens on port {remote} in {vm} (the connection was closed)"
        )
    };
    match over_master(reach.control_path().to_path_buf(), remote).await {
        OverMaster::Open(channel) => {
            crate::mux_log(&format!(
                "forwarded to {remote} over {}",
                reach.control_path().display()
            ));
            channel.join(conn).await;
            return Ok(());
        }
        OverMaster::Refused(why) => {
            crate::mux_log(&format!("forward to {remote} refused: {why}"));
            return Err(if why.contains("refused by peer") {
                nothing_listens()
            } else {
                format!(
                    "boxery forward: the connection to port {remote} in {vm} was refused: {why}"
                )
            });
        }
        OverMaster::Failed(why) => {
            return Err(format!(
                "boxery forward: the connection to port {remote} in {vm} failed: {why}"
            ));
        }
        OverMaster::NoMaster(why) => {
            crate::mux_log(&format!("forward to {remote} not over the master: {why}"))
        }
    }
    let mut child = reach
        .command()
        .args(["-o", "BatchMode=yes", "-W"])
        .arg(format!("127.0.0.1:{remote}"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("boxery forward: cannot run ssh: {e}"))?;
    let (to_vm, from_vm) = (
        child.stdin.take().expect("piped"),
        child.stdout.take().expect("piped"),
    );
    let mut err = child.stderr.take().expect("piped");
    let mut stderr = String::new();
    let (sent, _) = tokio::join!(
        splice(conn, to_vm, from_vm),
        err.read_to_string(&mut stderr)
    );
    let status = child.wait().await.ok();
    if sent > 0 || status.is_some_and(|s| s.success()) {
        return Ok(());
    }
    let line = stderr.lines().last().unwrap_or("").trim();
    // ssh (at LogLevel ERROR) fails a refused channel with 255 and no word; an ssh that
    // cannot reach the VM at all says why
    let refused = line.is_empty() && status.is_some_and(|s| s.code() == Some(255));
    // over a master ssh says "Stdio forwarding request failed: Session open refused by peer"
    let refused = refused
        || [
            "open failed",
            "forwarding failed",
            "forwarding request failed",
            "refused by peer",
        ]
        .iter()
        .any(|m| line.contains(m));
    Err(if refused {
        nothing_listens()
    } else if line.is_empty() {
        format!("boxery forward: the connection to port {remote} in {vm} ended with nothing sent")
    } else {
        format!(
            "boxery forward: the connection to port {remote} in {vm} failed: {}",
            crate::safe(line)
        )
    })
}

/// How the VM's ControlMaster answered a forwarded connection.
enum OverMaster {
    /// The channel is open.
    Open(Channel),
    /// The guest refused it (nothing listens on the port): what the master said.
    Refused(String),
    /// It was asked for and failed otherwise: why.
    Failed(String),
    /// No master took it (none is up, or it would not): why, for the debug log.
    NoMaster(String),
}

/// A channel to the guest opened over the master ([`mux::Session::ask_forward`]): the master reads
/// what to send from one pipe and writes what comes back to another, so a connection costs a
/// channel and no process.
struct Channel {
    to_vm: tokio::net::unix::pipe::Sender,
    from_vm: tokio::net::unix::pipe::Receiver,
    /// The master closes it once the channel has closed.
    control: tokio::net::UnixStream,
}

/// How long the guest may take to open (or refuse) a forwarded connection's channel.
const OPEN_TIMEOUT: Duration = Duration::from_secs(30);

/// Ask the master at `cm` for a channel to the guest's `127.0.0.1:remote`. The request is made
/// on a blocking thread (a local socket: hello and the request); the guest's answer is
/// awaited here, so a slow guest holds no thread and an interrupted forward does not wait for
/// it.
async fn over_master(cm: std::path::PathBuf, remote: u16) -> OverMaster {
    let asked = tokio::task::spawn_blocking(move || {
        let no = |what: &str, e: std::io::Error| mux::Error::NoSession(format!("{what}: {e}"));
        let (up_r, up_w) = std::io::pipe().map_err(|e| no("pipe", e))?;
        let (down_r, down_w) = std::io::pipe().map_err(|e| no("pipe", e))?;
        let mut session = mux::open(&cm)?;
        session.ask_forward("127.0.0.1", remote, up_r.as_fd(), down_w.as_fd())?;
        // The master holds its own copies of `up_r` and `down_w` now; ours are dropped here,
        // so that the ends of file it signals reach the other side.
        let control = session.into_socket();
        control.set_nonblocking(true).map_err(|e| no("socket", e))?;
        Ok::<_, mux::Error>((OwnedFd::from(up_w), OwnedFd::from(down_r), control))
    })
    .await;
    let (to_vm, from_vm, control) = match asked {
        Ok(Ok(asked)) => asked,
        Ok(Err(e)) => return OverMaster::NoMaster(e.to_string()),
        Err(e) => return OverMaster::NoMaster(format!("the mux client failed: {e}")),
    };
    let wrap = || -> std::io::Result<Channel> {
        Ok(Channel {
            to_vm: tokio::net::unix::pipe::Sender::from_owned_fd(to_vm)?,
            from_vm: tokio::net::unix::pipe::Receiver::from_owned_fd(from_vm)?,
            control: tokio::net::UnixStream::from_std(control)?,
        })
    };
    // (an error drops the control socket, which closes whatever the master opened)
    let mut channel = match wrap() {
        Ok(c) => c,
        Err(e) => return OverMaster::NoMaster(format!("cannot wait on the channel: {e}")),
    };
    let answer = tokio::time::timeout(OPEN_TIMEOUT, mux::read_reply(&mut channel.control)).await;
    match answer {
        Ok(Ok(body)) => match mux::forward_answer(&body) {
            Ok(Ok(())) => OverMaster::Open(channel),
            Ok(Err(why)) => OverMaster::Refused(why),
            Err(e) => OverMaster::NoMaster(e.to_string()),
        },
        Ok(Err(e)) => OverMaster::NoMaster(format!("reading the master's answer: {e}")),
        Err(_) => OverMaster::Failed(format!(
            "the guest did not open the connection's channel within {} s",
            OPEN_TIMEOUT.as_secs()
        )),
    }
}

impl Channel {
    /// Carry `conn` both ways until both sides have ended and the master has closed the
    /// channel (or either side failed).
    async fn join(self, conn: TcpStream) {
        let Channel {
            to_vm,
            from_vm,
            mut control,
        } = self;
        let closed = async {
            // nothing is said on it; it ends when the channel does
            let mut b = [0u8; 64];
            while matches!(control.read(&mut b).await, Ok(n) if n > 0) {}
        };
        tokio::join!(splice(conn, to_vm, from_vm), closed);
    }
}

/// Carry `conn` both ways: what it sends goes to `to_vm`, which is dropped at the client's end
/// of file (the other side reads it and says so to the guest); what `from_vm` gives back goes
/// to `conn`, whose sending side is shut at its end. Each is dropped when its way ends, also
/// on an error: a client that went away (a cancelled download) closes `from_vm`, so that the
/// other side's writes fail and the channel closes instead of filling the pipe and hanging.
/// Returns the bytes given back.
async fn splice(
    conn: TcpStream,
    mut to_vm: impl tokio::io::AsyncWrite + Unpin,
    mut from_vm: impl tokio::io::AsyncRead + Unpin,
) -> u64 {
    let _ = conn.set_nodelay(true);
    let (mut rd, mut wr) = conn.into_split();
    let up = async {
        let _ = tokio::io::copy(&mut rd, &mut to_vm).await;
        drop(to_vm);
    };
    let down = async {
        let n = tokio::io::copy(&mut from_vm, &mut wr).await.unwrap_or(0);
        drop(from_vm);
        let _ = wr.shutdown().await;
        n
    };
    tokio::join!(up, down).1
}

/// A forward from a port in the guest to one here, established.
#[derive(Debug)]
pub struct Reverse {
    child: tokio::process::Child,
}

/// What the guest prints once its side of a reverse forward holds: the server has answered the
/// forward's request by then (requests on one connection are answered in order, and ssh asks
/// for the forward before it opens the session).
const READY: &str = "boxery-forward-ready";

impl Reverse {
    /// Make the guest's `127.0.0.1:ports.remote` reach `address:ports.local` here.
    pub async fn start(reach: &Reach, address: IpAddr, ports: Ports) -> Result<Reverse> {
        if ports.local == 0 {
            return Err(HandsError::Invalid(
                "a reverse forward needs the port here to connect to: LOCAL:REMOTE or PORT".into(),
            ));
        }
        let host = match address {
            IpAddr::V6(a) => format!("[{a}]"),
            IpAddr::V4(a) => a.to_string(),
        };
        let mut child = reach
            .alone_command()
            .args([
                "-T",
                "-o",
                "BatchMode=yes",
                "-o",
                "ExitOnForwardFailure=yes",
            ])
            .arg("-R")
            .arg(format!("127.0.0.1:{}:{host}:{}", ports.remote, ports.local))
            .args(["--", &format!("echo {READY}; exec cat >/dev/null")])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| HandsError::Failed(format!("cannot run ssh: {e}")))?;
        let out = child.stdout.take().expect("piped");
        let mut lines = BufReader::new(out).lines();
        let ready = matches!(lines.next_line().await, Ok(Some(l)) if l.trim() == READY);
        if ready {
            return Ok(Reverse { child });
        }
        let _ = child.start_kill();
        let mut stderr = String::new();
        if let Some(mut e) = child.stderr.take() {
            let _ = e.read_to_string(&mut stderr).await;
        }
        let _ = child.wait().await;
        let vm = reach.vm();
        let said = ssh_said(&stderr);
        let why = said.lines().last().unwrap_or("").trim().to_string();
        Err(if said.contains("remote port forwarding failed") {
            HandsError::Conflict(format!(
                "port {} in {vm} is taken (or the guest's sshd refuses forwarding): give \
                 another, LOCAL:REMOTE",
                ports.remote
            ))
        } else {
            HandsError::Failed(format!(
                "the reverse forward to {vm} did not start{}",
                if why.is_empty() {
                    String::new()
                } else {
                    format!(": {}", crate::safe(&why))
                }
            ))
        })
    }

    /// Hold until the forward ends (the VM went away or its connection dropped): what ended it.
    pub async fn wait(mut self) -> String {
        let mut stderr = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = e.read_to_string(&mut stderr).await;
        }
        match self.child.wait().await {
            Ok(s) => format!(
                "the connection ended ({s}){}",
                stderr
                    .lines()
                    .last()
                    .map(|l| format!(": {}", crate::safe(l.trim())))
                    .unwrap_or_default()
            ),
            Err(e) => format!("ssh could not be waited for: {e}"),
        }
    }
}

/// What ssh said when it failed: its stderr, or, when `BOXERY_SSH_LOG` sends its messages to a
/// file instead, the end of that file.
fn ssh_said(stderr: &str) -> String {
    if !stderr.trim().is_empty() {
        return stderr.to_string();
    }
    let Some(f) = std::env::var_os("BOXERY_SSH_LOG").filter(|f| !f.is_empty()) else {
        return String::new();
    };
    let text = std::fs::read(f).unwrap_or_default();
    let tail = &text[text.len().saturating_sub(4096)..];
    String::from_utf8_lossy(tail)
        .lines()
        .filter(|l| !l.starts_with("debug"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The address a forward listens on by default: this machine's loopback.
pub const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_read_as_kubectl_reads_them() {
        assert_eq!(
            Ports::parse("8080").unwrap(),
            Ports {
                local: 8080,
                remote: 8080
            }
        );
        assert_eq!(
            Ports::parse("18080:8080").unwrap(),
            Ports {
                local: 18080,
                remote: 8080
            }
        );
        assert_eq!(
            Ports::parse(":8080").unwrap(),
            Ports {
                local: 0,
                remote: 8080
            }
        );
        for bad in ["", "0", "8080:", "a:80", "70000", "1:2:3", ":0", "-1"] {
            let e = Ports::parse(bad).unwrap_err().to_string();
            assert!(e.contains("LOCAL:REMOTE"), "{bad}: {e}");
        }
    }

    #[tokio::test]
    async fn a_taken_port_is_refused_before_anything_is_forwarded() {
        let taken = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = taken.local_addr().unwrap().port();
        let e = Local::bind(
            LOOPBACK,
            Ports {
                local: port,
                remote: 80,
            },
        )
        .await
        .unwrap_err();
        assert!(matches!(e, HandsError::Conflict(_)), "{e}");
        assert!(e.to_string().contains(":80`"), "{e}");
        let any = Local::bind(
            LOOPBACK,
            Ports {
                local: 0,
                remote: 80,
            },
        )
        .await
        .unwrap();
        assert_ne!(any.addr().port(), 0);
        assert!(any.addr().ip().is_loopback());
    }
}
